"""The model's math on one device's view: a decoder-only transformer (RMSNorm, causal multi-head attention
with RoPE, SwiGLU MLP, vocabulary-parallel cross-entropy).

The math never names a collective or a mesh axis. Where a contraction runs over a sharded dimension it asks
`ops` (the schedule's TP contractions):
  ops.column(x, w, eq)  x[B, L_tp, D] (or x[B, L, D]) . w[D, .., N_tp] -> y[B, L, .., N_tp]
  ops.row(h, w, eq)     h[B, L, .., N_tp] . w[.., N_tp, D] -> y[B, L_tp, D] (reduced over tensor)
  ops.reduce(y)         y[B, L, D]{U_tp} -> y[B, L_tp, D]
  ops.vocab_max/vocab_sum/vocab_start, ops.batch_sum: reductions over the vocab and batch shards.
With `IdentityOps` every one of these is the plain operation: that is the unsharded model.
Weights come from `w.get(name)` (gathered by the schedule) and the layer stack runs as `w.layers(x, layer)`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from shardlab.config import ModelConfig


def rms_norm(x_BLD, scale_D, eps):
  x32 = x_BLD.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale_D.astype(jnp.float32)[None, None, :]).astype(x_BLD.dtype)


def rope(x_BLHK, theta):
  """Rotary position embedding (rotate-half form) over the full sequence, positions 0..L-1."""
  L, K = x_BLHK.shape[1], x_BLHK.shape[-1]
  freq_K2 = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
  ang_LK2 = jnp.arange(L, dtype=jnp.float32)[:, None] * freq_K2[None, :]
  cos, sin = jnp.cos(ang_LK2)[None, :, None, :], jnp.sin(ang_LK2)[None, :, None, :]
  x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLHK.dtype)


def attention(q_BLHK, k_BLHK, v_BLHK):
  L, K = q_BLHK.shape[1], q_BLHK.shape[-1]
  s_BHLL = jnp.einsum("blhk,bmhk->bhlm", q_BLHK, k_BLHK, preferred_element_type=jnp.float32) / jnp.sqrt(K)
  causal_LL = jnp.tril(jnp.ones((L, L), bool))
  s_BHLL = jnp.where(causal_LL, s_BHLL, -jnp.inf)
  p_BHLL = jax.nn.softmax(s_BHLL, axis=-1).astype(v_BLHK.dtype)
  return jnp.einsum("bhlm,bmhk->blhk", p_BHLL, v_BLHK)


def layer(ops, m: ModelConfig, x_BLD, w):
  """One block. x is the residual stream (sequence-sharded over `tensor` when ops.seq_sharded)."""
  h_BLD = rms_norm(x_BLD, w["attn_norm"], m.norm_eps)
  qkv_BL3HK = ops.column(h_BLD, w["wqkv"], "bld,dthk->blthk")
  q_BLHK, k_BLHK, v_BLHK = (qkv_BL3HK[:, :, i] for i in range(3))
  o_BLHK = attention(rope(q_BLHK, m.rope_theta), rope(k_BLHK, m.rope_theta), v_BLHK)
  x_BLD = x_BLD + ops.row(o_BLHK, w["wo"], "blhk,hkd->bld")
  h_BLD = rms_norm(x_BLD, w["mlp_norm"], m.norm_eps)
  gu_BL2F = ops.column(h_BLD, w["wi"], "bld,dtf->bltf")
  a_BLF = jax.nn.silu(gu_BL2F[:, :, 0]) * gu_BL2F[:, :, 1]
  return x_BLD + ops.row(a_BLF, w["wd"], "blf,fd->bld")


def embed(ops, tokens_BL, emb_VD):
  """Vocabulary-parallel lookup: each tensor rank looks up the tokens in its vocab slice, zeros elsewhere;
  ops.reduce sums the slices (and scatters the sequence when sequence-parallel)."""
  V = emb_VD.shape[0]
  local_BL = tokens_BL - ops.vocab_start(V)
  inside_BL = (local_BL >= 0) & (local_BL < V)
  e_BLD = jnp.take(emb_VD, jnp.clip(local_BL, 0, V - 1), axis=0) * inside_BL[..., None].astype(emb_VD.dtype)
  return ops.reduce(e_BLD)


def cross_entropy(ops, logits_BLV, targets_BL):
  """Per-token negative log-likelihood with the vocabulary sharded: a max, a sum of exponentials and the
  target logit, each reduced over the vocab shards."""
  z_BLV = logits_BLV.astype(jnp.float32)
  V = z_BLV.shape[-1]
  m_BL = ops.vocab_max(jax.lax.stop_gradient(jnp.max(z_BLV, axis=-1)))
  lse_BL = jnp.log(ops.vocab_sum(jnp.sum(jnp.exp(z_BLV - m_BL[..., None]), axis=-1))) + m_BL
  local_BL = targets_BL - ops.vocab_start(V)
  inside_BL = (local_BL >= 0) & (local_BL < V)
  tgt_BL = jnp.take_along_axis(z_BLV, jnp.clip(local_BL, 0, V - 1)[..., None], axis=-1)[..., 0]
  tgt_BL = ops.vocab_sum(jnp.where(inside_BL, tgt_BL, 0.0))
  return lse_BL - tgt_BL


def loss(ops, m: ModelConfig, w, tokens_BL, targets_BL, n_tokens: int):
  """Sum of this device's token losses over the global token count: summed over devices (and over
  microbatches) it is the global mean."""
  x_BLD = embed(ops, tokens_BL, w.get("embed"))
  x_BLD = w.layers(x_BLD, lambda x, lw: layer(ops, m, x, lw))
  x_BLD = rms_norm(x_BLD, w.get("final_norm"), m.norm_eps)
  logits_BLV = ops.column(x_BLD, w.get("unembed"), "bld,dv->blv")
  nll_BL = cross_entropy(ops, logits_BLV, targets_BL)
  return ops.batch_sum(jnp.sum(nll_BL)) / n_tokens
