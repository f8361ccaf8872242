"""Analytic memory per device for the configured schedule, beside what the compiler reports
(`compiled.memory_analysis()`, program.memory): their ratio says how much the compiler adds (temporaries,
copies, fusion buffers) or saves (buffer reuse) against the textbook count.

ZeRO-3 (arXiv:1910.02054): fp32 master weights, fp32 gradients and two fp32 Adam moments are 16 B/param,
sharded over every device (ZeRO-3); the compute-dtype copy, the gathered weights (one layer at prefetch 0, k+1 at
depth k, every layer when they are kept for backward or gathered once per step) and the activations come on top.
Local sizes here are exact (from the parameter declarations and the mesh); activations are the planner's estimate
(planner.activation_elements_per_token), divided over `tensor` except, under the all-reduce (Megatron) contraction,
the parts a layer keeps of the replicated residual stream (`_replicated_per_token`). The loss holds the float32
logits and their float32 cotangent at once where the backward starts: 8 bytes per local logit.

What it leaves out (experiments/validate/README.md measures it against the compilers' `memory_analysis()`): the
transients of one layer's backward (the gradient of the largest activation, a tensor-parallel ring's chunk
buffers, the all-reduce's float32 partial sums), which XLA's buffer reuse may or may not fit into memory freed
elsewhere, and the compiler's fusion choices (it may keep a bfloat16 copy of the logits, or none).
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
  t = cfg.mesh.tensor
  per_token = activation_elements_per_token(m, s.remat)
  rep = _replicated_per_token(m, s.remat) if s.tp == "allreduce" else 0
  acts = tokens * m.n_layers * ((per_token - rep) // t + rep) * cb
  acts += tokens * m.vocab_size // t * 8           # fp32 logits and their fp32 cotangent, live at once
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


def _replicated_per_token(model, remat: str) -> int:
  """Of a layer's saved elements per token (planner.activation_elements_per_token), those of the residual
  stream, which the all-reduce contraction keeps whole on every `tensor` device: the RMSNorms' inputs, outputs
  and statistics (remat=none), the layer input and, when saved, the output projections' results (after the
  all-reduce)."""
  d = model.d_model
  if model.kind == "ffn":
    return d
  return {"none": 6 * d + 4, "save_matmuls": 2 * d, "save_qkv_proj": d, "save_qkv_attn_out": d,
          "save_matmuls_attn_out": 2 * d, "full": d}[remat]


def _leaves(tree) -> list:
  import jax
  return jax.tree.leaves(tree, is_leaf=PM.is_param)


def compare(cfg, compiled: dict) -> dict:
  """{"analytic": breakdown, "compiled_over_analytic": compiled peak / analytic total, "components": per part,
  the analytic and compiled bytes and the error (analytic / compiled - 1)}. The parts a compiler reports:
  `state` (the arguments less the token batch: fp32 weights and Adam moments), `working` (its temporaries:
  gradients, gathered weights, saved activations, the logits) and `peak`."""
  a = breakdown(cfg)
  state = a["master_params"] + a["optimizer"]
  batch = cfg.train.batch_size // cfg.mesh.fsdp * (cfg.model.seq_len + 1) * 4      # int32 tokens per device
  parts = {"state": (state, compiled["argument"] - batch), "working": (a["total"] - state, compiled["temp"]),
           "peak": (a["total"], compiled["peak"])}
  return {"analytic": a, "compiled_over_analytic": compiled["peak"] / a["total"] if a["total"] else 0.0,
          "components": {k: {"analytic": an, "compiled": co, "error": an / co - 1 if co else None}
                         for k, (an, co) in parts.items()}}
