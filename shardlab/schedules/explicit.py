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

The layer loop is a stage unit (`Stage`) whose forward and backward are plain functions: the forward saves each
layer's residuals (its `jax.vjp` closure, flattened) minus the gathered weights, and the backward re-gathers
those weights with the same prefetch, then applies the transpose of the gather (a psum_scatter over `fsdp`) to
each layer's weight gradient as soon as it is ready. Plain AD of a prefetching scan would save every gathered
weight (the carry) for backward. The layer stack of one microbatch is the custom_vjp made of the two; a pipeline
schedule calls them for different microbatches in one tick.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from shardlab import collectives as C
from shardlab import model as M
from shardlab.axes import CONTEXT, EXPERT, FSDP, PIPELINE, TENSOR
from shardlab.config import ContextConfig, ExpertConfig, ModelConfig, PipelineConfig, ScheduleConfig
from shardlab.data import Batch
from shardlab.jax_private import dce_used_inputs
from shardlab.schedules.split import split
from shardlab.layout import Layout, honoured
from shardlab.errors import ConfigError
from shardlab.params import declare, is_param
from shardlab.schedules import context as CP
from shardlab.schedules import expert as EP
from shardlab.schedules.parallel import Parallel, accumulate, microbatches
from shardlab.schedules.tp import MATMUL, TP, make_tp

# remat: what each layer keeps for backward, by checkpoint name (the rest is recomputed in backward).
#   none                   everything JAX's AD saves (with plain attention, the [B, H, L, L] probabilities)
#   full                   nothing but the layer input: the whole layer runs again in backward
#   save_matmuls           every projection's output (Q, K/V, out, gate/up, down); attention recomputed
#   save_qkv_proj          the Q and K/V projections only (MaxText's save_qkv_proj)
#   save_qkv_attn_out      Q, K/V and the attention output (blockwise: and its log-sum-exp): attention is
#                          not recomputed; norms, the out-projection and the MLP are
#   save_matmuls_attn_out  every projection and the attention output (MaxText's minimal_with_context)
REMAT = {
    "none": (),
    "full": (),
    "save_matmuls": (MATMUL,),
    "save_qkv_proj": (M.QKV_PROJ,),
    "save_qkv_attn_out": (M.QKV_PROJ, M.ATTN_OUT),
    "save_matmuls_attn_out": (MATMUL, M.ATTN_OUT),
}
KNOBS = {"tp": tuple(TP), "grad_reduce": ("per_layer", "next_layer", "deferred"),
         "remat": tuple(REMAT), "gather_dtype": ("param", "compute")}


def remat_policy(remat: str):
  """schedule.remat -> a jax.checkpoint policy (None: save everything; full: save nothing; else the named set)."""
  if remat == "none":
    return None
  if remat == "full":
    return jax.checkpoint_policies.nothing_saveable
  return jax.checkpoint_policies.save_only_these_names(*REMAT[remat])


def _take(stacked, l):
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, l, 0, keepdims=False), stacked)


def _put(bufs, values, l):
  return jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, l, 0), bufs, values)


