"""One configuration, end to end: build the step, compile it (for the local devices, the target's, or both),
analyze the compiled program, then train it. `python -m shardlab` (shardlab/run.py) calls `train`.

  build(cfg, devices)            mesh, declarations, schedule, optimizer, the jitted step, its abstract inputs
  lower(built)                   the step lowered for those inputs (one layer's residual bytes recorded)
  compile_and_analyze(cfg, out)  the local and/or target program and the summary's analysis of it
  fit(cfg, built, compiled, ..)  the step loop: data, checkpoints, signals, metrics
  train(cfg, out, resolved)      all of it; returns the summary, also written to out/summary.json

What a run writes (metrics.jsonl, summary.json, TensorBoard, the profile) goes through shardlab/outputs.py.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path

from shardlab import outputs as O
from shardlab.config import Config
from shardlab.errors import ConfigError


def build(cfg, devices=None):
  """Everything a run needs before it has data: mesh, parameter declarations, schedule, optimizer and the
  jitted step, plus the abstract (shape, dtype, sharding) state and batch it compiles for. `cfg`: a Config, or
  its composition (composition.resolve: what the planner's candidates are). `devices`: lay the mesh over these
  (a target's, target.devices) instead of the local ones."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from shardlab import params as PM, schedules, train as T
  from shardlab.composition import Composition, resolve
  from shardlab.data import Batch
  from shardlab.mesh import make_mesh
  # The audit reads each collective's op_name: a program from a persistent compilation cache must carry its own
  # metadata, not that of an identical program traced by other code (JAX leaves metadata out of the key).
  jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
  c = cfg if isinstance(cfg, Composition) else resolve(cfg)
  mesh = make_mesh(c.mesh.shape, devices=devices)
  layout = c.layout
  decls = PM.declare(c.model, c.mesh.tensor, layout, mesh.axis_names)
  sched = schedules.build(c.schedule, c.model, T.DTYPES[c.precision.compute_dtype], layout, c.context,
                          c.pipeline, c.expert)
  opt = T.make_optimizer(c.train, decls)
  step_fn = T.make_train_step(c, sched, decls, opt, mesh)
  specs = T.state_specs(opt, decls)
  shapes = jax.eval_shape(lambda: T.init_state_local(PM.init(jax.random.key(0), decls, c.model), opt))
  abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                                shapes, specs)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), T.batch_specs(layout, mesh),
                           is_leaf=lambda x: isinstance(x, P))
  B, L = c.train.batch_size, c.model.seq_len
  abstract_batch = Batch(*(jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s)
                           for shape, s in zip(((B, L), (B, L), (L,)), shardings)))
  return dict(mesh=mesh, decls=decls, schedule=sched, opt=opt, step_fn=step_fn, abstract_state=abstract_state,
              abstract_batch=abstract_batch)


def lower(built: dict):
  """built["step_fn"] traced and lowered for build()'s abstract inputs (its pipeline slots checked on that one
  trace: schedules/pipeline.py, check_slots); one layer's residual bytes, which the schedule's
  stage unit returns while that trace runs (Stage.residual_bytes; schedules without a stage unit record none),
  go into built["layer_residuals"] for the memory breakdown."""
  from shardlab.schedules.pipeline import check_slots
  with built["schedule"].recording_residuals() as rec:
    traced = built["step_fn"].trace(built["abstract_state"], built["abstract_batch"])
  check_slots(traced.jaxpr)          # a part that misstated what it places: one line, before compiling
  built["traced"] = traced           # the ledger reads the same trace (costmodel.predict_run)
  lowered = traced.lower()
  built["layer_residuals"] = max(rec, key=lambda r: r["saved"]) if rec else None
  return lowered


def compile_and_analyze(cfg: Config, out_dir) -> tuple[dict | None, object, dict, dict]:
  """(the local build or None, its compiled step or None, the analysed build, the analysis). The local program
  is what trains here; with compile_for=target the same step is also compiled by the target's compiler and
  every analysis (ledger, audit, memory, overlap, prediction; timeline.* in out_dir) reads that program."""
  from shardlab import target as TG
  from shardlab.analysis.costmodel import predict_run
  from shardlab.analysis.program import Program, analyze
  from shardlab.composition import resolve
  c = resolve(cfg)                # the step's composition, read once: the builds and the analysis take it
  on_target = cfg.compile_for == "target"
  b = compiled = None
  times = {}
  if not (on_target and cfg.dry_run):
    b = build(c)
    # the parts' options for the local devices (a GPU machine's are CUDA: the ring's two collectives in flight)
    local = next(iter(b["mesh"].devices.flat)).platform
    b["compiler_options"] = c.target_flags(cfg.xla.flags, {"gpu": "cuda"}.get(local, local))
    t0 = time.perf_counter()
    compiled = TG.compile_with(lower(b), b["compiler_options"])
    times["local"] = time.perf_counter() - t0
  a = b
  if on_target:
    topo = TG.topology(cfg.hardware, cfg.mesh.n_devices)   # (preflight.check found the extra and it valid)
    devs = TG.devices(cfg.hardware, cfg.mesh.n_devices)
    a = build(c, TG.mesh_devices(devs, tuple(cfg.mesh.shape.values())))
    t0 = time.perf_counter()
    flags = c.target_flags(cfg.xla.flags)            # the parts' options, the run's xla.flags over them
    a["compiled"], buffers = TG.compile_reading_buffers(lower(a), flags)
    times["target"] = time.perf_counter() - t0
  else:
    a["compiled"], buffers = compiled, None
  prog = Program.of(a["compiled"], a["mesh"], buffers)     # the compiled HLO, parsed once
  analysis = analyze(a["compiled"], a["mesh"], prog)
  if not getattr(a["schedule"], "shard_mapped", True):   # the compiler places every collective (gspmd), by design
    analysis["audit"] = {**analysis["audit"], "placed_by": "compiler"}
  # prediction, memory, ledger, audit; a pipeline's table replayed with its compiled slots (pipeline.png)
  analysis.update(predict_run(a["compiled"], a["mesh"], c, out_dir, analysis, a, prog, figures=cfg.figures))
  if on_target:
    analysis["target"] = {**TG.describe(devs, topo), "compiler_options": flags}
  analysis.update(compile_time_s=sum(times.values()), compile_times_s=times)
  return b, compiled, a, analysis


