"""A fused flash-attention kernel for one block of queries against one block of keys, written with Pallas: the ring's
per-step kernel and blockwise attention on GPU and TPU targets (schedules/context.py, attention.py).

  block_attention(q, k, v, pq, pk)          -> o, lse        forward: the step's output (normalised, float32) and
                                                               its log-sum-exp, for the ring's online merge
  block_attention_bwd(q, k, v, pq, pk, lse, do, delta) -> dq, dk, dv   backward from the FINAL log-sum-exp and
                                                               delta = rowsum(dO * O) (FlashAttention-2's)

q[B, Lq, H, K] attends to k, v[B, Lk, G, K] (H query heads share G key/value heads, head h reads h // (H / G)); query
n sees key m where pq[n] >= pk[m] (token positions: any placement, contiguous, zigzag or striped). A block pair
whose keys all follow its queries is skipped at run time, so a causal step does the work of its visible blocks: on a
GPU each cell loops over the range of blocks from its first to its last visible one (`spans`, computed from the
positions before the call; every block in it for the positions of a causal sequence, a zigzag or a striped
placement, which ascend on each device; positions that do not ascend may leave invisible blocks inside a range, which
the mask makes add nothing), a loop with no branch, which Triton can software-pipeline; interpreted, each cell
visits every block under `lax.cond` on the blocks' positions (a loop of static length: the HLO analyses read its
trip count). Rows that see no key get lse = -inf and o = 0.

Three Pallas kernels (Tri Dao, FlashAttention-2, arXiv:2307.08691: Algorithms 1 and 2): the forward, one grid cell
per (query block, batch, head) looping over key blocks with an online softmax; the backward's dK/dV, one cell per
(key block, batch, head) looping over query blocks; its dQ, one cell per (query block, batch, head) looping over
key blocks. dK and dV come out per query head and are summed over each group outside the kernel.

On a GPU target they lower to Triton (`__gpu$xla.gpu.triton` custom calls); for a TPU target the same three are
written for Mosaic (below: a grid over key blocks, the softmax in scratch; `on_platforms` picks per platform);
`interpret=True` runs the kernels through Pallas's interpreter (the CPU tests: tests/test_flash_kernel.py holds
them to plain attention and to the pure-JAX kernels). The FLOPs each call does are stated in its name (`shardlab_flash_<kind>_<FLOPs>f`, the
matmuls of the block pairs it visits, `pair_counts`): Triton's custom call carries no cost estimate, and the
calibrated replay prices the call from that figure at the preset's attention efficiency (analysis/hlo.py,
`stated_flops`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

NAME = "shardlab_flash"           # the kernels' names start with this (analysis/hlo.py reads their stated FLOPs)
BWD_OVER_FWD = (8 + 6) / 4        # the FLOPs its backward states over its forward's, per visible block pair: dK/dV
                                  # 8 and dQ 6 (S and dP again in each) x B H bq bk K against the forward's 4
BLOCK_Q, BLOCK_K = 64, 64         # tile sizes on a GPU: [64, 64] float32 scores per cell; powers of two >= 16
WARPS, STAGES = 4, 2


def _pow2(n: int) -> bool:
  return n >= 16 and not n & (n - 1)


def usable(lq: int, lk: int, head_dim: int, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> str | None:
  """Why the kernel cannot run these shapes as Triton tiles (None: it can): blocks of min(block, length) tokens
  that divide the lengths, and blocks and the head dimension powers of two of at least 16."""
  bq, bk = min(block_q, lq), min(block_k, lk)
  if lq % bq or lk % bk or not (_pow2(bq) and _pow2(bk)):
    return f"{lq} queries and {lk} keys do not cut into blocks of a power of two >= 16 tokens (at most {block_q})"
  if not _pow2(head_dim):
    return f"head dimension {head_dim} is not a power of two >= 16"
  return None


def pair_counts(pq: np.ndarray, pk: np.ndarray, block_q: int, block_k: int) -> int:
  """How many (query block, key block) pairs have a key at or before a query: the blocks the kernels visit, from
  positions known ahead (the ring's plan)."""
  bq, bk = min(block_q, len(pq)), min(block_k, len(pk))
  hi = np.asarray(pq).reshape(-1, bq).max(1)
  lo = np.asarray(pk).reshape(-1, bk).min(1)
  return int((hi[:, None] >= lo[None, :]).sum())


def _mm(a, b, ta: bool = False, tb: bool = False):
  """a @ b (a or b transposed) with float32 accumulation: a tensor-core matmul in a Triton kernel."""
  dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _varying(*xs):
  """The inputs made varying over the union of their varying mesh axes (inside shard_map), and that type for the
  outputs: a Pallas call's outputs vary as its inputs do."""
  from shardlab import collectives as C
  axes = tuple(sorted(frozenset().union(*(C.varying_axes(x) for x in xs))))
  xs = [C.pvary(x, axes, name="flash_inputs") for x in xs]
  return xs, jax.typeof(xs[0]).manual_axis_type


def _one(index_map):
  """The BlockSpec of one int32 per grid cell (a span's end), `index_map` naming which."""
  return pl.BlockSpec((1,), index_map)


def _out(shape, dtype, mat):
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def _rows(ref, interpret: bool):
  """rows(start, size): ref[start:start + size] along its first axis, read inside the kernel's loop. Interpreted,
  the whole block is read once before the loop and sliced as a value: the interpreter, in jax 0.10.2, loses a
  ref's varying mesh axes (shard_map's check_vma) when the ref is read inside a loop."""
  if not interpret:
    return lambda start, size: ref[pl.ds(start, size)]
  whole = ref[...]
  return lambda start, size: lax.dynamic_slice_in_dim(whole, start, size, 0)


def _visit(pairs: int, total: int):
  """The scope of a kernel's block-skipping branch, declaring how often it is taken: `pairs` of the `total` block
  pairs (analysis/hlo.py: declared_runs; it counts a branch under a conditional only where it is declared, and an
  interpreted kernel's branch is a conditional of the program)."""
  return jax.named_scope(f"flash_visit_runs_{pairs}_of_{total}")


def spans(pq, pk, block_q: int, block_k: int):
  """(first, end) of the key blocks each query block sees (int32 [Lq / bq] each: blocks first..end-1 hold every
  key at or before one of its queries; first = end = 0 where it sees none), and the same of the query blocks each
  key block is seen by ([Lk / bk]), from the blocks' extreme positions: the loop ranges of the kernels' cells."""
  seen = (jnp.max(pq.reshape(-1, block_q), 1)[:, None] >= jnp.min(pk.reshape(-1, block_k), 1)[None, :])

  def span(m):                                  # m[rows, cols] -> first and one past the last True per row
    n = m.shape[1]
    first = jnp.argmax(m, axis=1)
    end = n - jnp.argmax(m[:, ::-1], axis=1)
    any_ = jnp.any(m, axis=1)
    return jnp.where(any_, first, 0).astype(jnp.int32), jnp.where(any_, end, 0).astype(jnp.int32)
  return span(seen), span(seen.T)


def _loop(lo_ref, hi_ref, n: int, body, init, runs: tuple):
  """body over the blocks a cell sees: with its span (lo_ref, hi_ref: one int32 each, the Triton kernels) a loop
  over blocks lo..hi-1 with no branch; without (interpreted) every one of the n blocks under `lax.cond`, the
  branch's count declared (`_visit`)."""
  if lo_ref is not None:
    return lax.fori_loop(jnp.min(lo_ref[...]), jnp.max(hi_ref[...]), lambda j, c: body(j, c, None), init)
  with _visit(*runs):
    return lax.fori_loop(0, n, lambda j, c: body(j, c, lax.cond), init)


def _name(kind: str, flops: float) -> str:
  return f"{NAME}_{kind}_{int(flops)}f"


def _compiler_params(interpret: bool):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=WARPS, num_stages=STAGES)


