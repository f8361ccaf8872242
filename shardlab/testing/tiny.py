"""The tiny model: its config, batch, plain reference and compiled schedules (cached: one compile per distinct
schedule, mesh and model in a process), and a schedule checked against baseline."""
from __future__ import annotations

import functools


from shardlab.composition import resolve
from shardlab.testing.compare import assert_trees_close
from shardlab.testing.meshes import mesh_id, mesh_of, named_shape
from shardlab.testing.programs import assert_collectives, assert_overlap, format_ledger


def tiny_config(model: dict | None = None, **schedule):
  """The tiny model used by the tests: 4 layers, so that prefetch depth 2 still runs a loop of 2 trips.
  `model`: ModelConfig fields to change (e.g. {"n_kv_heads": 2, "attention": "blockwise"})."""
  from shardlab.config import Config, ModelConfig, ScheduleConfig, TrainConfig
  return Config(model=ModelConfig(**{"n_layers": 4, **(model or {})}), schedule=ScheduleConfig(**schedule),
                train=TrainConfig(steps=3))


@functools.lru_cache(maxsize=None)
def tiny_batch(batch_size: int | None = None, seq_len: int | None = None):
  """One batch of tokens[B, L+1] for the tiny model (B: train.batch_size, 16, or `batch_size`; L: its
  model.seq_len, or `seq_len`: the compile_schedule and reference of a model with another)."""
  from shardlab.data import markov_batch
  cfg = tiny_config()
  return markov_batch(0, 0, batch_size or cfg.train.batch_size, seq_len or cfg.model.seq_len, cfg.model.vocab_size,
                      cfg.data.branching)


def _with_batch(cfg, batch_size: int | None):
  """cfg with train.batch_size = batch_size (None: unchanged)."""
  import dataclasses
  if not batch_size:
    return cfg
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch_size))


def placed_batch(tokens_BL1, mesh, layout=None, order=None):
  """tokens[B, L+1] -> data.Batch (inputs, targets, positions), each field placed by the layout's data spec on
  `mesh` (default layout: layout.Layout()), the tokens of each sequence in `order` (a schedule's data_order)."""
  import jax
  from jax.sharding import NamedSharding
  from shardlab.data import split
  from shardlab.layout import Layout
  from shardlab.train import batch_specs
  specs = batch_specs(layout or Layout(), mesh)
  return jax.device_put(split(tokens_BL1, order), type(specs)(*(NamedSharding(mesh, s) for s in specs)))


def abstract_batch(batch_size: int, seq_len: int, mesh, layout=None):
  """A data.Batch of ShapeDtypeStructs (int32 inputs, targets [batch_size, seq_len], positions [seq_len]) placed
  like placed_batch (for .lower)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from shardlab.data import Batch
  from shardlab.layout import Layout
  from shardlab.train import batch_specs
  shapes = ((batch_size, seq_len), (batch_size, seq_len), (seq_len,))
  return Batch(*(jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, s))
                 for shape, s in zip(shapes, batch_specs(layout or Layout(), mesh))))


def reference_loss_and_grads(model: dict | None = None, batch_size: int | None = None):
  """Loss and gradients of the unsharded reference on the tiny model (`model`: fields changed) and
  `tiny_batch(batch_size)`; cached. The reference has one attention (plain): model.attention and its block are ignored.
  Its layers run in the model's order, whatever schedule it is compared with."""
  model = {k: v for k, v in (model or {}).items() if k not in ("attention", "attention_block")}
  return _reference_loss_and_grads(tuple(sorted(model.items())), batch_size)


@functools.lru_cache(maxsize=None)
def _reference_loss_and_grads(model_items: tuple, batch_size: int | None = None):
  import jax
  from shardlab import reference as R
  cfg = _with_batch(tiny_config(dict(model_items)), batch_size)
  p = _reference_params(model_items)
  b = tiny_batch(batch_size, cfg.model.seq_len)
  with jax.numpy_dtype_promotion("strict"):
    return jax.jit(jax.value_and_grad(lambda p: R.loss(p, b[:, :-1], b[:, 1:], cfg.model)))(p)