def train(cfg: Config, out_dir: str | os.PathLike, resolved: dict | None = None) -> dict:
  """Validate, build, compile, analyze and (unless cfg.dry_run) train; returns the summary, which is also
  written to out_dir/summary.json. Raises preflight.Finished, writing nothing, when `checkpoint.resume=true`
  finds the run already finished."""
  from shardlab import checkpoint as CK, preflight
  preflight.check(cfg, out_dir)                   # settings, processes, devices, memory, dirs, lock; before compile
  import dataclasses

  import jax
  from shardlab import params as PM
  out = Path(out_dir)
  main = jax.process_index() == 0                 # only process 0 writes the run's files
  try:                                            # the run dir's lock is released however this ends
    # SIGTERM/SIGINT from here on stop the run with a line and a summary (while compiling: once XLA returns).
    with CK.StopOnSignal() as stop:
      # The analysis's files (timeline.*) are written into a directory beside them and renamed in whole.
      stage = out / f".analysis-{os.getpid()}"
      try:
        b, compiled, a, analysis = compile_and_analyze(cfg, stage)
        if stage.is_dir():
          O.move_into(stage, out)
      except OSError as e:
        if not O.writing_failed(e, out):
          raise
        raise O.cannot_write(out, "the analysis (timeline.json, timeline.png)", "before training") from None
      except CK.StoppedAtOnce:
        _compile_interrupted(out, main, "stopped at once by a second signal while compiling")
        raise
      finally:
        if stage.is_dir():                        # what a failed analysis or move left behind
          shutil.rmtree(stage, ignore_errors=True)
      signum = stop.requested()                   # agreed by every process
      if signum:
        e = CK.Interrupted(signum, None, None)
        _compile_interrupted(out, main, str(e))
        raise e
      out.mkdir(parents=True, exist_ok=True)
      devs = jax.devices()
      summary = {
          "status": "ok", "mesh": dict(cfg.mesh.shape), "devices": len(devs),
          "platform": devs[0].platform, "device_kind": devs[0].device_kind, "schedule": cfg.schedule.label,
          "model": cfg.model.label, "n_params": PM.count(a["decls"]), "compile_for": cfg.compile_for, "jax_version": jax.__version__,
          "xla": {"name": cfg.xla.name, "flags": dict(cfg.xla.flags),
                  "compiler_options": b["compiler_options"] if b else None},   # the local compile's, parts' too
          **analysis, "config": resolved if resolved is not None else dataclasses.asdict(cfg)}
      if not cfg.dry_run:
        fit(cfg, b, compiled, summary, out, main, stop)
      if main:
        try:
          O.write_json(out / "summary.json", summary)
        except OSError:
          done = len(summary.get("losses") or [])
          raise O.cannot_write(out, "summary.json", f"after step {done}", summary.get("checkpoint")) from None
  finally:
    preflight.unlock_run_dir(out)
  return summary


def layer_order(schedule, shape: dict) -> list[int] | None:
  """The stored layer that runs at each depth under `schedule` on a mesh of `shape` (an interleaved pipeline's
  placement), or None for the model's own order."""
  stages = getattr(schedule, "stages_on", None)
  pipe = stages(shape) if stages else None
  return pipe.layer_order() if pipe is not None else None


def _compile_interrupted(out: Path, main: bool, why: str) -> None:
  """A signal while compiling: summary.json says so, unless a run before this one (resumed) left one."""
  if main and not (out / "summary.json").exists():
    try:
      O.write_json(out / "summary.json", {"status": "interrupted", "error": why, "losses": []})
    except OSError:
      pass


