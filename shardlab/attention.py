"""Causal attention, three ways, all the same math: `attend(impl, q_BLHK, k_BLGK, v_BLGK, block)`.

H query heads share G key/value heads (grouped-query attention; G = H is multi-head, G = 1 multi-query):
query head h reads key/value head h // R, R = H / G (Llama's `repeat_kv` order).

  plain        the readable reference: scores [B, H, L, L] materialised (and saved for backward)
  blockwise    memory-efficient attention in pure JAX (Rabe & Staats, arXiv:2112.05682; the FlashAttention
               recurrence, arXiv:2205.14135): queries and keys in blocks, an online softmax over key blocks; a
               custom_vjp saves only the output and the log-sum-exp and recomputes each block's scores in
               backward, so memory is O(L) in forward and backward; only the block pairs on or below the
               causal diagonal are computed. Compiles anywhere (CPU included); in a program lowered for a GPU
               or a TPU, where the shapes fit its tiles, the same computation by shardlab's fused Pallas kernels
               (flash_kernel.py, the ring's), residuals alike.
  dot_product  jax.nn.dot_product_attention(is_causal=True): cuDNN flash attention in programs lowered for a
               GPU (bf16/fp16), XLA's own implementation elsewhere (which materialises the scores, like plain)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from shardlab import collectives as C
from shardlab import flash_kernel as F

IMPLS = ("plain", "blockwise", "dot_product")
ATTN_OUT = "attn_out"   # the checkpoint name of the attention output (and blockwise's log-sum-exp)


def attend(impl: str, q_BLHK, k_BLGK, v_BLGK, block: int = 512):
  """o[B, L, H, K], named ATTN_OUT (what the save_*attn_out remat policies keep)."""
  if impl == "plain":
    return checkpoint_name(plain(q_BLHK, k_BLGK, v_BLGK), ATTN_OUT)
  if impl == "blockwise":
    return blockwise(q_BLHK, k_BLGK, v_BLGK, block)   # named inside, with the log-sum-exp
  if impl == "dot_product":
    return checkpoint_name(dot_product(q_BLHK, k_BLGK, v_BLGK), ATTN_OUT)
  raise ValueError(f"model.attention={impl}: unknown; choose one of {', '.join(IMPLS)}")


def dot_product(q_BLHK, k_BLGK, v_BLGK):
  """jax.nn.dot_product_attention, whose default (`implementation=None`) is XLA's on every platform: cuDNN's
  flash attention is chosen here for programs lowered for CUDA (jax.lax.platform_dependent: a target compile
  for H100 included) when the inputs are bf16/fp16, the dtypes cuDNN's fused attention takes; XLA's elsewhere."""
  def impl(name):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=name)
  if q_BLHK.dtype not in (jnp.bfloat16, jnp.float16):
    return impl("xla")(q_BLHK, k_BLGK, v_BLGK)
  return jax.lax.platform_dependent(q_BLHK, k_BLGK, v_BLGK, cuda=impl("cudnn"), default=impl("xla"))


def _grouped(q_BLHK, G):
  """q[B, L, H, K] -> q[B, L, G, R, K]: the R query heads of each key/value head together."""
  B, L, H, K = q_BLHK.shape
  return q_BLHK.reshape(B, L, G, H // G, K)


def plain(q_BLHK, k_BLGK, v_BLGK, causal_LM=None):
  """causal_LM: which key each query may see (default: keys at or before the query, in index order); queries
  and keys may differ in number (context parallelism: local queries against the gathered keys)."""
  B, L, H, K = q_BLHK.shape
  # queries as [B, G, R, L, K]: the scores' matmul then writes [B, G, R, L, M] in the order its batch and free
  # dimensions come, the layout the backward reads (from [B, L, G, R, K] it wrote L and R together, and the H100
  # compiler copied the whole stack of saved float32 probabilities into the other layout before the backward loop:
  # both copies live at once, 8 GiB more for llama3_8b's 32 layers at 2048 tokens)
  q_BGRLK = jnp.transpose(_grouped(q_BLHK, k_BLGK.shape[2]), (0, 2, 3, 1, 4))
  s_BGRLM = jnp.einsum("bgrlk,bmgk->bgrlm", q_BGRLK, k_BLGK, preferred_element_type=jnp.float32) / jnp.sqrt(K)
  if causal_LM is None:
    causal_LM = jnp.tril(jnp.ones((L, L), bool))
  # the mask as an additive bias (0 or -inf): its VJP keeps nothing, where a `where` keeps the mask broadcast to
  # every head as a per-layer residual (1 byte per score: the H100 compiler's buffer assignment)
  bias_LM = jnp.where(causal_LM, 0.0, -jnp.inf).astype(jnp.float32)
  p_BGRLM = jax.nn.softmax(s_BGRLM + bias_LM[None, None, None], axis=-1).astype(v_BLGK.dtype)
  return jnp.einsum("bgrlm,bmgk->blgrk", p_BGRLM, v_BLGK).reshape(B, L, H, K)


# ---------------------------------------------------------------------------------------------- blockwise

def block_size(seq_len: int, block: int) -> int:
  return min(block, seq_len)


def blockwise(q_BLHK, k_BLGK, v_BLGK, block: int = 512):
  """Causal attention with queries and keys in blocks of `block` (min(block, L); L must be a multiple)."""
  B, L, H, K = q_BLHK.shape
  n = block_size(L, block)
  if L % n:
    raise ValueError(f"blockwise attention: sequence length {L} is not a multiple of the block size {n}")
  return _flash(n, F.platforms(L, L, K), q_BLHK, k_BLGK, v_BLGK)


def blocks(x, n):
  """x[B, L, ...] -> x[L/n, B, n, ...]: blocks of the sequence first (what scan iterates over)."""
  return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // n, n, *x.shape[2:]), 1, 0)


def unblocks(x):
  """The inverse of `blocks`."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def varying_zeros(shape, axes, value=0.0):
  """A float32 scan carry varying over the mesh `axes` its updates vary over (shard_map's type check)."""
  return C.pvary(jnp.full(shape, value, jnp.float32), tuple(axes), name="zeros")


