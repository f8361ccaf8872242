"""Sweep summaries: at the end of a `--multirun`, one row per job in summary.csv and summary.md in the sweep
directory. A failed job is a row with its error (the task function records it instead of raising), and a sweep
with any failed job exits with status 1 once the summary is written."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from shardlab.axes import CLASSIC, names as axis_names
from shardlab.outputs import prediction_model

# bytes_<axis>: bytes per device per step over each mesh axis (data, fsdp and tensor always; any other declared
# axis when a job of the sweep has it), in the registry's order.
COLUMNS = ["job", "overrides", "status", "final_loss", "step_time_s_median", "tokens_per_s",
           *[f"bytes_{a}" for a in CLASSIC], "memory_peak_bytes", "predicted_step_s", "hardware", "prediction_model",
           "error"]


def columns(rows: list[dict]) -> list[str]:
  """COLUMNS with a bytes_<axis> column for every declared axis some row has, in the registry's order."""
  have = {k for r in rows for k in r}
  axes = [f"bytes_{a}" for a in axis_names() if a in CLASSIC or f"bytes_{a}" in have]
  i = COLUMNS.index(f"bytes_{CLASSIC[0]}")
  return COLUMNS[:i] + axes + COLUMNS[i + len(CLASSIC):]


def bytes_per_axis(comm: dict) -> dict:
  """{axis: bytes sent per device per step} from a summary's `comm` ({kind: {axis: {"bytes", ..}}}); a
  collective over several axes counts on each."""
  out: dict = {}
  for per_axis in comm.values():
    for axis, row in per_axis.items():
      for a in axis.split("+"):   # a collective over both axes counts on each
        out[a] = out.get(a, 0) + row["bytes"]
  return out


def job_row(job_dir: Path) -> dict:
  overrides_file = job_dir / ".hydra" / "overrides.yaml"
  overrides = []
  if overrides_file.exists():
    import yaml
    overrides = yaml.safe_load(overrides_file.read_text()) or []
  row = {"job": job_dir.name, "overrides": " ".join(overrides), "status": "missing"}
  summary_file = job_dir / "summary.json"
  if not summary_file.exists():
    row["error"] = "no summary.json (the job died before writing one)"
    return row
  try:
    s = json.loads(summary_file.read_text())
  except (OSError, ValueError) as e:
    s = None
    row["error"] = f"summary.json unreadable: {e}"
  if not isinstance(s, dict):
    row.setdefault("error", "summary.json is not a JSON object")
    return row
  pred = s.get("prediction") or {}
  per_axis = bytes_per_axis(s.get("comm", {}))
  row.update(status=s.get("status"), final_loss=s.get("final_loss"), step_time_s_median=s.get("step_time_s_median"),
             tokens_per_s=s.get("tokens_per_s_median"),
             **{f"bytes_{a}": per_axis.get(a) for a in dict.fromkeys([*CLASSIC, *per_axis])},
             memory_peak_bytes=(s.get("memory") or {}).get("peak"),
             predicted_step_s=pred.get("t_overlapped_s"), hardware=pred.get("hardware"),
             prediction_model=prediction_model(pred), error=s.get("error"))
  return row


def collect(sweep_dir) -> list[dict]:
  jobs = [d for d in Path(sweep_dir).iterdir() if d.is_dir() and (d / ".hydra").exists()]
  def num(d):
    head = d.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, d.name)
  return [job_row(d) for d in sorted(jobs, key=num)]


def fmt(v) -> str:
  """A table cell: empty for None, 4 significant digits for a float, pipes and newlines escaped."""
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v).replace("|", "\\|").replace("\n", " ")


def write(sweep_dir) -> list[dict]:
  """summary.csv and summary.md, each replaced whole (a failure leaves the earlier version)."""
  import io
  from shardlab.outputs import write_atomic
  rows = collect(sweep_dir)
  d = Path(sweep_dir)
  cols = columns(rows)
  buf = io.StringIO(newline="")
  w = csv.DictWriter(buf, fieldnames=cols)
  w.writeheader()
  for r in rows:
    w.writerow({k: r.get(k) for k in cols})
  write_atomic(d / "summary.csv", buf.getvalue())
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(fmt(r.get(k)) for k in cols) + " |" for r in rows]
  ok = sum(r["status"] == "ok" for r in rows)
  write_atomic(d / "summary.md", f"# Sweep {d}\n\n{ok} of {len(rows)} jobs ok. Step times are measured on this "
                                f"machine; predicted_step_s is the cost model's, on `hardware`, by `prediction_model` "
                                f"(calibrated: replay of a target program; peak-rate: over the local program).\n\n"
                                + "\n".join(lines) + "\n")
  return rows


def check_sweep_dir(sweep_dir, resume: bool) -> None:
  """A sweep directory belongs to one sweep: a new sweep into one that holds another's jobs or summary would
  overwrite job 0.. and mix its rows with the old jobs' (ConfigError). With checkpoint.resume=true the same
  sweep goes on there (a requeued or re-launched sweep: each job resumes its own run dir)."""
  from shardlab.mesh import ConfigError
  from shardlab.preflight import check_run_dir
  check_run_dir(sweep_dir, "hydra.sweep.dir")     # named, not a file, can be made
  d = Path(str(sweep_dir))
  if resume or not d.is_dir():
    return
  jobs = sorted(p.name for p in d.iterdir() if p.is_dir() and ((p / ".hydra").exists() or (p / "summary.json").exists()))
  held = jobs or [n for n in ("summary.csv", "summary.md") if (d / n).exists()]
  if held:
    what = (f"{len(jobs)} jobs: {', '.join(jobs[:3])}{', ...' if len(jobs) > 3 else ''}" if jobs else
            " and ".join(held))
    raise ConfigError(f"hydra.sweep.dir={sweep_dir}: holds another sweep ({what}); a new sweep would overwrite its "
                      "jobs: choose a new hydra.sweep.dir, or continue that sweep with checkpoint.resume=true")


class SweepSummary(Callback):
  """Hydra callback (conf/config.yaml): refuses a sweep into another sweep's directory before any job
  starts, and writes the sweep summary when a multirun ends."""

  def on_multirun_start(self, config, **kwargs) -> None:
    from omegaconf import OmegaConf
    from shardlab.mesh import ConfigError
    try:
      check_sweep_dir(OmegaConf.select(config, "hydra.sweep.dir"), bool(OmegaConf.select(config, "checkpoint.resume")))
    except ConfigError as e:
      print(f"shardlab: error: {e}", file=sys.stderr, flush=True)
      sys.exit(2)

  def on_multirun_end(self, config, **kwargs) -> None:
    rows = write(config.hydra.sweep.dir)
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:   # after the summary is written: a CI script must not read a sweep with failed jobs as success
      print(f"shardlab: error: {len(failed)} of {len(rows)} sweep jobs failed (first: job {failed[0]['job']}: "
            f"{failed[0].get('error') or failed[0]['status']}); see {Path(config.hydra.sweep.dir) / 'summary.md'}",
            file=sys.stderr)
      sys.exit(1)
