"""The Hydra entry point: `python -m shardlab [overrides]` trains one configuration (shardlab/trainer.py) and
writes metrics.jsonl and summary.json in the run directory (shardlab/outputs.py). Here: parsing, the checks
before Hydra writes anything (`Preflight`), and turning every failure into one line and an exit code."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from shardlab.config import CONF_DIR, Config, register_configs, to_config  # noqa: F401  (CONF_DIR: re-exported)
from shardlab.config import check_hardware_overrides
from shardlab.errors import ConfigError
from shardlab.outputs import RunLog, final_line, human_bytes, human_seconds, prediction_model, record_failure
from shardlab.trainer import build, lower, train  # noqa: F401  (the library entry points, re-exported)


def _task(dcfg) -> str | None:
  """One run (or one job of a sweep). A sweep's job that fails returns its error (sweep.SweepSummary counts it:
  its row may still show the earlier run's summary.json, which a failed resume keeps)."""
  from hydra.core.hydra_config import HydraConfig
  from hydra.types import RunMode
  from shardlab.errors import RunError
  hc = HydraConfig.get()
  out_dir = hc.runtime.output_dir
  sweeping = hc.mode == RunMode.MULTIRUN
  from shardlab.preflight import Finished
  log = RunLog(Path(out_dir) / "run.log", write=_first_process(dcfg))   # run.log: what the run printed
  try:
    with log:
      summary = _train(dcfg, out_dir)
      print("\n".join(numbers(summary)), flush=True)
      print(final_line(out_dir, summary), flush=True)
  except Finished as e:                   # a requeued job whose run is done: nothing written, exit 0
    print(f"shardlab: {e}", flush=True)
  except ConfigError as e:
    if _FULL_ERROR:
      raise
    print(f"shardlab: error: {e}", file=sys.stderr)
    log.note(f"shardlab: error: {e}")
    if not sweeping:
      sys.exit(2)
    record_failure(out_dir, e)
    return f"{type(e).__name__}: {e}"
  except Exception as e:
    from shardlab.checkpoint import Interrupted, StoppedAtOnce
    if isinstance(e, (Interrupted, StoppedAtOnce)):  # summary.json says so; a sweep stops too
      print(f"shardlab: {e}", file=sys.stderr)
      log.note(f"shardlab: {e}")
      sys.exit(128 + e.signum)
    if not isinstance(e, (FloatingPointError, RunError)):
      e = _lost_peer_or(e)                # a collective broken by a lost process: name that process instead
    if isinstance(e, (FloatingPointError, RunError)) and not _FULL_ERROR:  # one line; summary.json has the losses
      print(f"shardlab: error: {e}", file=sys.stderr)
      log.note(f"shardlab: error: {e}")
      record_failure(out_dir, e)
      if not sweeping:
        if isinstance(e, RunError):   # a failed save or a lost peer can leave threads that never end: do not wait
          sys.stdout.flush()
          sys.stderr.flush()
          os._exit(1)
        sys.exit(1)
      return f"{type(e).__name__}: {e}"
    record_failure(out_dir, e)
    if not sweeping:
      raise
    print(f"shardlab: job {hc.job.num} failed: {type(e).__name__}: {e}", file=sys.stderr)
    log.note(f"shardlab: job {hc.job.num} failed: {type(e).__name__}: {e}")
    return f"{type(e).__name__}: {e}"
  return None


def _first_process(dcfg) -> bool:
  """Whether this is process 0 of the run (the one that writes run.log), from the settings or the cluster's
  rank variables, without touching JAX (jax.distributed starts later, in train)."""
  from omegaconf import OmegaConf
  rank = os.environ.get("SLURM_PROCID") or os.environ.get("OMPI_COMM_WORLD_RANK")
  if rank is None or not rank.strip().isdigit():
    rank = OmegaConf.select(dcfg, "distributed.process_id", default=0) or 0
  return int(rank) == 0