def varying(*xs) -> frozenset:
  return frozenset().union(*(C.varying_axes(x) for x in xs))


def _scores(q_BNGRK, k_BMGK, i, j):
  """One block's causal scores s[B, G, R, N, M] (float32), -inf where key j*M+m follows query i*N+n."""
  N, M, K = q_BNGRK.shape[1], k_BMGK.shape[1], q_BNGRK.shape[-1]
  s = jnp.einsum("bngrk,bmgk->bgrnm", q_BNGRK, k_BMGK, preferred_element_type=jnp.float32) / jnp.sqrt(K)
  causal_NM = (i * N + jnp.arange(N))[:, None] >= (j * M + jnp.arange(M))[None, :]
  return jnp.where(causal_NM[None, None, None], s, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(n, fusable, q_BLHK, k_BLGK, v_BLGK):
  return _flash_fwd(n, fusable, q_BLHK, k_BLGK, v_BLGK)[0]


def _flash_fwd(n, fusable, q_BLHK, k_BLGK, v_BLGK):
  """The output and the log-sum-exp, named ATTN_OUT: a remat policy that keeps them does not rerun this."""
  o_BLHK, lse_b = F.on_platforms(fusable, functools.partial(_flash_forward, n), functools.partial(_fused_forward, n),
                                 q_BLHK, k_BLGK, v_BLGK)
  o_BLHK = checkpoint_name(o_BLHK, ATTN_OUT)
  lse_b = checkpoint_name(lse_b, ATTN_OUT)                       # lse[L/n, B, G, R, n]
  return o_BLHK, (q_BLHK, k_BLGK, v_BLGK, o_BLHK, lse_b)        # O(L) residuals; o is the output itself


def _flash_bwd(n, fusable, res, do_BLHK):
  return F.on_platforms(fusable, lambda *a: _flash_backward(n, a[:-1], a[-1]),
                        lambda *a, backend, interpret: _fused_backward(n, a[:-1], a[-1], backend, interpret),
                        *res, do_BLHK)


def _fused_forward(n, q_BLHK, k_BLGK, v_BLGK, backend: str = "triton", interpret: bool = False):
  """_flash_forward by the Pallas kernel of `backend` (flash_kernel.KERNELS; causal: positions in index order, the
  blocks above the diagonal skipped), the log-sum-exp in _flash_forward's layout."""
  L = q_BLHK.shape[1]
  pos = jnp.arange(L, dtype=jnp.int32)
  forward, _, blocks = F.KERNELS[backend]
  o, lse = forward(q_BLHK, k_BLGK, v_BLGK, pos, pos, interpret=interpret,
                   pairs=F.pair_counts(np.arange(L), np.arange(L), *blocks))
  return o.astype(q_BLHK.dtype), F.lse_blocks(lse, k_BLGK.shape[2], n)


def _fused_backward(n, res, do_BLHK, backend: str = "triton", interpret: bool = False):
  """_flash_backward by the Pallas kernel of `backend`."""
  q_BLHK, k_BLGK, v_BLGK, o_BLHK, lse_b = res
  L = q_BLHK.shape[1]
  pos = jnp.arange(L, dtype=jnp.int32)
  delta = jnp.einsum("blhk,blhk->bhl", do_BLHK.astype(jnp.float32), o_BLHK.astype(jnp.float32))
  _, backward, blocks = F.KERNELS[backend]
  dq, dk, dv = backward(q_BLHK, k_BLGK, v_BLGK, pos, pos, F.lse_rows(lse_b), do_BLHK, delta, interpret=interpret,
                        pairs=F.pair_counts(np.arange(L), np.arange(L), *blocks))
  return dq.astype(q_BLHK.dtype), dk.astype(k_BLGK.dtype), dv.astype(v_BLGK.dtype)


def _causal_pairs(nb: int, by_key: bool):
  """The (query block i, key block j) pairs with j <= i, the only ones causal attention computes (the others are
  wholly masked: half the score FLOPs at long sequences), as two int32 arrays of one static length nb(nb+1)/2:
  by query block (j = 0..i for each i), or with by_key by key block (i = j..nb-1 for each j). One flat scan over
  them keeps every loop's trip count static (the HLO analyses read it)."""
  pairs = ([(i, j) for j in range(nb) for i in range(j, nb)] if by_key else
           [(i, j) for i in range(nb) for j in range(i + 1)])
  return tuple(jnp.asarray(a, jnp.int32) for a in zip(*pairs))


def at(x, i):
  return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False, allow_negative_indices=False)


