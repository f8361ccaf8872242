"""The communication ledger: bytes counted by hand from the tiny model's dims equal the ledger of the traced
program on every mesh and schedule family; the traced program's ledger equals the compiled HLO's for every preset;
no preset has a collective that shardlab.collectives did not place (the audit's one rule); rings move exactly the bytes of the collectives they replace.

Bytes are per device per step, bandwidth-optimal (NCCL tests, doc/PERFORMANCE.md): an all-gather or reduce-scatter
of a full array of V bytes over n devices moves V (n-1)/n, an all-reduce 2 V (n-1)/n, a ppermute its operand.
"""
import functools
import math

import pytest

from conftest import MESHES, compiled_grads, load_preset, mesh_of, preset_params, tiny_config
from shardlab.composition import resolve
from shardlab.testing import abstract_batch

FAMILIES = ["baseline", "collective_matmul", "collective_matmul_bidi", "megatron_allreduce", "keep_gathered",
            "deferred_reduce", "next_layer_reduce"]


@functools.lru_cache(maxsize=None)
def knobs_of(preset: str) -> tuple:
  return tuple(sorted((k, v) for k, v in load_preset(preset).items() if k != "name"))


@functools.lru_cache(maxsize=None)
def grad_fn_and_args(mesh_shape: tuple, knobs: tuple, model: tuple = ()):
  """The grad function conftest.compiled_grads compiles, and abstract arguments to trace it with."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from shardlab import params as PM, schedules, train as T
  cfg = tiny_config(dict(model), **dict(knobs))
  mesh, decls = mesh_of(*mesh_shape), PM.declare(cfg.model)
  fn = T.make_grad_fn(resolve(cfg), schedules.build(cfg.schedule, cfg.model, jnp.float32), decls, mesh)
  params = jax.tree.map(lambda d: jax.ShapeDtypeStruct(d.shape, jnp.float32, sharding=NamedSharding(mesh, d.spec())),
                        decls, is_leaf=PM.is_param)
  tokens = abstract_batch(cfg.train.batch_size, cfg.model.seq_len, mesh)
  return fn, (params, tokens)


@functools.lru_cache(maxsize=None)
def program_rows(mesh_shape, knobs, model: tuple = ()):
  import jax
  from shardlab.analysis import ledger
  fn, args = grad_fn_and_args(mesh_shape, knobs, model)
  with jax.numpy_dtype_promotion("strict"):
    return ledger.from_program(jax.make_jaxpr(fn)(*args))


def compiled_rows(mesh_shape, knobs, model: tuple = ()):
  from shardlab.analysis import hlo, ledger
  from shardlab.testing import compile_schedule
  mesh = mesh_of(*mesh_shape)
  compiled = compile_schedule(dict(knobs), mesh_shape, dict(model))[0] if model else compiled_grads(mesh_shape, knobs)[0]
  colls = hlo.collectives(compiled.as_text(), mesh.device_ids, tuple(mesh.axis_names))
  return colls, ledger.from_hlo(colls)


def _adder(out: dict, sizes: dict):
  """add(kind, axis, elements, count): `count` float32 collectives of `elements` over `axis` into out[(kind, axis)]
  ({"count", "bytes"}, bytes per device, bandwidth-optimal; `sizes`: each mesh axis's devices)."""
  def add(kind, axis, elements, count=1):
    axis = "+".join(a for a in axis.split("+") if sizes[a] > 1)   # axes of size 1 are no axes
    n = 1 if not axis else math.prod(sizes[a] for a in axis.split("+"))
    if n == 1 or count == 0:
      return                                          # nothing to move (XLA drops these too)
    full = 4 * elements
    moved = {"all-reduce": 2 * full * (n - 1) // n, "collective-permute": full}.get(kind, full * (n - 1) // n)
    row = out.setdefault((kind, axis), {"count": 0, "bytes": 0})
    row["count"] += count
    row["bytes"] += count * moved
  return add


def hand_ledger(mesh_shape, knobs: dict) -> dict:
  """{(kind, axis): {"count", "bytes"}} of one step of make_grad_fn, from the model dims alone (float32).
  mesh_shape: (fsdp X, tensor Y) or (data Z, fsdp X, tensor Y)."""
  cfg = tiny_config(**knobs)
  m, s = cfg.model, cfg.schedule
  D, F, H, K, V, NL, L = m.d_model, m.d_ff, m.n_heads, m.head_dim, m.vocab_size, m.n_layers, m.seq_len
  G = m.kv_heads
  Z, X, Y = mesh_shape if len(mesh_shape) == 3 else (1, *mesh_shape)
  sizes = {"data": Z, "fsdp": X, "tensor": Y}
  k = s.microbatches
  b = cfg.train.batch_size // (Z * X) // k           # sequences per device per microbatch
  out = {}
  add = _adder(out, sizes)

  # FSDP: the gathered weight W[D, N_tp] of each parameter (dims sharded over tensor stay divided by Y).
  norms, mats = [D, D], [D * H * K // Y, D * 2 * G * K // Y, H * K * D // Y, D * 2 * F // Y, F * D // Y]
  top = [V * D // Y, D, D * V // Y]                  # embed, final_norm, unembed
  if s.grad_reduce == "deferred":                    # every parameter gathered and reduced once, as a stack
    for e in [NL * e for e in norms + mats] + top:
      add("all-gather", "fsdp", e)
      add("reduce-scatter", "fsdp", e)
      add("all-reduce", "data", e // X)               # HSDP: the fsdp shard's gradient, over the data replicas
  else:
    for e in norms + mats:
      add("all-gather", "fsdp", e, NL)               # forward
      add("reduce-scatter", "fsdp", e, NL)           # each layer's gradient, in backward
    for e in mats:                                    # backward re-gather (norm scales are not needed again:
      add("all-gather", "fsdp", e, NL * s.reshard_after_forward)   # their backward reads saved activations)
    for e in top:                                     # gathered once; plain AD keeps them for backward
      add("all-gather", "fsdp", e)
      add("reduce-scatter", "fsdp", e)
    for e, times in [(e, NL) for e in norms + mats] + [(e, 1) for e in top]:
      add("all-reduce", "data", e // X, times)        # HSDP: after each reduce-scatter, its shard over data
  add("all-reduce", "data+fsdp", 1, k)                # loss_sum, a scalar per microbatch

  # TP: a sequence-sharded activation x[b, L_tp, D] gathers to `act` elements. Contractions: per layer
  # column(q and k/v, one gather), row(out), column(wi), row(wd); plus the unembedding column; plus the
  # embedding's reduce.
  act, contractions = b * L * D, 4 * NL + 1
  if s.tp == "allreduce":                             # psum per row + embed (fwd), per column input (bwd)
    add("all-reduce", "tensor", act, k * (2 * NL + 1 + 2 * NL + 1))
  else:
    if s.tp == "allgather":                           # a column's all-gather, its transpose in backward, ...
      add("all-gather", "tensor", act, k * contractions)
      add("reduce-scatter", "tensor", act, k * contractions)
    else:                                             # ... or their rings: n-1 blocks, twice as many half-blocks
      halves = 2 if s.tp == "ring_bidi" else 1
      add("collective-permute", "tensor", act // Y // halves, k * 2 * contractions * (Y - 1) * halves)
    add("reduce-scatter", "tensor", act, k)           # embedding reduce (forward) ...
    add("all-gather", "tensor", act, k)               # ... and its transpose
    if s.grad_reduce == "deferred":                   # norm-scale gradients summed over tensor (sequence-parallel)
      for e in [NL * D, NL * D, D]:
        add("all-reduce", "tensor", e)
    else:
      add("all-reduce", "tensor", D, 2 * NL + 1)
  add("all-reduce", "tensor", b * L, 3 * k)           # vocab-parallel loss: max, sum of exps, target logit
  return out


def without_arrays(totals: dict) -> dict:
  return {key: {"count": t["count"], "bytes": t["bytes"]} for key, t in totals.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", MESHES + [(2, 2, 2), (2, 1, 4)], ids=lambda s: "x".join(map(str, s)))
def test_program_ledger_equals_hand_count(mesh_shape):
  """Every schedule family, from the traced program (no compile): executions and bytes per (kind, axis)."""
  from shardlab.analysis import ledger
  for preset in FAMILIES:
    got = without_arrays(ledger.totals(program_rows(mesh_shape, knobs_of(preset))))
    assert got == hand_ledger(mesh_shape, dict(knobs_of(preset))), f"{preset} on {mesh_shape}"


@pytest.mark.parametrize("preset", preset_params())
def test_compiled_ledger_equals_program_and_hand_count_and_nothing_unplanned(preset):
  """One 2D mesh, every hand-placed preset: HLO ledger = program ledger = hand count; the audit finds nothing
  unplanned (and, for a compiler-placed preset, flags every collective).
  XLA's all-reduce combiner merges small all-reduces into one tuple-shaped instruction (vocab sums, norm
  gradients): bytes and arrays per (kind, axis, dtype) must agree, executions may only drop, and only there."""
  from shardlab.analysis import ledger, program
  knobs = knobs_of(preset)
  colls, compiled = compiled_rows((2, 4), knobs)
  unplanned = program.audit(colls)["unplanned"]
  from shardlab import schedules
  if not getattr(schedules.resolve(dict(knobs)["impl"]), "shard_mapped", True):   # e.g. gspmd: XLA places every
    assert len(unplanned) == len(colls) > 0     # collective, by design; the audit must see all of them (a control)
    return
  assert unplanned == [], f"{preset}: collectives not placed through shardlab.collectives"
  prog = program_rows((2, 4), knobs)
  rec = ledger.reconcile(prog, compiled)
  assert rec.differences == [] and {r["rewrite"] for r in rec.rewrites} <= {"combined"}   # XLA:CPU, f32
  a, b = ledger.totals(prog), ledger.totals(compiled)
  assert all(a[key]["count"] == b[key]["count"] for key in a if key[0] != "all-reduce"), (a, b)
  assert {key: t["bytes"] for key, t in b.items()} == {
      key: t["bytes"] for key, t in hand_ledger((2, 4), dict(knobs)).items()}


@pytest.mark.parametrize("mesh_shape", [(2, 4), pytest.param((4, 2), marks=pytest.mark.slow)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_rings_and_allreduce_move_the_bytes_of_the_collectives_they_replace(mesh_shape):
  """Bandwidth-optimal TP: a ring of n-1 ppermutes moves (n-1)/n of the array, as the all-gather or
  reduce-scatter it replaces; an all-reduce (2 V (n-1)/n) moves what a reduce-scatter plus an all-gather do."""
  from shardlab.analysis import ledger

  def tensor_bytes(preset, kinds):
    t = ledger.totals([r for r in program_rows(mesh_shape, knobs_of(preset)) if r.scope not in (
        "vocab_max", "vocab_sum", "replicated_weight")])
    return sum(v["bytes"] for (kind, axis), v in t.items() if axis == "tensor" and kind in kinds)

  plain = tensor_bytes("baseline", ("all-gather", "reduce-scatter"))
  assert plain > 0
  for ring in ("collective_matmul", "collective_matmul_bidi", "prefetch_ring"):
    assert tensor_bytes(ring, ("all-gather", "reduce-scatter", "collective-permute")) == plain, ring
  assert tensor_bytes("megatron_allreduce", ("all-reduce",)) == plain


def test_dead_collectives_are_not_counted():
  """The custom_vjp backward traces `jax.vjp(gather, ..)` for its transpose only: its forward all-gather is dead
  and XLA drops it; the ledger must too (with it, the backward would count 6 more gathers per layer)."""
  import jax
  from jax.extend.core import jaxprs_in_params
  from shardlab.analysis import ledger
  fn, args = grad_fn_and_args((2, 4), knobs_of("baseline"))
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr

  def gathers(j, times=1):
    n = 0
    for e in j.eqns:
      n += times * (e.primitive.name == "all_gather" and e.params["axis_name"] == ("fsdp",))
      n += sum(gathers(s, times * e.params.get("length", 1)) for s in jaxprs_in_params(e.params))
    return n
  live = ledger.totals(program_rows((2, 4), knobs_of("baseline")))[("all-gather", "fsdp")]["count"]
  assert gathers(jaxpr) > live == hand_ledger((2, 4), dict(knobs_of("baseline")))[("all-gather", "fsdp")]["count"]


@pytest.mark.parametrize("preset", ["baseline", pytest.param("deferred_reduce", marks=pytest.mark.slow)])
def test_hsdp_compiled_ledger_equals_program_and_nothing_unplanned(preset):
  """HSDP on 2x2x2: the compiled program holds the traced program's collectives and nothing unplanned; each
  weight's gradient is reduce-scattered over fsdp and then all-reduced over data on the fsdp shard, so the
  data all-reduce moves exactly what the fsdp reduce-scatter does (2 V/2 (2-1)/2 = V (2-1)/2)."""
  from shardlab.analysis import ledger, program
  knobs = knobs_of(preset)
  colls, compiled = compiled_rows((2, 2, 2), knobs)
  assert program.audit(colls)["unplanned"] == []
  prog = program_rows((2, 2, 2), knobs)
  assert ledger.compare(prog, compiled) == []
  t = ledger.totals(compiled)
  assert t[("all-reduce", "data")]["bytes"] == t[("reduce-scatter", "fsdp")]["bytes"] > 0
  assert {key: v["bytes"] for key, v in t.items()} == {
      key: v["bytes"] for key, v in hand_ledger((2, 2, 2), dict(knobs)).items()}


FFN = (("kind", "ffn"),)


def ffn_hand_ledger(mesh_shape, knobs: dict) -> dict:
  """hand_ledger for the FFN-only model (model.kind=ffn): per layer W_in[D, F_tp] and W_out[F_tp, D] only, two
  TP contractions per layer (column, row), no embeddings, norms or vocabulary; the loss is one sum over the
  batch axes and, sequence-parallel, over tensor (its shards of the sequence)."""
  cfg = tiny_config(dict(FFN), **knobs)
  m, s = cfg.model, cfg.schedule
  D, F, NL, L = m.d_model, m.d_ff, m.n_layers, m.seq_len
  Z, X, Y = mesh_shape if len(mesh_shape) == 3 else (1, *mesh_shape)
  sizes = {"data": Z, "fsdp": X, "tensor": Y}
  k = s.microbatches
  b = cfg.train.batch_size // (Z * X) // k
  out = {}
  add = _adder(out, sizes)

  for e in (D * F // Y, F * D // Y):
    if s.grad_reduce == "deferred":
      add("all-gather", "fsdp", NL * e)
      add("reduce-scatter", "fsdp", NL * e)
      add("all-reduce", "data", NL * e // X)
    else:
      add("all-gather", "fsdp", e, NL * (1 + s.reshard_after_forward))
      add("reduce-scatter", "fsdp", e, NL)
      add("all-reduce", "data", e // X, NL)
  act = b * L * D                                     # x[b, L, D] gathered over tensor
  if s.tp == "allreduce":                             # psum per row (forward), per column's input (backward)
    add("all-reduce", "tensor", act, k * 2 * NL)
    add("all-reduce", "data+fsdp", 1, k)
  else:
    if s.tp == "allgather":
      add("all-gather", "tensor", act, k * 2 * NL)
      add("reduce-scatter", "tensor", act, k * 2 * NL)
    else:
      halves = 2 if s.tp == "ring_bidi" else 1
      add("collective-permute", "tensor", act // Y // halves, k * 2 * 2 * NL * (Y - 1) * halves)
    add("all-reduce", "data+fsdp+tensor", 1, k)
  return out


@pytest.mark.parametrize("mesh_shape", MESHES + [(2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_ffn_program_ledger_equals_hand_count(mesh_shape):
  """The FFN-only model, every schedule family, from the traced program: executions and bytes per (kind, axis)."""
  from shardlab.analysis import ledger
  for preset in FAMILIES:
    got = without_arrays(ledger.totals(program_rows(mesh_shape, knobs_of(preset), FFN)))
    assert got == ffn_hand_ledger(mesh_shape, dict(knobs_of(preset))), f"ffn, {preset} on {mesh_shape}"


@pytest.mark.parametrize("preset", ["baseline", "collective_matmul_bidi", "megatron_allreduce"])
def test_ffn_compiled_ledger_equals_program_and_nothing_unplanned(preset):
  """The FFN-only model's compiled program on 2x4 holds the collectives the code placed and nothing else."""
  from shardlab.analysis import ledger, program
  knobs = knobs_of(preset)
  colls, compiled = compiled_rows((2, 4), knobs, FFN)
  assert program.audit(colls)["unplanned"] == []
  assert ledger.compare(program_rows((2, 4), knobs, FFN), compiled) == []
  assert {key: t["bytes"] for key, t in ledger.totals(compiled).items()} == {
      key: t["bytes"] for key, t in ffn_hand_ledger((2, 4), dict(knobs)).items()}


def _row(kind, axis, dtype, n, full, count=1, arrays=1):
  from shardlab.analysis import hlo, ledger
  return ledger.Row(kind, axis, dtype, "fsdp_all_gather", False, n, arrays, count, full, hlo.moved_bytes(kind, full, n))


def test_reconcile_names_each_compiler_rewrite_and_reports_the_rest():
  """The rewrites the H100 and TPU compilers make, each named with its bytes (elements of the whole array
  conserved); a byte no rule pairs, or more executions than placed, stays a difference."""
  from shardlab.analysis import ledger
  placed = [_row("all-gather", "fsdp", "f32", 4, 4096, count=3), _row("reduce-scatter", "fsdp", "f32", 4, 4096),
            _row("reduce-scatter", "tensor", "bf16", 2, 2048, count=2), _row("all-gather", "tensor", "f32", 2, 64)]
  compiled = [_row("all-gather", "fsdp", "bf16", 4, 2048 * 3, arrays=3),             # 3 gathers combined, as bf16
              _row("all-reduce", "fsdp", "f32", 4, 4096),                            # reduce-scatter as all-reduce
              _row("reduce-scatter", "tensor", "bf16", 2, 2048, count=2),
              _row("all-reduce", "tensor", "f32", 2, 64)]                            # a small gather, reduced
  rec = ledger.reconcile(placed, compiled)
  assert rec.differences == [] and rec.unexplained == set()
  got = {(r["rewrite"], r["axis"]): r for r in rec.rewrites}
  assert set(got) == {("dtype narrowed", "fsdp"), ("reduce-scatter as all-reduce", "fsdp"), ("combined", "fsdp"),
                      ("all-gather as all-reduce", "tensor")}
  n = got[("dtype narrowed", "fsdp")]
  assert (n["program"]["bytes"], n["compiled"]["bytes"]) == (3 * 3072, 3 * 1536) and n["elements"] == 3 * 1024
  r = got[("reduce-scatter as all-reduce", "fsdp")]
  assert r["compiled"]["bytes"] == 2 * r["program"]["bytes"] == 2 * 3072
  assert got[("combined", "fsdp")]["program"]["executions"] == 4 and got[("combined", "fsdp")]["compiled"] == {
      "executions": 2, "arrays": 4}
  assert ledger.per_axis(placed, compiled)["fsdp"] == {"placed_bytes": 4 * 3072, "compiled_bytes": 3 * 1536 + 6144}

  extra = compiled + [_row("all-to-all", "tensor", "bf16", 2, 64)]                   # nobody placed it
  rec = ledger.reconcile(placed, extra)
  assert rec.unexplained == {"tensor"} and rec.differences == [
      "all-to-all/tensor/bf16: 32 bytes (32 elements) moved that the program did not place",
      "tensor: the compiled program runs 4 collectives per step, the program places 3"]
  summed = ledger.reconcile([_row("all-reduce", "fsdp", "f32", 8, 4, count=3)],
                            [_row("all-reduce", "fsdp", "f32", 8, 8)])
  assert summed.differences == [] and summed.rewrites[0]["rewrite"] == "all-reduce on fewer elements"
  assert summed.rewrites[0]["elements"] == 1 and summed.rewrites[0]["program"]["bytes"] == 7   # 3 scalars reduced as 2
  # libtpu's padded all-reduce-scatter: V = 64 rows over 4 as 4 x 17 padded rows, 4 rows realigned by a permute
  rs = [_row("reduce-scatter", "fsdp", "f32", 4, 4 * 64)]
  padded = [_row("all-reduce", "fsdp", "f32", 4, 4 * 68), _row("collective-permute", "fsdp", "f32", 4, 4 * 4)]
  rec = ledger.reconcile(rs, padded)
  assert rec.differences == [] and [r["rewrite"] for r in rec.rewrites] == [
      "reduce-scatter as all-reduce", "reduce-scatter padded to equal shards", "reduce-scatter's rows realigned"]
  too_much = [_row("all-reduce", "fsdp", "f32", 4, 4 * 64), _row("collective-permute", "fsdp", "f32", 4, 4 * 32)]
  assert ledger.reconcile(rs, too_much).differences                                 # more than a shard: reported
  missing = ledger.reconcile(placed, compiled[:2])                                  # the tensor axis dropped
  assert missing.unexplained == {"tensor"} and all("placed that" in d for d in missing.differences)
  # libtpu gathering the ring's positions once more than placed (beside a Mosaic kernel): named, counted
  gathers = [_row("all-gather", "context", "s32", 8, 8192, count=4)]
  again = ledger.reconcile(gathers, [_row("all-gather", "context", "s32", 8, 8192, count=5)])
  assert again.differences == [] and [(r["rewrite"], r["elements"]) for r in again.rewrites] == [("duplicated", 2048)]
  half = ledger.reconcile(gathers, [_row("all-gather", "context", "s32", 8, 8192, count=4),
                                    _row("all-gather", "context", "s32", 8, 4096)])   # not a whole placed array
  assert half.unexplained == {"context"}
  # an all-reduce nobody placed beside a placed scalar one (the gradient norm's psum): not 4096 runs of that
  # scalar "duplicated" (any leftover divides by 1 element), but bytes the program did not place
  norm = [_row("all-gather", "fsdp", "f32", 4, 4096, count=3), _row("all-reduce", "fsdp", "f32", 4, 4)]
  inserted = ledger.reconcile(norm, [*norm, _row("all-reduce", "fsdp", "f32", 4, 64 * 64 * 4)])
  assert inserted.unexplained == {"fsdp"} and not any(r["rewrite"] == "duplicated" for r in inserted.rewrites)
  # a placed all-reduce the compiled program does not run at all (no all-reduce on the axis): dropped, not
  # "on fewer elements" or "combined"
  vocab = [_row("all-gather", "tensor", "f32", 2, 32768, count=10), _row("all-reduce", "tensor", "f32", 2, 512,
                                                                         count=8)]
  dropped = ledger.reconcile(vocab, vocab[:1])
  assert dropped.unexplained == {"tensor"} and dropped.differences == [
      "all-reduce/tensor/f32: 4096 bytes (1024 elements) placed that the compiled program does not move"]


def test_a_loop_invariant_gather_run_once_is_hoisted():
  """A gather placed in every layer of a scan on an operand the loop does not change (the context strategies'
  positions: 2 layers, one gather each), which the compiler runs once: `hoisted`, no difference; a gather run
  fewer times than placed but not in a loop stays a difference."""
  from shardlab.analysis import ledger
  placed = [_row("all-gather", "context", "s32", 8, 128, count=2)]
  rec = ledger.reconcile(placed, [_row("all-gather", "context", "s32", 8, 128)])
  assert rec.differences == [] and [r["rewrite"] for r in rec.rewrites] == ["hoisted", "combined"]
  rec = ledger.reconcile([_row("all-gather", "context", "s32", 8, 128), _row("all-gather", "context", "s32", 8, 128)],
                         [_row("all-gather", "context", "s32", 8, 128)])
  assert rec.unexplained == {"context"}