HYDRA_DIR = ".hydra"   # the run's Hydra record; hydra.output_subdir is null (conf/config.yaml): written here


def _train(dcfg, out_dir) -> dict:
  """train() with the run's `.hydra/` record, which Hydra itself would write before any check, over the record
  of the run a check then refuses (or of a finished sweep job requeued). Written here first into a directory
  that holds no run (a new run, or a sweep's new job: its row needs overrides.yaml even if it fails); into one
  that does, only once this run has replaced that run's summary.json (it trained, or failed or was stopped after
  training): a refused, failed or finished resume leaves the record it found."""
  from omegaconf import OmegaConf
  from shardlab.outputs import cannot_write
  out = Path(out_dir)
  fresh = not any((out / n).exists() for n in (HYDRA_DIR, "summary.json", "metrics.jsonl"))
  if fresh:
    try:
      _save_hydra_record(out, dcfg)
    except OSError:
      raise cannot_write(out, f"{HYDRA_DIR}/", "before the run") from None
  before = _stamp(out / "summary.json")
  try:
    cfg, resolved = to_config(dcfg), OmegaConf.to_container(dcfg, resolve=True)
    if cfg.hardware.file:                   # summary.json records the preset the file gave, not the group's default
      import dataclasses
      resolved["hardware"] = dataclasses.asdict(cfg.hardware)
    return train(cfg, out_dir, resolved)
  finally:
    if not fresh and _stamp(out / "summary.json") != before:
      try:
        _save_hydra_record(out, dcfg)
      except OSError:   # a full disk: the run's own line says so; the earlier record stays whole
        pass
    elif not fresh:
      _close_run_log(out)


def _close_run_log(out: Path) -> None:
  """Stop logging into `out` (Hydra's run.log handler): a job that changed nothing there (finished and
  requeued, refused, or failed before training) leaves the earlier run's run.log as it was too, which the lines
  submitit logs when a job ends would otherwise be appended to."""
  import logging
  root = logging.getLogger()
  for h in list(root.handlers):
    name = getattr(h, "baseFilename", None)
    if name and Path(name).resolve().parent == out.resolve():
      root.removeHandler(h)
      h.close()


def _save_hydra_record(out: Path, dcfg) -> None:
  """config.yaml, hydra.yaml and overrides.yaml in <out>/.hydra, as Hydra writes them, each replaced whole."""
  from hydra.core.hydra_config import HydraConfig
  from omegaconf import OmegaConf
  from shardlab.outputs import write_atomic
  hcfg = HydraConfig.instance().cfg
  d = out / HYDRA_DIR
  d.mkdir(parents=True, exist_ok=True)
  for name, c in (("config.yaml", dcfg), ("hydra.yaml", hcfg), ("overrides.yaml", hcfg.hydra.overrides.task)):
    write_atomic(d / name, OmegaConf.to_yaml(c))


def _stamp(p: Path) -> tuple | None:
  """What changes when a file is replaced (write_atomic renames a new inode over it); None if there is none."""
  try:
    st = p.stat()
  except OSError:
    return None
  return st.st_ino, st.st_mtime_ns, st.st_size