def _schedule_key(schedule, knobs) -> tuple:
  """(implementation class or None, the ScheduleConfig's fields as a hashable tuple, name aside)."""
  import dataclasses
  from shardlab.config import ScheduleConfig
  cls = schedule if isinstance(schedule, type) else None
  if isinstance(schedule, ScheduleConfig):
    knobs = {**dataclasses.asdict(schedule), **knobs}
  elif isinstance(schedule, dict):
    knobs = {**schedule, **knobs}
  elif schedule is not None and cls is None:
    raise TypeError(f"schedule: a ScheduleConfig, a dict of knobs or a schedule class, not {schedule!r}")
  cfg = dataclasses.asdict(ScheduleConfig(**knobs))
  return cls, tuple(sorted((k, v) for k, v in cfg.items() if k != "name"))


def compile_schedule(schedule=None, mesh_shape=(2, 4), model: dict | None = None, layout: dict | None = None,
                     context: str | None = None, load_balance: bool = False, pipeline: dict | None = None,
                     expert: dict | None = None, stats: bool = False, batch_size: int | None = None,
                     context_kernel: str = "auto", ulysses: int = 0, **knobs):
  """(compiled grad fn, (loss, grads)) of a schedule on the tiny model and `tiny_batch()`; cached.

  schedule: a ScheduleConfig, a dict of knobs, or a schedule class (constructed as cls(ScheduleConfig(
  **knobs), model, compute_dtype, layout), like the registered ones); knobs override. model: ModelConfig fields
  to change (tiny_config). mesh_shape: any shape mesh_of takes. layout: sharding rules {logical: [axes]} (None:
  the default layout). context: the context-parallel strategy (context.impl; None: all_gather); load_balance:
  context.load_balance (the data in zigzag order); context_kernel: context.kernel (the ring's); ulysses:
  context.ulysses (usp's, a2a_p2p's Ulysses degree). pipeline: PipelineConfig fields ({"impl": "1f1b",
  "microbatches": 4}; None: no pipeline): the parameters are stored in the run's order of layers and the
  gradients come back in the model's (as trainer.fit and its checkpoints do), so every schedule is compared with
  the plain `reference_loss_and_grads(model)`. expert: ExpertConfig fields ({"impl": "ragged"}; None: all_to_all); stats: a MoE model's
  global router statistics third, (loss, grads, stats). batch_size: sequences in the batch (default 16; e.g. a
  multiple of a CSV table's microbatches), then compared with `reference_loss_and_grads(model, batch_size)`."""
  items = tuple(named_shape(mesh_shape).items())     # data 1 is no axis: the 2D mesh (one compile)
  rules = None if layout is None else tuple((k, tuple(v) if isinstance(v, (list, tuple)) else v)
                                            for k, v in layout.items())
  return _compile_schedule(items, *_schedule_key(schedule, knobs), tuple(sorted((model or {}).items())), rules,
                           context, load_balance, tuple(sorted((pipeline or {}).items())),
                           tuple(sorted((expert or {}).items())), stats, batch_size, context_kernel, ulysses)