def set_at(x, v, i):
  return jax.lax.dynamic_update_index_in_dim(x, v, i, 0, allow_negative_indices=False)


def _flash_forward(n, q_BLHK, k_BLGK, v_BLGK):
  """For each query block i, an online softmax over key blocks j = 0..i (key block 0 holds key 0, which every
  query sees, so the running max is finite after the first step); the blocks above the diagonal are skipped.
  Returns the output and the log-sum-exp [L/n, B, G, R, n]."""
  q_BLGRK = _grouped(q_BLHK, k_BLGK.shape[2])
  B, L, G, R, K = q_BLGRK.shape
  nb = L // n
  qb, kb, vb = blocks(q_BLGRK, n), blocks(k_BLGK, n), blocks(v_BLGK, n)
  axes = varying(q_BLGRK, k_BLGK, v_BLGK)

  def step(carry, ij):
    (m_BGRN, l_BGRN, acc_BGRNK), ob, lse_b = carry
    i, j = ij
    first = j == 0                                   # a new query block: restart its running softmax
    m_BGRN = jnp.where(first, -jnp.inf, m_BGRN)
    l_BGRN, acc_BGRNK = jnp.where(first, 0.0, l_BGRN), jnp.where(first, 0.0, acc_BGRNK)
    q_BNGRK, v_BMGK = at(qb, i), at(vb, j)
    s = _scores(q_BNGRK, at(kb, j), i, j)
    m_new = jnp.maximum(m_BGRN, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m_BGRN - m_new)
    pv = jnp.einsum("bgrnm,bmgk->bgrnk", p.astype(v_BMGK.dtype), v_BMGK, preferred_element_type=jnp.float32)
    m_BGRN, l_BGRN, acc_BGRNK = m_new, l_BGRN * corr + jnp.sum(p, axis=-1), acc_BGRNK * corr[..., None] + pv
    last = j == i                                    # the diagonal block is query block i's last
    o_BNGRK = jnp.einsum("bgrnk->bngrk", acc_BGRNK / l_BGRN[..., None])
    ob = set_at(ob, jnp.where(last, o_BNGRK, at(ob, i)), i)
    lse_b = set_at(lse_b, jnp.where(last, m_BGRN + jnp.log(l_BGRN), at(lse_b, i)), i)
    return ((m_BGRN, l_BGRN, acc_BGRNK), ob, lse_b), None

  state = (varying_zeros((B, G, R, n), axes, -jnp.inf), varying_zeros((B, G, R, n), axes), varying_zeros((B, G, R, n, K), axes))
  init = (state, varying_zeros((nb, B, n, G, R, K), axes), varying_zeros((nb, B, G, R, n), axes))
  (_, ob, lse_b), _ = jax.lax.scan(step, init, _causal_pairs(nb, by_key=False))
  return unblocks(ob).reshape(B, L, G * R, K).astype(q_BLHK.dtype), lse_b


