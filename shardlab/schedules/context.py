"""Context parallelism: the sequence of every activation split over the `context` mesh axis (the layout rule
`length -> context`), and attention across the split. Outside attention the axis is one more batch axis: the MLP
and norms see local tokens, the loss sums over it, and a weight replicated over it has its gradient summed over
it (the schedule's gather marks the fsdp shard varying there, as for HSDP's replicas).

A strategy is the model's attention hook, `attend(q, k, v, positions)` (schedules/parallel.py), picked by the
Hydra group `context/` (`context.impl`: a name in STRATEGIES or `package.module:Class`):

  all_gather  K and V (and their positions) all-gathered over `context`; each device's queries attend to the
              whole sequence's keys with the causal mask built from the positions (the data's: right however
              the tokens are placed). Backward (AD): the transpose of the gather, dK and dV reduce-scattered
              over `context`. Bytes per device per layer: (C-1)/C of the gathered K/V forward, the same backward;
              GQA moves only its G K/V heads. The attention is the plain one (scores [B, H, L/C, L]).
  ring        ring attention: K/V blocks rotated by ppermute, an online softmax over them, a custom VJP that
              rotates K/V again with dK/dV (no other device's K/V kept). Bytes per device per layer: (C-1) blocks
              of K and V forward, the same and C blocks of dK and dV backward; each step's ppermute depends only
              on the block received the step before, so a GPU can run it behind that step's attention.
  ulysses     DeepSpeed-Ulysses: Q, K and V all-to-all'd from sequence-sharded to head-sharded ([B, L/C, H, K]
              -> [B, L, H/C, K]), attention over the whole sequence on H/C heads (the model's own kernel:
              plain, blockwise or cuDNN's), the output all-to-all'd back. Backward (AD): the same all-to-alls the
              other way. Bytes per device per layer: (C-1)/C of q, k, v and o each way; needs the heads after
              tensor parallelism (query and K/V) divisible by C.

With no `context` axis in the mesh a strategy is the model's own attention (model.attention).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from shardlab import attention as A
from shardlab import collectives as C
from shardlab.config import ContextConfig, ModelConfig
from shardlab.data import zigzag
from shardlab.layout import Layout
from shardlab.mesh import ConfigError
from shardlab.schedules.loading import load_object

SEQ_DIM = 1   # q, k, v are [B, L, heads, K]


class AllGatherKV:
  """K/V all-gathered over the context axes; local queries, the causal mask from positions."""

  def __init__(self, model: ModelConfig, layout: Layout, cfg: ContextConfig | None = None):
    self.model, self.layout, self.cfg = model, layout, cfg or ContextConfig()

  def parts(self, shape: dict) -> int:
    """How many pieces the sequence is split into on a mesh of `shape`."""
    return math.prod(shape[a] for a in self.layout.rule("length", tuple(shape)))

  def check_balance(self, shape: dict) -> None:
    """With load balancing, a sequence that cuts into 2 C chunks."""
    c = self.parts(shape)
    if self.cfg.load_balance and c > 1 and self.model.seq_len % (2 * c):
      raise ConfigError(f"model.seq_len={self.model.seq_len} is not divisible by 2 * mesh.context={2 * c} "
                        f"(context.load_balance=true cuts each sequence into 2 C chunks); choose seq_len a multiple "
                        f"of {2 * c} or context.load_balance=false")

  def check(self, shape: dict) -> None:
    """What this strategy needs on a mesh of `shape` with a `length` rule: a sequence load balancing can cut
    into 2 C chunks, and the plain attention (a general mask)."""
    self.check_balance(shape)
    if self.layout.rule("length", tuple(shape)) and self.model.attention != "plain":
      raise ConfigError(f"model.attention={self.model.attention}: context=all_gather runs the plain attention "
                        f"(a causal mask from the tokens' positions); set model.attention=plain or mesh.context=1")

  def context_axis(self):
    """The mesh axes the sequence is split over on the mesh being traced (a name, or a tuple), None if none."""
    axes = self.layout.rule("length", jax.sharding.get_abstract_mesh().axis_names)
    return None if not axes else axes[0] if len(axes) == 1 else axes

  def own(self, q_BLHK, k_BLGK, v_BLGK):
    """The model's own attention (model.attention) over the sequence it is given, causal in index order."""
    return A.attend(self.model.attention, q_BLHK, k_BLGK, v_BLGK, self.model.attention_block)

  def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_L):
    axis = self.context_axis()
    if axis is None:
      return self.own(q_BLHK, k_BLGK, v_BLGK)
    # k[B, L_ctx, G, K] -> k[B, L, G, K]; backward: dK[B, L, G, K]{U_ctx} -> dK[B, L_ctx, G, K] (reduce-scatter)
    k_BMGK = C.all_gather(k_BLGK, axis, SEQ_DIM, name="cp_kv_all_gather")
    v_BMGK = C.all_gather(v_BLGK, axis, SEQ_DIM, name="cp_kv_all_gather")
    pos_M = C.all_gather(positions_L, axis, 0, name="cp_positions")     # ints: no gradient
    causal_LM = positions_L[:, None] >= pos_M[None, :]
    return checkpoint_name(A.plain(q_BLHK, k_BMGK, v_BMGK, causal_LM), A.ATTN_OUT)


