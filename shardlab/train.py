"""The training step: loss and gradients from the schedule, global-norm clipping with explicit reductions,
AdamW on the local shards (optimizer state sharded like the parameters: ZeRO-3), all inside one shard_map."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlab import collectives as C
from shardlab.composition import Composition
from shardlab.data import Batch
from shardlab.params import is_param, specs

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def lr_schedule(t):
  return optax.warmup_cosine_decay_schedule(init_value=0.1 * t.lr, peak_value=t.lr, warmup_steps=t.warmup_steps,
                                            decay_steps=max(t.steps, t.warmup_steps + 1), end_value=0.1 * t.lr)


def make_optimizer(t, decls) -> optax.GradientTransformation:
  """AdamW with the `train` group's settings; clipping happens before it, on the sharded gradients (see
  `clip_by_global_norm`)."""
  mask = jax.tree.map(lambda d: d.decay, decls, is_leaf=is_param)
  return optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.adam_eps, weight_decay=t.weight_decay, mask=mask)


def global_norm(grads, decls):
  """sqrt(sum of squares) over the whole model: each leaf's local sum is psum'd over exactly the mesh
  axes it is sharded on (a replicated leaf counted once), grouped so there is one psum per axis set."""
  groups = {}
  for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(decls, is_leaf=is_param)):
    axes = d.mesh_axes()
    groups[axes] = groups.get(axes, 0.0) + jnp.sum(jnp.square(g.astype(jnp.float32)))
  return jnp.sqrt(sum(C.psum(v, axes, name="grad_norm") if axes else v for axes, v in groups.items()))


def clip_by_global_norm(grads, norm, max_norm):
  """optax.clip_by_global_norm's formula, with the norm computed across shards."""
  return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm), grads)


def state_specs(opt, decls):
  pspecs = specs(decls)
  abstract = jax.eval_shape(opt.init, jax.tree.map(lambda d: jax.ShapeDtypeStruct(d.shape, jnp.float32), decls,
                                                    is_leaf=is_param))
  ospecs = optax.tree_map_params(opt, lambda _, s: s, abstract, pspecs, transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))
  return {"params": pspecs, "opt": ospecs, "step": P()}


def init_state_local(params, opt):
  """The training state of unsharded `params` (for shapes, and the reference layout of the state)."""
  return {"params": params, "opt": opt.init(params), "step": jnp.zeros((), jnp.int32)}


def init_state(params, opt, decls, mesh):
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(opt, decls),
                           is_leaf=lambda x: isinstance(x, P))
  opt_state = jax.jit(opt.init, out_shardings=shardings["opt"])(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
  return {"params": params, "opt": opt_state, "step": step}


def _jit(fn, mesh, in_specs, out_specs, shard_mapped: bool, **kw):
  """jit(shard_map(fn)) for explicit schedules; for compiler-sharded ones (gspmd), jit with the same
  shardings on inputs and outputs."""
  if shard_mapped:
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs), **kw)
  named = lambda t: jax.tree.map(lambda s: NamedSharding(mesh, s), t, is_leaf=lambda x: isinstance(x, P))
  return jax.jit(fn, in_shardings=named(in_specs), out_shardings=named(out_specs), **kw)


def batch_specs(layout, mesh) -> Batch:
  """The data's specs on the mesh: inputs and targets [B, L] by the layout's data spec, positions [L] by its
  `length` rule."""
  spec = layout.batch_spec(mesh.axis_names)
  return Batch(spec, spec, layout.spec(("length",), mesh.axis_names))


def router_metrics(m, stats, n_tokens: int) -> dict:
  """A MoE step's router statistics (model.loss_and_stats, global sums over layers) as metrics.jsonl keys, each a
  mean over the layers: router_aux_loss (the load-balancing loss, per sequence), router_z_loss, dropped_fraction
  (of the token-expert assignments, over capacity) and expert_load_max_over_mean (the busiest expert's
  assignments over the mean, over the step's layers)."""
  NL = m.n_layers
  load = stats["load"]
  return {"router_aux_loss": stats["aux"] * m.seq_len / n_tokens / NL,
          "router_z_loss": stats["z"] / n_tokens / NL,
          "dropped_fraction": stats["dropped"] / (n_tokens * m.top_k * NL),
          "expert_load_max_over_mean": jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)}


def make_grad_fn(c: Composition, schedule, decls, mesh, stats: bool = False):
  """(params, data.Batch) -> (loss, grads sharded like params), jitted; with `stats`, a MoE model's global router
  statistics third (model.loss_and_stats). For tests and analysis."""
  n_tokens = c.train.batch_size * c.model.seq_len
  pspecs = specs(decls)
  fn = lambda p, b: schedule.loss_and_grads(p, b, n_tokens)[:3 if stats else 2]
  schedule.bind(mesh)
  return _jit(fn, mesh, (pspecs, batch_specs(schedule.layout, mesh)), (P(), pspecs, *[P()] * stats),
              schedule.shard_mapped)


def make_train_step(c: Composition, schedule, decls, opt, mesh):
  """jit(shard_map(step)): (state, data.Batch) -> (state, {loss, grad_norm}). The state is donated."""
  n_tokens = c.train.batch_size * c.model.seq_len
  sspecs = state_specs(opt, decls)

  shard_mapped = schedule.shard_mapped
  schedule.bind(mesh)

  def step(state, batch):
    params = state["params"]
    loss, grads, *stats = schedule.loss_and_grads(params, batch, n_tokens)
    norm = global_norm(grads, decls) if shard_mapped else optax.tree.norm(grads)
    grads = clip_by_global_norm(grads, norm, c.train.grad_clip)
    updates, opt_state = opt.update(grads, state["opt"], params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": loss, "grad_norm": norm, **(router_metrics(c.model, stats[0], n_tokens) if stats else {})}
    return {"params": params, "opt": opt_state, "step": state["step"] + 1}, metrics

  return _jit(step, mesh, (sspecs, batch_specs(schedule.layout, mesh)), (sspecs, P()), shard_mapped, donate_argnums=0)
