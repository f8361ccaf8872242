"""The model's math on one device's view: a decoder-only transformer (RMSNorm, causal grouped-query attention
with RoPE (attention.py), SwiGLU MLP, vocabulary-parallel cross-entropy), or (model.kind=ffn) the Scaling
Book's FFN-only model: L blocks x + W_out relu(W_in x) on fixed token codes, regressing the next token's code.

The math never names a collective or a mesh axis. It reads its parallel context through one object, `ctx`
(schedules/parallel.py: `Parallel`): the TP contractions `ctx.tp`, the weights `ctx.weight(name)` (gathered by
the schedule, or already gathered), the layer loop `ctx.layers(x, layer_fn)` and attention
`ctx.attend(q, k, v, positions)` (context parallelism replaces it without touching this file). Where a
contraction runs over a sharded dimension it asks `ops = ctx.tp`:
  ops.column(x, w, eq)  x[B, L_tp, D] (or x[B, L, D]) . w[D, .., N_tp] -> y[B, L, .., N_tp]
  ops.columns(x, ws, eqs)  several column contractions of one x, gathered once (Q and K/V)
  ops.row(h, w, eq)     h[B, L, .., N_tp] . w[.., N_tp, D] -> y[B, L_tp, D] (reduced over tensor)
  ops.reduce(y)         y[B, L, D]{U_tp} -> y[B, L_tp, D]
  ops.vocab_max/vocab_sum/vocab_start, ops.batch_sum: reductions over the vocab and batch shards;
  ops.head_start: the first query head this device holds.
  ops.seq_shard(x), ops.token_sum(x): the FFN-only model's input into the residual stream's layout, and its
  loss summed over every token.
With `IdentityOps` every one of these is the plain operation: that is the unsharded model (`parallel.plain`).
The data arrives as inputs, targets and positions (data.Batch), already shifted; RoPE reads the positions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from shardlab import attention as A
from shardlab.config import ModelConfig
from shardlab.data import token_code

QKV_PROJ = "qkv_proj"   # checkpoint names the remat policies keep (schedules/stage.py: REMAT)
ATTN_OUT = A.ATTN_OUT   # the attention output (named by attention.attend)


def rms_norm(x_BLD, scale_D, eps):
  x32 = x_BLD.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale_D.astype(jnp.float32)[None, None, :]).astype(x_BLD.dtype)


def rope(x_BLHK, positions_L, theta):
  """Rotary position embedding (rotate-half form) at each token's position in its sequence (the data's
  positions: right however the sequence is split or reordered over devices)."""
  K = x_BLHK.shape[-1]
  freq_K2 = theta ** (-jnp.arange(0, K, 2, dtype=jnp.float32) / K)
  ang_LK2 = positions_L.astype(jnp.float32)[:, None] * freq_K2[None, :]
  cos, sin = jnp.cos(ang_LK2)[None, :, None, :], jnp.sin(ang_LK2)[None, :, None, :]
  x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLHK.dtype)


def local_kv(ops, m: ModelConfig, wkv_D2GK, h_local: int):
  """This device's K/V weights and, per local query head, the K/V head it reads (None: in order, R each).

  K/V heads sharded like the query heads (or not sharded): local query head j reads local K/V head j // R.
  Replicated over tensor (tensor does not divide G): the device slices the K/V heads its query heads
  h0..h0+h_local-1 read (h // R), so it computes no K/V it does not use; one head when tensor is a multiple
  of G (each device's query heads in one group), else an index per query head."""
  R, G = m.n_heads // m.kv_heads, m.kv_heads
  if wkv_D2GK.shape[2] * R == h_local:
    return wkv_D2GK, None
  T = m.n_heads // h_local
  need = max(((r + 1) * h_local - 1) // R - (r * h_local) // R + 1 for r in range(T))
  h0 = ops.head_start(h_local)
  start = jnp.minimum(h0 // R, G - need)
  w_D2NK = jax.lax.dynamic_slice_in_dim(wkv_D2GK, start, need, axis=2)
  return w_D2NK, (None if need == 1 else (h0 + jnp.arange(h_local)) // R - start)


def swiglu(ops, h_BLD, wi_D2F, wd_FD):
  """The dense MLP: column-parallel gate and up, row-parallel down."""
  gu_BL2F = ops.column(h_BLD, wi_D2F, "bld,dtf->bltf")
  a_BLF = jax.nn.silu(gu_BL2F[:, :, 0]) * gu_BL2F[:, :, 1]
  return ops.row(a_BLF, wd_FD, "blf,fd->bld")


# ---- mixture of experts: the router and the experts' math; where tokens travel is the dispatcher's
# (ctx.experts: schedules/expert.py) ----

STATS = ("aux", "z", "dropped", "load")   # what a MoE layer reports, summed over layers (and devices)


def route(m: ModelConfig, x_TD, w_DE):
  """Softmax over every expert's logit, the top k kept and renormalised (Qwen3-MoE's norm_topk_prob; the same
  weights as Mixtral's softmax over the top-k logits). -> logits [T, E] (float32), probs [T, E], idx [T, k]
  (each token's experts, best first), gate [T, k] (their weights, summing to 1)."""
  logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), w_DE.astype(jnp.float32))
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  if m.router_skew:     # picks on skewed logits, weighs by the router's own probabilities
    _, idx_TK = jax.lax.top_k(logits_TE + skew(m)[None, :], m.top_k)
    top_TK = jnp.take_along_axis(probs_TE, idx_TK, axis=-1)
  else:
    top_TK, idx_TK = jax.lax.top_k(probs_TE, m.top_k)
  return logits_TE, probs_TE, idx_TK, top_TK / jnp.sum(top_TK, axis=-1, keepdims=True)


def skew(m: ModelConfig):
  """model.router_skew's fixed offset on each expert's logit for the top-k pick: skew x (E-1-e)/(E-1)."""
  E = m.n_experts
  return m.router_skew * (E - 1 - jnp.arange(E, dtype=jnp.float32)) / max(E - 1, 1)


def expert_mlp(x_ECD, wi_ED2F, wd_EFD):
  """Each expert's SwiGLU on its own rows (capacity buffers: a row of zeros gives zeros)."""
  gu_EC2F = jnp.einsum("ecd,edtf->ectf", x_ECD, wi_ED2F)
  return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gu_EC2F[:, :, 0]) * gu_EC2F[:, :, 1], wd_EFD)


def grouped_mlp(x_MD, sizes_E, wi_ED2F, wd_EFD):
  """Rows sorted by expert, sizes_E rows for each (a grouped GEMM: jax.lax.ragged_dot); rows past their sum
  give zeros."""
  E, D, _, F = wi_ED2F.shape
  gu_M2F = jax.lax.ragged_dot(x_MD, wi_ED2F.reshape(E, D, 2 * F), sizes_E)
  return jax.lax.ragged_dot(jax.nn.silu(gu_M2F[:, :F]) * gu_M2F[:, F:], wd_EFD, sizes_E)


def combine(y_TKD, gate_TK):
  """Each token's expert outputs weighted by its gates and summed (in float32), in the outputs' dtype."""
  return jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), gate_TK).astype(y_TKD.dtype)


