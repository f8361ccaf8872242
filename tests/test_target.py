"""Compiling for the real target on this CPU machine (shardlab/target.py): the H100 compiler's program has the
collectives the code placed, at the program's dtypes (no XLA:CPU widening), async start/done pairs whose overlap
is reported, its own memory, and a calibrated prediction; `predict_fn` costs any program.

Needs the CUDA compiler plugin (`pip install "shardlab[cuda12]"`; .ci/run installs it); skipped without it.
"""
import functools
import re
from pathlib import Path

import pytest

pytest.importorskip("jax_cuda12_plugin", reason="target compilation needs the cuda12 extra: pip install 'shardlab[cuda12]'")

from conftest import load_preset, preset_names, tiny_config  # noqa: E402
from shardlab.testing import abstract_batch  # noqa: E402
from shardlab.axes import FSDP  # noqa: E402
from shardlab.composition import resolve  # noqa: E402
from shardlab.trainer import build  # noqa: E402
from shardlab.analysis.confirm import confirm_layouts  # noqa: E402

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md

H100 = None


def h100():
  global H100
  if H100 is None:
    from shardlab.analysis.predict import hardware_preset
    H100 = hardware_preset("h100")
  return H100


@functools.lru_cache(maxsize=None)
def target_grads(mesh_shape: tuple, knobs: tuple, compute: str = "float32"):
  """(Program of the grad step compiled for 8 x H100, the traced program's ledger rows, the mesh)."""
  from shardlab import target as TG
  from shardlab.analysis.program import Program
  lowered, program, mesh = lowered_grads(mesh_shape, knobs, compute)
  return Program.of(TG.compile_(lowered), mesh), program, mesh