@functools.lru_cache(maxsize=None)
def _compile_schedule(mesh_items, cls, items, model_items=(), rules=None, context=None, load_balance=False,
                      pipe_items=(), expert_items=(), stats=False, batch_size=None, context_kernel="auto",
                      ulysses=0):
  import jax
  import jax.numpy as jnp
  from shardlab import params as PM, schedules, train as T
  cfg = _with_batch(tiny_config(dict(model_items), **dict(items)), batch_size)
  mesh = mesh_of(mesh_items)
  layout, decls, params = _tiny_model(mesh_items, model_items, rules)
  from shardlab.config import ContextConfig
  cp = None if context is None and not load_balance else ContextConfig(
      name=(context or "all_gather").rpartition(":")[2], impl=context or "all_gather", load_balance=load_balance,
      kernel=context_kernel, ulysses=ulysses)
  from shardlab.config import PipelineConfig
  pipe = PipelineConfig(**{"name": dict(pipe_items).get("impl", "none"), **dict(pipe_items)}) if pipe_items else None
  from shardlab.axes import PIPELINE
  pipe = pipe.with_table(dict(mesh_items).get(PIPELINE, 1)) if pipe else None     # a CSV table fixes M and V
  from shardlab.config import ExpertConfig
  ep = ExpertConfig(**{"name": dict(expert_items).get("impl", "all_to_all"), **dict(expert_items)}) if expert_items else None
  sched = (cls(cfg.schedule, cfg.model, jnp.float32, layout, *([cp] if cp else [])) if cls
           else schedules.build(cfg.schedule, cfg.model, jnp.float32, layout, cp, pipe, ep))
  micro = getattr(sched, "microbatches_on", lambda shape: cfg.schedule.microbatches)(dict(mesh_items))
  PM.check_divisible(cfg.model, layout, dict(mesh_items), cfg.train.batch_size, micro,
                     seq_parallel=sched.ops.seq_sharded, seq_halves=sched.ops.bidirectional)
  b = placed_batch(tiny_batch(batch_size, cfg.model.seq_len), mesh, layout, sched.data_order(dict(mesh_items)))
  from shardlab.checkpoint import reorder_layers
  from shardlab.trainer import layer_order
  order = layer_order(sched, dict(mesh_items))    # the trainer's stored order of layers (an interleaved pipeline's)
  params = reorder_layers(params, order, to_model=False)
  with jax.numpy_dtype_promotion("strict"):
    compiled = T.make_grad_fn(resolve(cfg), sched, decls, mesh, stats).lower(params, b).compile()
  loss, grads, *rest = compiled(params, b)
  return compiled, jax.block_until_ready((loss, reorder_layers(grads, order, to_model=True), *rest))


@functools.lru_cache(maxsize=None)
def _reference_params(model_items: tuple):
  """The plain reference's parameters (seed 0) of the tiny model with `model_items` changed, on one device."""
  import jax
  from shardlab import params as PM
  cfg = tiny_config(dict(model_items))
  return PM.init(jax.random.key(0), PM.declare(cfg.model), cfg.model)