class Ulysses(AllGatherKV):
  """Sequence-sharded <-> head-sharded by all_to_all around the model's own attention."""

  def check(self, shape: dict) -> None:
    """The heads each device holds after tensor parallelism, query and K/V, split again over the context axes."""
    axes = self.layout.rule("length", tuple(shape))
    if not axes:
      return
    c, t = 1, 1
    for a in axes:
      c *= shape[a]
    for a in self.layout.rule("heads", tuple(shape)):
      t *= shape[a]
    m = self.model
    self.check_balance(shape)
    if (m.n_heads // t) % c or m.kv_heads % t or (m.kv_heads // t) % c:
      raise ConfigError(f"context=ulysses splits the heads over the context axes: model.n_heads={m.n_heads} and "
                        f"model.n_kv_heads={m.kv_heads} over tensor={t} leave {m.n_heads // t} and "
                        f"{m.kv_heads // t if m.kv_heads % t == 0 else 'replicated'} per device, not multiples of "
                        f"context={c}; use context=all_gather or a smaller mesh.context")

  def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_L):
    axis = self.context_axis()
    if axis is None:
      return self.own(q_BLHK, k_BLGK, v_BLGK)
    # x[B, L_ctx, N, K] -> x[B, L, N_ctx, K]; backward: the all_to_all back
    heads = lambda x: C.all_to_all(x, axis, 2, SEQ_DIM, name="cp_ulysses")
    q, k, v = heads(q_BLHK), heads(k_BLGK), heads(v_BLGK)
    if self.model.attention == "plain":     # the causal mask from the gathered positions
      pos_M = C.all_gather(positions_L, axis, 0, name="cp_positions")
      o = checkpoint_name(A.plain(q, k, v, pos_M[:, None] >= pos_M[None, :]), A.ATTN_OUT)
    elif self.cfg.load_balance:   # the whole sequence in the data's zigzag order: back to index order for the
      order = zigzag(q.shape[SEQ_DIM], q.shape[SEQ_DIM] // q_BLHK.shape[SEQ_DIM])   # kernel, and back after
      back = np.argsort(order)
      o = jnp.take(self.own(*(jnp.take(x, back, axis=SEQ_DIM) for x in (q, k, v))), order, axis=SEQ_DIM)
    else:   # the whole sequence, in index order: the kernel's own causal mask
      o = self.own(q, k, v)
    return C.all_to_all(o, axis, SEQ_DIM, 2, name="cp_ulysses")   # o[B, L, H_ctx, K] -> o[B, L_ctx, H, K]


class Ring(AllGatherKV):
  """Ring attention (Liu et al. 2023, haoliuhl/ringattention): K/V blocks rotated around the context axis by
  ppermute, each combined into an online softmax as it arrives; a custom VJP whose backward rotates the K/V
  blocks again with their dK/dV, so no device keeps another device's K/V as a residual (only its q, k, v, the
  output and the log-sum-exp)."""

  def check(self, shape: dict) -> None:
    self.check_balance(shape)
    axes = self.layout.rule("length", tuple(shape))
    if len(axes) > 1:
      raise ConfigError(f"layout rule length -> {' x '.join(axes)}: context=ring rotates over one mesh axis")

  def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_L):
    axis = self.context_axis()
    if axis is None:
      return self.own(q_BLHK, k_BLGK, v_BLGK)
    return checkpoint_name(ring_attention(q_BLHK, k_BLGK, v_BLGK, positions_L, axis), A.ATTN_OUT)


def _ring_scores(q_BLGRK, k_BMGK, pos_L, pos_M):
  """Scaled scores [B, G, R, L, M] in float32 and the causal mask [L, M] from the positions."""
  s = jnp.einsum("blgrk,bmgk->bgrlm", q_BLGRK, k_BMGK, preferred_element_type=jnp.float32)
  return s / np.sqrt(q_BLGRK.shape[-1]), pos_L[:, None] >= pos_M[None, :]


