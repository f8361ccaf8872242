"""Analytic memory per device for the configured schedule, beside what the compiler reports
(`compiled.memory_analysis()`, program.memory): their ratio says how much the compiler adds (temporaries,
copies, fusion buffers) or saves (buffer reuse) against the textbook count.

ZeRO-3 (arXiv:1910.02054): fp32 master weights, fp32 gradients and two fp32 Adam moments are 16 B/param,
sharded over every device (ZeRO-3); the compute-dtype copy, the gathered weights (one layer at prefetch 0, k+1 at
depth k, every layer when they are kept for backward or gathered once per step) and the activations come on top.
Local sizes here are exact (from the parameter declarations and the mesh); activations are the planner's estimate
(planner.activation_elements_per_token).
"""
from __future__ import annotations

import math

from shardlab import params as PM
from shardlab.analysis.planner import activation_elements_per_token, dtype_bytes
from shardlab.mesh import FSDP, TENSOR


def breakdown(cfg) -> dict:
  """Bytes per device: master_params, grads, optimizer, compute_params, gathered_weights, activations, total."""
  m, s = cfg.model, cfg.schedule
  sizes = {FSDP: cfg.mesh.fsdp, TENSOR: cfg.mesh.tensor}
  decls = PM.declare(m, cfg.mesh.tensor)
  leaves = _leaves(decls)

  def local(d, gathered=False):      # elements of one device's shard (gathered: the fsdp dim whole)
    return math.prod(d.shape) // math.prod(sizes[a] for a in d.mesh_axes() if not (gathered and a == FSDP))

  pb, cb = dtype_bytes(cfg.precision.param_dtype), dtype_bytes(cfg.precision.compute_dtype)
  shard = sum(local(d) for d in leaves)
  per_layer = sum(local(d, True) for d in _leaves(decls["layers"])) // m.n_layers
  top = sum(local(d, True) for k, d in decls.items() if k != "layers")
  deferred = s.grad_reduce == "deferred"
  live = m.n_layers if deferred or not s.reshard_after_forward else min(m.n_layers, s.prefetch + 1)
  tokens = cfg.train.batch_size // cfg.mesh.fsdp // s.microbatches * m.seq_len
  acts = tokens * m.n_layers * activation_elements_per_token(m, s.remat) * cb // cfg.mesh.tensor
  acts += tokens * m.vocab_size // cfg.mesh.tensor * 4                       # fp32 logits for the loss
  accum = 0 if s.microbatches == 1 else (per_layer * m.n_layers + top if deferred else shard) * pb
  out = {
      "master_params": shard * pb,
      "grads": shard * pb + accum,                                # + the accumulator of microbatched gradients
      "optimizer": 2 * shard * pb,                                # Adam mu and nu
      "compute_params": shard * cb if s.gather_dtype == "compute" and cb != pb else 0,   # the cast shard
      "gathered_weights": (live * per_layer + top) * cb,          # embed/unembed stay gathered for backward
      "activations": acts,
  }
  out["total"] = sum(out.values())
  return out


def _leaves(tree) -> list:
  import jax
  return jax.tree.leaves(tree, is_leaf=PM.is_param)


def compare(cfg, compiled: dict) -> dict:
  """{"analytic": breakdown, "compiled_over_analytic": compiled peak / analytic total}."""
  a = breakdown(cfg)
  return {"analytic": a, "compiled_over_analytic": compiled["peak"] / a["total"] if a["total"] else 0.0}
