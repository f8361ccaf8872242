"""What a run writes into its directory, and the line it ends with: metrics.jsonl (strict JSON, one object per
step), summary.json, TensorBoard scalars and a jax.profiler trace (`Logs`), the summary of a failed run, and
`final_line`. The trainer (shardlab/trainer.py) calls these; nothing here runs JAX computations.
"""
from __future__ import annotations

import json
import math
import os
import traceback
from pathlib import Path


def final_line(out_dir, summary: dict) -> str:
  """The one line a finished run ends with: run dir, status, final loss, median step time."""
  if summary.get("final_loss") is None:
    return f"shardlab: {out_dir}: {summary['status']} (dry run: compiled and analyzed, no step run)"
  ms = summary["step_time_s_median"] * 1e3
  return (f"shardlab: {out_dir}: {summary['status']}, final loss {summary['final_loss']:.4f} after "
          f"{len(summary['losses'])} steps, step time {ms:.1f} ms (median)")


def strict(x):
  """x with every non-finite float replaced by None, so that json.dumps writes strict JSON (null, not NaN)."""
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  if isinstance(x, dict):
    return {k: strict(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [strict(v) for v in x]
  return x


def write_json(path: Path, obj) -> None:
  path.write_text(json.dumps(strict(obj), indent=2, allow_nan=False))


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


def open_metrics(out: Path, start: int, main: bool):
  """metrics.jsonl for writing, keeping the rows before `start` when resuming into the same run dir (the rows
  of steps after the restored checkpoint are run again). Processes other than 0 write nowhere."""
  if not main:
    return open(os.devnull, "w")
  path = out / "metrics.jsonl"
  kept = [l for l in path.read_text().splitlines() if json.loads(l)["step"] < start] if start and path.exists() else []
  f = open(path, "w")
  f.writelines(l + "\n" for l in kept)
  return f


def record_failure(out_dir, e: BaseException) -> None:
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
  write_json(path, {"status": "error", "error": err, **({"traceback": tb} if tb.strip() != "NoneType: None" else {})})