def numbers(summary: dict) -> list[str]:
  """What a finished run ends with on the terminal, before its last line: memory per device and whether it fits
  the preset's HBM, the predicted step time, MFU and exposed communication (named: which model made them, on
  which program), and for a training run the measured step time beside the prediction."""
  pred, mem = summary.get("prediction") or {}, summary.get("memory") or {}
  hw = pred.get("hardware", "?")
  program = mem.get("compiled_by") or summary.get("platform", "?")
  out = [f"shardlab: prediction for {hw} ({prediction_model(pred) or 'no'} model over the {program} program):"]
  analytic = (mem.get("analytic") or {}).get("total")
  if "fits" in mem:                               # the target compiler's buffers against the preset's HBM
    held = (mem.get("allocated") or {}).get("total")
    out.append(f"  memory per device   {human_bytes(mem['peak'])} compiled for {program}"
               + (f" ({human_bytes(held)} in its buffer assignment)" if held else "")
               + f", HBM {human_bytes(mem['hbm_bytes'])}: " + ("fits" if mem["fits"] else "does NOT fit")
               + (f" (analytic {human_bytes(analytic)})" if analytic else ""))
  elif mem.get("peak") is not None:               # a local program: its peak is the local compiler's
    fit = ""
    hbm = ((summary.get("config") or {}).get("hardware") or {}).get("hbm_bytes")
    if analytic and hbm:
      fit = (f"; analytic {human_bytes(analytic)} of {hw}'s {human_bytes(hbm)}: "
             + ("fits" if analytic <= hbm else "does NOT fit"))
    out.append(f"  memory per device   {human_bytes(mem['peak'])} compiled for {program}{fit}")
  if pred:
    t = pred["t_overlapped_s"]
    exposed = pred.get("exposed_comm_s", 0.0)
    # a pipeline's step is its table's replay; the exposed communication is of one device's program walked alone
    walked = pred.get("t_device_program_s")
    of = (f"{100 * exposed / walked:.0f}% of one device's program walked alone, {human_seconds(walked)}"
          if walked else f"{100 * exposed / t:.0f}% of the step")
    out.append(f"  step time           {human_seconds(t)} predicted, MFU {100 * pred['mfu']:.3g}%; exposed "
               f"communication {human_seconds(exposed)} ({of})" if t > 0 and (walked is None or walked > 0) else
               "  step time           0 predicted")
  median = summary.get("step_time_s_median")
  if median is not None:
    kind = summary.get("device_kind") or summary.get("platform", "?")
    # the prediction's error only where the measurement ran on the hardware predicted for: its target's platform,
    # or the platform a calibrated preset was measured on (hardware.measured_on: HardwareConfig.describes)
    from shardlab.hardware import jax_platform
    hw_cfg = (summary.get("config") or {}).get("hardware") or {}
    same = bool(summary.get("platform")) and jax_platform(summary.get("platform")) in {
        jax_platform(hw_cfg.get("target_platform")), jax_platform(hw_cfg.get("measured_on"))}
    out.append(f"  measured            {human_seconds(median)} per step (median, {summary.get('devices', '?')} x "
               f"{kind})"
               + (f" beside the {human_seconds(pred['t_overlapped_s'])} predicted for {hw}"
                  + ((f" (prediction {pred['t_overlapped_s'] / median - 1:+.1%} of the measurement)" if same else
                      f" (measured on {summary.get('platform', '?')}, predicted for {hw}: no error to compute)")
                     if median > 0 else "")
                  if pred else ""))
  return out + findings(summary)


def findings(summary: dict) -> list[str]:
  """What the analysis found that a run must not end "ok" over in silence, one line each: collectives in the
  compiled program that no code placed (audit.unplanned: e.g. an all-reduce JAX inserted for a value typed
  varying where the math is invariant; docs/testing.md), bytes the ledger cannot explain (ledger.differences),
  memory over the preset's HBM; and, as a note, what the target's compiler rewrote (ledger.rewrites)."""
  out = []
  audit = summary.get("audit") or {}
  unplanned = audit.get("unplanned") or []
  if unplanned and audit.get("placed_by") == "compiler":
    out.append(f"shardlab: note: the compiler placed all {len(unplanned)} collectives (this schedule leaves them to "
               f"it): summary.json audit.unplanned")
  elif unplanned:
    kinds = sorted({f"{u['kind']} over {u.get('axis') or '?'}" for u in unplanned})
    out.append(f"shardlab: warning: {len(unplanned)} collective(s) in the compiled program that no code placed "
               f"({', '.join(kinds)}): summary.json audit.unplanned; a value typed varying where it is invariant "
               f"makes JAX add one (docs/testing.md)")
  led = summary.get("ledger") or {}
  diffs = led.get("differences") or []
  if diffs:
    out.append(f"shardlab: warning: the ledger does not explain {len(diffs)} difference(s) between the bytes placed "
               f"and compiled: {diffs[0]}{' ...' if len(diffs) > 1 else ''} (summary.json ledger.differences)")
  mem = summary.get("memory") or {}
  if mem.get("fits") is False:
    out.append(f"shardlab: warning: {human_bytes(mem['peak'])} per device does NOT fit the preset's "
               f"{human_bytes(mem['hbm_bytes'])} of HBM")
  rewrites = led.get("rewrites") or []
  if rewrites:
    kinds = sorted({r["rewrite"] for r in rewrites})
    out.append(f"shardlab: note: the compiler rewrote {len(rewrites)} of the placed collectives, each explained "
               f"({'; '.join(kinds)}): summary.json ledger.rewrites")
  return out


