"""What a run writes into its directory, and the line it ends with: metrics.jsonl (strict JSON, one object per
step), summary.json, TensorBoard scalars and a jax.profiler trace (`Logs`), the summary of a failed run, and
`final_line`. The trainer (shardlab/trainer.py) calls these; nothing here runs JAX computations.
"""
from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path


class RunLog:
  """Within it, what the run prints (stdout and stderr, as they reach the console) is also appended to `path`
  (<run dir>/run.log), a line at a time; a progress bar's redraws (carriage returns) leave the line's last state.
  The file is opened at the first line, so a run refused before it printed anything leaves run.log as it was;
  `note(line)` appends a line only to a log already started (an error after the run began). `write=False` (a
  process other than the first of a multi-process run) tees nothing."""

  def __init__(self, path, write: bool = True):
    self.path, self.write, self.file, self.saved, self.started = Path(path), write, None, None, False

  def __enter__(self):
    if self.write:
      self.saved = sys.stdout, sys.stderr
      sys.stdout, sys.stderr = _Tee(sys.stdout, self), _Tee(sys.stderr, self)
    return self

  def __exit__(self, *exc):
    if self.saved:
      for tee in (sys.stdout, sys.stderr):
        if isinstance(tee, _Tee):
          tee.end()     # and from now on only the console: a logger may hold on to the tee
      sys.stdout, sys.stderr = self.saved
    if self.file:
      self.file.close()
      self.file = None
    return False

  def line(self, text: str) -> None:
    try:
      if self.file is None:
        self.file, self.started = open(self.path, "a", encoding="utf-8"), True
      self.file.write(text + "\n")
      self.file.flush()
    except OSError:   # a full disk: the console still has it (the run reports what it could not write)
      self.write = False

  def note(self, text: str) -> None:
    if self.started and self.write:
      self.line(text)
      self.file.close()
      self.file = None


class _Tee:
  """A text stream that writes to `stream` and, until `end`, hands each finished line to `log` (RunLog.line).
  Closing it leaves `stream` open (a log handler made while it was sys.stderr closes its stream at exit)."""

  def __init__(self, stream, log: RunLog):
    self.stream, self.log, self.pending = stream, log, ""

  def write(self, s: str) -> int:
    n = self.stream.write(s)
    if self.log is not None and self.log.write:
      *lines, self.pending = (self.pending + s).split("\n")
      for l in lines:
        self.log.line(l.rsplit("\r", 1)[-1].rstrip())
    return n

  def end(self) -> None:
    if self.log is not None and self.pending.strip() and self.log.write:
      self.log.line(self.pending.rsplit("\r", 1)[-1].rstrip())
    self.pending, self.log = "", None

  def flush(self) -> None:
    self.stream.flush()

  def close(self) -> None:
    self.flush()

  def __getattr__(self, name):
    return getattr(self.stream, name)


def final_line(out_dir, summary: dict) -> str:
  """The one line a finished run ends with: run dir, status, final loss, median step time (none when this
  process ran no step: a requeued run whose last checkpoint was already the final one)."""
  if summary.get("final_loss") is None:
    return f"shardlab: {out_dir}: {summary['status']} (dry run: compiled and analyzed, no step run)"
  median = summary.get("step_time_s_median")
  time_ = f"step time {median * 1e3:.1f} ms (median)" if median is not None else "no step timed"
  return (f"shardlab: {out_dir}: {summary['status']}, final loss {summary['final_loss']:.4f} after "
          f"{len(summary['losses'])} steps, {time_}")


# The two models a run's prediction comes from (summary.json's prediction.model starts with the key).
PREDICTION_MODELS = {
    "calibrated": "calibrated replay of the target program (its compiler's scheduled order at achieved rates)",
    "peak-rate": "peak-rate model over the program (its dependency graph at the preset's peak rates)",
}