@functools.lru_cache(maxsize=None)
def lowered_grads(mesh_shape: tuple, knobs: tuple, compute: str = "float32"):
  """(The grad step lowered for 8 x H100, the traced program's ledger rows, the mesh)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from shardlab import params as PM, schedules, target as TG, train as T
  from shardlab.analysis import ledger
  from shardlab.mesh import make_mesh
  cfg = tiny_config(**dict(knobs))
  mesh = make_mesh(*mesh_shape, TG.mesh_devices(TG.devices(h100(), 8), mesh_shape))
  decls = PM.declare(cfg.model)
  fn = T.make_grad_fn(resolve(cfg), schedules.build(cfg.schedule, cfg.model, getattr(jnp, compute)), decls, mesh)
  params = jax.tree.map(lambda d: jax.ShapeDtypeStruct(d.shape, jnp.float32, sharding=NamedSharding(mesh, d.spec())),
                        decls, is_leaf=PM.is_param)
  tokens = abstract_batch(cfg.train.batch_size, cfg.model.seq_len, mesh)
  program = ledger.from_program(jax.make_jaxpr(fn)(params, tokens))
  return fn.lower(params, tokens), program, mesh


def knobs_of(preset: str) -> tuple:
  return tuple(sorted((k, v) for k, v in load_preset(preset).items() if k != "name"))


EXPLICIT = [p for p in preset_names() if load_preset(p).get("impl", "explicit") == "explicit"]


@pytest.mark.parametrize("preset", EXPLICIT)
def test_target_ledger_equals_program(preset):
  """Every byte the code placed, and nothing else, in the H100 program: bytes and arrays per kind, axis and dtype
  equal the traced program's (executions may only drop, where the GPU combiner merged collectives); every
  collective is planned, or a combination of planned ones; async collectives are one collective each, and no two
  are in flight at once."""
  from shardlab.analysis import costmodel, ledger
  prog, program, _ = target_grads((2, 4), knobs_of(preset))
  assert prog.platform == "gpu" and prog.scheduled
  rows = ledger.from_hlo(prog.collectives)
  assert ledger.compare(program, rows) == []
  audit = costmodel.reconcile_audit(prog.audit(), ledger.reconcile(program, rows), prog)
  assert audit["unplanned"] == []
  assert len(prog.async_pairs()) == len(prog.collectives)   # every collective: one start/done pair
  _assert_one_collective_in_flight(prog, preset)


def test_bf16_collectives_stay_bf16():
  """XLA:CPU widens bf16 collectives to f32 (twice the bytes); the GPU program keeps them bf16."""
  from shardlab.analysis import ledger
  prog, program, _ = target_grads((4, 2), knobs_of("fsdp_prefetch") + (("gather_dtype", "compute"),), "bfloat16")
  rows = ledger.from_hlo(prog.collectives)
  assert ledger.compare(program, rows) == []
  gathers = ledger.totals(rows, ("kind", "axis", "dtype"))
  assert ("all-gather", "fsdp", "bf16") in gathers and ("all-gather", "fsdp", "f32") not in gathers


def _loop_gathers(prog):
  return [p for p in prog.async_pairs() if p.coll.kind == "all-gather" and p.coll.axis == "fsdp" and p.in_loop]


def test_overlap_baseline_vs_prefetch():
  """What XLA's GPU scheduler does with the hand-placed FSDP gathers of the layer loops (8x1, 4 layers), pinned:
  in `baseline` each layer's gather feeds that layer's first matmul, so no matmul runs between its start and done.
  With `fsdp_prefetch` the forward loop's gather of layer l+1 encloses layer l's matmuls (the overlap prefetch
  claims), but at this size the backward loop's re-gather encloses none, and the report lists it under
  `not_realized`. Not a data dependency: XLA's latency-hiding scheduler overlaps an async collective only as far
  as its own cost estimate needs, and a tiny gather needs none; at D=1024 the same re-gather encloses 8 matmuls
  (experiments/overlap/)."""
  base, _, _ = target_grads((8, 1), knobs_of("baseline"))
  pre, _, _ = target_grads((8, 1), knobs_of("fsdp_prefetch"))
  b, p = _loop_gathers(base), _loop_gathers(pre)
  assert b and all(x.gemms == 0 for x in b), [(x.coll.name, x.gemms) for x in b]
  fwd = [x for x in p if "transpose(" not in x.coll.op_name]
  bwd = [x for x in p if "transpose(" in x.coll.op_name]
  assert fwd and all(x.gemms >= 4 for x in fwd), [(x.coll.name, x.gemms) for x in fwd]
  assert bwd and all(x.gemms == 0 for x in bwd), [(x.coll.name, x.gemms) for x in bwd]
  ob, op = base.overlap(), pre.overlap()
  assert ob["by_kind"]["all-gather"]["fsdp"]["with_matmul"] < op["by_kind"]["all-gather"]["fsdp"]["with_matmul"]
  assert op["not_realized"].get("all-gather fsdp (fsdp_all_gather)", 0) > 0


def _assert_one_collective_in_flight(prog, preset):
  """costmodel's one link stream on a switch is XLA's GPU schedule: no two async collectives are in flight at once
  (xla_gpu_experimental_parallel_collective_overlap_limit, default 1), FSDP gathers, rings and reductions alike
  (checked on every explicit preset's program above)."""
  from collections import defaultdict
  spans = defaultdict(list)
  for p in prog.async_pairs():
    spans[p.computation] += [(p.start, 1), (p.done, -1)] if not p.wraps else [(0, 1), (p.done, -1), (p.start, 1)]
  assert spans, preset
  for comp, events in spans.items():
    level, peak = 0, 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
      level += step
      peak = max(peak, level)
    assert peak == 1, f"{preset}: {peak} collectives in flight at once in {comp}"


def test_next_layer_reduce_realizes_the_gradient_reduce_scatter_overlap():
  """fsdp_prefetch's gradient reduce-scatters are exposed: each is written into the gradient stack in its own
  backward iteration, so XLA's scheduler has nothing to put between its start and done. grad_reduce=next_layer
  (the schedule fix: issue it one iteration later) lets the scheduler put the next layer's backward matmuls
  there, on the same 8x1 H100 program (prefetch 1 in both)."""
  pre = target_grads((8, 1), knobs_of("fsdp_prefetch"))[0].overlap()["by_kind"]["reduce-scatter"]["fsdp"]
  late = dict(knobs_of("next_layer_reduce"), prefetch=1)
  nxt = target_grads((8, 1), tuple(sorted(late.items())))[0].overlap()["by_kind"]["reduce-scatter"]["fsdp"]
  assert pre["with_matmul"] == 0, pre
  assert nxt["with_matmul"] >= 2 and nxt["matmuls_between"] >= 2, nxt


def test_calibrated_prediction_and_memory():
  """The calibrated replay of the target's order is slower than its peak-rate ceiling, and each of its parts is
  counted; memory comes from the GPU compiler."""
  from shardlab.analysis import costmodel
  prog, program, mesh = target_grads((8, 1), knobs_of("fsdp_prefetch"))
  pred, evs = costmodel.predict(prog, mesh, h100(), {}, 1e9, program)
  assert pred["model"].startswith("calibrated") and evs
  assert pred["t_overlapped_s"] > pred["scheduled_order_at_peak_s"] > 0
  assert pred["t_overlapped_s"] >= pred["t_compute_s"]
  assert pred["t_overlapped_s"] <= pred["t_serial_s"] + 1e-12
  assert pred["t_compute_s"] == pytest.approx(pred["t_gemm_s"] + pred["t_other_kernels_s"])
  # no fused attention kernel in this program (plain attention): every priced matmul is a GEMM's
  assert pred["t_attention_kernels_s"] == 0 and pred["t_matmul_s"] == pred["t_gemm_s"] > 0
  assert pred["t_comm_s"]["fsdp"] > 0
  m = prog.memory()
  assert m["peak"] > m["argument"] > 0


def test_predict_fn_collective_matmul():
  """predict_fn on the all-gather + matmul of the JAX Pallas collective-matmul doc (8 x H100): the gather moves
  (n-1)/n of A in bf16, and the prediction holds the compute and the communication."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from shardlab.analysis import predict_fn

  def build(mesh):
    f = jax.shard_map(lambda a, b: jax.lax.all_gather(a, "x", tiled=True) @ b, mesh=mesh,
                      in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
    return jax.jit(f), (jax.ShapeDtypeStruct((8 * 1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("x"))),
                        jax.ShapeDtypeStruct((4096, 8 * 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x"))))
  r = predict_fn(build, hardware="h100", axes={"x": 8})
  assert r["target"]["devices"] == 8 and r["target"]["platform"] == "gpu"
  assert r["collectives"]["all-gather"]["x"]["bf16"]["bytes"] == 8 * 1024 * 4096 * 2 * 7 // 8
  flops = 2 * 8 * 1024 * 4096 * 4096
  assert r["flops_per_device"] == flops
  assert r["t_compute_s"] > flops / 9.9e14 and r["t_comm_s"]["x"] > 0
  assert max(r["t_compute_s"], r["t_comm_s"]["x"]) <= r["t_overlapped_s"] <= r["t_serial_s"] + 1e-12
  assert r["memory"]["peak"] > 0
  for k in ("t_serial_s", "t_overlapped_s", "t_compute_s", "t_comm_s", "memory", "collectives"):
    assert k in r


def test_missing_extra_is_one_line(monkeypatch):
  import importlib.util
  from shardlab import target as TG
  from shardlab.mesh import ConfigError
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
  from shardlab.analysis.predict import hardware_preset
  with pytest.raises(ConfigError, match=r'pip install "shardlab\[tpu\]"'):
    TG.check(hardware_preset("tpu_v5p"), 8)
  with pytest.raises(ConfigError, match="describes no real target"):
    TG.check(hardware_preset("cpu"), 8)


def memory_numbers(compiled) -> list:
  """Every `*_in_bytes` figure of a compiled program's memory_analysis()."""
  m = compiled.memory_analysis()
  return [getattr(m, k) for k in dir(m) if k.endswith("_in_bytes")]


def test_the_suite_skips_the_gpu_assembler_and_reads_the_same_program(monkeypatch, tmp_path):
  """SHARDLAB_GPU_ASSEMBLER=none (tests/conftest.py): the H100 compiler's program without ptxas is the one with it,
  HLO text and memory alike, and the assembler did not run for its kernels. (Both compiled here: a compile of the
  same lowering made in target_grads differed in its HLO text's stack-frame tables.)"""
  from shardlab import target as TG
  lowered = lowered_grads((8, 1), knobs_of("fsdp_prefetch"), "float32")[0]   # the overlap tests' lowering (cached)
  assert TG.no_assembler_dir()
  skipped = Path(TG.no_assembler_dir()) / "bin" / "skipped"
  before = skipped.read_text().count("\n") if skipped.exists() else 0
  monkeypatch.setenv(TG.ASSEMBLER_ENV, "none")
  fast = TG.compile_(lowered, {"xla_gpu_kernel_cache_file": str(tmp_path / "a.bin")})
  assert skipped.read_text().count("\n") > before + 20      # one line per kernel the assembler did not build
  monkeypatch.delenv(TG.ASSEMBLER_ENV)
  real = TG.compile_(lowered, {"xla_gpu_kernel_cache_file": str(tmp_path / "b.bin")})
  assert fast.as_text() == real.as_text()
  assert memory_numbers(fast) == memory_numbers(real)
  # the stub's empty kernels are cached apart from the process's kernel cache, which compiles with the
  # assembler read (a Pallas kernel compiled after them is assembled, not taken from the stub's)
  monkeypatch.setattr(TG, "compile_with", lambda lowered, flags: flags)
  assert TG.compile_(lowered)["xla_gpu_kernel_cache_file"] == TG.kernel_cache_file()
  monkeypatch.setenv(TG.ASSEMBLER_ENV, "none")
  stub = TG.compile_(lowered)
  assert stub["xla_gpu_kernel_cache_file"] != TG.kernel_cache_file()
  assert Path(stub["xla_gpu_kernel_cache_file"]).parent == Path(stub["xla_gpu_cuda_data_dir"]) == Path(TG.no_assembler_dir())


def test_assembler_less_compiles_share_their_kernels_through_the_sessions_snapshot(monkeypatch, tmp_path):
  """SHARDLAB_GPU_STUB_KERNELS (tests/conftest.py): a process's first assembler-less compile starts from the
  session's snapshot of stub kernels and publishes its own when it holds more; a compile that reuses them
  generates fewer kernels and reads the same program, HLO text and memory alike."""
  from shardlab import target as TG
  snapshot = tmp_path / "snapshot.bin"
  monkeypatch.setenv(TG.STUB_KERNELS_ENV, str(snapshot))
  monkeypatch.setenv(TG.ASSEMBLER_ENV, "none")
  lowered = lowered_grads((2, 4), knobs_of("baseline"), "float32")[0]

  def compile_in_a_fresh_process():     # a process of its own, as far as the stub and its kernels go
    monkeypatch.setattr(TG, "_NO_ASSEMBLER", [])
    seeded = snapshot.read_bytes() if snapshot.exists() else None
    compiled = TG.compile_(lowered)    # a new stub dir: new options, so compiled again
    skipped = Path(TG.no_assembler_dir()) / "bin" / "skipped"
    return compiled, seeded, skipped.read_text().count("\n") if skipped.exists() else 0

  cold, seeded, built = compile_in_a_fresh_process()
  published = snapshot.read_bytes()
  assert seeded is None and published and built > 10
  warm, seeded, rebuilt = compile_in_a_fresh_process()
  assert seeded == published and rebuilt < built // 2, (built, rebuilt)
  assert warm.as_text() == cold.as_text() and memory_numbers(warm) == memory_numbers(cold)


def test_topologies():
  from shardlab import target as TG
  from shardlab.analysis.predict import hardware_preset
  from shardlab.mesh import ConfigError
  assert TG.topology(h100(), 8) == "1x1x8" and TG.topology(h100(), 64) == "1x8x8" and TG.topology(h100(), 2) == "1x1x2"
  assert TG.topology(hardware_preset("tpu_v5p"), 64) == "v5p:4x4x4"
  assert TG.topology(hardware_preset("tpu_v5e"), 8) == "v5e:2x4"   # libtpu 0.0.42's name ("TPU v5 lite" devices)
  with pytest.raises(ConfigError, match="whole nodes"):
    TG.topology(h100(), 12)


def _target_presets():
  from shardlab.config import CONF_DIR
  import yaml
  return sorted(p.stem for p in (CONF_DIR / "hardware").glob("*.yaml")
                if yaml.safe_load(p.read_text()).get("target_platform"))


@pytest.mark.parametrize("preset", _target_presets())
def test_every_target_preset_compiles_a_tiny_step_for_its_own_target(preset, tmp_path):
  """compile_for=target dry runs on every hardware preset that names a target (h100, h200, h100_multinode,
  tpu_v5p, tpu_v5e): the step compiles with that target's compiler and is analyzed, and the ledger explains
  every byte the compiler changed. bf16 with f32 master weights: both compilers gather the weights as bf16 (the
  convert moved in front of the all-gather); libtpu also reduces some reduce-scatters and small all-gathers
  as all-reduces, and splits a collective over fused continuations (one chain, counted once)."""
  import importlib.util
  from conftest import compose
  from shardlab.config import to_config
  from shardlab.trainer import train
  cfg = to_config(compose(f"hardware={preset}", "compile_for=target", "dry_run=true", "progress=false",
                          "figures=false", "precision=bf16", "schedule=fsdp_prefetch"))
  if importlib.util.find_spec("libtpu" if cfg.hardware.target_platform == "tpu" else "jax_cuda12_plugin") is None:
    pytest.skip(f"hardware={preset} compiles with the {cfg.hardware.target_platform} extra, not installed")
  summary = train(cfg, tmp_path / "run")
  assert summary["status"] == "ok" and summary["target"]["devices"] == 8, summary.get("target")
  led = summary["ledger"]
  assert led["differences"] == [] and summary["audit"]["unplanned"] == [], (led, summary["audit"])
  narrowed = [r for r in led["rewrites"] if r["rewrite"] == "dtype narrowed" and r["axis"] == FSDP]
  assert narrowed and narrowed[0]["program"]["dtype"] == "f32" and narrowed[0]["compiled"]["dtype"] == "bf16"
  assert narrowed[0]["compiled"]["bytes"] * 2 == narrowed[0]["program"]["bytes"]
  axes = led["per_axis"]
  assert axes[FSDP]["compiled_bytes"] < axes[FSDP]["placed_bytes"]
  # the matmuls are costed as matmuls on every target (libtpu's are convolutions: hlo.conv_flops)
  pred = summary["prediction"]
  assert pred["t_gemm_s"] > 0 and pred["ceiling"]["matmul_flops_per_device"] > 0, pred
  # the compiler's own buffer assignment was read: its parameters are memory_analysis()'s arguments; on the GPU
  # its total is memory_analysis()'s peak; libtpu's memory_analysis() differs from its assignment (on v5e it
  # reports no temporaries at all), and `fits` is judged on the larger of the two
  mem = summary["memory"]
  held = mem["allocated"]
  assert held["parameter"] == mem["argument"] and held["temp"] > 0, mem
  if cfg.hardware.target_platform == "cuda":
    assert abs(held["total"] - mem["peak"]) <= held["other"], mem
  assert mem["components"]["allocated"]["compiled"] == held["total"]
  assert mem["headroom_bytes"] == cfg.hardware.hbm_bytes - max(mem["peak"], held["total"])
  from shardlab.run import numbers          # what the dry run prints: the target's memory against HBM, named
  lines = numbers(summary)
  assert lines[0].startswith(f"shardlab: prediction for {preset} (calibrated model over the ")
  assert "fits" in lines[1] and "compiled for" in lines[1] and "in its buffer assignment" in lines[1]
  assert "exposed communication" in lines[2]


def test_the_context_search_answer_runs_as_printed_and_its_memory_is_the_compilers(tmp_path):
  """The context search's answer for llama3_8b at 32K tokens on 8 H100s (8 sequences, remat=full, cuDNN's
  attention): the settings it prints, added to the question's, run as a compile_for=target dry run (the H100
  compiler, deviceless), and the memory it predicted for them is within 10% of that compiler's peak."""
  from conftest import compose
  from shardlab.config import to_config
  from shardlab.plan import run
  from shardlab.trainer import train
  base = ["model=llama3_8b", "model.seq_len=32768", "train.batch_size=8", "mesh.fsdp=8", "mesh.tensor=1",
          "precision=bf16", "model.attention=dot_product", "schedule.remat=full", "hardware=h100"]
  ctx = run([*base, "context_search=true"])["context"]
  best = ctx["candidates"][0]
  assert best["label"] == ctx["best"]
  cfg = to_config(compose(*base, *best["overrides"], "compile_for=target", "dry_run=true", "progress=false",
                          "figures=false"))
  summary = train(cfg, tmp_path / "run")
  assert summary["status"] == "ok" and summary["target"]["platform"] == "gpu"
  compiled = summary["memory"]["peak"]
  assert abs(best["memory_bytes"] / compiled - 1) < 0.10, (best["memory_bytes"], compiled)


def test_usp_compiles_for_h100_with_its_groups_and_every_byte_placed(tmp_path):
  """context=usp with U = 2 of context 4 (zigzag) compiled for 8 H100s (fsdp 2 x context 4): Ulysses' all-to-alls
  run within pairs of context ranks, the ring's shifts within rings of 2, their bytes the hand count (U = 2's
  all-to-alls and R = 2's ring; tests/test_context.py checks the group sizes), and the ledger explains every
  compiled byte, nothing unplanned; with the two collectives in flight the ring asks for on a GPU, every ring shift
  runs behind the step that issues it, the last lone dK/dV too (at one in flight it did not; the sums' trip home
  after the last step, which has no step to hide behind, is not counted here)."""
  from conftest import compose
  from shardlab.config import to_config
  from shardlab.trainer import train
  cfg = to_config(compose("hardware=h100", "compile_for=target", "dry_run=true", "progress=false", "figures=false",
                          "mesh.fsdp=2", "mesh.context=4", "mesh.tensor=1", "model.seq_len=256", "model.d_model=256",
                          "model.n_heads=4", "precision=bf16", "context=usp", "context.ulysses=2",
                          "context.load_balance=true"))
  summary = train(cfg, tmp_path / "run")
  assert summary["status"] == "ok" and summary["target"]["platform"] == "gpu"
  assert not summary["audit"]["unplanned"] and not summary["ledger"]["differences"], (summary["audit"],
                                                                                     summary["ledger"]["differences"])
  comm = summary["comm"]
  assert comm["all-to-all"]["context"]["count"] == 2 * 4 * cfg.model.n_layers, comm["all-to-all"]
  # the bytes of a2a within pairs and shifts within rings of 2: the hand count (bf16; dK/dV summed in float32)
  from shardlab.analysis import context_cost as CC
  a = CC.attn_of(cfg.model, cfg.train.batch_size // 2, 4, 1, e=2)
  want = cfg.model.n_layers * sum(CC.bytes_per_layer("usp", a).values())
  got = comm["all-to-all"]["context"]["bytes"] + comm["collective-permute"]["context"]["bytes"]
  assert got == want, (got, want)
  # the ring's two collectives in flight (Ring.compiler_options), beside nothing the run asked for
  assert summary["target"]["compiler_options"] == {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
  rows = summary["overlap"]["ring_steps"]
  steps = [r for r in rows if r["can_hide_behind"] is not None]
  assert steps and all(r["hidden"] for r in steps), rows


@pytest.mark.parametrize("preset,mesh", [("h100_multinode", "mesh.pipeline=2 mesh.fsdp=1 mesh.tensor=8"),
                                         ("tpu_v5p", "mesh.pipeline=2 mesh.fsdp=2 mesh.tensor=2")])
def test_pipeline_compiles_across_h100_nodes_and_on_a_v5p_slice(preset, mesh, tmp_path):
  """A pipeline run compiled by the target's compiler: 2 H100 nodes with a stage per node (16 GPUs), and a v5p
  slice; its sends over `pipeline` are in the compiled program and the table's prediction is written."""
  import importlib.util
  from conftest import compose
  from shardlab.config import to_config
  from shardlab.trainer import train
  cfg = to_config(compose(f"hardware={preset}", "compile_for=target", "dry_run=true", "progress=false",
                          *mesh.split(), "model.n_layers=4", "pipeline=1f1b", "pipeline.microbatches=4"))
  if importlib.util.find_spec("libtpu" if cfg.hardware.target_platform == "tpu" else "jax_cuda12_plugin") is None:
    pytest.skip(f"hardware={preset} compiles with the {cfg.hardware.target_platform} extra, not installed")
  summary = train(cfg, tmp_path / "run")
  assert summary["status"] == "ok" and summary["target"]["devices"] == cfg.mesh.n_devices, summary.get("target")
  assert summary["comm"]["collective-permute"]["pipeline"]["count"] > 0, summary["comm"]
  pred = summary["pipeline_prediction"]
  assert pred["stages"] == 2 and pred["microbatches"] == 4 and 0 < pred["bubble"] < 1 and pred["slot_s"]["B"] > 0
  # each slot's exposed communication (the tensor-parallel transfers inside it) is a part of that slot's time; on
  # this tiny model the F and B slots wait for their TP transfers (0.47 of 0.67 ms in F on the H100 nodes)
  ex = pred["slot_exposed_comm_s"]
  assert set(ex) == {"F", "B", "W", "head"} and all(0 <= ex[k] <= pred["slot_s"][k] for k in ex), (ex, pred["slot_s"])
  assert ex["F"] > 0 and ex["B"] > 0, ex
  assert (tmp_path / "run" / "pipeline.png").is_file()
  # one prediction: the printed step is the picture's (the table replayed with each slot timed by the calibrated
  # replay of its compiled branch), not below one device's program walked with its ticks back to back
  step = summary["prediction"]
  assert step["t_overlapped_s"] == pred["step_s"] and step["model"].startswith("calibrated")
  assert pred["step_s"] >= 0.95 * step["t_device_program_s"], (pred["step_s"], step["t_device_program_s"])
  from shardlab.outputs import human_seconds
  from shardlab.run import numbers
  assert f"step time           {human_seconds(pred['step_s'])} predicted" in numbers(summary)[2]


_SMALL: dict = {}


def small_target(schedule: str, mesh: dict | None = None, pipeline: dict | None = None,
                 context: dict | None = None, **model):
  """A small bf16 transformer's train step compiled for 4x2 H100 (Config built directly, no Hydra): its
  composition, the compiled step and one layer's traced residual bytes. `mesh`, `pipeline`, `context`: MeshConfig,
  PipelineConfig and ContextConfig settings instead of fsdp=4 x tensor=2, none and all_gather. Compiled once per
  worker for each set of arguments (the memory test's program is the folded-loop test's too)."""
  import json
  key = json.dumps([schedule, mesh, pipeline, context, model], sort_keys=True)
  if key not in _SMALL:
    _SMALL[key] = _small_target(schedule, mesh, pipeline, context, **model)
  return _SMALL[key]


def _small_target(schedule: str, mesh: dict | None, pipeline: dict | None, context: dict | None, **model):
  from conftest import load_preset
  from shardlab import target as TG
  from shardlab.composition import resolve
  from shardlab.config import (Config, ContextConfig, MeshConfig, ModelConfig, PipelineConfig, PrecisionConfig,
                               ScheduleConfig, TrainConfig)
  from shardlab.run import build, lower
  m = {"d_model": 256, "d_ff": 1024, "n_layers": 4, "n_heads": 4, "vocab_size": 1024, "seq_len": 256,
       "attention": "blockwise", "attention_block": 128, **model}
  knobs = {k: v for k, v in load_preset(schedule).items()}
  cfg = Config(mesh=MeshConfig(**(mesh or {"fsdp": 4, "tensor": 2})), model=ModelConfig(**m),
               schedule=ScheduleConfig(**knobs), pipeline=PipelineConfig(**(pipeline or {})),
               context=ContextConfig(**(context or {})),
               train=TrainConfig(batch_size=16), precision=PrecisionConfig(param_dtype="float32", compute_dtype="bfloat16"),
               hardware=h100())
  b = build(cfg, TG.mesh_devices(TG.devices(h100(), 8), tuple(cfg.mesh.shape.values())))
  import os
  # a context split runs the ring's Pallas (Triton) kernels: they go through NVIDIA's assembler, as in a run
  was = os.environ.pop(TG.ASSEMBLER_ENV, None) if context else None
  try:
    compiled = TG.compile_(lower(b))
  finally:
    if was is not None:
      os.environ[TG.ASSEMBLER_ENV] = was
  return resolve(cfg), compiled, b["layer_residuals"]


@pytest.mark.parametrize("schedule", ["baseline", "megatron_allreduce", "collective_matmul", "prefetch_ring"])
def test_target_memory_explained_by_the_analytic_breakdown(schedule):
  """The H100 compiler's memory_analysis() of a small bf16 transformer on 4x2 (experiments/validate/memory.py's
  configuration, which runs every preset) against memory_model.breakdown with one layer's residuals read off the
  trace (and the cuBLAS workspaces the program declares, 8 MiB under the prefetching preset, where the compiler
  picks split-K GEMMs for the small weight gradients): the training state exactly, the working memory
  (temporaries) and the peak within 10%. Without the trace
  (the per-token estimate the planner uses) it is 20-40% short here: the estimate divides every activation by
  `tensor` and counts it at the compute dtype."""
  from shardlab.analysis import memory_model
  from shardlab.analysis.program import memory
  cfg, compiled, residuals = small_target(schedule)
  assert residuals and residuals["unremat"] >= residuals["saved"] > 0
  workspace = memory_model.gemm_workspace_bytes(compiled.as_text())
  got = memory_model.compare(cfg, memory(compiled), residuals, workspace)
  parts = got["components"]
  assert got["activations_from"] == "traced residuals"
  assert abs(parts["state"]["error"]) < 1e-3, parts
  assert abs(parts["working"]["error"]) < 0.10 and abs(parts["peak"]["error"]) < 0.10, parts
  estimate = memory_model.compare(cfg, memory(compiled))["components"]
  assert estimate["working"]["error"] < -0.15, estimate


@pytest.mark.parametrize("schedule", ["baseline", "collective_matmul_bidi"])
def test_ffn_target_memory_explained_by_the_analytic_breakdown(schedule):
  """The same for the FFN-only model (model.kind=ffn, D=1024, F=4096: experiments/validate/memory.py's), where the
  weight gradients outweigh the activations: the ring's backward keeps one partial weight gradient per ring step
  (4 on a tensor axis of 2 in half-blocks), which memory_model counts in layer_gradient."""
  from shardlab.analysis import memory_model
  from shardlab.analysis.program import memory
  cfg, compiled, residuals = small_target(schedule, kind="ffn", d_model=1024, d_ff=4096, attention="plain")
  got = memory_model.compare(cfg, memory(compiled), residuals)
  parts = got["components"]
  assert abs(parts["state"]["error"]) < 1e-3, parts
  assert abs(parts["working"]["error"]) < 0.10 and abs(parts["peak"]["error"]) < 0.10, parts
  # The ring's partial weight gradients are what closes the gap: without them the working memory is >10% short.
  plain = memory_model.breakdown(cfg.replace(schedule={"tp": "allgather"}), residuals)
  short = (plain["total"] - plain["master_params"] - plain["optimizer"]) / parts["working"]["compiled"] - 1
  if schedule == "collective_matmul_bidi":
    assert short < -0.10, (short, parts)
  else:
    assert plain == got["analytic"]


def test_pipeline_stage_memory_1f1b_below_gpipe_and_explained():
  """Pipeline stages on the H100 compiler (2 stages x tensor 4, M = 4P = 8 microbatches): 1f1b's working
  memory per device clearly below gpipe's (its stage 0 holds P microbatches of residuals, gpipe's M), and both
  within 10% of memory_model.breakdown, which sizes the stage's buffers from the executor's own allocation of the
  table (pipeline_buffers), and counts the chunk's stacked weight gradient a slot's backward returns. (Weights
  of at least a million elements per device: smaller ones get the GPU compiler's split-K partials, which the model
  leaves out.)"""
  from shardlab.analysis import memory_model
  from shardlab.analysis.program import memory
  work = {}
  for name in ("gpipe", "1f1b"):
    cfg, compiled, residuals = small_target("baseline", mesh={"pipeline": 2, "fsdp": 1, "tensor": 4},
                                            pipeline={"name": name, "impl": name, "microbatches": 8},
                                            d_model=1024, d_ff=4096, n_heads=8)
    got = memory_model.compare(cfg, memory(compiled), residuals)
    parts = got["components"]
    assert got["activations_from"] == "traced residuals"
    assert abs(parts["state"]["error"]) < 1e-3, parts
    assert abs(parts["working"]["error"]) < 0.10 and abs(parts["peak"]["error"]) < 0.10, (name, parts)
    assert memory_model.pipeline_buffers(cfg)["res"] == {"gpipe": 8, "1f1b": 2}[name]   # M, P: no slot to spare
    work[name] = parts["working"]["compiled"]
  assert work["1f1b"] < 0.75 * work["gpipe"], work


def test_ring_shifts_run_behind_their_steps_and_memory_is_explained():
  """Ring attention compiled for 8 H100s (fsdp 2 x context 4, bf16, 256 tokens in sub-blocks of 32): every byte
  over `context` is a placed K/V or dK/dV shift or the positions' gather; the overlap report's `ring_steps` shows
  every shift with its own ring step's attention scheduled between start and done, forward and backward, under
  the GPU compiler's default of one collective in flight (a backward step's K/V and the dK/dV before it travel in
  one collective); the memory within 10% of memory_model.breakdown."""
  import numpy as np
  from shardlab import target as TG
  from shardlab.analysis import memory_model
  from shardlab.analysis.program import Program, memory
  cfg, compiled, residuals = small_target("baseline", mesh={"fsdp": 2, "context": 4, "tensor": 1},
                                          context={"name": "ring", "impl": "ring"}, attention_block=32)
  devs = TG.mesh_devices(TG.devices(h100(), 8), tuple(cfg.mesh.shape.values()))
  prog = Program(compiled.as_text(), np.vectorize(lambda d: d.id)(devs), tuple(cfg.mesh.shape), "gpu", compiled)
  # over context besides the weight gradients' sums (all-reduces the GPU combiner merges: the run's audit
  # names them `combined`): K/V in bf16, dK/dV summed in float32 (with K/V's bits beside them, as float32 words)
  # and sent home in bf16, the positions
  over = {(c.kind, c.dtype, c.scope) for c in prog.collectives if c.axis == "context" and c.kind != "all-reduce"}
  assert over == {("collective-permute", "bf16", "cp_ring"), ("collective-permute", "f32", "cp_ring_kv_grad"),
                  ("collective-permute", "f32", "cp_ring_grad"), ("collective-permute", "bf16", "cp_ring_home"),
                  ("all-gather", "s32", "cp_positions")}, over
  rows = prog.overlap()["ring_steps"]
  forward = [r for r in rows if r["pass"] == "forward"]
  assert sorted(r["step"] for r in forward) == [0, 1, 2] and all(r["hidden"] for r in forward), forward
  backward = [r for r in rows if r["pass"] == "backward"]
  assert sorted((r["step"], r["shift"]) for r in backward) == [
      (0, "K/V"), (1, "K/V + dK/dV"), (2, "K/V + dK/dV"), (3, "dK/dV"), (3, "dK/dV home")], backward
  assert all(r["hidden"] for r in backward), backward
  got = memory_model.compare(cfg, memory(compiled), residuals)["components"]
  assert abs(got["working"]["error"]) < 0.10 and abs(got["peak"]["error"]) < 0.10, got


def test_the_ring_runs_its_pallas_kernels_on_the_gpu_target():
  """context.kernel=auto (the default): in the program compiled for the H100 target every ring step is
  shardlab's Pallas kernels (flash_kernel.py: Triton custom calls, forward, backward dK/dV and dQ), and no pure-JAX
  ring is left; each states its FLOPs, the block pairs of the busiest device (kernel_pairs) times a pair's
  matmuls, which the cost model reads as an attention kernel's. The same compiled step as
  test_ring_shifts_run_behind_their_steps_and_memory_is_explained (shifts hidden, memory explained)."""
  import re
  from shardlab import flash_kernel as F
  from shardlab.analysis import hlo
  from shardlab.schedules.context import kernel_pairs
  cfg, compiled, _ = small_target("baseline", mesh={"fsdp": 2, "context": 4, "tensor": 1},
                                  context={"name": "ring", "impl": "ring"}, attention_block=32)
  comps, _ = hlo.parse(compiled.as_text())
  calls = [i for c in comps.values() for i in c if hlo.stated_flops(i) is not None]
  assert calls and all('custom_call_target="__gpu$xla.gpu.triton"' in i.attrs for i in calls)
  assert not any(re.search(r"ring_(fwd|bwd)_step", i.op_name) and i.opcode == "while"
                 for c in comps.values() for i in c)                    # the pure ring's scans are gone
  b, h, local, k = 16 // 2, 4, 256 // 4, 64        # per device: batch over fsdp, every head, L / C tokens
  pairs = kernel_pairs(4, local, None)
  per_pair = {"fwd": 4, "bwd_dkv": 8, "bwd_dq": 6}  # FLOPs per (query, key, head dim) element of a visited pair
  bq, bk = min(F.BLOCK_Q, local), min(F.BLOCK_K, local)
  for kind, n in per_pair.items():
    got = sorted({hlo.stated_flops(i) for i in calls if f"shardlab_flash_{kind}_" in i.op_name})
    assert got == sorted({n * b * h * p * bq * bk * k for p in pairs}), (kind, got)
  flops = hlo.flops_fn(comps)
  assert all(hlo.is_attention_call(i) and flops(i, {}) == hlo.stated_flops(i) for i in calls)


def test_the_pallas_kernels_compile_for_the_tpu_target():
  """flash_kernel's Mosaic kernels (forward, backward dK/dV and dQ) compile deviceless for a v5p chip, causal over
  512 tokens, as custom calls named with the FLOPs they state: the 10 of 16 blocks of 128 x 128 on or below the
  diagonal (pair_counts), what the cost model reads."""
  import importlib.util
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from shardlab import flash_kernel as F, target as TG
  from shardlab.analysis import hlo
  from shardlab.analysis.predict import hardware_preset
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("needs the tpu extra: pip install 'shardlab[tpu]'")
  B, L, H, G, K = 1, 512, 4, 2, 128
  pos = jnp.arange(L, dtype=jnp.int32)
  pairs = F.pair_counts(np.arange(L), np.arange(L), F.TPU_BLOCK, F.TPU_BLOCK)
  assert pairs == 10

  def step(q, k, v, do):
    o, lse = F.block_attention_tpu(q, k, v, pos, pos, pairs=pairs)
    delta = jnp.einsum("blhk,blhk->bhl", do.astype(jnp.float32), o)
    return o, F.block_attention_bwd_tpu(q, k, v, pos, pos, lse, do, delta, pairs=pairs)
  mesh = Mesh(TG.devices(hardware_preset("tpu_v5p"), 8)[:1], ("x",))
  arg = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
  compiled = TG.compile_(jax.jit(step).lower(arg(B, L, H, K), arg(B, L, G, K), arg(B, L, G, K), arg(B, L, H, K)))
  comps, _ = hlo.parse(compiled.as_text())
  stated = sorted(hlo.stated_flops(i) for c in comps.values() for i in c if hlo.stated_flops(i) is not None)
  assert stated == sorted(n * B * H * pairs * 128 * 128 * K for n in (4, 8, 6)), stated


def test_dot_product_attention_is_cudnn_flash_on_the_gpu_target():
  """model.attention=dot_product in bf16 lowers to cuDNN's fused attention for the H100 target (jax.nn's default
  would be XLA's), and the cost model counts its FLOPs (causal: half the 4 B H L^2 K of the forward)."""
  cfg, compiled, _ = small_target("baseline", attention="dot_product", n_layers=1)
  text = compiled.as_text()
  assert 'custom_call_target="__cudnn$fmhaSoftmax"' in text and "__cudnn$fmhaSoftmaxBackward" in text
  from shardlab.analysis import hlo
  from shardlab.analysis.hlo import attention_call_flops
  comps, _ = hlo.parse(text)
  fwd = [i for c in comps.values() for i in c if hlo.is_attention_call(i) and "Backward" not in i.attrs]
  b, h, l, k = 16 // 4, 4 // 2, 256, 64          # per device: batch over fsdp, heads over tensor
  assert [attention_call_flops(i) for i in fwd] == [4 * b * h * l * l * k / 2]
  # the calibrated prediction's kernels: matmuls, the fused attention kernels, the rest. t_gemm_s is the first
  # two together; t_matmul_s the matmuls alone (what the search's time model calls t_gemm_s)
  import numpy as np
  from shardlab import target as TG
  from shardlab.analysis import costmodel
  from shardlab.analysis.program import Program
  devs = TG.mesh_devices(TG.devices(h100(), 8), tuple(cfg.mesh.shape.values()))
  prog = Program(text, np.vectorize(lambda d: d.id)(devs), tuple(cfg.mesh.shape), "gpu", compiled)
  pred, _ = costmodel.predict(prog, None, h100(), {}, 1e9)
  # cuDNN's kernels are priced at the attention rate, outside the matmuls: at least the forward's FLOPs' time
  assert pred["t_attention_kernels_s"] >= sum(attention_call_flops(i) for i in fwd) / h100().attention_rate()
  assert 0 < pred["t_matmul_s"] < pred["t_gemm_s"]


# ------------------------------------------------------------------------------ the planner, confirmed on the target

def test_plan_top_k_compiles_the_best_layouts_for_the_target():
  """`python -m shardlab.plan search=true top=2` compiles the two best layouts for 8 x H100 and puts the compiled
  memory and the calibrated step time beside the closed forms. The tiny model with a 1.5 MB HBM budget: the HSDP
  layouts (data > 1) do not fit by the closed forms, so the best two by the time model are 1x1x8 and 1x2x4 (with
  train.mfu's roofline they were 1x4x2 and 1x2x4), which the train step can express. The compiled arguments are
  the training state (fp32 params and two Adam moments, sharded over the 8 devices: 12 B/param / 8, a little more
  where norms are replicated over tensor) and the batch."""
  from shardlab.analysis import planner
  from shardlab.plan import run
  r = run(["search=true", "top=2", "model=tiny", "hardware=h100", "mesh.fsdp=4", "mesh.tensor=2",
           "hardware.hbm_bytes=1500000", "schedule.remat=none", "schedule.microbatches=1"])   # kept as given
  assert [(l["data"], l["fsdp"], l["tensor"]) for l in r["layouts"]] == [(1, 1, 8), (1, 2, 4)]
  from shardlab.plan import compose
  n_params = planner.param_count(compose(["model=tiny"]).model)
  peaks = []
  for l in r["layouts"]:
    t = l["target"]
    assert t["compiled"] and t["platform"] == "gpu" and t["devices"] == 8 and t["topology"] == "1x1x8"
    assert t["prediction_model"].startswith("calibrated") and t["step_time_s"] > 0 and 0 < t["mfu"] < 1
    assert t["step_time_closed_form_s"] == l["step_time_s"] and "t_gemm_s" in l["step_model"]   # the time model's
    assert t["search_error"] == pytest.approx(l["step_time_s"] / t["step_time_s"] - 1)
    assert t["memory_closed_form_bytes"] == l["memory_per_device_bytes"]
    data_bytes = (2 * 16 // (l["data"] * l["fsdp"]) * 32 + 32) * 4   # inputs, targets [B_fsdp, L]; positions [L]
    assert 12 * n_params / 8 < t["memory_compiled"]["argument"] < 1.02 * 12 * n_params / 8 + data_bytes
    assert t["fits"] == (t["memory_compiled_bytes"] <= 1500000)
    peaks.append(t["memory_compiled_bytes"])
  assert peaks[0] != peaks[1]          # two compiles of two meshes, not one result copied


def test_plan_top_k_compiles_hsdp_and_says_why_a_layout_is_not_compiled(monkeypatch):
  """An HSDP layout (data 2 x fsdp 2 x tensor 2) compiles for the target like any other; a layout the train step
  cannot express (4 sequences over 8 batch shards) is listed with why; a missing target compiler is one line
  and exit 2 before anything compiles."""
  import importlib.util
  from shardlab.analysis import planner
  from shardlab.composition import resolve
  from shardlab.plan import compose, main
  cfg = resolve(compose(["model=tiny", "hardware=h100", "mesh.fsdp=4", "mesh.tensor=2"]))
  hsdp = next(l for l in planner.search(cfg) if (l["data"], l["fsdp"], l["tensor"]) == (2, 2, 2))
  out = confirm_layouts([hsdp], cfg, 1, build)[0]["target"]
  assert out["compiled"] is True and out["memory_compiled_bytes"] > 0, out
  small = resolve(compose(["model=tiny", "hardware=h100", "mesh.fsdp=4", "mesh.tensor=2", "train.batch_size=4"]))
  odd = next(l for l in planner.search(small) if (l["data"], l["fsdp"], l["tensor"]) == (2, 4, 1))
  out = confirm_layouts([odd], small, 1, build)[0]["target"]
  assert out == {"compiled": False, "why": out["why"]} and "not a whole number" in out["why"]
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "jax_cuda12_plugin" else real(name, *a))
  assert main(["search=true", "top=1", "model=tiny"]) == 2


def test_batch_window_confirmed_by_compiling_for_the_target():
  """The issue's check, on the target: the largest batch that fits a budget by the H100 compiler's memory report
  fits (compiled), and one more sequence per fsdp shard does not (compiled). Tiny model, 4x2 of 8 x H100, a
  2.7 MB budget. The analytic window (planner.batch_window) is reported beside it and its batch compiled; this
  test does not require the two to agree (the closed-form activation count is not the compiler's)."""
  from shardlab.analysis.confirm import confirm_batch_window
  from shardlab.composition import resolve
  from shardlab.plan import compose
  cfg = resolve(compose(["model=tiny", "hardware=h100", "mesh.fsdp=4", "mesh.tensor=2", "hardware.hbm_bytes=2700000"]))
  w = confirm_batch_window(cfg, build)
  s, peaks = w["max_sequences_per_fsdp_shard"], w["peaks"]
  assert w["confirmed"] and s >= 2 and w["target"]["platform"] == "gpu"
  assert peaks[s] <= 2_700_000 < peaks[s + 1]
  assert w["max_batch_per_device_tokens"] == s * cfg.model.seq_len / 2
  assert all(peaks[a] < peaks[b] for a, b in zip(sorted(peaks), sorted(peaks)[1:]))   # more batch, more memory
  a = w["analytic"]
  assert a["max_sequences_per_fsdp_shard"] > 0 and a["peak_on_target"] == peaks[a["max_sequences_per_fsdp_shard"]]


@pytest.mark.parametrize("schedule", ["baseline", "fsdp_prefetch"])
def test_tpu_loop_trip_counts_are_read_off_their_conditions(schedule):
  """libtpu's while loops carry no known_trip_count (XLA:CPU's and the GPU compiler's do): the analysis reads
  `i < N` off each loop's condition and the counter's initial constant. For the same step, every loop of the
  TPU program runs as often as the annotated XLA:CPU program's; the TPU ledger is then the program's."""
  pytest.importorskip("libtpu", reason="the TPU target needs the tpu extra: pip install 'shardlab[tpu]'")
  from conftest import compose
  from shardlab import target as TG
  from shardlab.analysis import hlo
  from shardlab.config import to_config
  from shardlab.trainer import build, lower

  def trips(text):
    comps, _ = hlo.parse(text)
    return sorted(hlo.trip_count(i, c, comps) for c, ins in comps.items() for i in ins if i.opcode == "while")
  cfg = to_config(compose("hardware=tpu_v5p", f"schedule={schedule}", "model.n_layers=4"))
  b = build(cfg)
  # XLA:CPU's default emitters, as a user's run compiles it: the tests' elemental emitters (testing.FAST_COMPILE)
  # expand each scatter into a loop of its own (the loss's take_along_axis gradient: 128 trips, one per token)
  local = b["step_fn"].lower(b["abstract_state"], b["abstract_batch"]).compile(
      compiler_options={"xla_cpu_use_fusion_emitters": True}).as_text()
  tpu = TG.compile_(lower(build(cfg, TG.mesh_devices(TG.devices(cfg.hardware, 8), (4, 2))))).as_text()
  assert '"known_trip_count"' not in tpu and "known_trip_count" in local
  assert trips(tpu) == trips(local) == ([4, 4] if schedule == "baseline" else [3, 3])


@pytest.mark.parametrize("step,trips,copied", [(1, 5, False), (2, 3, False), (1, 5, True)])
def test_trip_count_of_an_unannotated_loop_through_a_copied_counter(step, trips, copied):
  """The form libtpu emits: the counter starts as a copy of a constant (2), the condition's root is `i < 7`,
  the body adds `step` (2: a body unrolled twice), to the counter itself or to a copy of it (libtpu's form for
  v5p 16 x 4 at batch 16, which once ended in a traceback)."""
  from shardlab.analysis import hlo
  text = f"""HloModule m

%cond (p: (s32[], f32[])) -> pred[] {{
  %n = s32[] constant(7)
  %p = (s32[], f32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%body (q: (s32[], f32[])) -> (s32[], f32[]) {{
  %q = (s32[], f32[]) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %c = s32[] constant({step})
  %next = s32[] add(%i, %c)
  %x = f32[] get-tuple-element(%q), index=1
  ROOT %r = (s32[], f32[]) tuple(%next, %x)
}}

ENTRY %main (x: f32[]) -> (s32[], f32[]) {{
  %x = f32[] parameter(0)
  %two = s32[] constant(2)
  %start = s32[] copy(%two)
  %t = (s32[], f32[]) tuple(%start, %x)
  ROOT %w = (s32[], f32[]) while(%t), condition=%cond, body=%body
}}
"""
  if copied:
    text = text.replace("  %next = s32[] add(%i, %c)", "  %ic = s32[] copy(%i)\n  %next = s32[] add(%ic, %c)")
  comps, entry = hlo.parse(text)
  loop = next(i for i in comps[entry] if i.opcode == "while")
  assert hlo.trip_count(loop, entry, comps) == trips
  assert hlo.multiplicities(comps, entry)["body"] == trips
  with pytest.raises(ValueError, match="no known trip count"):       # a body that does not count up: refused
    hlo.trip_count(loop, entry, hlo.parse(re.sub(r"add\((%ic?), %c\)", r"multiply(\1, %c)", text))[0])


@pytest.mark.parametrize("preset", ["h100", "tpu_v5p"])
def test_gspmd_baseline_compiles_for_each_target_with_its_attention_kernel(preset, tmp_path):
  """The compiler's baseline runs the same attention kernel as the explicit schedules: on the H100 target cuDNN's
  fused attention (a shard_map over batch and heads; JAX's cuDNN partitioner refuses a head-sharded operand),
  on v5p the blockwise kernel; every collective is the compiler's (the audit lists them all as unplanned)."""
  import importlib.util
  from conftest import compose
  from shardlab.config import to_config
  from shardlab.trainer import train
  attention = "dot_product" if preset == "h100" else "blockwise"
  dump = [f"+xla.flags.xla_dump_to={tmp_path / 'dump'}"] if preset == "h100" else []
  cfg = to_config(compose(f"hardware={preset}", "compile_for=target", "dry_run=true", "progress=false",
                          "figures=false", "precision=bf16", "schedule=gspmd", f"model.attention={attention}", *dump))
  if importlib.util.find_spec("libtpu" if cfg.hardware.target_platform == "tpu" else "jax_cuda12_plugin") is None:
    pytest.skip(f"hardware={preset} compiles with the {cfg.hardware.target_platform} extra, not installed")
  summary = train(cfg, tmp_path / "run")
  assert summary["status"] == "ok" and summary["audit"]["unplanned"] and summary["ledger"]["program"] == {}
  if preset == "h100":
    hlo = "".join(p.read_text() for p in (tmp_path / "dump").glob("*after_optimizations.txt"))
    assert "__cudnn$fmha" in hlo


def test_moe_ragged_dispatch_compiles_to_ragged_all_to_all_on_h100(tmp_path):
  """The tiny MoE with expert=ragged compiled for 8 H100s: the program has ragged_all_to_all over `expert` (the
  CPU runs a padded all_to_all instead), the ledger explains every byte (a ragged all-to-all counted at its
  input, the most it can send) and nothing is unplanned (the GPU compiler drops the ragged ones' op_name: listed
  as placed)."""
  from conftest import compose
  from shardlab.axes import EXPERT
  from shardlab.config import to_config
  from shardlab.trainer import train
  cfg = to_config(compose("hardware=h100", "compile_for=target", "dry_run=true", "progress=false", "model=tiny_moe",
                          "figures=false", "mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2", "expert=ragged"))
  summary = train(cfg, tmp_path / "run")
  assert summary["status"] == "ok"
  # 2 layers x (dispatch, combine) x (forward, backward); 4 instructions in the two layer loops
  assert summary["comm"]["ragged-all-to-all"][EXPERT]["count"] == 8, summary["comm"]
  assert summary["ledger"]["differences"] == [] and summary["audit"]["unplanned"] == [], summary["audit"]
  dropped = [c for c in summary["audit"]["combined"] if c["kind"] == "ragged-all-to-all"]
  assert len(dropped) == 4 and all(c["rewrite"] == ["placed; its op_name dropped by the compiler"] for c in dropped)


def test_a_folded_loop_replays_the_same_step(monkeypatch):
  """The calibrated replay adds a loop's iterations at once once two in a row change the state alike (the layer
  loop's steady state): the step, the exposed communication, every axis's time and the kernel count are those
  of the replay that walks every iteration, with far fewer timeline events (a 70B step: 730,206 -> 980, 45 s ->
  0.05 s; docs/analysis.md)."""
  import numpy as np
  from shardlab import target as TG
  from shardlab.analysis import calibrated
  from shardlab.analysis.program import Program
  cfg, compiled, _ = small_target("baseline")          # the memory test's program: 4 layers
  devs = TG.mesh_devices(TG.devices(h100(), 8), tuple(cfg.mesh.shape.values()))
  prog = Program(compiled.as_text(), np.vectorize(lambda d: d.id)(devs), tuple(cfg.mesh.shape), "gpu", compiled)
  folded = calibrated.replay(prog, h100(), {})
  assert any(e["cat"] == "loop, folded" for e in folded.events)
  monkeypatch.setattr(calibrated, "_same", lambda a, b: False)       # every iteration walked
  walked = calibrated.replay(prog, h100(), {})
  assert folded.t_total_s == pytest.approx(walked.t_total_s, rel=1e-9)
  assert folded.t_exposed_comm_s == pytest.approx(walked.t_exposed_comm_s, rel=1e-9, abs=1e-15)
  assert folded.t_comm_s == pytest.approx(walked.t_comm_s, rel=1e-9) and folded.kernels == walked.kernels
  assert len(folded.events) < len(walked.events)
