"""The weights part: how a device's parameter shard becomes the weights its layers compute with, and how their
gradients go back to the shard (`schedule.weights`: sharded, or package.module:Class).

  FSDP / ZeRO-3   a weight's `embed` dim sharded over fsdp (or over fsdp and context: the training state split
                  over every device, torchtitan's dp_shard_cp): all_gather before use, psum_scatter of the
                  gradient (the gather's transpose)
  HSDP            the batch split over more axes than the weights (`data`): the gradient, reduce-scattered over
                  fsdp, then summed over the replicas on the shard (1/fsdp of the bytes)
  data parallel   `embed` replicated: nothing gathered, the gradient all-reduced

Its knobs are the schedule group's (schedules/explicit.py's docstring): prefetch, reshard_after_forward,
gather_dtype, grad_reduce. Built as `cls(model, layout, cfg, tp, compute_dtype)`: cfg the ScheduleConfig, tp the
run's TP contraction (a sequence-parallel one makes the residual stream vary over tensor as well).

In the step (inside shard_map), what the explicit schedule's hooks call:
  gather(shard, decl, stacked)               W[D_fsdp, ..] -> W[D, ..] in the compute dtype
  reduce_grad(grad, shard, decl, stacked)    the gradient of gather(shard) -> the gradient of the shard
  stage(layer_fn, gather, reduce, policy)    the layer loop's stage unit: prefetch depth, re-gather or keep,
                                             when each layer's gradient is reduced
  once_per_step                              every weight gathered once per step, every gradient reduced once

Its costs, what the analysis asks (analysis/closed_forms.py, memory_model.py, context_cost.py, the planner),
so that a weights part of a user's is priced like this one:
  element_bytes(precision)   bytes of one element gathered, and of one element of a layer's gradient reduced
  regathers                  gathers of a layer's weights in its backward (1: re-gathered, 0: kept from forward)
  live_layers(n)             gathered layers held at once in a stack of n
  cast_bytes(precision)      bytes per shard element of a compute-dtype copy of the shard kept beside it
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from shardlab import collectives as C
from shardlab.axes import CONTEXT, FSDP, TENSOR
from shardlab.config import ModelConfig, ScheduleConfig
from shardlab.errors import ConfigError
from shardlab.layout import Layout
from shardlab.loading import load_object
from shardlab.schedules.stage import Stage

GRAD_REDUCE = ("per_layer", "next_layer", "deferred")
GATHER_DTYPE = ("param", "compute")


def itemsize(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


def residual_axes(layout: Layout, tp) -> tuple[str, ...]:
  """Mesh axes the residual stream varies over: the batch axes and, when `tp` is sequence-parallel, `tensor`.
  Read at trace time, inside shard_map, from the mesh being traced."""
  names = jax.sharding.get_abstract_mesh().axis_names
  return layout.token_axes(names) + ((TENSOR,) if tp.seq_sharded else ())


class FSDPWeights:
  """FSDP / ZeRO-3 over the axes the layout's `embed` rule names, HSDP over the batch axes the weights are not
  split over, plain data parallelism where `embed` is replicated (module doc)."""

  def __init__(self, model: ModelConfig, layout: Layout, cfg: ScheduleConfig, tp=None, compute_dtype=jnp.float32):
    if cfg.grad_reduce not in GRAD_REDUCE:
      raise ConfigError(f"schedule.grad_reduce={cfg.grad_reduce}: unknown; choose one of {', '.join(GRAD_REDUCE)}")
    if cfg.gather_dtype not in GATHER_DTYPE:
      raise ConfigError(f"schedule.gather_dtype={cfg.gather_dtype}: unknown; choose one of "
                        f"{', '.join(GATHER_DTYPE)}")
    if not 0 <= cfg.prefetch <= model.n_layers:
      raise ConfigError(f"schedule.prefetch={cfg.prefetch}: must be between 0 and model.n_layers={model.n_layers}")
    if cfg.grad_reduce == "deferred" and (cfg.prefetch or not cfg.reshard_after_forward):
      raise ConfigError("schedule.grad_reduce=deferred gathers every weight once per step, so it takes no "
                        "schedule.prefetch and no schedule.reshard_after_forward=false; set prefetch=0 and "
                        "reshard_after_forward=true")
    self.model, self.layout, self.cfg, self.tp, self.dtype = model, layout, cfg, tp, compute_dtype

  # ----------------------------------------------------------------------------------------- what it can run
  def honours(self, axis_names) -> dict:
    """The layout rules it can honour on a mesh of `axis_names`: a weight's `embed` dim over `fsdp`, over `fsdp`
    and the `context` the sequence is split over, or replicated; the batch over any batch axes that, with the
    sequence's, include the axes weights are sharded on (weights are replicated over the others: HSDP)."""
    weights = set(self.layout.rule("embed", axis_names))
    batch, length = self.layout.batch_axes(axis_names), self.layout.rule("length", axis_names)
    embed = [(FSDP,), ()] + ([(FSDP, CONTEXT)] if CONTEXT in length else [])
    return {"embed": embed,
            "batch": [batch] if weights <= set(batch) | set(length) else [tuple(sorted(weights - set(length)))]}

  # ------------------------------------------------------------------------------------------- in the step
  def residual_axes(self) -> tuple[str, ...]:
    return residual_axes(self.layout, self.tp)

  def gather(self, shard, decl, stacked: bool = False):
    """W[D_fsdp, ..] -> W[D, ..] in the compute dtype (gathered over the axes the layout's rule for that dim names
    on this mesh: fsdp, or fsdp and context; the declarations know fsdp and tensor only). Backward (AD):
    psum_scatter of the gradient over them, and a psum over the residual axes the weight is replicated on (e.g.
    norm scales under SP), and over `tensor` for weights replicated there but read by tensor-parallel compute
    (K/V heads tensor does not divide). Over HSDP's `data` axis (params.replica_axes) and those `tensor`
    replicas the shard is marked varying before the gather, so the gradient is summed there on the fsdp shard,
    after the reduce-scatter: W{U_data}[D_fsdp] -> all-reduce over data of 1/fsdp of the bytes, as HSDP does."""
    w = shard.astype(self.dtype) if self.cfg.gather_dtype == "compute" else shard
    dim = decl.dim_of(FSDP)
    early = (TENSOR,) if decl.tensor_replicated else ()
    if dim is not None:     # sharded over fsdp: reduce the replicas' gradients on the shard (the token axes this
      names = jax.sharding.get_abstract_mesh().axis_names      # weight is not sharded over: data, context, expert)
      early += tuple(a for a in self.layout.token_axes(names) if a not in decl.mesh_axes())
      if "experts" in decl.axes and self.tp.seq_sharded and TENSOR not in decl.mesh_axes():
        early += (TENSOR,)  # an expert's rows differ by tensor rank (sequence-parallel tokens): summed on the shard
    if early:
      w = C.pvary(w, early, name="replicated_weight")
    if dim is not None:
      over = self.layout.rule(decl.axes[dim], jax.sharding.get_abstract_mesh().axis_names)  # fsdp (and context)
      w = C.all_gather(w, over, dim + stacked, name="fsdp_all_gather")   # W[D_fsdp, N_tp] -> W[D, N_tp]
    return C.pvary(w.astype(self.dtype), self.residual_axes(), name="replicated_weight")

  def reduce_grad(self, grad, shard, decl, stacked: bool = False):
    """grad (the gradient of gather(shard, decl, stacked), varying over the residual axes) -> the gradient of
    `shard`, fully reduced: the transpose of `gather`. Override to reduce differently (bucketed, another
    collective); it must stay the same sum."""
    return jax.vjp(lambda s: self.gather(s, decl, stacked), shard)[1](grad)[0]

  def stage(self, layer_fn, gather, reduce, policy) -> Stage:
    """The layer loop's stage unit for `gather` and `reduce` (the schedule's hooks, per layer): weights fetched
    `prefetch` layers ahead, re-gathered in backward or kept from forward (reshard_after_forward), each layer's
    gradient reduced in its backward iteration or, with grad_reduce=next_layer, the next one's."""
    return Stage(layer_fn, gather, self.cfg.prefetch, not self.cfg.reshard_after_forward, policy, reduce,
                 late=self.cfg.grad_reduce == "next_layer")

  @property
  def once_per_step(self) -> bool:
    """Every weight gathered once per step and every gradient reduced once (grad_reduce=deferred): the step
    accumulates the microbatches' gradients of the gathered weights in between."""
    return self.cfg.grad_reduce == "deferred"

  # ---------------------------------------------------------------------------------------- what it costs
  @property
  def prefetches(self) -> bool:
    """The next layer's weights are gathered (and this layer's gradient reduced) while this layer computes, so the
    time model (analysis/step_model.py) hides them behind its kernels; without prefetch each layer waits."""
    return bool(self.cfg.prefetch) and not self.once_per_step

  def element_bytes(self, precision) -> int:
    """Bytes of one weight element gathered, and of one element of a layer's whole gradient before its
    reduction (gather_dtype: the parameter's dtype, or the compute dtype cast before the gather)."""
    return itemsize(precision.param_dtype if self.cfg.gather_dtype == "param" else precision.compute_dtype)

  @property
  def regathers(self) -> int:
    """Gathers of a layer's weights in its backward: 1 re-gathered (reshard_after_forward), 0 kept from forward."""
    return 1 if self.cfg.reshard_after_forward else 0

  def live_layers(self, n: int) -> int:
    """Gathered layers held at once in a stack of n: the layer computing and the `prefetch` in flight, or all
    of them when they are kept for backward or gathered once per step."""
    return n if self.once_per_step or not self.cfg.reshard_after_forward else min(n, self.cfg.prefetch + 1)

  def cast_bytes(self, precision) -> int:
    """Bytes per shard element of the compute-dtype copy of the shard that a cast-first gather keeps (0: none)."""
    pb, cb = itemsize(precision.param_dtype), itemsize(precision.compute_dtype)
    return cb if self.cfg.gather_dtype == "compute" and cb != pb else 0


WEIGHTS = {"sharded": FSDPWeights}


def make(cfg: ScheduleConfig, model: ModelConfig, layout: Layout, tp=None, compute_dtype=jnp.float32):
  """The weights part `schedule.weights` names, built for the model, the run's layout and the TP contraction. A
  user's class is checked against the WeightsPart protocol (schedules/protocol.py) before it is built and after,
  and what its constructor raises is one line (loading.call_user)."""
  from shardlab.loading import call_user, check_instance
  from shardlab.schedules.protocol import WeightsPart
  spec = str(getattr(cfg, "weights", "sharded"))
  cls = load_object(spec, "schedule.weights", WEIGHTS, WeightsPart)
  part = call_user(cls, spec, "schedule.weights", model, layout, cfg, tp, compute_dtype)
  check_instance(part, spec, "schedule.weights", WeightsPart)
  return part