def prediction_model(pred: dict | None) -> str | None:
  """'calibrated' or 'peak-rate': which model made summary.json's `prediction` (None without one). A summary
  written before predictions were named has no `model` for the peak-rate one."""
  if not pred:
    return None
  return "calibrated" if str(pred.get("model", "")).startswith("calibrated") else "peak-rate"


def prediction_label(summary: dict) -> str:
  """'calibrated, h100 program' / 'peak-rate, cpu program': the model and the program it read, for figures."""
  pred = summary.get("prediction") or {}
  kind = prediction_model(pred)
  if kind is None:
    return "no prediction"
  program = (summary.get("memory") or {}).get("compiled_by") or summary.get("platform") or "?"
  return f"{kind}, {program} program"


def part_columns(summary: dict, metrics: list[dict] | None = None) -> dict:
  """The columns of the parts a run has, for the sweep's and the report's tables (None where it has not that
  part): pipeline_bubble (the executor's, predicted; its step is the run's predicted step), pipeline_table_bubble (the table's own),
  pipeline_in_flight (microbatches each stage holds, stage 0 first); context_comm_s and expert_comm_s (the
  predicted time of the collectives over that axis, where it splits); for a mixture of experts, over the run's
  steps (`metrics`: metrics.jsonl's rows), dropped_fraction and expert_load_max_over_mean (their means)."""
  out = {}
  pp = summary.get("pipeline_prediction")
  if pp:
    out.update(pipeline_bubble=pp.get("bubble"),
               pipeline_table_bubble=pp.get("table_bubble"),
               pipeline_in_flight="/".join(str(n) for n in pp.get("in_flight") or []) or None)
  comm = (summary.get("prediction") or {}).get("t_comm_s") or {}
  mesh = summary.get("mesh") or {}
  from shardlab.axes import CONTEXT, EXPERT
  for axis in (CONTEXT, EXPERT):          # a sequence or the experts split: their links' predicted time
    if mesh.get(axis, 1) > 1 and axis in comm:
      out[f"{axis}_comm_s"] = comm[axis]
  rows = [r for r in metrics or [] if "dropped_fraction" in r]
  if rows:
    mean = lambda k: sum(r[k] for r in rows) / len(rows)
    out.update(dropped_fraction=mean("dropped_fraction"), expert_load_max_over_mean=mean("expert_load_max_over_mean"))
  return out


def read_metrics(run_dir) -> list[dict]:
  """metrics.jsonl's rows ([] if there is none, or a row does not parse: a run killed while writing one)."""
  rows = []
  try:
    text = (Path(run_dir) / "metrics.jsonl").read_text()
  except OSError:
    return rows
  for line in text.splitlines():
    try:
      rows.append(json.loads(line))
    except ValueError:
      continue
  return rows


def cell(column: str, v) -> str:
  """A table cell of a human table (summary.md, report.md): bytes in GB/MB, seconds in s/ms/us, rates per second
  with thousands separators, fractions as percentages, other floats to 4 significant digits; empty for None;
  pipes and newlines escaped."""
  if v is None:
    return ""
  if isinstance(v, (int, float)) and not isinstance(v, bool):
    if column.startswith("bytes_") or column.endswith("_bytes"):
      return human_bytes(v)
    if "_per_s" in column:          # a rate (tokens_per_s), not a time
      return f"{v:,.0f}/s"
    if column.endswith("_s") or column.endswith("_s_median"):
      return human_seconds(v)
    if column.endswith("bubble") or column.endswith("fraction"):
      return f"{100 * v:.3g}%"
    if isinstance(v, float):
      return f"{v:.4g}"
  return str(v).replace("|", "\\|").replace("\n", " ")


def human_bytes(b: float) -> str:
  """'69.5 GB', '513 kB': decimal units, 3 significant digits (what the terminal shows)."""
  for unit, n in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(b) >= n:
      return f"{b / n:.3g} {unit}"
  return f"{b:.0f} B"