# ------------------------------------------------------------------------------------------------ forward

def _fwd_kernel(q_ref, k_ref, v_ref, pq_ref, pk_ref, *refs, block_k: int, scale: float, interpret: bool,
                runs: tuple):
  lo_ref, hi_ref, o_ref, lse_ref = refs if len(refs) == 4 else (None, None, *refs)
  q, pq = q_ref[...], pq_ref[...]                      # [bq, K], [bq]
  bq, K = q.shape
  top = jnp.max(pq)
  k_rows, v_rows, pk_rows = (_rows(r, interpret) for r in (k_ref, v_ref, pk_ref))

  def body(j, carry, cond):
    def visit(carry):
      m, l, acc = carry
      k, v, pk = k_rows(j * block_k, block_k), v_rows(j * block_k, block_k), pk_rows(j * block_k, block_k)
      s = _mm(q, k, tb=True) * scale
      s = jnp.where(pq[:, None] >= pk[None, :], s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # a row with no visible key yet
      p = jnp.exp(s - m_safe[:, None])
      corr = jnp.exp(m - m_safe)
      pv = _mm(p.astype(v.dtype), v)
      return m_new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + pv
    if cond is None:
      return visit(carry)
    return cond(top >= jnp.min(pk_rows(j * block_k, block_k)), visit, lambda c: c, carry)

  init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, K), jnp.float32))
  m, l, acc = _loop(lo_ref, hi_ref, k_ref.shape[0] // block_k, body, init, runs)
  seen = l > 0
  o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def block_attention(q, k, v, pq, pk, *, pairs: int | None = None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
                    interpret: bool = False, ranged: bool | None = None):
  """o[B, Lq, H, K] (float32, normalised over this block's keys) and lse[B, H, Lq] (float32). `pairs`: the visible
  block pairs (pair_counts) this call is stated to compute (default: all of them). `ranged`: loop over each cell's
  span of visible blocks (`spans`; default: when not interpreted)."""
  B, Lq, H, K = q.shape
  Lk, G = k.shape[1], k.shape[2]
  R = H // G
  bq, bk = min(block_q, Lq), min(block_k, Lk)
  pairs = (Lq // bq) * (Lk // bk) if pairs is None else pairs
  flops = 4.0 * B * H * pairs * bq * bk * K
  runs = (pairs, (Lq // bq) * (Lk // bk))
  kernel = functools.partial(_fwd_kernel, block_k=bk, scale=1.0 / math.sqrt(K), interpret=interpret, runs=runs)
  pq, pk = pq.astype(jnp.int32), pk.astype(jnp.int32)
  span = list(spans(pq, pk, bq, bk)[0]) if (not interpret if ranged is None else ranged) else []
  args, mat = _varying(q, k, v, pq, pk, *span)
  return pl.pallas_call(
      kernel, grid=(Lq // bq, B, H),
      in_specs=[pl.BlockSpec((None, bq, None, K), lambda i, b, h: (b, i, h, 0)),
                pl.BlockSpec((None, Lk, None, K), lambda i, b, h: (b, 0, h // R, 0)),
                pl.BlockSpec((None, Lk, None, K), lambda i, b, h: (b, 0, h // R, 0)),
                pl.BlockSpec((bq,), lambda i, b, h: (i,)),
                pl.BlockSpec((Lk,), lambda i, b, h: (0,))] + [_one(lambda i, b, h: (i,))] * len(span),
      out_specs=[pl.BlockSpec((None, bq, None, K), lambda i, b, h: (b, i, h, 0)),
                 pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
      out_shape=[_out((B, Lq, H, K), jnp.float32, mat), _out((B, H, Lq), jnp.float32, mat)],
      compiler_params=_compiler_params(interpret), interpret=interpret, name=_name("fwd", flops),
  )(*args)


def lse_blocks(lse_BHL, G: int, n: int):
  """lse[B, H, L] (the kernel's) -> [L/n, B, G, R, n] (the pure-JAX kernels' residual layout: attention.py's
  blockwise, the ring's), n their block size; lse_rows is the way back."""
  B, H, L = lse_BHL.shape
  return jnp.transpose(lse_BHL.reshape(B, G, H // G, L // n, n), (3, 0, 1, 2, 4))


def lse_rows(lse_b):
  nb, B, G, R, n = lse_b.shape
  return jnp.transpose(lse_b, (1, 2, 3, 0, 4)).reshape(B, G * R, nb * n)


# ----------------------------------------------------------------------------------------------- backward

def _probs(q, k, pq, pk, lse, scale):
  """p[bq, bk] = exp(s - lse) where the key is visible, 0 elsewhere (s recomputed from q, k)."""
  s = _mm(q, k, tb=True) * scale
  return jnp.where(pq[:, None] >= pk[None, :], jnp.exp(s - lse[:, None]), 0.0)


def _dkv_kernel(q_ref, k_ref, v_ref, pq_ref, pk_ref, lse_ref, do_ref, delta_ref, *refs, block_q: int,
                scale: float, interpret: bool, runs: tuple):
  lo_ref, hi_ref, dk_ref, dv_ref = refs if len(refs) == 4 else (None, None, *refs)
  k, v, pk = k_ref[...], v_ref[...], pk_ref[...]       # [bk, K], [bk]
  low = jnp.min(pk)
  q_rows, do_rows, pq_rows, lse_rows, delta_rows = (_rows(r, interpret)
                                                    for r in (q_ref, do_ref, pq_ref, lse_ref, delta_ref))

  def body(i, carry, cond):
    def visit(carry):
      dk, dv = carry
      at = (i * block_q, block_q)
      q, do, pq = q_rows(*at), do_rows(*at), pq_rows(*at)
      p = _probs(q, k, pq, pk, lse_rows(*at), scale)
      dv = dv + _mm(p.astype(do.dtype), do, ta=True)
      dp = _mm(do, v, tb=True)
      ds = (p * (dp - delta_rows(*at)[:, None]) * scale).astype(q.dtype)
      return dk + _mm(ds, q, ta=True), dv
    if cond is None:
      return visit(carry)
    return cond(jnp.max(pq_rows(i * block_q, block_q)) >= low, visit, lambda c: c, carry)

  zero = jnp.zeros(k.shape, jnp.float32)
  dk, dv = _loop(lo_ref, hi_ref, q_ref.shape[0] // block_q, body, (zero, zero), runs)
  dk_ref[...], dv_ref[...] = dk, dv


def _dq_kernel(q_ref, k_ref, v_ref, pq_ref, pk_ref, lse_ref, do_ref, delta_ref, *refs, block_k: int,
               scale: float, interpret: bool, runs: tuple):
  lo_ref, hi_ref, dq_ref = refs if len(refs) == 3 else (None, None, *refs)
  q, do, pq, lse, delta = q_ref[...], do_ref[...], pq_ref[...], lse_ref[...], delta_ref[...]
  top = jnp.max(pq)
  k_rows, v_rows, pk_rows = (_rows(r, interpret) for r in (k_ref, v_ref, pk_ref))

  def body(j, dq, cond):
    def visit(dq):
      at = (j * block_k, block_k)
      k, v = k_rows(*at), v_rows(*at)
      p = _probs(q, k, pq, pk_rows(*at), lse, scale)
      dp = _mm(do, v, tb=True)
      ds = (p * (dp - delta[:, None]) * scale).astype(k.dtype)
      return dq + _mm(ds, k)
    if cond is None:
      return visit(dq)
    return cond(top >= jnp.min(pk_rows(j * block_k, block_k)), visit, lambda c: c, dq)

  dq_ref[...] = _loop(lo_ref, hi_ref, k_ref.shape[0] // block_k, body, jnp.zeros(q.shape, jnp.float32), runs)


def block_attention_bwd(q, k, v, pq, pk, lse, do, delta, *, pairs: int | None = None, block_q: int = BLOCK_Q,
                        block_k: int = BLOCK_K, interpret: bool = False, ranged: bool | None = None):
  """dq[B, Lq, H, K], dk, dv[B, Lk, G, K] (float32) of this block pair's attention, given the final lse[B, H, Lq]
  and delta[B, H, Lq] = rowsum(dO * O) of the whole attention the block is part of. `ranged`: as block_attention's."""
  B, Lq, H, K = q.shape
  Lk, G = k.shape[1], k.shape[2]
  R = H // G
  bq, bk = min(block_q, Lq), min(block_k, Lk)
  pairs = (Lq // bq) * (Lk // bk) if pairs is None else pairs
  scale = 1.0 / math.sqrt(K)
  runs = (pairs, (Lq // bq) * (Lk // bk))
  pq, pk = pq.astype(jnp.int32), pk.astype(jnp.int32)
  by_q, by_k = spans(pq, pk, bq, bk) if (not interpret if ranged is None else ranged) else ((), ())
  args, mat = _varying(q, k, v, pq, pk, lse, do, delta, *by_q, *by_k)
  args, by_q, by_k = args[:8], args[8:8 + len(by_q)], args[8 + len(by_q):]
  params, f32 = _compiler_params(interpret), jnp.float32
  whole_q = pl.BlockSpec((None, Lq, None, K), lambda j, b, h: (b, 0, h, 0))
  kv_block = pl.BlockSpec((None, bk, None, K), lambda j, b, h: (b, j, h // R, 0))
  dk, dv = pl.pallas_call(     # four matmuls per visited pair: s, dP, dV, dK
      functools.partial(_dkv_kernel, block_q=bq, scale=scale, interpret=interpret, runs=runs), grid=(Lk // bk, B, H),
      in_specs=[whole_q, kv_block, kv_block, pl.BlockSpec((Lq,), lambda j, b, h: (0,)),
                pl.BlockSpec((bk,), lambda j, b, h: (j,)), pl.BlockSpec((None, None, Lq), lambda j, b, h: (b, h, 0)),
                whole_q, pl.BlockSpec((None, None, Lq), lambda j, b, h: (b, h, 0))]
               + [_one(lambda j, b, h: (j,))] * len(by_k),
      out_specs=[pl.BlockSpec((None, bk, None, K), lambda j, b, h: (b, j, h, 0))] * 2,
      out_shape=[_out((B, Lk, H, K), f32, mat)] * 2,
      compiler_params=params, interpret=interpret, name=_name("bwd_dkv", 8.0 * B * H * pairs * bq * bk * K),
  )(*args, *by_k)
  q_block = pl.BlockSpec((None, bq, None, K), lambda i, b, h: (b, i, h, 0))
  whole_kv = pl.BlockSpec((None, Lk, None, K), lambda i, b, h: (b, 0, h // R, 0))
  row = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
  dq = pl.pallas_call(         # three matmuls per visited pair: s, dP, dQ
      functools.partial(_dq_kernel, block_k=bk, scale=scale, interpret=interpret, runs=runs), grid=(Lq // bq, B, H),
      in_specs=[q_block, whole_kv, whole_kv, pl.BlockSpec((bq,), lambda i, b, h: (i,)),
                pl.BlockSpec((Lk,), lambda i, b, h: (0,)), row, q_block, row]
               + [_one(lambda i, b, h: (i,))] * len(by_q),
      out_specs=q_block, out_shape=_out((B, Lq, H, K), f32, mat),
      compiler_params=params, interpret=interpret, name=_name("bwd_dq", 6.0 * B * H * pairs * bq * bk * K),
  )(*args, *by_q)
  group = lambda x: x.reshape(B, Lk, G, R, K).sum(3)
  return dq, group(dk), group(dv)


# ------------------------------------------------------------------------------------------ TPU (Mosaic)
#
# The same forward for a TPU target. Mosaic wants 2-D tiles of (8, 128): the grid runs over (batch, head, query
# block, key block) with the key blocks innermost and sequential ("arbitrary"), the online softmax in VMEM scratch
# (its max and sum replicated over 128 lanes, as JAX's TPU flash kernel keeps them), the query positions as
# [Lq, 128] (replicated over lanes) and the key positions as [8, Lk] (over sublanes), and whether a block pair has
# a visible key decided from each block's extreme positions prefetched into scalar memory.

LANES, SUBLANES, TPU_BLOCK = 128, 8, 128


def usable_tpu(lq: int, lk: int, head_dim: int) -> str | None:
  """Why the TPU kernel cannot take these shapes (None: it can): blocks of 128 tokens, a head dimension of 64 or a
  multiple of 128."""
  if lq % TPU_BLOCK or lk % TPU_BLOCK:
    return f"{lq} queries or {lk} keys do not cut into blocks of {TPU_BLOCK}"
  if head_dim != 64 and head_dim % LANES:
    return f"head dimension {head_dim} is neither 64 nor a multiple of {LANES}"
  return None


def _lanes(x, width: int):
  """A [rows, 128] lane-replicated column as [rows, width]."""
  if width == LANES:
    return x
  if width < LANES:
    return x[:, :width]
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.repeat(x, width // LANES, 1)


def _fwd_tpu_kernel(qmax_ref, kmin_ref, q_ref, k_ref, v_ref, pq_ref, pk_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *,
                    scale: float, runs: tuple):
  i, j = pl.program_id(2), pl.program_id(3)
  K = q_ref.shape[-1]

  @pl.when(j == 0)
  def _start():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  with _visit(*runs):
    @pl.when(qmax_ref[i] >= kmin_ref[j])
    def _block():
      s = _mm(q_ref[...], k_ref[...], tb=True) * scale                       # [bq, bk]
      s = jnp.where(pq_ref[...] >= pk_ref[...][:1, :], s, -jnp.inf)
      m_prev = m_sc[...]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))         # [bq, 128]
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp(s - m_safe)
      corr = jnp.exp(m_prev - m_safe)
      l_sc[...] = l_sc[...] * corr + jnp.sum(p, axis=1, keepdims=True)
      acc_sc[...] = acc_sc[...] * _lanes(corr, K) + _mm(p.astype(v_ref.dtype), v_ref[...])
      m_sc[...] = m_new

  @pl.when(j == pl.num_programs(3) - 1)
  def _end():
    l = l_sc[...]
    seen = l > 0
    o_ref[...] = (acc_sc[...] / _lanes(jnp.where(seen, l, 1.0), K)).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m_sc[...] + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def _extremes(p, block: int, fn):
  return fn(p.reshape(-1, block), axis=1).astype(jnp.int32)


def _tpu_call(q, k, pq, pk, pairs):
  """What both Mosaic calls start from: (B, Lq, H, K, Lk, G, R, nq, nk, pairs), and the position arguments: each
  block's extreme positions (scalar-prefetched: query blocks' last, key blocks' first) and the positions replicated
  over lanes (queries, [Lq, 128]) and over sublanes (keys, [8, Lk])."""
  B, Lq, H, K = q.shape
  Lk, G = k.shape[1], k.shape[2]
  nq, nk = Lq // TPU_BLOCK, Lk // TPU_BLOCK
  pq, pk = pq.astype(jnp.int32), pk.astype(jnp.int32)
  where = [_extremes(pq, TPU_BLOCK, jnp.max), _extremes(pk, TPU_BLOCK, jnp.min),
           jnp.broadcast_to(pq[:, None], (Lq, LANES)), jnp.broadcast_to(pk[None, :], (SUBLANES, Lk))]
  return (B, Lq, H, K, Lk, G, H // G, nq, nk, nq * nk if pairs is None else pairs), where


def _heads(x):
  return jnp.transpose(x, (0, 2, 1, 3))                                      # [B, L, N, K] -> [B, N, L, K]


def block_attention_tpu(q, k, v, pq, pk, *, pairs: int | None = None, interpret: bool = False):
  """block_attention's forward by Mosaic (a TPU target): the same o[B, Lq, H, K] (float32) and lse[B, H, Lq]."""
  from jax.experimental.pallas import tpu as pltpu
  (B, Lq, H, K, Lk, G, R, nq, nk, pairs), (qmax, kmin, pq_rows, pk_rows) = _tpu_call(q, k, pq, pk, pairs)
  bq = bk = TPU_BLOCK
  args, mat = _varying(qmax, kmin, _heads(q), _heads(k), _heads(v), pq_rows, pk_rows)
  grid = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(B, H, nq, nk),
      in_specs=[pl.BlockSpec((None, None, bq, K), lambda b, h, i, j, *_: (b, h, i, 0)),
                pl.BlockSpec((None, None, bk, K), lambda b, h, i, j, *_: (b, lax.div(h, R), j, 0)),
                pl.BlockSpec((None, None, bk, K), lambda b, h, i, j, *_: (b, lax.div(h, R), j, 0)),
                pl.BlockSpec((bq, LANES), lambda b, h, i, j, *_: (i, 0)),
                pl.BlockSpec((SUBLANES, bk), lambda b, h, i, j, *_: (0, j))],
      out_specs=[pl.BlockSpec((None, None, bq, K), lambda b, h, i, j, *_: (b, h, i, 0)),
                 pl.BlockSpec((None, None, bq, LANES), lambda b, h, i, j, *_: (b, h, i, 0))],
      scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                      pltpu.VMEM((bq, K), jnp.float32)])
  params = None if interpret else pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
  o, lse = pl.pallas_call(
      functools.partial(_fwd_tpu_kernel, scale=1.0 / math.sqrt(K), runs=(pairs, nq * nk)), grid_spec=grid,
      out_shape=[_out((B, H, Lq, K), jnp.float32, mat), _out((B, H, Lq, LANES), jnp.float32, mat)],
      compiler_params=params, interpret=interpret, name=_name("fwd", 4.0 * B * H * pairs * bq * bk * K),
  )(*args)
  return _heads(o), lse[..., 0]


def _dkv_tpu_kernel(qmax_ref, kmin_ref, q_ref, k_ref, v_ref, pq_ref, pk_ref, lse_ref, do_ref, delta_ref, dk_ref,
                    dv_ref, dk_sc, dv_sc, *, scale: float, runs: tuple):
  j, i = pl.program_id(2), pl.program_id(3)

  @pl.when(i == 0)
  def _start():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  with _visit(*runs):
    @pl.when(qmax_ref[i] >= kmin_ref[j])
    def _block():
      q, do = q_ref[...], do_ref[...]
      s = _mm(q, k_ref[...], tb=True) * scale                                # [bq, bk]
      p = jnp.where(pq_ref[...] >= pk_ref[...][:1, :], jnp.exp(s - lse_ref[...]), 0.0)
      dv_sc[...] += _mm(p.T.astype(do.dtype), do)
      ds = (p * (_mm(do, v_ref[...], tb=True) - delta_ref[...]) * scale).astype(q.dtype)
      dk_sc[...] += _mm(ds.T, q)

  @pl.when(i == pl.num_programs(3) - 1)
  def _end():
    dk_ref[...], dv_ref[...] = dk_sc[...], dv_sc[...]


def _dq_tpu_kernel(qmax_ref, kmin_ref, q_ref, k_ref, v_ref, pq_ref, pk_ref, lse_ref, do_ref, delta_ref, dq_ref, dq_sc,
                   *, scale: float, runs: tuple):
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _start():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  with _visit(*runs):
    @pl.when(qmax_ref[i] >= kmin_ref[j])
    def _block():
      k = k_ref[...]
      s = _mm(q_ref[...], k, tb=True) * scale
      p = jnp.where(pq_ref[...] >= pk_ref[...][:1, :], jnp.exp(s - lse_ref[...]), 0.0)
      ds = (p * (_mm(do_ref[...], v_ref[...], tb=True) - delta_ref[...]) * scale).astype(k.dtype)
      dq_sc[...] += _mm(ds, k)

  @pl.when(j == pl.num_programs(3) - 1)
  def _end():
    dq_ref[...] = dq_sc[...]


def block_attention_bwd_tpu(q, k, v, pq, pk, lse, do, delta, *, pairs: int | None = None, interpret: bool = False):
  """block_attention_bwd by Mosaic (a TPU target): the same dq[B, Lq, H, K], dk, dv[B, Lk, G, K] (float32)."""
  from jax.experimental.pallas import tpu as pltpu
  (B, Lq, H, K, Lk, G, R, nq, nk, pairs), (qmax, kmin, pq_rows, pk_rows) = _tpu_call(q, k, pq, pk, pairs)
  bq = bk = TPU_BLOCK
  rows = lambda x: jnp.broadcast_to(x[..., None], (*x.shape, LANES))         # [B, H, Lq] -> [B, H, Lq, 128]
  args, mat = _varying(qmax, kmin, _heads(q), _heads(k), _heads(v), pq_rows, pk_rows, rows(lse), _heads(do),
                       rows(delta))
  scale, runs, f32 = 1.0 / math.sqrt(K), (pairs, nq * nk), jnp.float32
  params = None if interpret else pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))

  def specs(q_at, kv_at):     # block index maps from (b, h, outer, inner) to the query and the key block
    q_block = pl.BlockSpec((None, None, bq, K), lambda b, h, o, n, *_: (b, h, q_at(o, n), 0))
    kv_block = pl.BlockSpec((None, None, bk, K), lambda b, h, o, n, *_: (b, lax.div(h, R), kv_at(o, n), 0))
    row = pl.BlockSpec((None, None, bq, LANES), lambda b, h, o, n, *_: (b, h, q_at(o, n), 0))
    return [q_block, kv_block, kv_block, pl.BlockSpec((bq, LANES), lambda b, h, o, n, *_: (q_at(o, n), 0)),
            pl.BlockSpec((SUBLANES, bk), lambda b, h, o, n, *_: (0, kv_at(o, n))), row, q_block, row]

  dk, dv = pl.pallas_call(     # per key block, the query blocks in turn
      functools.partial(_dkv_tpu_kernel, scale=scale, runs=runs),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(B, H, nk, nq), in_specs=specs(lambda o, n: n, lambda o, n: o),
          out_specs=[pl.BlockSpec((None, None, bk, K), lambda b, h, o, n, *_: (b, h, o, 0))] * 2,
          scratch_shapes=[pltpu.VMEM((bk, K), f32), pltpu.VMEM((bk, K), f32)]),
      out_shape=[_out((B, H, Lk, K), f32, mat)] * 2, compiler_params=params, interpret=interpret,
      name=_name("bwd_dkv", 8.0 * B * H * pairs * bq * bk * K),
  )(*args)
  dq = pl.pallas_call(         # per query block, the key blocks in turn
      functools.partial(_dq_tpu_kernel, scale=scale, runs=runs),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(B, H, nq, nk), in_specs=specs(lambda o, n: o, lambda o, n: n),
          out_specs=pl.BlockSpec((None, None, bq, K), lambda b, h, o, n, *_: (b, h, o, 0)),
          scratch_shapes=[pltpu.VMEM((bq, K), f32)]),
      out_shape=_out((B, H, Lq, K), f32, mat), compiler_params=params, interpret=interpret,
      name=_name("bwd_dq", 6.0 * B * H * pairs * bq * bk * K),
  )(*args)
  group = lambda x: _heads(x).reshape(B, Lk, G, R, K).sum(3)
  return _heads(dq), group(dk), group(dv)


# ------------------------------------------------------------------------------------------------ dispatch

KERNELS = {"triton": (block_attention, block_attention_bwd, (BLOCK_Q, BLOCK_K)),
           "mosaic": (block_attention_tpu, block_attention_bwd_tpu, (TPU_BLOCK, TPU_BLOCK))}
BACKEND = {"cuda": "triton", "tpu": "mosaic"}


def platforms(lq: int, lk: int, head_dim: int) -> tuple:
  """The platforms whose kernel takes these shapes: "cuda" (Triton tiles, `usable`), "tpu" (Mosaic, `usable_tpu`)."""
  return tuple(p for p, why in (("cuda", usable(lq, lk, head_dim)), ("tpu", usable_tpu(lq, lk, head_dim)))
               if why is None)


def on_platforms(fused_on: tuple, pure, fused, *args):
  """pure(*args), or where the program is lowered for a platform in `fused_on` the same computation by these
  kernels: fused(*args, backend=..., interpret=...): "cuda" by Triton, "tpu" by Mosaic, "default" (every other
  platform, this CPU) by Triton's kernels run by Pallas's interpreter. jax.lax.platform_dependent lowers one
  branch: the program for each platform holds one of them."""
  if not fused_on:
    return pure(*args)
  branches = {p: functools.partial(fused, backend=BACKEND[p], interpret=False) if p in fused_on else pure
              for p in ("cuda", "tpu")}      # a GPU or TPU whose kernel does not take the shapes: pure JAX
  other = functools.partial(fused, backend="triton", interpret=True) if "default" in fused_on else pure
  return jax.lax.platform_dependent(*args, **branches, default=other)