def _lost_peer_or(e: Exception) -> Exception:
  """With several processes, an error out of a step is most often a peer that vanished (gloo: 'connection
  closed by peer'): wait until the coordination service can tell (the watchdog then exits with one line naming
  the process), or return a RunError when a peer stopped on its own error; otherwise `e` unchanged."""
  from shardlab.errors import RunError
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



_FULL_ERROR = False   # HYDRA_FULL_ERROR=1: tracebacks instead of one-line errors


class Preflight(Callback):
  """Hydra callback (conf/config.yaml): `preflight.check` before Hydra makes the run directory or opens its
  run.log (`.hydra/` is written by `_train`, after it), so a rejected run leaves an existing run directory (and
  its record) untouched. Single runs only; each job of a multirun is checked by `train` (a failed job must
  still leave its row)."""

  def on_run_start(self, config, **kwargs) -> None:
    from omegaconf import OmegaConf
    from shardlab import preflight
    from shardlab.errors import RunError
    if _FULL_ERROR:   # tracebacks wanted: let train raise them (Hydra turns callback errors into warnings)
      return
    try:
      preflight.check(to_config(config), str(OmegaConf.select(config, "hydra.run.dir")))
    except preflight.Finished as e:       # a requeued job whose run is done: one line, exit 0, nothing written
      print(f"shardlab: {e}", flush=True)
      sys.exit(0)
    except (ConfigError, RunError) as e:
      print(f"shardlab: error: {e}", file=sys.stderr, flush=True)
      sys.exit(2 if isinstance(e, ConfigError) else 1)
    except Exception as e:     # a check that failed unexpectedly: Hydra would warn and go on to write the run dir
      first = (str(e).strip().splitlines() or [""])[0]
      print(f"shardlab: error: checking the settings failed: {type(e).__name__}: {first} (HYDRA_FULL_ERROR=1 "
            f"for the traceback)", file=sys.stderr, flush=True)
      sys.exit(1)


def _hydra_error(e: BaseException) -> str:
  """Hydra's or OmegaConf's error in one line: its first line (and its cause's), plus what Hydra put on the
  lines after it that a fix needs: a missing group option's choices, an override's parse error."""
  from hydra.errors import MissingConfigException, OverrideParseException
  msg = ": ".join(str(x).strip().splitlines()[0].rstrip(".") for x in (e, e.__cause__) if x and str(x).strip())
  lines = [l.strip() for l in str(e).splitlines()]
  if isinstance(e, MissingConfigException):
    at = next((i for i, l in enumerate(lines) if l.startswith("Available options in")), None)
    if at is not None:
      options = []
      for l in lines[at + 1:]:
        if not l or l.startswith("Config search path"):
          break
        if not l.endswith("_schema"):       # the structured configs' schemas, not choices
          options.append(l)
      msg += f"; choose one of: {', '.join(options)}" if options else ""
  elif isinstance(e, OverrideParseException):
    why = next((l for l in lines[1:] if l and not l.startswith("See https")), "")
    msg += (f" ({why})" if why else "") + "; write each setting as key=value, e.g. train.steps=10"
  return msg