def human_seconds(t: float) -> str:
  """'1.34 s', '138 us': 3 significant digits."""
  for unit, n in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if t >= n * 0.9995:                  # 0.9996 s is '1 s', not '1e+03 ms'
      if t < n:
        return f"1 {unit}"
      return f"{t / n:.3g} {unit}"
  return f"{t * 1e9:.3g} ns"


def strict(x):
  """x with every non-finite float replaced by None, so that json.dumps writes strict JSON (null, not NaN)."""
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  if isinstance(x, dict):
    return {k: strict(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [strict(v) for v in x]
  return x


def write_atomic(path, data: str | bytes) -> None:
  """Write `path` so that a failure (a full disk, a kill) leaves its earlier version or nothing, never a
  truncated file: a temporary file in the same directory, flushed to disk, renamed over `path`."""
  path = Path(path)
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
  try:
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def overwrite_setting(text: str) -> bool:
  """A command's overwrite= setting: true or false, else one ConfigError line."""
  from shardlab.errors import ConfigError
  if text not in ("true", "false"):
    raise ConfigError(f"overwrite={text}: true or false")
  return text == "true"


def check_output_file(setting: str, path, overwrite: str = "false", also=()) -> None:
  """A file a command was told to write (`out=`, `json=`; `also`: files written beside it) is checked before any
  work: its directory exists and takes a file, and a file already there is not written over unless asked
  (`overwrite`: the command's overwrite= setting, true or false). ConfigError, one line naming the setting."""
  import tempfile
  from shardlab.errors import ConfigError
  replace = overwrite_setting(overwrite)
  path = Path(path)
  for p in (path, *also):
    if p.is_dir():
      raise ConfigError(f"{setting}={path}: {p} is a directory; name a file")
    if p.exists() and not replace:
      raise ConfigError(f"{setting}={path}: {p} already exists; pick another path or add overwrite=true")
  if not path.parent.is_dir():
    raise ConfigError(f"{setting}={path}: the directory {path.parent} does not exist")
  try:
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.probe-"):
      pass
  except OSError as e:
    raise ConfigError(f"{setting}={path}: cannot write in {path.parent} ({e.strerror or e})") from None


def write_json(path: Path, obj) -> None:
  write_atomic(path, json.dumps(strict(obj), indent=2, allow_nan=False))


def move_into(src: Path, dst: Path) -> None:
  """Every file of `src` (a staging directory the analysis wrote into) renamed into `dst`, replacing older
  versions whole; then `src` removed. Same filesystem: each rename is atomic."""
  for p in sorted(src.iterdir()):
    os.replace(p, dst / p.name)
  src.rmdir()


def writing_failed(e: OSError, out) -> bool:
  """An OSError from writing into the run directory `out`: a path under it, or no space, quota or permission."""
  import errno
  name = getattr(e, "filename", None)
  under = name is not None and str(Path(name).absolute()).startswith(str(Path(out).absolute()))
  return under or e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO)


def cannot_write(out, what: str, when: str, ckpt: dict | None = None):
  """The RunError for a file of the run directory that could not be written (a full disk, most often): one
  line naming the directory, the file and the step; what was written before stays whole (write_atomic,
  Metrics)."""
  import sys
  from shardlab.errors import RunError
  e = sys.exc_info()[1]
  why = getattr(e, "strerror", None) or " ".join(str(e).split())[:160]
  saved = (ckpt or {}).get("saved") or []
  last = saved[-1] if saved else (ckpt or {}).get("resumed_from")
  keep = (f"; checkpoint {last} in {ckpt['dir']} is saved: free space, then continue with checkpoint.resume=true"
          if last is not None else "; free space or choose another hydra.run.dir")
  return RunError(f"hydra.run.dir={out}: cannot write {what} {when} ({why}); its earlier files are kept whole{keep}")


def non_finite(loss: float, gnorm: float, step: int, ckpt) -> str:
  """Which one is non-finite: a finite loss with a NaN/inf gradient norm is not 'a non-finite loss'."""
  good = f"checkpoint {ckpt.latest} in {ckpt.dir}" if ckpt.latest else "none"
  what = (f"non-finite loss {loss} (grad_norm {gnorm})" if not math.isfinite(loss) else
          f"non-finite gradient norm {gnorm} (loss {loss})")
  return f"{what} at step {step}; last good checkpoint: {good}"


class Logs:
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
        if math.isfinite(rec[k]):   # a NaN is in metrics.jsonl (null); tensorboardX would warn before our line
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
      try:
        self.tb.close()
      except OSError:   # a full disk: metrics.jsonl and the error line say what happened
        pass


def _rows(path: Path) -> list[str]:
  """metrics.jsonl's lines that parse (a line cut short by a kill or a full disk is dropped)."""
  out = []
  for l in path.read_text().splitlines() if path.exists() else []:
    try:
      if isinstance(json.loads(l).get("step"), int):
        out.append(l)
    except (ValueError, AttributeError):
      pass
  return out


def step_times(out: Path, steps: int) -> list[float]:
  """The step times metrics.jsonl recorded for steps [0, steps) (a resumed run that ran no step itself)."""
  rows = [json.loads(l) for l in _rows(out / "metrics.jsonl")]
  return [r["step_time_s"] for r in rows if r["step"] < steps and isinstance(r.get("step_time_s"), float)]


class Metrics:
  """metrics.jsonl, one line per step, appended unbuffered. A line that fails to be written whole (a full disk)
  is cut off again, so the file keeps only whole lines; the OSError is raised. `opener`: opens the file when the
  first line is written (a resumed run drops the rows it runs again only then: open_metrics)."""

  def __init__(self, f=None, opener=None):
    self.f, self.opener = f, opener

  def write(self, line: str) -> None:
    if self.f is None:
      self.f = self.opener()
    data, pos = line.encode(), self.f.tell()
    try:
      while data:
        data = data[self.f.write(data):]
    except OSError:
      try:
        os.ftruncate(self.f.fileno(), pos)
      except OSError:
        pass
      raise

  def flush(self) -> None:
    """Nothing buffered: each write reached the file."""

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.f is not None:
      self.f.close()


def open_metrics(out: Path, start: int, main: bool) -> Metrics:
  """metrics.jsonl for appending, keeping the rows before `start` when resuming into the same run dir (the rows
  of steps after the restored checkpoint are run again; the kept rows are rewritten atomically, so a failure
  leaves the old file). A fresh run (start 0) starts an empty file. Both happen when the first new row is
  written: a run that fails before its first step leaves the file it found whole. Processes other than 0 write
  nowhere."""
  if not main:
    return Metrics(open(os.devnull, "wb", buffering=0))
  path = out / "metrics.jsonl"

  def opener():
    kept = [l for l in _rows(path) if json.loads(l)["step"] < start] if start else []
    write_atomic(path, "".join(l + "\n" for l in kept))
    return open(path, "ab", buffering=0)
  return Metrics(opener=opener)


def record_failure(out_dir, e: BaseException) -> None:
  """A failed job leaves a summary.json that says so (a sweep keeps going and reports it as a row), but only
  where there is none. One already there is kept, whatever it says: this run's own (the trainer wrote the error
  with the losses so far), or an earlier run's that a failed or refused resume found (its losses, an interrupted
  or finished run's, must not give way to a bare error record; the error is on stderr)."""
  path = Path(out_dir, "summary.json")
  if os.path.lexists(path):
    return
  err, tb = f"{type(e).__name__}: {e}", traceback.format_exc()
  try:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_json(path, {"status": "error", "error": err, **({"traceback": tb} if tb.strip() != "NoneType: None" else {})})
  except OSError:   # a full disk (the error line says so): the earlier summary.json, if any, stays whole
    pass