def local_experts(x_TD, idx_TK, gate_TK, wi_ED2F, wd_EFD, first=0):
  """The routed experts on one device, dropless: the assignments to experts first .. first + E - 1 (E local
  experts) sorted by expert, one grouped GEMM, unsorted and combined; assignments to other experts give zeros.
  -> y [T, D]."""
  T, K = idx_TK.shape
  E = wi_ED2F.shape[0]
  e_M = idx_TK.reshape(-1) - first
  e_M = jnp.where((e_M >= 0) & (e_M < E), e_M, E)                 # another device's expert: sorted last
  order_M = jnp.argsort(e_M, stable=True)
  sizes_E = jnp.bincount(e_M, length=E + 1)[:E].astype(jnp.int32)
  y_MD = grouped_mlp(x_TD[order_M // K], sizes_E, wi_ED2F, wd_EFD)
  y_MD = jax.lax.stop_gradient(jnp.zeros_like(y_MD)).at[order_M].set(y_MD)   # back to (token, k) order
  return combine(y_MD.reshape(T, K, -1), gate_TK)


def moe_mlp(ctx, m: ModelConfig, h_BLD, w):
  """The routed experts of one layer on this device's tokens h [B, L, D] -> (y [B, L, D], stats). Where the
  tokens travel is `ctx.experts(x, idx, gate, we_i, we_d) -> (y, dropped)` (the dispatcher). stats (STATS),
  this device's share: aux, the load-balancing loss summed over its sequences (Switch's E sum_e f_e P_e per
  sequence: f_e the fraction of the sequence's assignments routed to e, P_e its mean probability; a sequence
  split over devices is counted through `ctx.seq_sum`); z, the sum over its tokens of logsumexp(logits)^2;
  dropped, the assignments over capacity; load [E], the assignments each expert got."""
  B, L, D = h_BLD.shape
  E, K = m.n_experts, m.top_k
  x_TD = h_BLD.reshape(B * L, D)
  logits_TE, probs_TE, idx_TK, gate_TK = route(m, x_TD, w["router"])
  y_TD, dropped = ctx.experts(x_TD, idx_TK, gate_TK, w["we_i"], w["we_d"])
  counts_BE = jnp.sum(jax.nn.one_hot(idx_TK, E, dtype=jnp.float32), axis=1).reshape(B, L, E).sum(axis=1)
  f_BE = ctx.seq_sum(jax.lax.stop_gradient(counts_BE)) / (m.seq_len * K)
  aux = E * jnp.sum(f_BE * probs_TE.reshape(B, L, E).sum(axis=1)) / m.seq_len
  z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))
  stats = {"aux": aux, "z": z, "dropped": jnp.asarray(dropped, jnp.float32) + jnp.zeros_like(z),
           "load": jnp.sum(counts_BE, axis=0)}
  return y_TD.reshape(B, L, D), stats


