"""A deliberately plain single-device implementation of the same model and optimizer step: no shard_map, no
collectives, no schedule, written apart from model.py. Used only as a test oracle."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from shardlab.config import ModelConfig, TrainConfig


def _norm(x, s, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * s[None, None, :]


def _rope(x, theta):
  L, K = x.shape[1], x.shape[-1]
  inv = 1.0 / (theta ** (jnp.arange(0, K, 2, dtype=jnp.float32) / K))
  ang = jnp.outer(jnp.arange(L, dtype=jnp.float32), inv)
  c, s = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
  a, b = x[..., : K // 2], x[..., K // 2:]
  return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _moe(h, p, m, capacity=None):
  """The routed experts the obvious way: every expert on every token, each output weighted by the token's gate
  for that expert (0 unless it is one of the token's top k). -> (y, load-balancing loss: the mean over
  sequences of E sum_e f_e P_e, z-loss: the mean over tokens of logsumexp(logits)^2).

  capacity (groups, slots): the batch's rows cut into `groups` equal runs; in each, the token-expert
  assignments in token order, then k, and an expert keeps its first `slots` (GShard's capacity, per group)."""
  E, k = m.n_experts, m.top_k
  logits = jnp.einsum("bld,de->ble", h, p["router"])
  probs = jax.nn.softmax(logits, axis=-1)
  if m.router_skew:   # the pick on logits offset by skew x (E-1-e)/(E-1); the gates from the probabilities
    bias = m.router_skew * (E - 1 - jnp.arange(E, dtype=jnp.float32)) / max(E - 1, 1)
    _, idx = jax.lax.top_k(logits + bias[None, None, :], k)
    top = jnp.take_along_axis(probs, idx, axis=-1)
  else:
    top, idx = jax.lax.top_k(probs, k)
  chosen = jax.nn.one_hot(idx, E).sum(axis=2)                            # [B, L, E]: 1 where e is in the top k
  weight = jnp.where(chosen > 0, probs, 0.0) / jnp.sum(top, axis=-1, keepdims=True)
  if capacity is not None:
    groups, slots = capacity
    B, L = h.shape[:2]
    picks = jax.nn.one_hot(idx, E).reshape(groups, B // groups * L * k, E)
    kept = ((jnp.cumsum(picks, axis=1) <= slots).astype(picks.dtype) * picks).reshape(B, L, k, E).sum(axis=2)
    weight = weight * kept
  y = jnp.zeros_like(h)
  for e in range(E):
    g = h @ p["we_i"][e][:, 0]
    u = h @ p["we_i"][e][:, 1]
    y = y + weight[..., e:e + 1] * ((jax.nn.silu(g) * u) @ p["we_d"][e])
  f = chosen.mean(axis=1) / k                                            # [B, E]: share of each row's picks
  balance = jnp.mean(E * jnp.sum(f * probs.mean(axis=1), axis=-1))
  z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
  return y, balance, z


def loss(params, tokens, targets, m: ModelConfig, capacity=None):
  """The mean next-token loss of model `m` (and a MoE model's router losses). capacity: see _moe."""
  if m.kind == "ffn":
    from shardlab.data import token_code   # the task's fixed input and target codes, not model math
    x = token_code(tokens, m.d_model)
    for i in range(m.n_layers):
      x = x + jnp.maximum(x @ params["layers"]["wi"][i], 0.0) @ params["layers"]["wd"][i]
    return jnp.mean(jnp.square(x - token_code(targets, m.d_model)))
  x = params["embed"][tokens]
  router = 0.0
  L = tokens.shape[1]
  mask = jnp.tril(jnp.ones((L, L), bool))
  for i in range(m.n_layers):
    p = {k: v[i] for k, v in params["layers"].items()}
    h = _norm(x, p["attn_norm"], m.norm_eps)
    q = jnp.einsum("bld,dhk->blhk", h, p["wq"])
    k = jnp.einsum("bld,dhk->blhk", h, p["wkv"][:, 0])
    v = jnp.einsum("bld,dhk->blhk", h, p["wkv"][:, 1])
    q, k = _rope(q, m.rope_theta), _rope(k, m.rope_theta)
    rep = m.n_heads // m.kv_heads              # grouped-query: each K/V head serves `rep` query heads in a row
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    att = jnp.einsum("blhk,bmhk->bhlm", q, k) / jnp.sqrt(q.shape[-1])
    att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
    o = jnp.einsum("bhlm,bmhk->blhk", att, v)
    x = x + jnp.einsum("blhk,hkd->bld", o, p["wo"])
    h = _norm(x, p["mlp_norm"], m.norm_eps)
    if m.n_experts:
      y, balance, z = _moe(h, p, m, capacity)
      x = x + y
      router = router + m.router_aux_loss * balance + m.router_z_loss * z
    if "wi" in p:       # the dense MLP (a MoE model's shared experts)
      g = h @ p["wi"][:, 0]
      u = h @ p["wi"][:, 1]
      x = x + (jax.nn.silu(g) * u) @ p["wd"]
  logits = _norm(x, params["final_norm"], m.norm_eps) @ params["unembed"]
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)) + router


def optimizer(t: TrainConfig, params):
  """AdamW with the `train` group's settings, clipped by optax's own global norm."""
  from shardlab.train import lr_schedule
  mask = jax.tree_util.tree_map_with_path(lambda path, _: not path[-1].key.endswith("norm"), params)
  return optax.chain(optax.clip_by_global_norm(t.grad_clip),
                     optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.adam_eps, weight_decay=t.weight_decay, mask=mask))


def train_step(params, opt_state, batch, m: ModelConfig, opt):
  l, g = jax.value_and_grad(loss)(params, batch[:, :-1], batch[:, 1:], m)
  updates, opt_state = opt.update(g, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, l, optax.tree.norm(g)
