"""The explicit schedule: every FSDP and TP collective placed by hand, every knob orthogonal.

  prefetch k       layer l+k's weights are all-gathered while layer l computes, held in the scan carry;
                   in backward the same, in reverse order (re-gathering l-k while layer l's backward runs)
  reshard          True: gathered weights are not saved for backward but re-gathered (ZeRO-3 / FSDP2's
                   reshard_after_forward); False: kept as residuals (one all-gather per step, more memory)
  gather_dtype     "compute": cast the shard first, gather in the compute dtype (half the bytes in bf16)
  tp               the tensor-parallel contraction (schedules/tp.py)
  grad_reduce      per_layer: each layer's gradient is reduce-scattered inside backward;
                   deferred: weights gathered once, local gradients accumulated over the microbatches,
                   reduce-scattered once per step
  microbatches     gradient accumulation inside the step
  remat            what a layer keeps for backward (REMAT: none, full, save_matmuls, save_qkv_proj, ...)

The layer stack is a custom_vjp: the forward saves each layer's residuals (its `jax.vjp` closure, flattened)
minus the gathered weights, and the backward re-gathers those weights with the same prefetch, then applies
the transpose of the gather (a psum_scatter over `fsdp`) to each layer's weight gradient as soon as it is
ready. Plain AD of a prefetching scan would save every gathered weight (the carry) for backward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from shardlab import collectives as C
from shardlab import model as M
from shardlab.config import ModelConfig, ScheduleConfig
from shardlab.mesh import FSDP, TENSOR, ConfigError
from shardlab.params import declare, is_param
from shardlab.schedules.tp import MATMUL, make_tp

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
KNOBS = {"tp": ("allgather", "ring", "ring_bidi", "allreduce"), "grad_reduce": ("per_layer", "deferred"),
         "remat": tuple(REMAT), "gather_dtype": ("param", "compute")}


def _remat_policy(remat: str):
  if remat == "none":
    return None
  if remat == "full":
    return jax.checkpoint_policies.nothing_saveable
  return jax.checkpoint_policies.save_only_these_names(*REMAT[remat])


def _take(stacked, l):
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, l, 0, keepdims=False), stacked)


def _put(bufs, values, l):
  return jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, l, 0), bufs, values)


def pipeline(n: int, depth: int, reverse: bool, fetch, body, carry, bufs):
  """`carry, bufs = body(l, carry, W_l, bufs)` for l = 0..n-1 (n-1..0 if reverse), W_l = fetch(l) issued
  `depth` layers ahead and held in the loop carry. The last `depth` layers fetch nothing (no extra bytes).
  `fetch(l, carry)` sees the loop carry at the time it is issued (see `bwd`)."""
  order = (lambda j: n - 1 - j) if reverse else (lambda j: j)
  k = depth if fetch is not None else 0
  ahead = ()
  for j in range(k):
    ahead += (fetch(order(j), carry),)

  def step(state, j):
    carry, ahead, bufs = state
    l = order(j)
    if fetch is None:
      w = None
    elif k == 0:
      w = fetch(l, carry)
    else:
      w, ahead = ahead[0], ahead[1:] + (fetch(order(j + k), carry),)   # W_{l+k} in flight during layer l
    carry, bufs = body(l, carry, w, bufs)
    return (carry, ahead, bufs), None

  if n > k:
    (carry, ahead, bufs), _ = jax.lax.scan(step, (carry, ahead, bufs), jnp.arange(n - k))
  for i in range(k):
    carry, bufs = body(order(n - k + i), carry, ahead[i], bufs)
  return carry, bufs


def layer_stack(x, stacked, layer_fn, gather, depth: int, keep: bool, policy):
  """x -> layer_fn(..layer_fn(layer_fn(x, W_0), W_1).., W_{n-1}) with W_l = gather(stacked[l])."""
  n = jax.tree.leaves(stacked)[0].shape[0]
  f = layer_fn if policy is None else jax.checkpoint(layer_fn, policy=policy)
  meta = {}

  def residuals(x, w):
    """One layer's forward and what its backward needs, as flat leaves; weights located by identity."""
    y, vjp = jax.vjp(f, x, w)
    leaves, treedef = jax.tree.flatten(vjp)
    w_index = {id(a): i for i, a in enumerate(jax.tree.leaves(w))}
    where_w = tuple(-1 if keep else w_index.get(id(a), -1) for a in leaves)
    return y, leaves, treedef, where_w

  def save(leaves, where_w):
    return [a for a, i in zip(leaves, where_w) if i < 0]

  @jax.custom_vjp
  def stack(x, stacked):
    fetch = lambda l, _: gather(_take(stacked, l))
    return pipeline(n, depth, False, fetch, lambda l, x, w, b: (layer_fn(x, w), b), x, ())[0]

  def fwd(x, stacked):
    fetch = lambda l, _: gather(_take(stacked, l))
    # Shapes (and varying axes) of one layer's residuals, from an abstract trace that emits nothing.
    def probe(x, stacked):
      _, leaves, treedef, where_w = residuals(x, gather(_take(stacked, 0)))
      meta.update(treedef=treedef, where_w=where_w)
      return save(leaves, where_w)
    avals = jax.make_jaxpr(probe)(x, stacked).out_avals
    bufs = [C.pvary(jnp.zeros((n, *a.shape), a.dtype), a.manual_axis_type.varying, name="zeros")
            for a in avals]

    def body(l, x, w, bufs):
      y, leaves, _, where_w = residuals(x, w)
      assert where_w == meta["where_w"], "a layer's residual structure changed between layers"
      return y, _put(bufs, save(leaves, where_w), l)

    y, bufs = pipeline(n, depth, False, fetch, body, x, bufs)
    return y, (bufs, stacked)

  def bwd(res, dy):
    bufs, stacked = res
    where_w, treedef = meta["where_w"], meta["treedef"]
    def regather(l, dx):
      # XLA:CPU drops optimization barriers before its last CSE pass, which would then merge a re-gather
      # outside the layer loop with the identical forward gather (keeping that layer gathered). Indexing with
      # a value of dx makes the two differ: `dx == dx` holds unless dx is NaN, and XLA does not fold it.
      probe = jax.tree.leaves(dx)[0].reshape(-1)[0]
      l = jnp.where(probe == probe, l, n)   # n: out of range (clamped), so never equal to l
      return gather(_take(stacked, l))
    grads = jax.tree.map(C.zeros_like, stacked)

    def body(l, dx, w, grads):
      saved = iter(_take(bufs, l))
      w_leaves = jax.tree.leaves(w) if w is not None else []
      leaves = [next(saved) if i < 0 else w_leaves[i] for i in where_w]
      dx, dw = jax.tree.unflatten(treedef, leaves)(dx)
      _, gather_t = jax.vjp(gather, _take(stacked, l))
      return dx, _put(grads, gather_t(dw)[0], l)   # W_l's gradient reduce-scattered now, in backward

    dx, grads = pipeline(n, depth, True, None if keep else regather, body, dy, grads)
    return dx, grads

  stack.defvjp(fwd, bwd)
  return stack(x, stacked)