def _flash_backward(n, res, do_BLHK):
  """FlashAttention's backward: per key block j, for query blocks i = j..nb-1 (the pairs the forward computed),
  recompute p = exp(s - lse) and accumulate dq, dk, dv; nothing of size L x L is ever held."""
  q_BLHK, k_BLGK, v_BLGK, o_BLHK, lse_b = res
  G = k_BLGK.shape[2]
  q_BLGRK, o_BLGRK, do_BLGRK = (_grouped(a, G) for a in (q_BLHK, o_BLHK, do_BLHK))
  B, L, H, K = q_BLHK.shape
  nb = L // n
  axes = varying(q_BLGRK, k_BLGK, v_BLGK, do_BLGRK)
  delta_BLGR = jnp.sum(do_BLGRK.astype(jnp.float32) * o_BLGRK.astype(jnp.float32), axis=-1)
  qb, dob, kb, vb = blocks(q_BLGRK, n), blocks(do_BLGRK, n), blocks(k_BLGK, n), blocks(v_BLGK, n)
  delta_b = jnp.einsum("ibngr->ibgrn", blocks(delta_BLGR, n))

  # Every matmul in the compute dtype with float32 accumulation, P and dS cast down first (as FlashAttention-2's
  # backward does, arXiv:2307.08691 Algorithm 2): a bf16 run's backward runs at the bf16 rate, not float32's.
  dt = q_BLGRK.dtype
  mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

  def step(carry, ij):
    (dk_BMGK, dv_BMGK), dq_b, dk_b, dv_b = carry
    i, j = ij
    first = i == j                                   # a new key block: restart its dk, dv sums
    dk_BMGK, dv_BMGK = jnp.where(first, 0.0, dk_BMGK), jnp.where(first, 0.0, dv_BMGK)
    q_BNGRK, do_BNGRK, k_BMGK, v_BMGK = at(qb, i), at(dob, i), at(kb, j), at(vb, j)
    p = jnp.exp(_scores(q_BNGRK, k_BMGK, i, j) - at(lse_b, i)[..., None])           # p[B, G, R, N, M]
    dv_BMGK += mm("bgrnm,bngrk->bmgk", p.astype(dt), do_BNGRK)
    dp = mm("bngrk,bmgk->bgrnm", do_BNGRK, v_BMGK)
    ds = (p * (dp - at(delta_b, i)[..., None]) / jnp.sqrt(K)).astype(dt)
    dq_b = set_at(dq_b, at(dq_b, i) + mm("bgrnm,bmgk->bngrk", ds, k_BMGK), i)
    dk_BMGK += mm("bgrnm,bngrk->bmgk", ds, q_BNGRK)
    last = i == nb - 1                               # key block j's last query block
    dk_b = set_at(dk_b, jnp.where(last, dk_BMGK, at(dk_b, j)), j)
    dv_b = set_at(dv_b, jnp.where(last, dv_BMGK, at(dv_b, j)), j)
    return ((dk_BMGK, dv_BMGK), dq_b, dk_b, dv_b), None

  kv = (varying_zeros(kb.shape[1:], axes), varying_zeros(kb.shape[1:], axes))
  init = (kv, varying_zeros(qb.shape, axes), varying_zeros(kb.shape, axes), varying_zeros(kb.shape, axes))
  (_, dq_b, dk_b, dv_b), _ = jax.lax.scan(step, init, _causal_pairs(nb, by_key=True))
  return (unblocks(dq_b).reshape(B, L, H, K).astype(q_BLHK.dtype), unblocks(dk_b).astype(k_BLGK.dtype),
          unblocks(dv_b).astype(v_BLGK.dtype))


_flash.defvjp(_flash_fwd, _flash_bwd)
