"""The Hydra entry point: `python -m shardlab [overrides]` trains one configuration and writes
metrics.jsonl and summary.json in the run directory."""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from hydra.experimental.callback import Callback

from shardlab.config import CONF_DIR, Config, register_configs, to_config
from shardlab.mesh import ConfigError



def build(cfg: Config, devices=None):
  """Everything a run needs before it has data: mesh, parameter declarations, schedule, optimizer and the
  jitted step, plus the abstract (shape, dtype, sharding) state and batch it compiles for. `devices`: lay the
  mesh over these (a target's, target.devices) instead of the local ones."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from shardlab import params as PM, schedules, train as T
  from shardlab.mesh import FSDP, make_mesh
  # The audit reads each collective's op_name: a program from a persistent compilation cache must carry its own
  # metadata, not that of an identical program traced by other code (JAX leaves metadata out of the key).
  jax.config.update("jax_compilation_cache_include_metadata_in_key", True)
  mesh = make_mesh(cfg.mesh.fsdp, cfg.mesh.tensor, devices)
  decls = PM.declare(cfg.model, cfg.mesh.tensor)
  sched = schedules.build(cfg.schedule, cfg.model, T.DTYPES[cfg.precision.compute_dtype])
  opt = T.make_optimizer(cfg, decls)
  step_fn = T.make_train_step(cfg, sched, decls, opt, mesh)
  specs = T.state_specs(opt, decls)
  shapes = jax.eval_shape(lambda: T.init_state_local(PM.init(jax.random.key(0), decls, cfg.model), opt))
  abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                                shapes, specs)
  abstract_batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32,
                                        sharding=NamedSharding(mesh, P(FSDP)))
  return dict(mesh=mesh, decls=decls, schedule=sched, opt=opt, step_fn=step_fn, abstract_state=abstract_state,
              abstract_batch=abstract_batch)


def lower(built: dict):
  """built["step_fn"].lower(...) for build()'s abstract inputs; one layer's residual bytes, read off that trace
  (schedules.explicit.record_residuals), go into built["layer_residuals"] for the memory breakdown."""
  from shardlab.schedules.explicit import record_residuals
  with record_residuals() as rec:
    lowered = built["step_fn"].lower(built["abstract_state"], built["abstract_batch"])
  built["layer_residuals"] = max(rec, key=lambda r: r["saved"]) if rec else None
  return lowered


def train(cfg: Config, out_dir: str | os.PathLike, resolved: dict | None = None) -> dict:
  """Validate, build, compile, analyze and (unless cfg.dry_run) train; returns the summary, which is also
  written to out_dir/summary.json."""
  from shardlab import preflight
  preflight.check(cfg, out_dir)                   # settings, processes, devices, memory, dirs, lock; before compile
  import jax
  on_target = cfg.compile_for == "target"
  n_mesh = cfg.mesh.fsdp * cfg.mesh.tensor
  if on_target:
    from shardlab import target as TG
    topo = TG.topology(cfg.hardware, n_mesh)      # (preflight.check found the extra installed and it valid)
  from jax.sharding import NamedSharding, PartitionSpec as P
  from tqdm import tqdm

  from shardlab import params as PM, train as T
  from shardlab.analysis.program import Program, analyze
  from shardlab.data import MarkovData
  from shardlab.mesh import FSDP

  from shardlab import target as TGC
  b = compiled = None
  compile_time = {}
  if not (on_target and cfg.dry_run):             # the local program: what trains here
    b = build(cfg)
    t0 = time.perf_counter()
    compiled = TGC.compile_with(lower(b), cfg.xla.flags)
    compile_time["local"] = time.perf_counter() - t0
  a = b                                           # the program every analysis reads
  if on_target:                                   # the same step, compiled by the target's compiler
    devs = TG.devices(cfg.hardware, n_mesh)
    a = build(cfg, TG.mesh_devices(devs, (cfg.mesh.fsdp, cfg.mesh.tensor)))
    t0 = time.perf_counter()
    a["compiled"] = TG.compile_(lower(a), cfg.xla.flags)
    compile_time["target"] = time.perf_counter() - t0
  else:
    a["compiled"] = compiled
  prog = Program.of(a["compiled"], a["mesh"])     # the compiled HLO, parsed once
  analysis = analyze(a["compiled"], a["mesh"], prog)
  from shardlab.analysis.costmodel import predict_run   # prediction + analytic memory; timeline.json/.png
  analysis.update(predict_run(a["compiled"], a["mesh"], cfg, out_dir, analysis, a, prog))
  if on_target:
    analysis["target"] = TG.describe(devs, topo)
  mesh = (b or a)["mesh"]
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  devs = jax.devices()
  summary = {
      "status": "ok", "mesh": {"fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}, "devices": len(devs),
      "platform": devs[0].platform, "device_kind": devs[0].device_kind, "schedule": cfg.schedule.name,
      "n_params": PM.count(a["decls"]), "compile_time_s": sum(compile_time.values()),
      "compile_times_s": compile_time, "compile_for": cfg.compile_for, "jax_version": jax.__version__,
      "xla": {"name": cfg.xla.name, "flags": dict(cfg.xla.flags)},
      **analysis, "config": resolved if resolved is not None else _asdict(cfg)}

  main = jax.process_index() == 0                 # only process 0 writes the run's files
  if not cfg.dry_run:
    from shardlab import checkpoint as CK
    ckpt = CK.Checkpointer(cfg.checkpoint, cfg.checkpoint.dir or out / "checkpoints", (cfg.mesh.fsdp, cfg.mesh.tensor),
                           preflight.record_settings(cfg))
    state, losses = ckpt.restore(b["abstract_state"]) if cfg.checkpoint.resume else (None, [])
    start = len(losses)                           # steps done; the data resumes there (a batch is f(seed, step))
    if start > cfg.train.steps:
      raise ConfigError(f"train.steps={cfg.train.steps}: the checkpoint in {ckpt.dir} is already at step {start}; "
                        f"raise train.steps to continue it")
    if state is None:
      state = T.init_state(PM.init_sharded(cfg.train.seed, b["decls"], cfg.model, mesh), b["opt"], b["decls"], mesh)
    summary["checkpoint"] = {"dir": str(ckpt.dir), "resumed_from": ckpt.latest, "saved": ckpt.saved}
    data = MarkovData(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size,
                      cfg.data.branching, NamedSharding(mesh, P(FSDP)))
    tokens = cfg.train.batch_size * cfg.model.seq_len
    times = []
    try:
      with _open_metrics(out, start, main) as f, CK.StopOnSignal() as stop, _Logs(cfg, out, main, start) as logs:
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
          rec = {"step": step, "loss": loss, "grad_norm": gnorm, "step_time_s": dt, "tokens_per_s": tokens / dt}
          f.write(json.dumps(_strict(rec), allow_nan=False) + "\n")   # strict JSON: null for NaN/inf
          f.flush()
          logs.after(step, rec)
          bar.set_postfix(loss=f"{loss:.4f}")
          if not (math.isfinite(loss) and math.isfinite(gnorm)):   # this state is never saved
            raise FloatingPointError(_non_finite(loss, gnorm, step, ckpt))
          ckpt.check()                            # a save that failed in the background stops the run now
          signum = stop.requested()
          if signum or (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0):
            ckpt.save(step + 1, state, losses)
          if signum:
            raise CK.Interrupted(signum, step + 1, ckpt)
        ckpt.save(cfg.train.steps, state, losses)  # the final save (skipped if `every` just saved it)
        ckpt.wait()                               # a save that failed in the background raises here
    except Exception as e:                        # summary.json says why, with the losses so far
      summary.update(status="interrupted" if isinstance(e, (CK.Interrupted, CK.StoppedAtOnce)) else "error",
                     error=f"{type(e).__name__}: {e}", losses=losses)
      if main:
        _write_json(out / "summary.json", summary)
      raise
    finally:
      ckpt.close()                                # bounded wait for a save still being written
      preflight.unlock_run_dir(out)
    median = statistics.median(times[1:] or times) if times else None
    summary.update(losses=losses, final_loss=losses[-1], step_time_s_median=median,
                   tokens_per_s_median=tokens / median if median else None)
  if main:
    _write_json(out / "summary.json", summary)
  preflight.unlock_run_dir(out)
  return summary


def final_line(out_dir, summary: dict) -> str:
  """The one line a finished run ends with: run dir, status, final loss, median step time."""
  if summary.get("final_loss") is None:
    return f"shardlab: {out_dir}: {summary['status']} (dry run: compiled and analyzed, no step run)"
  ms = summary["step_time_s_median"] * 1e3
  return (f"shardlab: {out_dir}: {summary['status']}, final loss {summary['final_loss']:.4f} after "
          f"{len(summary['losses'])} steps, step time {ms:.1f} ms (median)")


def _strict(x):
  """x with every non-finite float replaced by None, so that json.dumps writes strict JSON (null, not NaN)."""
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  if isinstance(x, dict):
    return {k: _strict(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_strict(v) for v in x]
  return x


def _write_json(path: Path, obj) -> None:
  path.write_text(json.dumps(_strict(obj), indent=2, allow_nan=False))


def _non_finite(loss: float, gnorm: float, step: int, ckpt) -> str:
  """Which one is non-finite: a finite loss with a NaN/inf gradient norm is not 'a non-finite loss'."""
  good = f"checkpoint {ckpt.latest} in {ckpt.dir}" if ckpt.latest else "none"
  what = (f"non-finite loss {loss} (grad_norm {gnorm})" if not math.isfinite(loss) else
          f"non-finite gradient norm {gnorm} (loss {loss})")
  return f"{what} at step {step}; last good checkpoint: {good}"


class _Logs:
  """TensorBoard scalars beside metrics.jsonl (tensorboardX, process 0 only) and, with profile.enabled, a
  jax.profiler trace of steps [profile.start_step, profile.start_step + profile.steps) in <run dir>/profile."""

  def __init__(self, cfg: Config, out: Path, main: bool, start: int):
    self.cfg, self.out, self.main = cfg, out, main
    p = cfg.profile
    self.window = range(max(p.start_step, start), max(p.start_step, start) + p.steps) if p.enabled else range(0)
    self.tracing = False

  def __enter__(self):
    self.tb = None
    if self.main and self.cfg.tensorboard:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(str(self.out / "tensorboard"))
    return self

  def before(self, step: int) -> None:
    if step == self.window.start and self.window:
      import jax
      jax.profiler.start_trace(str(self.out / "profile"))
      self.tracing = True

  def after(self, step: int, rec: dict) -> None:
    if self.tb is not None:
      for k in ("loss", "grad_norm", "step_time_s", "tokens_per_s"):
        self.tb.add_scalar(f"train/{k}", rec[k], step)
    if self.tracing and step == self.window[-1]:
      self._stop()

  def _stop(self) -> None:
    import jax
    jax.profiler.stop_trace()
    self.tracing = False

  def __exit__(self, *exc):
    if self.tracing:
      self._stop()
    if self.tb is not None:
      self.tb.close()


def _open_metrics(out: Path, start: int, main: bool):
  """metrics.jsonl for writing, keeping the rows before `start` when resuming into the same run dir (the rows
  of steps after the restored checkpoint are run again). Processes other than 0 write nowhere."""
  if not main:
    return open(os.devnull, "w")
  path = out / "metrics.jsonl"
  kept = [l for l in path.read_text().splitlines() if json.loads(l)["step"] < start] if start and path.exists() else []
  f = open(path, "w")
  f.writelines(l + "\n" for l in kept)
  return f


def _asdict(cfg):
  import dataclasses
  return dataclasses.asdict(cfg)


def _task(dcfg) -> None:
  from hydra.core.hydra_config import HydraConfig
  from hydra.types import RunMode
  from omegaconf import OmegaConf
  from shardlab.validate import RunError
  hc = HydraConfig.get()
  out_dir = hc.runtime.output_dir
  sweeping = hc.mode == RunMode.MULTIRUN
  try:
    summary = train(to_config(dcfg), out_dir, OmegaConf.to_container(dcfg, resolve=True))
    print(final_line(out_dir, summary), flush=True)
  except ConfigError as e:
    if _FULL_ERROR:
      raise
    print(f"shardlab: error: {e}", file=sys.stderr)
    if not sweeping:
      sys.exit(2)
    _record_failure(out_dir, e)
  except Exception as e:
    from shardlab.checkpoint import Interrupted, StoppedAtOnce
    if isinstance(e, (Interrupted, StoppedAtOnce)):  # summary.json says so; a sweep stops too
      print(f"shardlab: {e}", file=sys.stderr)
      sys.exit(128 + e.signum)
    if not isinstance(e, (FloatingPointError, RunError)):
      e = _lost_peer_or(e)                # a collective broken by a lost process: name that process instead
    if isinstance(e, (FloatingPointError, RunError)) and not _FULL_ERROR:  # one line; summary.json has the losses
      print(f"shardlab: error: {e}", file=sys.stderr)
      _record_failure(out_dir, e)
      if not sweeping:
        if isinstance(e, RunError):   # a failed save or a lost peer can leave threads that never end: do not wait
          sys.stdout.flush()
          sys.stderr.flush()
          os._exit(1)
        sys.exit(1)
      return
    _record_failure(out_dir, e)
    if not sweeping:
      raise
    print(f"shardlab: job {hc.job.num} failed: {type(e).__name__}: {e}", file=sys.stderr)


def _lost_peer_or(e: Exception) -> Exception:
  """With several processes, an error out of a step is most often a peer that vanished (gloo: 'connection
  closed by peer'): wait until the coordination service can tell (the watchdog then exits with one line naming
  the process), or return a RunError when a peer stopped on its own error; otherwise `e` unchanged."""
  from shardlab.validate import RunError
  try:
    import jax
    if jax.process_count() == 1:
      return e
    from shardlab import distributed as D
    D.wait_for_lost_peer()
  except RunError as lost:
    return lost
  except Exception:  # noqa: BLE001  (JAX not started: nothing to ask)
    pass
  return e


def _record_failure(out_dir, e: BaseException) -> None:
  """A failed job leaves a summary.json that says so (a sweep keeps going and reports it as a row). If the run
  already wrote this error into summary.json (with the losses so far), that summary is kept."""
  path = Path(out_dir, "summary.json")
  err = f"{type(e).__name__}: {e}"
  try:
    old = json.loads(path.read_text()) if path.exists() else None
  except (OSError, ValueError):
    old = None
  if isinstance(old, dict) and old.get("error") == err:
    return
  Path(out_dir).mkdir(parents=True, exist_ok=True)
  tb = traceback.format_exc()
  _write_json(path, {"status": "error", "error": err, **({"traceback": tb} if tb.strip() != "NoneType: None" else {})})


_FULL_ERROR = False   # HYDRA_FULL_ERROR=1: tracebacks instead of one-line errors


class Preflight(Callback):
  """Hydra callback (shardlab/conf/config.yaml): `preflight.check` before Hydra makes the run directory or writes
  `.hydra/`, so a rejected run leaves an existing run directory (and its record) untouched. Single runs only;
  each job of a multirun is checked by `train` (a failed job must still leave its row)."""

  def on_run_start(self, config, **kwargs) -> None:
    from omegaconf import OmegaConf
    from shardlab import preflight
    from shardlab.validate import RunError
    if _FULL_ERROR:   # tracebacks wanted: let train raise them (Hydra turns callback errors into warnings)
      return
    try:
      preflight.check(to_config(config), str(OmegaConf.select(config, "hydra.run.dir")))
    except (ConfigError, RunError) as e:
      print(f"shardlab: error: {e}", file=sys.stderr, flush=True)
      sys.exit(2 if isinstance(e, ConfigError) else 1)


def cli() -> None:
  import hydra
  from hydra.errors import HydraException
  from omegaconf.errors import OmegaConfBaseException
  global _FULL_ERROR
  register_configs()
  asked = os.environ.get("HYDRA_FULL_ERROR")
  _FULL_ERROR = asked == "1"
  os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its own errors (unknown key, wrong type) to us, unprinted
  try:
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)(_task)()
  except KeyboardInterrupt:               # SIGINT before training started (or while stopping): nothing to save
    if _FULL_ERROR:
      raise
    print("shardlab: interrupted by SIGINT outside the step loop; nothing saved by this signal", file=sys.stderr)
    sys.exit(130)
  except (HydraException, OmegaConfBaseException) as e:
    if _FULL_ERROR:
      raise
    msg = ": ".join(str(x).strip().splitlines()[0].rstrip(".") for x in (e, e.__cause__) if x and str(x).strip())
    print(f"shardlab: error: {msg} (`python -m shardlab --help` lists every group, option and setting)",
          file=sys.stderr)
    sys.exit(2)
  finally:
    if asked is None:
      os.environ.pop("HYDRA_FULL_ERROR")
    else:
      os.environ["HYDRA_FULL_ERROR"] = asked


if __name__ == "__main__":
  cli()