class _Weights:
  """What the model reads its weights through: FSDP-gathered on demand, or already gathered."""

  def __init__(self, sched: "ExplicitSchedule", params, gathered: bool):
    self.s, self.params, self.gathered = sched, params, gathered

  def get(self, name):
    p = self.params[name]
    return p if self.gathered else self.s.gather(p, self.s.decls[name])

  def layers(self, x, layer_fn):
    s = self.s
    if self.gathered:   # deferred reduction: weights already gathered; backward re-reads them, no comm
      return layer_stack(x, self.params["layers"], layer_fn, lambda w: w, 0, False, s.policy)
    decls = {k: d.per_layer() for k, d in s.decls["layers"].items()}
    gather = lambda w: {k: s.gather(v, decls[k]) for k, v in w.items()}
    return layer_stack(x, self.params["layers"], layer_fn, gather, s.cfg.prefetch,
                       not s.cfg.reshard_after_forward, s.policy)


class ExplicitSchedule:
  """Hand-placed FSDP x TP. Runs inside shard_map over the (fsdp, tensor) mesh."""

  def __init__(self, cfg: ScheduleConfig, model: ModelConfig, compute_dtype=jnp.float32):
    for knob, allowed in KNOBS.items():
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
    self.ops = make_tp(cfg.tp)
    self.decls = declare(model)
    self.policy = _remat_policy(cfg.remat)
    # The residual stream varies over fsdp (batch) and, when sequence-parallel, over tensor (sequence).
    self.residual_axes = (FSDP, TENSOR) if self.ops.seq_sharded else (FSDP,)

  def gather(self, shard, decl, stacked: bool = False):
    """W[D_fsdp, ..] -> W[D, ..] in the compute dtype. Backward (AD): psum_scatter of the gradient over fsdp,
    and a psum over the residual axes the weight is replicated on (e.g. norm scales under SP), and over
    `tensor` for weights replicated there but read by tensor-parallel compute (K/V heads tensor does not
    divide; summed on the fsdp shard: pvary before the gather in forward, psum after its transpose)."""
    w = shard.astype(self.dtype) if self.cfg.gather_dtype == "compute" else shard
    if decl.tensor_replicated:
      w = C.pvary(w, TENSOR, name="replicated_weight")
    dim = decl.dim_of(FSDP)
    if dim is not None:
      w = C.all_gather(w, FSDP, dim + stacked, name="fsdp_all_gather")   # W[D_fsdp, N_tp] -> W[D, N_tp]
    return C.pvary(w.astype(self.dtype), self.residual_axes, name="replicated_weight")

  def gather_all(self, params):
    return {k: (jax.tree.map(lambda p, d: self.gather(p, d.per_layer(), stacked=True), v, self.decls[k],
                             is_leaf=is_param) if k == "layers" else self.gather(v, self.decls[k]))
            for k, v in params.items()}

  def loss_and_grads(self, params, tokens_BL, targets_BL, n_tokens: int):
    """Loss and gradients (shaped and sharded like `params`, fully reduced) for this device's batch."""
    k = self.cfg.microbatches
    mb = lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:])
    toks, tgts = mb(tokens_BL), mb(targets_BL)
    if self.cfg.grad_reduce == "deferred":
      gathered, gather_t = jax.vjp(self.gather_all, params)      # one all-gather per parameter per step
      loss, g = self._accumulate(gathered, toks, tgts, n_tokens, gathered=True)
      return loss, gather_t(g)[0]                                 # one reduce-scatter per parameter per step
    return self._accumulate(params, toks, tgts, n_tokens, gathered=False)

  def _accumulate(self, params, toks, tgts, n_tokens, gathered):
    def loss_fn(p, t, y):
      return M.loss(self.ops, self.model, _Weights(self, p, gathered), t, y, n_tokens)
    vg = jax.value_and_grad(loss_fn)
    if toks.shape[0] == 1:
      return vg(params, toks[0], tgts[0])

    def micro(acc, batch):
      loss, g = vg(params, *batch)
      return jax.tree.map(jnp.add, acc, (loss, g)), None
    zero = (jnp.zeros((), jnp.float32), jax.tree.map(C.zeros_like, params))
    return jax.lax.scan(micro, zero, (toks, tgts))[0]
