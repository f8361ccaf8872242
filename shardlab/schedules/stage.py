"""The stage unit: a stack of layers with its own forward and backward, as plain functions (`Stage`), its
prefetching layer loop (`prefetched_loop`) and the remat policies (`REMAT`, `remat_policy`): what the explicit
schedule's layer loop runs, and what a pipeline stage's slots call for different microbatches in one tick.

The forward saves each layer's residuals (its `jax.vjp` closure, flattened) minus the gathered weights, and the
backward re-gathers those weights with the same prefetch, then applies the weights part's reduction (by default
the transpose of the gather: a psum_scatter over `fsdp`) to each layer's weight gradient as soon as it is ready.
Plain AD of a prefetching scan would save every gathered weight (the carry) for backward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from shardlab import collectives as C
from shardlab import model as M
from shardlab.jax_private import dce_used_inputs
from shardlab.schedules.split import split
from shardlab.schedules.tp import MATMUL

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

def remat_policy(remat: str):
  """schedule.remat -> a jax.checkpoint policy (None: save everything; full: save nothing; else the named set)."""
  if remat == "none":
    return None
  if remat == "full":
    return jax.checkpoint_policies.nothing_saveable
  return jax.checkpoint_policies.save_only_these_names(*REMAT[remat])


# Layer and slot indices are never negative: no index normalization (three ops per leaf to trace, per layer).
def _take(stacked, l):
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, l, 0, keepdims=False, allow_negative_indices=False),
                      stacked)


def _put(bufs, values, l):
  return jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, l, 0, allow_negative_indices=False),
                      bufs, values)


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
    """One layer's forward and what its backward needs, as flat leaves; weights located by identity. After a
    probe (`_probe`), the probe's trace of it is replayed (`meta["replay"]`: the same equations, bound again, at a
    fraction of the cost of tracing the layer's VJP anew for every layer the loop unrolls)."""
    replay = self.meta.get("replay")
    if replay is not None:
      closed, y_tree, n_y = replay
      out = jaxpr_as_fun(closed)(*jax.tree.leaves(x), *jax.tree.leaves(w))
      return jax.tree.unflatten(y_tree, out[:n_y]), out[n_y:], self.meta["treedef"], self.meta["where_w"]
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
    self.meta.pop("replay", None)

    def traced(x, w):
      y, leaves, treedef, where_w = self._residuals(x, w)
      self.meta.update(treedef=treedef, where_w=where_w, y=(jax.tree.structure(y), len(jax.tree.leaves(y))))
      return [*jax.tree.leaves(y), *leaves]

    def probe(x, stacked):
      w = self.gather(_take(stacked, 0))
      closed = jax.make_jaxpr(traced)(x, w)
      self.meta["replay"] = (closed, *self.meta["y"])
      y, leaves, treedef, where_w = self._residuals(x, w)
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
    recomputed or saved, while it runs}. memory_model.breakdown counts activations from them. Without a remat
    policy the two are one trace."""
    unremat = _read_residual_bytes(self.layer_fn, self.gather, x, stacked)
    saved = unremat if self.f is self.layer_fn else _read_residual_bytes(self.f, self.gather, x, stacked)
    return {"saved": saved, "unremat": unremat}

  def __call__(self, x, stacked):
    @jax.custom_vjp
    def stack(x, stacked):
      return self.apply(x, stacked)
    stack.defvjp(self.forward, self.backward)
    return stack(x, stacked)