def layer(ctx, m: ModelConfig, x_BLD, w, positions_L):
  """One block. x is the residual stream (sequence-sharded over `tensor` when ctx.tp.seq_sharded); positions are
  those of the tokens attention sees (the whole local sequence). A MoE model's block takes and returns
  (x, stats): the router statistics summed over the layers so far."""
  if m.moe:
    x_BLD, stats = x_BLD
  ops = ctx.tp
  h_BLD = rms_norm(x_BLD, w["attn_norm"], m.norm_eps)
  wkv_D2GK, kv_index = local_kv(ops, m, w["wkv"], w["wq"].shape[1])
  q_BLHK, kv_BL2GK = ops.columns(h_BLD, (w["wq"], wkv_D2GK), ("bld,dhk->blhk", "bld,dtgk->bltgk"))
  q_BLHK, kv_BL2GK = checkpoint_name(q_BLHK, QKV_PROJ), checkpoint_name(kv_BL2GK, QKV_PROJ)
  k_BLGK, v_BLGK = kv_BL2GK[:, :, 0], kv_BL2GK[:, :, 1]
  if kv_index is not None:   # one K/V head per query head (replicated K/V, heads not aligned to devices)
    k_BLGK, v_BLGK = jnp.take(k_BLGK, kv_index, axis=2), jnp.take(v_BLGK, kv_index, axis=2)
  o_BLHK = ctx.attend(rope(q_BLHK, positions_L, m.rope_theta), rope(k_BLGK, positions_L, m.rope_theta), v_BLGK,
                      positions_L)
  x_BLD = x_BLD + ops.row(o_BLHK, w["wo"], "blhk,hkd->bld")
  h_BLD = rms_norm(x_BLD, w["mlp_norm"], m.norm_eps)
  if not m.moe:
    return x_BLD + swiglu(ops, h_BLD, w["wi"], w["wd"])
  y_BLD, st = moe_mlp(ctx, m, h_BLD, w)
  if m.mlp_ff:                      # shared experts: every token, tensor-parallel like the dense MLP
    y_BLD = y_BLD + swiglu(ops, h_BLD, w["wi"], w["wd"])
  return x_BLD + y_BLD, jax.tree.map(jnp.add, stats, st)


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


def ffn_layer(ops, x_BLD, w):
  """One block of the FFN-only model: x + W_out relu(W_in x). The residual stream stays float32 (it carries the
  fixed input codes); the matmuls and their communication run in the weights' (compute) dtype."""
  h_BLF = ops.column(x_BLD.astype(w["wi"].dtype), w["wi"], "bld,df->blf")
  return x_BLD + ops.row(jax.nn.relu(h_BLF), w["wd"], "blf,fd->bld").astype(x_BLD.dtype)