@functools.lru_cache(maxsize=None)
def _tiny_model(mesh_items, model_items=(), rules=None):
  """(layout, parameter declarations, parameters placed by the layout) of the tiny model on the mesh: made once
  per mesh, model and layout (jax arrays are immutable; every compiled step of the kit takes them). The
  parameters are the plain reference's own (seed 0, evaluated op by op; PM.init_sharded's compiled ones differ
  from them in the last bit: PM.init), copied into their shards from the host: no init program compiled per mesh
  and layout (0.5-0.8 s each)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from shardlab import params as PM
  from shardlab.axes import TENSOR
  from shardlab.layout import Layout
  cfg, mesh = tiny_config(dict(model_items)), mesh_of(mesh_items)
  layout = Layout() if rules is None else Layout.of(dict(rules))
  layout.check(mesh.axis_names)
  decls = PM.declare(cfg.model, dict(mesh_items)[TENSOR], layout, mesh.axis_names)
  ref = _reference_params(model_items)     # the mesh changes specs, never shapes (PM.declare)
  shardings = jax.tree.map(lambda d: NamedSharding(mesh, d.spec()), decls, is_leaf=PM.is_param)
  return layout, decls, jax.device_put(jax.tree.map(np.asarray, ref), shardings)


def _check_claims(ledger, base, comm, label) -> None:
  """`ledger` moves no more bytes than `comm` claims relative to `base` (see assert_schedule_matches_baseline)."""
  rows = lambda l: {f"{k} {a}": r["bytes"] for k, axes in l.items() for a, r in axes.items()}
  from shardlab.analysis.hlo import COLLECTIVES
  have, was = rows(ledger), rows(base)
  claims = {key: 1.0 for key in [*have, *was, "total"]} if comm == "baseline" else dict(comm)
  for key in claims:
    if key != "total" and (len(key.split()) != 2 or key.split()[0] not in COLLECTIVES):
      raise ValueError(f"comm claim {key!r}: expected 'total' or '<kind> <axis>' with a kind of "
                       f"{', '.join(COLLECTIVES)} (e.g. 'all-gather fsdp')")
  errors = []
  for key, factor in sorted(claims.items()):
    got = sum(have.values()) if key == "total" else have.get(key, 0)
    base_bytes = sum(was.values()) if key == "total" else was.get(key, 0)
    if got > factor * base_bytes:
      what = "in all" if key == "total" else "as " + key.replace(" ", " over ", 1)
      errors.append(f"moves {got} bytes per device per step {what}, more than it claims: {factor:g}x the "
                    f"baseline's {base_bytes}")
  if errors:
    raise AssertionError(f"{label}: " + "; ".join(errors) + f". Ledger: {format_ledger(ledger)}. "
                         f"Baseline: {format_ledger(base)}")


def _schedule_name(cls, items) -> str:
  defaults = dict(_schedule_key(None, {})[1])
  return cls.__name__ if cls else ", ".join(f"{k}={v}" for k, v in items if v != defaults[k]) or "baseline"


def assert_schedule_matches_baseline(schedule=None, mesh_shapes=((2, 4),), comm=None, reference: bool = False,
                                     rtol: float = 2e-5, atol: float = 2e-5, against=None, overlap=None,
                                     **knobs) -> dict:
  """A schedule trains the tiny model exactly as `baseline` does (loss and every gradient) on each mesh, and
  moves no more bytes than it claims; returns {mesh id: {"ledger", "baseline"}}.

  schedule    a ScheduleConfig, a dict of knobs, or a schedule class (see compile_schedule); knobs override.
  against     the schedule to compare with instead of `baseline` (same forms as `schedule`, None: baseline);
              `comm` claims are then relative to it, and the result's "baseline" is its ledger.
  comm        the byte claim, checked on the compiled programs' ledgers: None (no claim); "baseline" (no
              row and no total above the baseline's); or {"all-gather fsdp": 0.5, "total": 1.0, ...}: each
              named row (kind and axis) or the total at most that many times the baseline's bytes.
  overlap     a claim on what the schedule hides, checked on the compiled program (see assert_overlap): a dict
              of its arguments ({"kind": "reduce-scatter", "scope": "fsdp_all_gather", "behind": "all"}), or a
              list of them.
  reference   also compare with the unsharded reference (the baseline already is, in tests/).
  Every schedule is also audited: no collective that shardlab.collectives did not place (the one rule).
  """
  cls, items = _schedule_key(schedule, knobs)
  other_cls, other_items = _schedule_key(against, {})
  name, other = _schedule_name(cls, items), _schedule_name(other_cls, other_items)
  out = {}
  for shape in mesh_shapes:
    shape = tuple(named_shape(shape).items())
    label = f"{name} on {mesh_id(dict(shape))}"
    compiled, (loss, grads) = _compile_schedule(shape, cls, items)
    base_compiled, (base_loss, base_grads) = _compile_schedule(shape, other_cls, other_items)
    assert_trees_close(loss, base_loss, rtol=1e-6, atol=0, label=f"{label}, loss vs {other}")
    assert_trees_close(grads, base_grads, rtol=rtol, atol=atol, label=f"{label}, gradient vs {other} ")
    if reference:
      ref_loss, ref_grads = reference_loss_and_grads()
      assert_trees_close(grads, ref_grads, rtol=rtol, atol=atol, label=f"{label}, gradient vs reference ")
    ledger = assert_collectives(compiled, mesh=mesh_of(shape), label=f"{label}: ")
    base = assert_collectives(base_compiled, mesh=mesh_of(shape), label=f"{other} on {mesh_id(dict(shape))}: ")
    if comm is not None:
      _check_claims(ledger, base, comm, label)
    for claim in ([overlap] if isinstance(overlap, dict) else overlap or []):
      assert_overlap(compiled, label=f"{label}: ", **claim)
    out[mesh_id(dict(shape))] = {"ledger": ledger, "baseline": base}
  return out