def fit(cfg: Config, b: dict, compiled, summary: dict, out: Path, main: bool, stop=None) -> None:
  """The step loop on the local devices, from a fresh state or the newest checkpoint: metrics.jsonl per step,
  checkpoints every `checkpoint.every` steps, at the end and on SIGTERM/SIGINT; fills in the summary's losses
  and step times. On an error summary.json says why, with the losses so far, and the error is raised. `stop`:
  the caller's StopOnSignal (one is made here if none)."""
  import jax
  from tqdm import tqdm

  from shardlab import checkpoint as CK, params as PM, preflight, train as T
  from shardlab.data import MarkovData
  mesh = b["mesh"]
  order = layer_order(b["schedule"], dict(mesh.shape))
  ckpt = CK.Checkpointer(cfg.checkpoint, cfg.checkpoint.dir or out / "checkpoints", tuple(cfg.mesh.shape.values()),
                         preflight.record_settings(cfg), order)
  try:
    state, losses = ckpt.restore(b["abstract_state"]) if cfg.checkpoint.resume else (None, [])
    start = len(losses)                           # steps done; the data resumes there (a batch is f(seed, step))
    if start > cfg.train.steps:
      raise ConfigError(f"train.steps={cfg.train.steps}: the checkpoint in {ckpt.dir} is already at step {start}; "
                        f"raise train.steps to continue it")
    if state is None:   # the model's parameters, its layers stored in the order the schedule runs them
      params = CK.reorder_layers(PM.init_sharded(cfg.train.seed, b["decls"], cfg.model, mesh), order, to_model=False)
      state = T.init_state(params, b["opt"], b["decls"], mesh)
    summary["checkpoint"] = {"dir": str(ckpt.dir), "resumed_from": ckpt.latest, "saved": ckpt.saved}
    data = MarkovData(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size,
                      cfg.data.branching, jax.tree.map(lambda a: a.sharding, b["abstract_batch"]),
                      b["schedule"].data_order(dict(mesh.shape)))
    tokens = cfg.train.batch_size * cfg.model.seq_len
    times = []
    try:
      try:
        f = O.open_metrics(out, start, main)
      except OSError:
        raise O.cannot_write(out, "metrics.jsonl", f"before step {start}", summary["checkpoint"]) from None
      with f, (contextlib.nullcontext(stop) if stop else CK.StopOnSignal()) as stop, \
           O.Logs(cfg, out, main, start) as logs:
        bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
                   disable=not cfg.progress or not main, desc="train")
        for step in bar:
          batch = data.batch(step)
          logs.before(step)
          t = time.perf_counter()
          state, met = compiled(state, batch)
          loss, gnorm = float(met["loss"]), float(met["grad_norm"])   # waits for the step
          dt = time.perf_counter() - t
          losses.append(loss)
          times.append(dt)
          rec = {"step": step, "loss": loss, "grad_norm": gnorm, "step_time_s": dt, "tokens_per_s": tokens / dt,
                 **{k: float(v) for k, v in met.items() if k not in ("loss", "grad_norm")}}   # a MoE's router
          try:
            f.write(json.dumps(O.strict(rec), allow_nan=False) + "\n")   # strict JSON: null for NaN/inf
          except OSError:
            raise O.cannot_write(out, "metrics.jsonl", f"at step {step}", summary["checkpoint"]) from None
          logs.after(step, rec)
          bar.set_postfix(loss=f"{loss:.4f}")
          if not (math.isfinite(loss) and math.isfinite(gnorm)):   # this state is never saved
            raise FloatingPointError(O.non_finite(loss, gnorm, step, ckpt))
          ckpt.check()                            # a save that failed in the background stops the run now
          signum = stop.requested()
          if signum or (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0):
            ckpt.save(step + 1, state, losses)
          if signum:
            raise CK.Interrupted(signum, step + 1, ckpt)
        ckpt.save(cfg.train.steps, state, losses)  # the final save (skipped if `every` just saved it)
        ckpt.wait()                               # a save that failed in the background raises here
    except Exception as e:                        # summary.json says why, with the losses so far
      if isinstance(e, CK.StoppedAtOnce) and cfg.checkpoint.enabled:
        ckpt.close()                              # the save in flight (if any) finished: name what is on disk
        e.name_checkpoint(ckpt.newest_complete(), ckpt.dir)
      summary.update(status="interrupted" if isinstance(e, (CK.Interrupted, CK.StoppedAtOnce)) else "error",
                     error=f"{type(e).__name__}: {e}", losses=losses)
      # A resumed run that failed before its first step keeps the summary it found (it ran nothing new).
      if main and (len(losses) > start or not (out / "summary.json").exists()):
        try:
          O.write_json(out / "summary.json", summary)
        except OSError:                           # a full disk: the line says so; the earlier version stays
          pass
      raise
  finally:
    ckpt.close()                                  # bounded wait for a save still being written
  if not times and main:                          # resumed from the final checkpoint: the steps' times as recorded
    times = O.step_times(out, cfg.train.steps)
  median = statistics.median(times[1:] or times) if times else None
  summary.update(losses=losses, final_loss=losses[-1], step_time_s_median=median,
                 tokens_per_s_median=tokens / median if median else None)