def _unknown_flags(argv: list[str]) -> list[str]:
  """Command-line flags Hydra's parser does not know (it would print its 8-line usage for them)."""
  from hydra._internal.utils import get_args_parser
  try:
    _, extra = get_args_parser().parse_known_args(argv)
  except SystemExit:                       # a known flag used wrongly: Hydra's own message
    return []
  return [a for a in extra if a.startswith("-")]


def _help(main) -> None:
  """Hydra's --help, its group lines without the structured configs' schemas (`*_schema`: the types each YAML
  is checked against, not choices)."""
  import io
  import re
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    try:
      main()
    except SystemExit:
      pass
  for line in buf.getvalue().splitlines():
    m = re.match(r"^(\w+): (.*)$", line)
    if m and "_schema" in m.group(2):
      kept = [o for o in m.group(2).split(", ") if not o.endswith("_schema")]
      if not kept:
        continue
      line = f"{m.group(1)}: {', '.join(kept)}"
    print(line)


@contextlib.contextmanager
def _compose_once(argv: list[str]):
  """Hydra (hydra-core 1.3, `hydra._internal.hydra.Hydra.get_mode`, a private name: this is the one place that
  uses it) composes the whole config twice per command: once only to read `hydra.mode`, then to run. shardlab's
  config sets no mode, so where the command line cannot set one either (no `hydra.mode` override, no other
  config or search path named) the first compose is skipped: Hydra then runs a single run, or a sweep with -m, exactly as it
  would (a quarter of a second per command on a 2-core machine). Otherwise Hydra's own get_mode runs."""
  if any("hydra.mode" in a or "searchpath" in a
         or a.startswith(("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")) for a in argv):
    yield
    return
  from hydra._internal.hydra import Hydra
  own = Hydra.get_mode
  Hydra.get_mode = lambda self, config_name, overrides: None      # what it returns when the config sets no mode
  try:
    yield
  finally:
    Hydra.get_mode = own


def cli() -> None:
  import hydra
  from hydra.errors import HydraException
  from omegaconf.errors import OmegaConfBaseException
  global _FULL_ERROR
  import logging
  register_configs()
  # A log handler that cannot write (Hydra's <run dir>/run.log on a full disk) prints "--- Logging error ---"
  # and a traceback per record; the run reports the full disk itself, in one line.
  logging.raiseExceptions = False
  asked = os.environ.get("HYDRA_FULL_ERROR")
  _FULL_ERROR = asked == "1"
  unknown = [] if _FULL_ERROR else _unknown_flags(sys.argv[1:])
  if unknown:
    print(f"shardlab: error: unknown option {' '.join(unknown)}: settings are key=value (e.g. train.steps=10); "
          "`python -m shardlab --help` lists every group, option and setting", file=sys.stderr)
    sys.exit(2)
  try:
    check_hardware_overrides(sys.argv[1:])
  except ConfigError as e:
    print(f"shardlab: error: {e}", file=sys.stderr)
    sys.exit(2)
  os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its own errors (unknown key, wrong type) to us, unprinted
  if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
    _help(lambda: hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)(_task)())
    return
  try:
    with _compose_once(sys.argv[1:]):
      hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)(_task)()
  except KeyboardInterrupt:               # SIGINT before training started (or while stopping): nothing to save
    if _FULL_ERROR:
      raise
    print("shardlab: interrupted by SIGINT outside the step loop; nothing saved by this signal", file=sys.stderr)
    sys.exit(130)
  except (HydraException, OmegaConfBaseException) as e:
    if _FULL_ERROR:
      raise
    print(f"shardlab: error: {_hydra_error(e)} (`python -m shardlab --help` lists every group, option and "
          "setting)", file=sys.stderr)
    sys.exit(2)
  finally:
    if asked is None:
      os.environ.pop("HYDRA_FULL_ERROR")
    else:
      os.environ["HYDRA_FULL_ERROR"] = asked


if __name__ == "__main__":
  cli()