def prefetched_loop(n: int, depth: int, reverse: bool, fetch, body, carry, bufs, settle=None):
  """`carry, bufs = body(l, carry, W_l, bufs)` for l = 0..n-1 (n-1..0 if reverse), W_l = fetch(l) issued
  `depth` layers ahead and held in the loop carry (FSDP prefetch). The last `depth` layers fetch nothing (no
  extra bytes). `fetch(l, carry)` sees the loop carry at the time it is issued (see `Stage.backward`).

  settle: one layer late. `body` then returns (carry, bufs, item), and `bufs = settle(l, item, bufs)` runs in
  the next layer's iteration (the last layer's after the loop): e.g. a gradient reduce-scatter issued while the
  next layer's backward computes (grad_reduce=next_layer). The first layer runs outside the loop."""
  order = (lambda j: n - 1 - j) if reverse else (lambda j: j)
  k = depth if fetch is not None else 0
  ahead = ()
  for j in range(k):
    ahead += (fetch(order(j), carry),)

  def step(state, j, tail: bool = False):
    carry, ahead, bufs, pending = state
    l = order(j)
    if fetch is None:
      w = None
    elif k == 0:
      w = fetch(l, carry)
    elif tail:                          # the last k layers: already fetched, fetch nothing more
      w, ahead = ahead[0], ahead[1:]
    else:
      w, ahead = ahead[0], ahead[1:] + (fetch(order(j + k), carry),)   # W_{l+k} in flight during layer l
    if settle is None:
      carry, bufs = body(l, carry, w, bufs)
      return carry, ahead, bufs, pending
    if pending is not None:
      bufs = settle(*pending, bufs)     # the previous layer's item, while this layer computes
    carry, bufs, item = body(l, carry, w, bufs)
    return carry, ahead, bufs, (jnp.asarray(l, jnp.int32), item)

  state, start = (carry, ahead, bufs, None), 0
  if settle is not None:                # the first layer has nothing to settle: outside the loop
    state, start = step(state, 0, tail=n <= k), 1
  if n - k > start:
    state, _ = jax.lax.scan(lambda s, j: (step(s, j), None), state, jnp.arange(start, n - k))
  for j in range(max(start, n - k), n):
    state = step(state, j, tail=True)
  carry, _, bufs, pending = state
  if settle is not None:
    bufs = settle(*pending, bufs)
  return carry, bufs


def _nbytes(avals) -> int:
  return sum(a.size * a.dtype.itemsize for a in avals)


def _read_residual_bytes(fn, gather, x, stacked) -> int:
  """Bytes per device of the residuals of one layer `fn` that its backward reads, the gathered weights left out
  (memory_model counts those as gathered_weights). AD's closure can hold residuals its transpose never reads
  (a collective-matmul ring's per-step values); the stack saves them, and XLA removes them from the loop state
  as dead, so they are left out here too (DCE of the backward's jaxpr)."""
  meta = {}

  def forward(x, stacked):
    w = gather(_take(stacked, 0))
    y, vjp = jax.vjp(fn, x, w)
    leaves, meta["treedef"] = jax.tree.flatten(vjp)
    ids = {id(a) for a in jax.tree.leaves(w)}
    meta["weight"] = [id(a) in ids for a in leaves]
    return y, leaves
  y, leaves = jax.eval_shape(forward, x, stacked)
  backward = jax.make_jaxpr(lambda leaves, ct: jax.tree.unflatten(meta["treedef"], leaves)(ct))(leaves, y).jaxpr
  used = dce_used_inputs(backward)      # per input: the leaves, then ct
  return _nbytes([a for a, u, w in zip(leaves, used, meta["weight"]) if u and not w])