def _ring_forward(q_BLHK, k_BLGK, v_BLGK, pos_L, axis):
  B, L, H, K = q_BLHK.shape
  G = k_BLGK.shape[2]
  q = q_BLHK.reshape(B, L, G, H // G, K)
  n = C.axis_size(axis)
  acc = C.zeros_like(q.astype(jnp.float32))                          # sum of p v, [B, L, G, R, K]
  m = C.pvary(jnp.full((B, G, H // G, L), -jnp.inf, jnp.float32), C.varying_axes(acc), name="zeros")   # max
  l = C.zeros_like(m)                                                  # running sum of p
  k, v, pos = k_BLGK, v_BLGK, pos_L
  for step in range(n):      # after `step` shifts this device holds the block of rank r - step
    s, mask = _ring_scores(q, k, pos_L, pos)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)             # a row with no visible key yet
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    l = l * corr + jnp.sum(p, axis=-1)
    acc = acc * corr.transpose(0, 3, 1, 2)[..., None] + jnp.einsum("bgrlm,bmgk->blgrk", p, v.astype(jnp.float32))
    m = m_new
    if step < n - 1:
      k, v, pos = (C.ring_shift(x, axis, +1, name="cp_ring") for x in (k, v, pos))
  o = acc / l.transpose(0, 3, 1, 2)[..., None]
  lse = jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(l)
  return o.reshape(B, L, H, K).astype(q_BLHK.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def ring_attention(q_BLHK, k_BLGK, v_BLGK, pos_L, axis):
  """Causal attention of the local queries against every device's keys along `axis`, K/V rotated by ppermute."""
  return _ring_forward(q_BLHK, k_BLGK, v_BLGK, pos_L, axis)[0]


def _ring_fwd(q, k, v, pos, axis):
  o, lse = _ring_forward(q, k, v, pos, axis)
  return o, (q, k, v, pos, o, lse)        # local blocks only: O(L / C) per device


def _ring_bwd(axis, res, do_BLHK):
  q_BLHK, k_BLGK, v_BLGK, pos_L, o_BLHK, lse = res
  B, L, H, K = q_BLHK.shape
  G = k_BLGK.shape[2]
  grouped = lambda x: x.reshape(B, L, G, H // G, K).astype(jnp.float32)
  q, do, o = grouped(q_BLHK), grouped(do_BLHK), grouped(o_BLHK)
  D = jnp.sum(do * o, axis=-1).transpose(0, 2, 3, 1)                   # [B, G, R, L]
  n = C.axis_size(axis)
  dq = C.zeros_like(q)
  k, v, pos = k_BLGK, v_BLGK, pos_L
  dk, dv = C.zeros_like(k.astype(jnp.float32)), C.zeros_like(v.astype(jnp.float32))
  for step in range(n):      # the blocks travel as in forward, each with its dK/dV accumulating on the way
    s, mask = _ring_scores(q, k, pos_L, pos)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
    dv = dv + jnp.einsum("bgrlm,blgrk->bmgk", p, do)
    ds = p * (jnp.einsum("blgrk,bmgk->bgrlm", do, v.astype(jnp.float32)) - D[..., None]) / np.sqrt(K)
    dq = dq + jnp.einsum("bgrlm,bmgk->blgrk", ds, k.astype(jnp.float32))
    dk = dk + jnp.einsum("bgrlm,blgrk->bmgk", ds, q)
    if step < n - 1:
      k, v, pos = (C.ring_shift(x, axis, +1, name="cp_ring") for x in (k, v, pos))
    dk, dv = (C.ring_shift(x, axis, +1, name="cp_ring_grad") for x in (dk, dv))   # the last shift: home
  zero_pos = np.zeros(pos_L.shape, jax.dtypes.float0)
  return dq.reshape(B, L, H, K).astype(q_BLHK.dtype), dk.astype(k_BLGK.dtype), dv.astype(v_BLGK.dtype), zero_pos


ring_attention.defvjp(_ring_fwd, _ring_bwd)


STRATEGIES = {"all_gather": AllGatherKV, "ulysses": Ulysses, "ring": Ring}


def make(cfg: ContextConfig, model: ModelConfig, layout: Layout):
  """The strategy `context.impl` names, built for the model, the run's layout and its settings."""
  return load_object(cfg.impl, "context.impl", STRATEGIES)(model, layout, cfg)
