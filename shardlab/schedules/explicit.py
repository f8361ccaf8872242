"""The explicit schedule: every FSDP and TP collective placed by hand, every knob orthogonal.

  prefetch k       layer l+k's weights are all-gathered while layer l computes, held in the scan carry;
                   in backward the same, in reverse order (re-gathering l-k while layer l's backward runs)
  reshard          True: gathered weights are not saved for backward but re-gathered (ZeRO-3 / FSDP2's
                   reshard_after_forward); False: kept as residuals (one all-gather per step, more memory)
  gather_dtype     "compute": cast the shard first, gather in the compute dtype (half the bytes in bf16)
  tp               the tensor-parallel contraction (schedules/tp.py)
  grad_reduce      per_layer: each layer's gradient is reduce-scattered inside backward, in its own iteration;
                   next_layer: one layer later, in the next backward iteration (behind that layer's matmuls);
                   deferred: weights gathered once, local gradients accumulated over the microbatches,
                   reduce-scattered once per step
  microbatches     gradient accumulation inside the step
  remat            what a layer keeps for backward (REMAT: none, full, save_matmuls, save_qkv_proj, ...)

The schedule is its parts: the weights part (schedule.weights, schedules/weights.py: the FSDP / HSDP gathers
and gradient reductions, the prefetch), the TP contraction (schedule.tp, schedules/tp.py), the attention across
`context` (context.impl, schedules/context.py), the MoE dispatcher over `expert` (expert.impl,
schedules/expert.py) and, on a `pipeline` axis, the pipeline executor (schedules/pipeline.py), which runs the
same parts inside each stage. The layer loop is the stage unit (schedules/stage.py: `Stage`), whose forward and
backward are plain functions; the layer stack of one microbatch is the custom_vjp made of the two, and a
pipeline schedule calls them for different microbatches in one tick.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from shardlab import collectives as C
from shardlab import model as M
from shardlab.axes import CONTEXT, EXPERT, PIPELINE, TENSOR
from shardlab.config import ContextConfig, ExpertConfig, ModelConfig, PipelineConfig, ScheduleConfig
from shardlab.data import Batch
from shardlab.layout import Layout, honoured
from shardlab.errors import ConfigError
from shardlab.params import declare, is_param
from shardlab.schedules import context as CP
from shardlab.schedules import expert as EP
from shardlab.schedules import weights as WT
from shardlab.schedules.parallel import Parallel, accumulate, microbatches
from shardlab.schedules.stage import REMAT, Stage, remat_policy
from shardlab.schedules.tp import TP, make_tp

KNOBS = {"tp": tuple(TP), "grad_reduce": WT.GRAD_REDUCE, "remat": tuple(REMAT), "gather_dtype": WT.GATHER_DTYPE}


class ExplicitSchedule:
  """Hand-placed FSDP x TP, and HSDP when the mesh has a `data` axis. Runs inside shard_map over the mesh; which
  axes the batch and the weights are split over comes from the layout on that mesh (`Layout.batch_axes`).

  Its hooks (schedules/protocol.py: `LayerSchedule`) are the extension points; override one in a subclass
  in your own file and run it with `schedule.impl=your_module:YourClass`:
    gather(shard, decl, stacked)             how a weight is gathered (default: the weights part's)
    reduce_grad(grad, shard, decl, stacked)  how its gradient is reduced (default: the weights part's, or the
                                             transpose of an overridden gather)
    layer_loop(x, stacked, layer_fn, gathered)  the layer loop (prefetch, what backward keeps, when
                                             gradients are reduced: schedule.grad_reduce)
    ops                                      the TP contraction, an instance of `schedule.tp`'s class
                                             (schedules/tp.py: TP registry, or package.module:Class)
    weights                                  the weights part, an instance of `schedule.weights`'s class
                                             (schedules/weights.py; its knobs are the schedule group's)
  """

  shard_mapped = True   # runs inside shard_map (train.py)
  pipelines = True      # runs the layer stack as pipeline stages (schedules/pipeline.py) when given a pipeline

  def __init__(self, cfg: ScheduleConfig, model: ModelConfig, compute_dtype=jnp.float32, layout: Layout | None = None,
               context: ContextConfig | None = None, pipeline: PipelineConfig | None = None,
               expert: ExpertConfig | None = None):
    if cfg.remat not in REMAT:
      raise ConfigError(f"schedule.remat={cfg.remat}: unknown; choose one of {', '.join(REMAT)}")
    if cfg.microbatches < 1:
      raise ConfigError(f"schedule.microbatches={cfg.microbatches}: must be >= 1")
    self.cfg, self.model, self.dtype = cfg, model, compute_dtype
    self.layout = layout or Layout()
    self.ops = make_tp(cfg.tp, self.layout)
    self.weights = WT.make(cfg, model, self.layout, self.ops, compute_dtype)   # FSDP / HSDP gathers, reductions
    self.decls = declare(model, layout=self.layout)
    self.policy = remat_policy(cfg.remat)
    self.cp = CP.make(context or ContextConfig(), model, self.layout)   # attention across `context`
    self.ep = EP.make(expert or ExpertConfig(), model, self.layout)     # a MoE layer's dispatch over `expert`
    self.residuals: list | None = None   # a list while recording_residuals() is active
    self.pipe = pipeline or PipelineConfig()   # the pipeline schedule (schedules/pipeline.py) when mesh.pipeline > 1
    if self.pipe.staged and (cfg.microbatches != 1 or self.weights.once_per_step):
      raise ConfigError(f"pipeline={self.pipe.name} splits the batch into pipeline.microbatches and gathers "
                        f"weights per pipeline.gather; set schedule.microbatches=1 and a grad_reduce other than "
                        f"deferred (pipeline.gather=step gathers once per step)")

  def pipeline(self, P: int):
    """The pipeline executor on P stages (schedules/pipeline.py: Pipeline), or None without one."""
    if not self.pipe.staged:
      return None
    from shardlab.schedules.pipeline import Pipeline
    return Pipeline(self, self.pipe, P)

  def stages_on(self, shape: dict):
    """The pipeline executor on a mesh of `shape` ({axis: size}), or None without a pipeline schedule."""
    return self.pipeline(shape.get(PIPELINE, 1))

  def microbatches_on(self, shape: dict) -> int:
    """How many microbatches this schedule splits each device's batch into on a mesh of `shape`."""
    pipe = self.pipeline(shape.get(PIPELINE, 1))
    return pipe.M if pipe else self.cfg.microbatches

  def honours(self, axis_names) -> dict:
    """The layout rules this schedule can honour on a mesh of `axis_names`, derived from its parts: the TP
    contraction's dims over its axis; the weights part's `embed` and `batch` rules (FSDP, HSDP, data parallel:
    schedules/weights.py); the sequence whole or over `context` (its attention strategy, schedules/context.py,
    attends across the split); the experts as the dispatcher places them; the layers whole or, with a pipeline
    schedule (the `pipeline` group), split into stages over `pipeline`."""
    layers = [(PIPELINE,)] if self.pipe.staged and PIPELINE in axis_names else [()]
    return {**self.ops.honours(), "layers": layers, "length": [(), (CONTEXT,)], "expert_mlp": [()],
            **getattr(self.ep, "honours", lambda: {"experts": [(EXPERT,), ()]})(),
            **self.weights.honours(axis_names)}

  def check_mesh(self, shape: dict, who: str | None = None) -> None:
    """A layout rule this schedule cannot honour on a mesh of `shape` ({axis: size}), or a context split its
    attention strategy cannot run: one line."""
    if self.model.moe:      # the dispatcher's own words first (it knows which expert layouts it runs)
      self.ep.check(dict(shape))
    honoured(self.layout, self.honours(tuple(shape)), tuple(shape), who or f"the {type(self).__name__} schedule")
    self.cp.check(dict(shape))
    pipe = self.pipeline(shape.get(PIPELINE, 1))
    if pipe is not None:
      pipe.check(self.model.n_layers, dict(shape))

  def data_order(self, shape: dict):
    """The order the data must hold each sequence's tokens in on a mesh of `shape` (context.load_balance: the
    zigzag of data.zigzag), or None."""
    return self.cp.cfg.order(self.model.seq_len, self.cp.parts(shape))

  def bind(self, mesh) -> None:
    """The mesh the step is built for: checked (check_mesh); the dispatcher learns its devices' platform."""
    self.check_mesh(dict(mesh.shape))
    bind = getattr(self.ep, "bind", None)   # a dispatcher learns the devices' platform (optional for a user's)
    if bind is not None:
      bind(mesh)

  @property
  def residual_axes(self) -> tuple[str, ...]:
    """Mesh axes the residual stream varies over: the batch axes and, when sequence-parallel, `tensor` (the
    sequence; weights.residual_axes). Read at trace time, inside shard_map."""
    return WT.residual_axes(self.layout, self.ops)

  def gather(self, shard, decl, stacked: bool = False):
    """W[D_fsdp, ..] -> W[D, ..] in the compute dtype, varying over the residual axes: the weights part's gather
    (schedules/weights.py: over fsdp, or fsdp and context; HSDP's replicas summed on the shard in backward)."""
    return self.weights.gather(shard, decl, stacked)

  def reduce_grad(self, grad, shard, decl, stacked: bool = False):
    """grad (the gradient of gather(shard, decl, stacked), varying over the residual axes) -> the gradient of
    `shard`, fully reduced: the weights part's reduction, or the transpose of `gather` where a subclass
    overrides it. Override to reduce differently (bucketed, another collective, another scope); it must stay
    the same sum."""
    if type(self).gather is ExplicitSchedule.gather:
      return self.weights.reduce_grad(grad, shard, decl, stacked)
    return jax.vjp(lambda s: self.gather(s, decl, stacked), shard)[1](grad)[0]

  def fetch(self, shard, decl, stacked: bool = False):
    """gather(shard) whose backward is reduce_grad: how the model reads a weight outside the layer loop."""
    @jax.custom_vjp
    def fetched(s):
      return self.gather(s, decl, stacked)
    fetched.defvjp(lambda s: (self.gather(s, decl, stacked), s),
                   lambda s, g: (self.reduce_grad(g, s, decl, stacked),))
    return fetched(shard)

  def layer_loop(self, x, stacked, layer_fn, gathered: bool = False):
    """x through every layer of `stacked` (each layer's weights [NL, ..] sharded like params): the prefetch
    depth, what backward keeps, and when each layer's gradient is reduced (in its backward iteration, or with
    grad_reduce=next_layer in the next one's, so that it runs behind that layer's matmuls)."""
    stage = self.stage(layer_fn, gathered)
    if self.residuals is not None:
      self.residuals.append(stage.residual_bytes(x, stacked))
    return stage(x, stacked)

  def stage(self, layer_fn, gathered: bool = False) -> Stage:
    """The stage unit of this schedule's layer loop: its gather (prefetch depth, re-gather or keep), remat
    policy and gradient reduction (reduce_grad, in the layer's backward iteration or the next one's)."""
    if gathered:   # deferred reduction: weights already gathered; backward re-reads them, no comm
      return Stage(layer_fn, lambda w: w, policy=self.policy)
    decls = {k: d.per_layer() for k, d in self.decls["layers"].items()}
    gather = lambda w: {k: self.gather(v, decls[k]) for k, v in w.items()}
    reduce = lambda g, w: {k: self.reduce_grad(g[k], v, decls[k]) for k, v in w.items()}
    return self.weights.stage(layer_fn, gather, reduce, self.policy)

  @contextlib.contextmanager
  def recording_residuals(self):
    """Within it, every layer loop this schedule traces appends one layer's residual bytes (Stage.residual_bytes)
    to the list it yields: what trainer.lower hands the memory breakdown."""
    prev, self.residuals = self.residuals, []
    try:
      yield self.residuals
    finally:
      self.residuals = prev

  def gather_all(self, params):
    return {k: (jax.tree.map(lambda p, d: self.gather(p, d.per_layer(), stacked=True), v, self.decls[k],
                             is_leaf=is_param) if k == "layers" else self.gather(v, self.decls[k]))
            for k, v in params.items()}

  def reduce_all(self, grads, params):
    """gather_all's transpose, through reduce_grad (grad_reduce=deferred)."""
    return {k: (jax.tree.map(lambda g, p, d: self.reduce_grad(g, p, d.per_layer(), stacked=True), v, params[k],
                             self.decls[k], is_leaf=is_param) if k == "layers"
                else self.reduce_grad(v, params[k], self.decls[k])) for k, v in grads.items()}

  def context(self, params, gathered: bool = False) -> Parallel:
    """The model's parallel context: this schedule's TP contractions, its weights reader (FSDP-gathered on
    demand through `fetch`, or already gathered) and layer loop, and the model's attention."""
    weight = (lambda name: params[name]) if gathered else (lambda name: self.fetch(params[name], self.decls[name]))
    layers = lambda x, layer_fn: self.layer_loop(x, params["layers"], layer_fn, gathered)
    return self.parallel(weight, layers)

  def parallel(self, weight, layers=None) -> Parallel:
    """The model's parallel context from a weights reader and a layer loop (None: a pipeline's stages run the
    layers), with this schedule's parts: the TP contraction, the attention across `context`, the MoE dispatcher
    over `expert` (in expert.chunks), the per-sequence sum."""
    return Parallel(self.ops, weight, layers, self.cp.attend,
                    EP.chunked(self.ep.dispatch, getattr(self.ep.cfg, "chunks", 1)), self.seq_sum)

  def seq_sum(self, a):
    """A per-sequence sum over the devices that split each sequence: the `length` axes and, when the residual
    stream is sequence-parallel, `tensor` (the router's per-sequence counts)."""
    names = jax.sharding.get_abstract_mesh().axis_names
    axes = self.layout.rule("length", names) + ((TENSOR,) if self.ops.seq_sharded else ())
    return C.psum(a, axes, name="router_counts") if axes else a

  def loss_and_grads(self, params, batch: Batch, n_tokens: int):
    """Loss and gradients (shaped and sharded like `params`, fully reduced) for this device's batch; a MoE model's
    router statistics third (model.loss_and_stats)."""
    names = jax.sharding.get_abstract_mesh().axis_names
    pipe = self.pipeline(jax.sharding.get_abstract_mesh().shape[PIPELINE] if PIPELINE in names else 1)
    if pipe is not None:
      return pipe.loss_and_grads(params, batch, n_tokens)
    batches = microbatches(batch, self.cfg.microbatches)
    if self.weights.once_per_step:
      gathered = self.gather_all(params)                          # one all-gather per parameter per step
      loss, g, *stats = self._accumulate(gathered, batches, n_tokens, gathered=True)
      return (loss, self.reduce_all(g, params), *stats)           # one reduce-scatter per parameter per step
    return self._accumulate(params, batches, n_tokens, gathered=False)

  def _accumulate(self, params, batches: Batch, n_tokens, gathered):
    if self.model.moe:
      loss_fn = lambda p, b: M.loss_and_stats(self.context(p, gathered), self.model, b, n_tokens)
      (loss, stats), g = accumulate(jax.value_and_grad(loss_fn, has_aux=True), params, batches, C.zeros_like,
                                    M.zero_stats(self.model))
      return loss, g, stats
    loss_fn = lambda p, b: M.loss(self.context(p, gathered), self.model, b, n_tokens)
    return accumulate(jax.value_and_grad(loss_fn), params, batches, C.zeros_like)
