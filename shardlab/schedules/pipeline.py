"""The pipeline executor: the layer stack of an ExplicitSchedule run as pipeline stages by a table (the `pipeline`
config group; the tables themselves, pure Python, are shardlab/pipeline_tables.py, re-exported here: a user's table
imports `from shardlab.schedules.pipeline import Action`). One program runs every stage (SPMD): a `lax.scan` over
the table's ticks; in each, a stage runs its F slot, its B slot and its W slot (each a `lax.cond`, skipped when the
table leaves it empty), then sends its forward output to the next stage and its input gradient to the previous one
(two ppermutes over `pipeline`, every tick, whatever was computed). What a stage holds between slots lives in
buffers of static slots allocated from the table (pipeline_tables.Plan). A part inside the stages whose layer places
a ppermute is refused (Pipeline.check_parts): only the stages running a slot reach it.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from shardlab import collectives as C
from shardlab.axes import PIPELINE, TENSOR
from shardlab.config import PipelineConfig
from shardlab.errors import ConfigError
from shardlab.pipeline_tables import (  # noqa: F401  (re-exported: the tables' names, for users' tables and scripts)
    KINDS, SCHEDULES, Action, Plan, build, check, check_shape, closed_form_bubble, depth_order, in_flight, load_table,
    orders, runs, table, table_of, v_shaped, vstage)
from shardlab.schedules.capability import stated, unstated_by

def _zeros(aval, n: int | None = None, extra=(), lead=()):
  """Zeros shaped like `aval` (with leading dims n and `lead`, if given), varying over its axes and `extra`."""
  shape = (*(() if n is None else (n,)), *lead, *aval.shape)
  axes = tuple(dict.fromkeys((*aval.manual_axis_type.varying, *extra)))
  return C.pvary(jnp.zeros(shape, aval.dtype), axes, name="zeros")


def _avals(fn, *args):
  """The avals of fn(*args)'s outputs (their varying axes included), in its output's tree, from a trace that
  emits nothing."""
  out = {}

  def flat(*a):
    leaves, out["tree"] = jax.tree.flatten(fn(*a))
    return leaves
  avals = jax.make_jaxpr(flat)(*args).out_avals
  return jax.tree.unflatten(out["tree"], avals)


def _slot(name: str, n: int, T: int, on, run, idle, *args):
  """lax.cond(on, run, idle, *args) in the named scope that declares its count (`runs`; check_slots finds the
  slots by it)."""
  with jax.named_scope(runs(name, n, T)):
    return jax.lax.cond(on == 1, run, idle, *args)


_SLOT = re.compile(r"pipeline_(\w+?)_runs_\d+_of_\d+")


def check_slots(jaxpr) -> None:
  """A pipeline slot (a lax.cond in a `runs` scope) whose branch places a ppermute over an axis of more than one
  device is a ConfigError (one line), read off the step's one trace before it is lowered (trainer.lower): a
  ppermute inside a slot, which only some stages run in a tick, would be paired with other stages' pipeline sends
  and hang. Pipeline.check_parts refuses the parts that say they place one; this catches a part that misstated
  it, whoever wrote it."""
  from jax.extend.core import jaxprs_in_params

  def walk(jx, sizes: dict, slot: str | None) -> None:
    for eqn in jx.eqns:
      here = dict(eqn.params["mesh"].shape) if eqn.primitive.name == "shard_map" else sizes
      inner = slot
      if slot is None and eqn.primitive.name == "cond":
        found = _SLOT.findall(str(eqn.source_info.name_stack))
        inner = found[-1] if found else None
      axes = eqn.params.get("axis_name", ())
      axes = axes if isinstance(axes, tuple) else (axes,)
      if slot is not None and eqn.primitive.name == "ppermute" and any(here.get(a, 1) > 1 for a in axes):
        raise ConfigError(f"pipeline: the {slot} slot places a ppermute over {'+'.join(axes)} "
                          f"({eqn.source_info.name_stack}); a ppermute inside a slot, which only some stages run in "
                          f"a tick, would be paired with other stages' pipeline sends: a part inside the stages "
                          f"says point_to_point = False but is not (schedules/capability.py)")
      for sub in jaxprs_in_params(eqn.params):
        walk(sub, here, inner)
  walk(getattr(jaxpr, "jaxpr", jaxpr), {}, None)


def _clamped(i, n: int):
  """min(i, n - 1) as an index: a Python int stays one, a traced one is clamped by one op."""
  if isinstance(i, int):
    return min(i, n - 1)
  return jax.lax.min(i, jnp.asarray(n - 1, i.dtype))


def _take(tree, i):
  """Slot i of each buffer (an idle slot's index, past the last, reads the last: its value goes unused)."""
  clamped = {}    # one clamp per buffer length (the buffers of a tree share it)

  def take(a):
    n = a.shape[0]
    if n not in clamped:
      clamped[n] = _clamped(i, n)
    return jax.lax.dynamic_index_in_dim(a, clamped[n], 0, keepdims=False, allow_negative_indices=False)
  return jax.tree.map(take, tree)


def _set(tree, values, i, n: int):
  """`values` written to slot i of each buffer of n slots; i = n (what an idle slot writes) writes nothing:
  the last slot's own value back, so that no buffer needs a slot to throw writes away."""
  j, writes = _clamped(i, max(n, 1)), i < n

  def put(a, v):
    old = jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False, allow_negative_indices=False)
    return jax.lax.dynamic_update_index_in_dim(a, jax.lax.select(jnp.broadcast_to(writes, v.shape), v, old), j, 0,
                                                allow_negative_indices=False)
  return jax.tree.map(put, tree, values)


