"""The model's parallel context, and what every schedule shares around it.

`Parallel` is the one object model.py reads (model.loss(ctx, ...)):

  ctx.tp                          the TP contractions (schedules/tp.py: column, row, reduce, vocab_*, ...)
  ctx.weight(name)                a weight outside the layer loop, gathered (or already gathered)
  ctx.layers(x, layer_fn)         x through every layer of the stacked weights (the schedule's layer loop)
  ctx.attend(q, k, v, positions)  causal attention of the local sequence (context parallelism replaces it)
  ctx.experts(x, idx, gate, wi, wd)  a MoE layer's routed experts on this device's tokens -> (y, dropped): the
                                  dispatcher (schedules/expert.py); plain: every expert here, dropless
  ctx.seq_sum(a)                  a per-sequence sum of this device's tokens over the devices that split each
                                  sequence (the router's per-sequence counts); plain: itself

`plain(model, params)` is the unsharded view: IdentityOps, the weights as they are, a scan, the model's own
attention. A schedule builds its context once per microbatch; `accumulate` is the microbatch loop every
schedule runs (gradient accumulation: the sum of each microbatch's loss and gradients).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from shardlab import attention as A
from shardlab import model as M
from shardlab.config import ModelConfig
from shardlab.data import Batch
from shardlab.schedules.tp import IdentityOps


@dataclass(frozen=True)
class Parallel:
  tp: Any                                   # a TPContraction
  weight: Callable[[str], Any]              # name -> the weight, as the model computes with it
  layers: Callable[[Any, Callable], Any]    # (x, layer_fn(x, layer_weights)) -> x after every layer
  attend: Callable[..., Any]                # (q[B, L, H, K], k[B, L, G, K], v, positions[L]) -> o[B, L, H, K]
  experts: Callable[..., Any] = None        # (x[T, D], idx[T, k], gate[T, k], wi[E, ..], wd[E, ..]) -> (y[T, D],
                                            #  dropped); None: every expert on this device (plain_experts)
  seq_sum: Callable[[Any], Any] = None      # None: the identity (no device splits a sequence)

  def __post_init__(self):
    if self.experts is None:
      object.__setattr__(self, "experts", plain_experts)
    if self.seq_sum is None:
      object.__setattr__(self, "seq_sum", lambda a: a)


def plain_experts(x_TD, idx_TK, gate_TK, wi, wd):
  """Every expert on this device, dropless (model.local_experts): the unsharded MoE layer."""
  return M.local_experts(x_TD, idx_TK, gate_TK, wi, wd), 0


def attention(m: ModelConfig) -> Callable:
  """The model's own attention (model.attention: plain, blockwise or cuDNN's), on the whole local sequence. The
  tokens of a sequence are in order here (positions 0..L-1 along L), so the causal mask is the index order."""
  return lambda q, k, v, positions: A.attend(m.attention, q, k, v, m.attention_block)


def scan_layers(stacked, policy=None) -> Callable:
  """The plain layer loop: lax.scan over the stacked weights, each layer under the remat policy."""
  def layers(x, layer_fn):
    f = layer_fn if policy is None else jax.checkpoint(layer_fn, policy=policy)
    return jax.lax.scan(lambda x, w: (f(x, w), None), x, stacked)[0]
  return layers


def plain(m: ModelConfig, params, ops=None, policy=None) -> Parallel:
  """The unsharded model's context (or `ops`' contractions on weights already where they need to be)."""
  return Parallel(ops or IdentityOps(), params.__getitem__, scan_layers(params["layers"], policy), attention(m))


def microbatches(batch: Batch, k: int, rows: Callable | None = None) -> Batch:
  """inputs, targets [B, L] -> [k, B / k, L] (microbatch j: rows j B/k .. (j+1) B/k - 1 of this device's, or
  `rows(a)`'s split); positions [L] -> [k, L], the same for every microbatch."""
  rows = rows or (lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]))
  return Batch(rows(batch.inputs), rows(batch.targets), jnp.broadcast_to(batch.positions, (k, *batch.positions.shape)))


def accumulate(value_and_grad: Callable, params, batches: Batch, zeros_like=jnp.zeros_like, zero_aux=None):
  """(sum of losses, sum of gradients) of value_and_grad(params, batch) over the leading (microbatch) dim of
  `batches`: one call when there is one microbatch, else a scan that carries the running sums. zero_aux: a
  value_and_grad(has_aux=True)'s aux as zeros (summed too)."""
  if batches.inputs.shape[0] == 1:
    return value_and_grad(params, Batch(*(a[0] for a in batches)))

  def micro(acc, b):
    loss, g = value_and_grad(params, Batch(*b))
    return jax.tree.map(jnp.add, acc, (loss, g)), None
  loss0 = jnp.zeros((), jnp.float32)
  zero = (loss0 if zero_aux is None else (loss0, zero_aux), jax.tree.map(zeros_like, params))
  return jax.lax.scan(micro, zero, tuple(batches))[0]