def embed_in(ctx, m: ModelConfig, batch):
  """The residual stream's input: the vocabulary-parallel embedding of the inputs (the FFN-only model: their
  codes, data.token_code); a MoE model's is (x, zero stats)."""
  if m.kind == "ffn":
    return ctx.tp.seq_shard(token_code(batch.inputs, m.d_model))
  x_BLD = embed(ctx.tp, batch.inputs, ctx.weight("embed"))
  if not m.moe:
    return x_BLD
  zero = jnp.zeros_like(x_BLD[0, 0, 0], dtype=jnp.float32)      # varying like the residual stream
  return x_BLD, {**{k: zero for k in STATS[:-1]}, "load": jnp.zeros_like(x_BLD[0, 0, :1], jnp.float32,
                                                                          shape=(m.n_experts,))}


def zero_stats(m: ModelConfig) -> dict:
  """The global router statistics (router_terms) as zeros: a microbatch loop's start."""
  return {**{k: jnp.zeros((), jnp.float32) for k in STATS[:-1]}, "load": jnp.zeros((m.n_experts,), jnp.float32)}


def router_terms(ctx, m: ModelConfig, stats, n_tokens: int):
  """A MoE model's stats summed over every device -> (the loss terms router_aux_loss x the mean over sequences
  of the load-balancing loss, summed over layers, and router_z_loss x the mean over tokens of the z-loss,
  summed over layers; the stats themselves, global)."""
  total = ctx.tp.token_sum(stats)
  terms = m.router_aux_loss * total["aux"] * m.seq_len / n_tokens + m.router_z_loss * total["z"] / n_tokens
  return terms, total


def block(ctx, m: ModelConfig, batch):
  """layer_fn(x, layer_weights) of one block, for the layer loop (ctx.layers)."""
  if m.kind == "ffn":
    return lambda x, lw: ffn_layer(ctx.tp, x, lw)
  return lambda x, lw: layer(ctx, m, x, lw, batch.positions)


def head_loss(ctx, m: ModelConfig, x_BLD, batch, n_tokens: int):
  """The loss of the residual stream after the last layer: final norm, vocabulary-parallel logits and cross-
  entropy, this device's tokens' sum over the global token count (the FFN-only model: the squared error of each
  code dimension against the next token's code, data.token_code)."""
  ops = ctx.tp
  if m.kind == "ffn":
    err_BLD = x_BLD - ops.seq_shard(token_code(batch.targets, m.d_model))
    return ops.token_sum(jnp.sum(err_BLD * err_BLD)) / (n_tokens * m.d_model)
  x_BLD = rms_norm(x_BLD, ctx.weight("final_norm"), m.norm_eps)
  logits_BLV = ops.column(x_BLD, ctx.weight("unembed"), "bld,dv->blv")
  nll_BL = cross_entropy(ops, logits_BLV, batch.targets)
  return ops.batch_sum(jnp.sum(nll_BL)) / n_tokens


def loss(ctx, m: ModelConfig, batch, n_tokens: int):
  """Sum of this device's token losses over the global token count: summed over devices (and over
  microbatches) it is the global mean. `batch`: data.Batch (inputs and targets [B, L], positions [L]). The three
  parts (embed_in, the layers of `block`, head_loss) are what a pipeline runs on different stages. A MoE
  model's loss adds its router terms (router_terms)."""
  return loss_and_stats(ctx, m, batch, n_tokens)[0]


def loss_and_stats(ctx, m: ModelConfig, batch, n_tokens: int):
  """(loss, stats): `loss` and, for a MoE model, its router statistics summed over layers and devices
  (router_terms; {} for a dense one)."""
  return head_and_stats(ctx, m, ctx.layers(embed_in(ctx, m, batch), block(ctx, m, batch)), batch, n_tokens)


def head_and_stats(ctx, m: ModelConfig, out, batch, n_tokens: int):
  """(loss, stats) of the last layer's output `out` (a MoE model's: (x, its router statistics summed over the
  layers)): head_loss, plus the router terms and the global statistics (router_terms) for a MoE model."""
  if not m.moe:
    return head_loss(ctx, m, out, batch, n_tokens), {}
  x_BLD, stats = out
  terms, total = router_terms(ctx, m, stats, n_tokens)
  return head_loss(ctx, m, x_BLD, batch, n_tokens) + terms, total