class Stage:
  """A stack of layers as one unit with its own forward and backward, as plain functions:

    forward(x, stacked)      -> (y, residuals)   every layer of `stacked` for one microbatch; residuals are what
                                                 each layer's backward reads (its jax.vjp closure's leaves,
                                                 flattened and stacked per layer), the gathered weights left out
    backward(residuals, dy)  -> (dx, dW)         every layer backward in reverse, re-gathering the weights with
                                                 the same prefetch; dW: each layer's gradient shard, reduced by
                                                 `reduce` in its own backward iteration (or the next one's, late)

  W_l = gather(stacked[l]) is fetched `depth` layers ahead (FSDP prefetch, prefetched_loop). `keep`: the
  gathered weights are residuals too (no re-gather in backward). `policy`: the remat policy of each layer.
  `reduce(dW_l, stacked[l])` is layer l's gradient shard (default: the transpose of `gather`). The layer stack
  of one microbatch (every layer forward, then every layer backward) is `__call__`: a custom_vjp made of the
  two; a pipeline schedule calls forward and backward itself, for different microbatches in one tick."""

  def __init__(self, layer_fn, gather, depth: int = 0, keep: bool = False, policy=None, reduce=None,
               late: bool = False):
    self.layer_fn, self.gather, self.depth, self.keep, self.policy, self.late = layer_fn, gather, depth, keep, policy, late
    self.reduce = reduce or (lambda dw, shard: jax.vjp(gather, shard)[1](dw)[0])
    self.f = layer_fn if policy is None else jax.checkpoint(layer_fn, policy=policy)
    self.meta = {}   # one layer's residual structure (treedef, where the weights are), set by forward's trace

  def _residuals(self, x, w):
    """One layer's forward and what its backward needs, as flat leaves; weights located by identity."""
    y, vjp = jax.vjp(self.f, x, w)
    leaves, treedef = jax.tree.flatten(vjp)
    w_index = {id(a): i for i, a in enumerate(jax.tree.leaves(w))}
    where_w = tuple(-1 if self.keep else w_index.get(id(a), -1) for a in leaves)
    return y, leaves, treedef, where_w

  @staticmethod
  def _save(leaves, where_w):
    return [a for a, i in zip(leaves, where_w) if i < 0]

  def _fetch(self, stacked):
    return lambda l, _: self.gather(_take(stacked, l))

  def apply(self, x, stacked):
    """The forward alone (nothing kept for backward)."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    body = lambda l, x, w, b: (self.layer_fn(x, w), b)
    return prefetched_loop(n, self.depth, False, self._fetch(stacked), body, x, ())[0]

  def _probe(self, x, stacked, split_backward: bool = False, vary=()):
    """One layer's residual structure, from an abstract trace that emits nothing: sets `meta` (treedef, where
    the weights are; with split_backward, the layer's backward cut for zero-bubble, see `held`, traced with every
    input varying over `vary` too, as the buffers it will read them from are) and returns the saved leaves' types."""
    def probe(x, stacked):
      y, leaves, treedef, where_w = self._residuals(x, self.gather(_take(stacked, 0)))
      self.meta.update(treedef=treedef, where_w=where_w)
      if split_backward:
        widen = lambda a: C.pvary(a, vary, name="zeros")
        self.meta["split"] = self._split([widen(a) for a in leaves], jax.tree.map(widen, y),
                                         jax.tree.structure(stacked))
      return self._save(leaves, where_w)
    return jax.make_jaxpr(probe)(x, stacked).out_avals

  def _split(self, leaves, y, w_tree):
    """The layer's backward cut into B (input gradient) and W (weight gradient) (schedules/split.py), over the
    flat inputs: the vjp closure's leaves, then the output gradient's. The cut's jaxprs hold no tracer: made
    once, by the probe, they run wherever the backward runs."""
    treedef, n, y_tree = self.meta["treedef"], len(leaves), jax.tree.structure(y)

    def backward(*a):
      dx, dw = jax.tree.unflatten(treedef, list(a[:n]))(jax.tree.unflatten(y_tree, list(a[n:])))
      return [*jax.tree.leaves(dx), *w_tree.flatten_up_to(dw)]
    cts = jax.tree.leaves(y)
    weights = [i for i, w in enumerate(self.meta["where_w"]) if w >= 0]
    return {"cut": split(backward, [*leaves, *cts], len(cts), held=len(cts), weights=weights), "w_tree": w_tree,
            "cts": [jax.typeof(c) for c in cts]}

  def held(self, x, stacked, vary=()) -> list:
    """The types of what one layer's zero-bubble B leaves for its W (per microbatch, beside its residuals): the
    output gradients W reads, then the cut's boundary (each weight contraction's output gradient, and under
    remat what B recomputed that W reads). Also makes the cut that backward(part="input" / "weight") runs, its
    inputs varying over `vary` (the mesh axes the caller's buffers add: a pipeline's)."""
    self._probe(x, stacked, split_backward=True, vary=vary)
    sp, n = self.meta["split"]["cut"], len(self.meta["where_w"])
    return [a for a, r in zip(self.meta["split"]["cts"], sp.w_reads[n:]) if r] + list(sp.boundary_avals)

  def forward(self, x, stacked):
    """(y, residuals): residuals = (one buffer per saved leaf [n, ...], stacked)."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    # Shapes (and varying axes) of one layer's residuals, from an abstract trace that emits nothing.
    avals = self._probe(x, stacked)
    bufs = [C.pvary(jnp.zeros((n, *a.shape), a.dtype), a.manual_axis_type.varying, name="zeros") for a in avals]

    def body(l, x, w, bufs):
      y, leaves, _, where_w = self._residuals(x, w)
      assert where_w == self.meta["where_w"], "a layer's residual structure changed between layers"
      return y, _put(bufs, self._save(leaves, where_w), l)

    y, bufs = prefetched_loop(n, self.depth, False, self._fetch(stacked), body, x, bufs)
    return y, (bufs, stacked)

  def backward(self, residuals, dy, part: str = "both"):
    """(dx, dW), dW shaped like `stacked`: each layer's gradient reduced (its shard).

    Zero-bubble's split (schedules/split.py): part="input" returns (dx, held), the input gradient and, per
    layer, what its weight gradient needs beyond the residuals (`held`: a list of [n, ..] buffers, see `held`);
    part="weight" takes those as `dy` and returns dW. Between them each layer's backward runs once: B leaves
    the weight-gradient work out, W does only that (reading the weights only where that work does)."""
    bufs, stacked = residuals
    n = jax.tree.leaves(stacked)[0].shape[0]
    where_w, treedef = self.meta["where_w"], self.meta["treedef"]

    def regather(l, dx):
      # XLA:CPU drops optimization barriers before its last CSE pass, which would then merge a re-gather
      # outside the layer loop with the identical forward gather (keeping that layer gathered). Indexing with
      # a value of dx makes the two differ: `dx == dx` holds unless dx is NaN, and XLA does not fold it.
      probe = jax.tree.leaves(dx)[0].reshape(-1)[0]
      l = jnp.where(probe == probe, l, n)   # n: out of range (clamped), so never equal to l
      return self.gather(_take(stacked, l))

    def settle(l, dw, grads):
      return _put(grads, self.reduce(dw, _take(stacked, l)), l)   # W_l's gradient reduce-scattered, in backward

    def leaves(l, w):
      saved = iter(_take(bufs, l))
      w_leaves = jax.tree.leaves(w) if w is not None else []
      return [next(saved) if i < 0 else w_leaves[i] if w_leaves else None for i in where_w]

    fetch = None if self.keep else regather
    if part != "both":
      assert "split" in self.meta, "Stage.held makes the backward's cut before a split backward runs"
      sp, k = self.meta["split"]["cut"], len(where_w)
    if part == "input":
      n_ct = len(jax.tree.leaves(dy))
      keep_ct = sp.w_reads[k:]

      def body(l, dx, w, out):
        cts = jax.tree.leaves(dx)
        dxs, boundary = sp.b(*leaves(l, w), *cts)
        held = [c for c, r in zip(cts, keep_ct) if r] + boundary
        return jax.tree.unflatten(jax.tree.structure(dx), dxs), _put(out, held, l)
      avals = [a for a, r in zip(self.meta["split"]["cts"], keep_ct) if r] + list(sp.boundary_avals)
      out = [C.pvary(jnp.zeros((n, *a.shape), a.dtype), tuple(a.manual_axis_type.varying), name="zeros")
             for a in avals]
      assert n_ct == len(keep_ct)
      return prefetched_loop(n, self.depth, True, fetch, body, dy, out)

    grads = jax.tree.map(C.zeros_like, stacked)
    if part == "weight":
      w_tree = self.meta["split"]["w_tree"]
      held_in = dy
      n_kept = sum(sp.w_reads[k:])
      reads_w = any(r and i >= 0 for r, i in zip(sp.w_reads[:k], where_w))
      fetch = fetch if reads_w else None

      def body(l, carry, w, grads):
        held = _take(held_in, l)
        cts = iter(held[:n_kept])
        args = [*leaves(l, w), *(next(cts) if r else None for r in sp.w_reads[k:])]
        dw = w_tree.unflatten(sp.w([a for a, r in zip(args, sp.w_reads) if r], held[n_kept:]))
        return (carry, grads, dw) if self.late else (carry, settle(l, dw, grads))
      carry = _take(held_in, n - 1)
    else:
      def body(l, dx, w, grads):
        dx, dw = jax.tree.unflatten(treedef, leaves(l, w))(dx)
        return (dx, grads, dw) if self.late else (dx, settle(l, dw, grads))
      carry = dy
    dx, grads = prefetched_loop(n, self.depth, True, fetch, body, carry, grads, settle if self.late else None)
    return grads if part == "weight" else (dx, grads)

  def residual_bytes(self, x, stacked) -> dict:
    """One layer's residual bytes per device (one microbatch), from abstract traces that emit nothing: {"saved":
    what the remat policy keeps for backward, gathered weights left out (memory_model counts them as
    gathered_weights), "unremat": all a layer's backward needs without remat, which its backward holds,
    recomputed or saved, while it runs}. memory_model.breakdown counts activations from them."""
    return {"saved": _read_residual_bytes(self.f, self.gather, x, stacked),
            "unremat": _read_residual_bytes(self.layer_fn, self.gather, x, stacked)}

  def __call__(self, x, stacked):
    @jax.custom_vjp
    def stack(x, stacked):
      return self.apply(x, stacked)
    stack.defvjp(self.forward, self.backward)
    return stack(x, stacked)


class ExplicitSchedule:
  """Hand-placed FSDP x TP, and HSDP when the mesh has a `data` axis. Runs inside shard_map over the mesh; which
  axes the batch and the weights are split over comes from the layout on that mesh (`Layout.batch_axes`).

  Its hooks (schedules/protocol.py: `LayerSchedule`) are the extension points; override one in a subclass
  in your own file and run it with `schedule.impl=your_module:YourClass`:
    gather(shard, decl, stacked)             how a weight is gathered
    reduce_grad(grad, shard, decl, stacked)  how its gradient is reduced (default: the transpose of gather)
    layer_loop(x, stacked, layer_fn, gathered)  the layer loop (prefetch, what backward keeps, when
                                             gradients are reduced: schedule.grad_reduce)
    ops                                      the TP contraction, an instance of `schedule.tp`'s class
                                             (schedules/tp.py: TP registry, or package.module:Class)
  """

  shard_mapped = True   # runs inside shard_map (train.py)
  pipelines = True      # runs the layer stack as pipeline stages (schedules/pipeline.py) when given a pipeline

  def __init__(self, cfg: ScheduleConfig, model: ModelConfig, compute_dtype=jnp.float32, layout: Layout | None = None,
               context: ContextConfig | None = None, pipeline: PipelineConfig | None = None,
               expert: ExpertConfig | None = None):
    for knob, allowed in KNOBS.items():
      if knob == "tp":
        continue                                    # a registered contraction or package.module:Class
      if getattr(cfg, knob) not in allowed:
        raise ConfigError(f"schedule.{knob}={getattr(cfg, knob)}: unknown; choose one of {', '.join(allowed)}")
    if not 0 <= cfg.prefetch <= model.n_layers:
      raise ConfigError(f"schedule.prefetch={cfg.prefetch}: must be between 0 and model.n_layers={model.n_layers}")
    if cfg.microbatches < 1:
      raise ConfigError(f"schedule.microbatches={cfg.microbatches}: must be >= 1")
    if cfg.grad_reduce == "deferred" and (cfg.prefetch or not cfg.reshard_after_forward):
      raise ConfigError("schedule.grad_reduce=deferred gathers every weight once per step, so it takes no "
                        "schedule.prefetch and no schedule.reshard_after_forward=false; set prefetch=0 and "
                        "reshard_after_forward=true")
    self.cfg, self.model, self.dtype = cfg, model, compute_dtype
    self.layout = layout or Layout()
    self.ops = make_tp(cfg.tp, self.layout)
    self.decls = declare(model, layout=self.layout)
    self.policy = remat_policy(cfg.remat)
    self.cp = CP.make(context or ContextConfig(), model, self.layout)   # attention across `context`
    self.ep = EP.make(expert or ExpertConfig(), model, self.layout)     # a MoE layer's dispatch over `expert`
    self.residuals: list | None = None   # a list while recording_residuals() is active
    self.pipe = pipeline or PipelineConfig()   # the pipeline schedule (schedules/pipeline.py) when mesh.pipeline > 1
    if self.pipe.staged and (cfg.microbatches != 1 or cfg.grad_reduce == "deferred"):
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
    contraction's dims over its axis; a weight's `embed` dim over `fsdp` (FSDP / ZeRO-3), over `fsdp` and the
    `context` the sequence is split over (the training state split over every device: torchtitan's
    dp_shard_cp), or replicated (plain data parallelism, gradients all-reduced); the batch over any batch axes
    that, with the sequence's, include the axes weights are sharded on (weights are replicated over the others:
    HSDP); the sequence whole or over `context` (its
    attention strategy, schedules/context.py, attends across the split); the layers whole or, with a pipeline
    schedule (the `pipeline` group), split into stages over `pipeline`."""
    weights = set(self.layout.rule("embed", axis_names))
    batch, length = self.layout.batch_axes(axis_names), self.layout.rule("length", axis_names)
    layers = [(PIPELINE,)] if self.pipe.staged and PIPELINE in axis_names else [()]
    embed = [(FSDP,), ()] + ([(FSDP, CONTEXT)] if CONTEXT in length else [])
    return {**self.ops.honours(), "embed": embed, "layers": layers, "length": [(), (CONTEXT,)],
            "expert_mlp": [()], **getattr(self.ep, "honours", lambda: {"experts": [(EXPERT,), ()]})(),
            "batch": [batch] if weights <= set(batch) | set(length) else [tuple(sorted(weights - set(length)))]}

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
    sequence). Read at trace time, inside shard_map, from the mesh being traced."""
    names = jax.sharding.get_abstract_mesh().axis_names
    return self.layout.token_axes(names) + ((TENSOR,) if self.ops.seq_sharded else ())

  def gather(self, shard, decl, stacked: bool = False):
    """W[D_fsdp, ..] -> W[D, ..] in the compute dtype (gathered over the axes the layout's rule for that dim names
    on this mesh: fsdp, or fsdp and context; the declarations know fsdp and tensor only). Backward (AD):
    psum_scatter of the gradient over them,
    and a psum over the residual axes the weight is replicated on (e.g. norm scales under SP), and over
    `tensor` for weights replicated there but read by tensor-parallel compute (K/V heads tensor does not
    divide). Over HSDP's `data` axis (params.replica_axes) and those `tensor` replicas the shard is marked
    varying before the gather, so the gradient is summed there on the fsdp shard, after the reduce-scatter:
    W{U_data}[D_fsdp] -> all-reduce over data of 1/fsdp of the bytes, as HSDP does."""
    w = shard.astype(self.dtype) if self.cfg.gather_dtype == "compute" else shard
    dim = decl.dim_of(FSDP)
    early = (TENSOR,) if decl.tensor_replicated else ()
    if dim is not None:     # sharded over fsdp: reduce the replicas' gradients on the shard (the token axes this
      names = jax.sharding.get_abstract_mesh().axis_names      # weight is not sharded over: data, context, expert)
      early += tuple(a for a in self.layout.token_axes(names) if a not in decl.mesh_axes())
      if "experts" in decl.axes and self.ops.seq_sharded and TENSOR not in decl.mesh_axes():
        early += (TENSOR,)  # an expert's rows differ by tensor rank (sequence-parallel tokens): summed on the shard
    if early:
      w = C.pvary(w, early, name="replicated_weight")
    if dim is not None:
      over = self.layout.rule(decl.axes[dim], jax.sharding.get_abstract_mesh().axis_names)  # fsdp (and context)
      w = C.all_gather(w, over, dim + stacked, name="fsdp_all_gather")   # W[D_fsdp, N_tp] -> W[D, N_tp]
    return C.pvary(w.astype(self.dtype), self.residual_axes, name="replicated_weight")

  def reduce_grad(self, grad, shard, decl, stacked: bool = False):
    """grad (the gradient of gather(shard, decl, stacked), varying over the residual axes) -> the gradient of
    `shard`, fully reduced: the transpose of `gather` (a psum_scatter over fsdp, psums over the axes the
    weight is replicated on). Override to reduce differently (bucketed, another collective, another scope);
    it must stay the same sum."""
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
    return Stage(layer_fn, gather, self.cfg.prefetch, not self.cfg.reshard_after_forward, self.policy, reduce,
                 late=self.cfg.grad_reduce == "next_layer")

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
    if self.cfg.grad_reduce == "deferred":
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