class Pipeline:
  """The layer stack of an ExplicitSchedule run as pipeline stages, by a table (`pipeline` config group).

  Stage s holds layers [s NL/P, (s+1) NL/P) (the `layers` rule: stacked weights sharded over `pipeline`), as V
  chunks of NL/(P V): chunk c is model stage c P + s (Megatron's interleaved assignment). With V = 1 the stages
  run the layers in their order; with V > 1 the stored layer i of stage s, chunk c runs at depth (c P + s) k + j
  (k = NL/(P V), i = s V k + c k + j): `depth_order`. Inside a stage: the schedule's own stage unit (FSDP
  gathers with prefetch, TP, remat, the gradient reduce-scatter in each layer's backward).

  Outside the layers: the embedding, final norm and unembedding are replicated over `pipeline`, gathered once
  per step (their gradients reduce-scattered once, and summed over `pipeline`). Every stage embeds every
  microbatch at the start of the step (one vocabulary-parallel lookup per microbatch; stage 0 uses them), and
  the embedding's backward runs once at the end on the input gradients stage 0 kept. The head (norm, logits,
  loss) runs on the last stage, in the F slot of the last virtual stage, forward and backward at once: its
  output gradient is there for that stage's B slot.
  """

  def __init__(self, sched, cfg: PipelineConfig, P: int):
    self.sched, self.cfg, self.P = sched, cfg, P
    self.M, self.V = cfg.count(P), cfg.virtual_stages

  def ticks(self):
    return table_of(self.cfg.impl, self.cfg.table, self.P, self.M, self.V, self.cfg.consecutive)

  def check(self, n_layers: int, shape: dict | None = None) -> None:
    """One line for what this pipeline cannot run: a part inside its stages that may not run in a slot (on a mesh
    of `shape`), layers that P x V does not divide, a table that cannot run."""
    if self.cfg.gather not in ("microbatch", "step"):
      raise ConfigError(f"pipeline.gather={self.cfg.gather}: choose microbatch (a stage's weights gathered in "
                        f"every forward and backward) or step (once per step)")
    if self.M < 1 or self.V < 1:
      raise ConfigError(f"pipeline.microbatches={self.cfg.microbatches} pipeline.virtual_stages={self.V}: "
                        f"microbatches must be >= 0 (0: one per stage) and virtual_stages >= 1")
    if self.P < 2:
      raise ConfigError(f"pipeline={self.cfg.name} needs stages: set mesh.pipeline to 2 or more, or pipeline=none")
    self.check_parts(shape)
    if n_layers % (self.P * self.V):
      raise ConfigError(f"model.n_layers={n_layers} is not divisible by mesh.pipeline x pipeline.virtual_stages"
                        f"={self.P} x {self.V} (each stage holds {self.V} chunk(s) of equal layers); choose "
                        f"n_layers a multiple of {self.P * self.V}")
    self.ticks()

  def layer_order(self) -> list[int] | None:
    """The stored row of the stacked layers that runs at each depth (`depth_order`), or None where that is the
    identity (V = 1). Training stores the layers in this order, a sharding of the model's order over `pipeline`
    that costs nothing per step; checkpoints hold the model's order (checkpoint.Checkpointer: `layer_order`), so
    the same parameters run as the same network under every schedule, and a run resumes onto any of them."""
    order = depth_order(self.sched.model.n_layers, self.P, self.V, v_shaped(self.ticks()))
    return None if order == sorted(order) else order

  def parts_inside(self, shape: dict | None) -> list[tuple[str, object]]:
    """(setting, part) for each part that runs inside a stage and moves bytes on a mesh of `shape`: the TP
    contraction when `tensor` splits, the context strategy when the sequence does, a MoE model's dispatcher when
    the experts do (None: all)."""
    sched, out = self.sched, []
    if shape is None or shape.get(TENSOR, 1) > 1:
      out.append((f"schedule.tp={sched.cfg.tp}", sched.ops))
    if shape is None or sched.cp.parts(shape) > 1:
      out.append((f"context.impl={sched.cp.cfg.impl}", sched.cp))
    if sched.model.moe and (shape is None or any(shape.get(a, 1) > 1 for a in
                                                 sched.layout.rule("experts", tuple(shape)))):
      out.append((f"expert.impl={sched.ep.cfg.impl}", sched.ep))
    return out

  def check_parts(self, shape: dict | None) -> None:
    """A part whose layer places a ppermute cannot run inside a slot: only the stages whose table runs that slot
    in a tick reach it, and XLA pairs a collective-permute over the whole program (one program; collectives meet
    in program order), so it would meet another stage's pipeline send: wrong numbers on one machine, a deadlock
    on another. Group collectives (all-gather, all-to-all, psum) pair within the stage and may. Asked of the
    part's class (schedules/capability.py), never its name: a part that does not state it is refused too."""
    for setting, part in self.parts_inside(shape):
      p2p = stated(part, "point_to_point")
      if p2p is False:
        continue
      why = ("its layer places ppermutes (point_to_point = True)" if p2p else
             f"it does not say whether its layer places ppermutes ({unstated_by(part, 'point_to_point')})")
      raise ConfigError(f"pipeline={self.cfg.name} with {setting}: {why}; a ppermute inside a pipeline slot, "
                        f"which only some stages run in a tick, would be paired with other stages' pipeline sends; "
                        f"use schedule.tp=allgather or allreduce and context=all_gather or ulysses, or state "
                        f"point_to_point = False in {type(part).__name__} if none of its collectives is a ppermute")

  def loss_and_grads(self, params, batch, n_tokens):
    from shardlab import model as MD
    from shardlab.data import Batch
    from shardlab.schedules.parallel import microbatches
    sched, m = self.sched, self.sched.model
    P, M, V = self.P, self.M, self.V
    plan = Plan(self.ticks(), M, V)
    T = plan.T
    me = jax.lax.axis_index(PIPELINE)
    rows = {f: jnp.asarray(a)[:, me] for f, a in plan.arrays.items()}
    batches = microbatches(batch, M)
    ctx = lambda w: sched.parallel(w.__getitem__)   # the stage's parts (TP, attention, MoE dispatch); no loop
    tree = jax.tree.map     # the residual stream: an array, or a MoE model's (x, router statistics so far)

    # The weights outside the layers: gathered once per step, replicated over pipeline (gradients summed there).
    outer = {k: v for k, v in params.items() if k != "layers"}
    hw, outer_vjp = jax.vjp(lambda o: {k: sched.gather(C.pvary(v, PIPELINE), sched.decls[k]) for k, v in o.items()},
                            outer)
    embed_all = lambda w: tree(lambda a: C.pvary(a, PIPELINE),
                               jax.lax.map(lambda b: MD.embed_in(ctx(w), m, Batch(*b)), tuple(batches)))
    x0, embed_vjp = jax.vjp(embed_all, hw)
    layer_fn = MD.block(ctx(hw), m, Batch(batch.inputs, batch.targets, batch.positions))

    layers = params["layers"]
    step_gather = self.cfg.gather == "step"
    if step_gather:    # a stage's weights gathered once per step, their gradients reduce-scattered once
      layers, layers_vjp = jax.vjp(lambda L: {k: sched.gather(v, sched.decls["layers"][k].per_layer(), stacked=True)
                                              for k, v in L.items()}, layers)
    stage = sched.stage(layer_fn, gathered=step_gather)
    k = jax.tree.leaves(layers)[0].shape[0] // V
    chunk = lambda c: jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, c * k, k, 0, allow_negative_indices=False),
                                        layers)

    def add_chunk(g, dw, c):
      return jax.tree.map(lambda G, d: jax.lax.dynamic_update_slice_in_dim(
          G, jax.lax.dynamic_slice_in_dim(G, c * k, k, 0, allow_negative_indices=False) + d, c * k, 0,
          allow_negative_indices=False), g, dw)

    # Buffers of static slots (Plan); slot index = the slot count is an idle slot's: its write writes nothing.
    x_first = _take(x0, 0)
    x_aval = tree(jax.typeof, x_first)
    zeros = lambda avals, n=None, extra=(): tree(lambda a: _zeros(a, n, extra), avals)
    res_avals = jax.make_jaxpr(lambda x, w: stage.forward(x, w)[1][0])(x_first, chunk(0)).out_avals
    held = stage.held(x_first, chunk(0), (PIPELINE,)) if plan.split else []   # what a layer's B leaves its W
    if sched.residuals is not None:   # one layer's residual bytes for one microbatch (the memory breakdown)
      sched.residuals.append({**stage.residual_bytes(x_first, chunk(0)),
                              **({"held": sum(a.size * a.dtype.itemsize for a in held)} if plan.split else {})})
    n_slots = plan.slots
    head = lambda y, w, b: MD.head_and_stats(ctx(w), m, y, b, n_tokens)   # (loss, a MoE model's statistics)
    loss_aval, stats_aval = _avals(head, x_first, hw, Batch(*_take(tuple(batches), 0)))
    size = {k: max(n, 1) for k, n in n_slots.items()}   # (a buffer no action uses still takes the idle writes)
    st = {"inb": zeros(x_aval, size["in"]), "dyb": zeros(x_aval, size["dy"]),
          "res": [_zeros(a, size["res"], (PIPELINE,)) for a in res_avals],
          "fsend": zeros(x_aval), "bsend": zeros(x_aval), "dx0": zeros(x_aval, M),
          "g": tree(C.zeros_like, layers), "gh": tree(C.zeros_like, hw),
          "loss": _zeros(loss_aval, extra=(PIPELINE,)), "stats": zeros(stats_aval, extra=(PIPELINE,))}
    if plan.split:
      st["wb"] = [_zeros(a, size["w"], lead=(k,)) for a in held]

    # Each slot's conditional takes the slices it reads and returns what it makes; the buffers are read and
    # written outside it (an idle slot returns zeros, and its write writes nothing, `_set`). A conditional that
    # updated a buffer in place would hold a second copy of it: XLA keeps the carry and the branch's result apart.
    zeros_like = lambda t: jax.tree.map(C.zeros_like, t)

    def head_run(y, mb, gh, loss, stats):
      b = Batch(*_take(tuple(batches), mb))
      l, vjp, s = jax.vjp(lambda y, w: head(y, w, b), y, hw, has_aux=True)
      dy, dhw = vjp(jnp.ones_like(l))
      return dy, tree(jnp.add, gh, dhw), loss + l, tree(jnp.add, stats, s)

    def f_run(x, c):
      y, (bufs, _) = stage.forward(x, chunk(c))
      return y, bufs

    def b_run(res, dy, c, g):
      res = (res, chunk(c))
      if plan.split:
        dx, dys = stage.backward(res, dy, part="input")
        return dx, dys, g
      dx, dw = stage.backward(res, dy)
      return dx, (), add_chunk(g, dw, c)

    def w_run(res, dys, c, g):
      return add_chunk(g, stage.backward((res, chunk(c)), dys, part="weight"), c)

    fwd, bwd = plan.sends()
    cond = lambda name, n, on, run, idle, *args: _slot(name, n, T, on, run, idle, *args)

    def tick(st, r):
      x = tree(lambda a, b: jnp.where(r["f_first"] == 1, a[r["f_mb"]], b[r["f_in"]]), x0, st["inb"])
      y, bufs = cond("F", M * V, r["f_on"], f_run, lambda x, c: (zeros_like(x), [_zeros(a) for a in res_avals]),
                     x, r["f_chunk"])
      st = {**st, "res": _set(st["res"], bufs, r["f_res"], n_slots["res"]), "fsend": y}
      # the head, after the last virtual stage's F: once per microbatch on the last stage
      dy, gh, loss, stats = cond("head", M, r["f_last"], head_run,
                                 lambda y, mb, gh, loss, stats: (zeros_like(y), gh, loss, stats),
                                 y, r["f_mb"], st["gh"], st["loss"], st["stats"])
      st = {**st, "dyb": _set(st["dyb"], dy, r["f_dy"], n_slots["dy"]), "gh": gh, "loss": loss, "stats": stats}
      res, dyin = _take(st["res"], r["b_res"]), _take(st["dyb"], r["b_dy"])
      if plan.split:
        idle_b = lambda res, dy, c, g: (zeros_like(dy), zeros_like(_take(st["wb"], 0)), g)
      else:
        idle_b = lambda res, dy, c, g: (zeros_like(dy), (), g)
      dx, dys, g = cond("B", M * V, r["b_on"], b_run, idle_b, res, dyin, r["b_chunk"], st["g"])
      first = jnp.where(r["b_first"] == 1, r["b_mb"], M)
      st = {**st, "g": g, "bsend": dx, "dx0": _set(st["dx0"], dx, first, M)}
      if plan.split:
        st = {**st, "wb": _set(st["wb"], dys, r["b_w"], n_slots["w"])}
        g = cond("W", M * V, r["w_on"], w_run, lambda res, dys, c, g: g,
                 _take(st["res"], r["w_res"]), _take(st["wb"], r["w_w"]), r["w_chunk"], st["g"])
        st = {**st, "g": g}
      if plan.v_shape:   # one action per tick: its output goes down or up the stages (or stays: the V's turn)
        out = tree(lambda y, dx: jnp.where(r["f_on"] == 1, y, dx), st["fsend"], st["bsend"])
        down = C.ppermute(out, PIPELINE, fwd, name="pipeline_forward")
        up = C.ppermute(out, PIPELINE, bwd, name="pipeline_backward")
        inb = _set(_set(_set(st["inb"], down, r["r_in"], n_slots["in"]), up, r["r_in_up"], n_slots["in"]),
                   out, r["r_in_own"], n_slots["in"])
        dyb = _set(_set(_set(st["dyb"], up, r["r_dy"], n_slots["dy"]), down, r["r_dy_down"], n_slots["dy"]),
                   out, r["r_dy_own"], n_slots["dy"])
        return {**st, "inb": inb, "dyb": dyb}, None
      got_f = C.ppermute(st["fsend"], PIPELINE, fwd, name="pipeline_forward")
      got_b = C.ppermute(st["bsend"], PIPELINE, bwd, name="pipeline_backward")
      st = {**st, "inb": _set(st["inb"], got_f, r["r_in"], n_slots["in"]),
            "dyb": _set(st["dyb"], got_b, r["r_dy"], n_slots["dy"])}
      return st, None

    st, _ = jax.lax.scan(tick, st, rows)
    loss = C.psum(st["loss"], PIPELINE, name="pipeline_loss")
    g_hw = tree(jnp.add, st["gh"], embed_vjp(st["dx0"])[0])
    grads = dict(outer_vjp(g_hw)[0])
    grads["layers"] = layers_vjp(st["g"])[0] if step_gather else st["g"]
    if not m.moe:
      return loss, grads
    return loss, grads, C.psum(st["stats"], PIPELINE, name="pipeline_router_stats")   # the last stage's
