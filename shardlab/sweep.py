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
from shardlab.outputs import cell, part_columns, prediction_model, read_metrics

# bytes_<axis>: bytes per device per step over each mesh axis (data, fsdp and tensor always; any other declared
# axis when a job of the sweep has it), in the registry's order.
COLUMNS = ["job", "overrides", "status", "final_loss", "step_time_s_median", "tokens_per_s",
           *[f"bytes_{a}" for a in CLASSIC], "memory_peak_bytes", "predicted_step_s", "hardware", "prediction_model",
           "error"]
PART_NOTES = {"pipeline_bubble": "pipeline_bubble is the predicted idle share of the step as the executor runs the "
                                  "table (pipeline_table_bubble: the table's own, asynchronous).",
              "pipeline_in_flight": "pipeline_in_flight: the microbatches each stage holds at most, stage 0 first.",
              "context_comm_s": "context_comm_s: the predicted time of the collectives over context (the sequence "
                                "split's transfers, hidden or not).",
              "expert_comm_s": "expert_comm_s: the predicted time of the dispatch and combine over expert.",
              "dropped_fraction": "dropped_fraction and expert_load_max_over_mean: means over the steps (measured)."}
# The parts' own columns (outputs.part_columns), after predicted_step_s, where some job has the part.
PART_COLUMNS = ["pipeline_bubble", "pipeline_table_bubble", "pipeline_in_flight", "context_comm_s", "expert_comm_s",
                "dropped_fraction", "expert_load_max_over_mean"]


def columns(rows: list[dict]) -> list[str]:
  """COLUMNS with a bytes_<axis> column for every declared axis some row has, in the registry's order, and the
  columns of the parts some row has (PART_COLUMNS)."""
  have = {k for r in rows for k in r if r[k] is not None}
  axes = [f"bytes_{a}" for a in axis_names() if a in CLASSIC or f"bytes_{a}" in have]
  i = COLUMNS.index(f"bytes_{CLASSIC[0]}")
  cols = COLUMNS[:i] + axes + COLUMNS[i + len(CLASSIC):]
  j = cols.index("predicted_step_s") + 1
  return cols[:j] + [c for c in PART_COLUMNS if c in have] + cols[j:]


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
             prediction_model=prediction_model(pred), error=s.get("error"),
             **part_columns(s, read_metrics(job_dir)))
  return row


def collect(sweep_dir) -> list[dict]:
  jobs = [d for d in Path(sweep_dir).iterdir() if d.is_dir() and (d / ".hydra").exists()]
  def num(d):
    head = d.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, d.name)
  return [job_row(d) for d in sorted(jobs, key=num)]




def _replace(path: Path, text: str) -> None:
  """`path` replaced whole by `text` (a failure leaves the earlier version), and left alone when it already
  says that (a resumed sweep whose jobs were all finished rewrites nothing)."""
  from shardlab.outputs import write_atomic
  try:
    if path.read_bytes() == text.encode():
      return
  except OSError:
    pass
  write_atomic(path, text)


def write(sweep_dir) -> list[dict]:
  """summary.csv and summary.md, each replaced whole, and only if it changed."""
  import io
  rows = collect(sweep_dir)
  d = Path(sweep_dir)
  cols = columns(rows)
  buf = io.StringIO(newline="")
  w = csv.DictWriter(buf, fieldnames=cols)
  w.writeheader()
  for r in rows:
    w.writerow({k: r.get(k) for k in cols})
  _replace(d / "summary.csv", buf.getvalue())
  shown = [c for c in cols if c in ("job", "status") or any(r.get(c) is not None for r in rows)]   # none empty
  lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
  lines += ["| " + " | ".join(cell(k, r.get(k)) for k in shown) + " |" for r in rows]
  ok = sum(r["status"] == "ok" for r in rows)
  parts = [c for c in PART_COLUMNS if c in cols]
  _replace(d / "summary.md", f"# Sweep {d}\n\n{ok} of {len(rows)} jobs ok. Step times are measured on this "
                            f"machine; predicted_step_s is the cost model's, on `hardware`, by `prediction_model` "
                            f"(calibrated: replay of a target program; peak-rate: over the local program)."
                            + (" " + " ".join(PART_NOTES[c] for c in parts if c in PART_NOTES) if parts else "")
                            + " summary.csv has the same rows in plain numbers, and every column (here those no job fills are left out)."
                            "\n\n" + "\n".join(lines) + "\n")
  return rows


def check_sweep_dir(sweep_dir, resume: bool, overrides=()) -> None:
  """A sweep directory belongs to one sweep: a new sweep into one that holds another's jobs or summary would
  overwrite job 0.. and mix its rows with the old jobs' (ConfigError). With checkpoint.resume=true the same
  sweep goes on there (a requeued or re-launched sweep: each job resumes its own run dir); a different one
  (`overrides`, the command's, against its multirun.yaml) is refused too. A single run's directory is no sweep
  directory: the sweep's jobs would hide it from the report, and it theirs."""
  from shardlab.errors import ConfigError
  from shardlab.preflight import check_run_dir, has_checkpoint, run_files, sweep_jobs
  check_run_dir(sweep_dir, "hydra.sweep.dir")     # named, not a file, can be made
  d = Path(str(sweep_dir))
  if not d.is_dir():
    return
  single = run_files(d)
  if single:
    raise ConfigError(f"hydra.sweep.dir={sweep_dir}: holds a single run ({' and '.join(single)}); a sweep's jobs "
                      "beside it would hide it from its report: choose a new hydra.sweep.dir")
  jobs = sweep_jobs(d)
  held = jobs or [n for n in ("summary.csv", "summary.md") if (d / n).exists()]
  if not held and not (d / ".submitit").exists() and (d / "multirun.yaml").is_file():
    # the record of a launch that ran no job and queued none (Hydra saves it before it composes the jobs: a
    # sweep value with a typo is refused after): nothing of a sweep to keep, and this sweep writes its own
    (d / "multirun.yaml").unlink()
    return
  if held and not resume:
    what = (f"{len(jobs)} jobs: {', '.join(jobs[:3])}{', ...' if len(jobs) > 3 else ''}" if jobs else
            " and ".join(held))
    cont = ", or continue that sweep with checkpoint.resume=true" if any(has_checkpoint(d / j) for j in jobs) else ""
    raise ConfigError(f"hydra.sweep.dir={sweep_dir}: holds another sweep ({what}); a new sweep would overwrite its "
                      f"jobs: choose a new hydra.sweep.dir{cont}")
  check_same_sweep(d, overrides)


def _sweep_of(overrides) -> tuple[list, dict]:
  """(the sweep overrides, in order: they make and number the jobs; the others by key, but for run control and
  train.steps, which a resumed sweep may raise to continue every job), each with its parsed value (so that
  1e-3,2e-3 and 0.001,0.002 are the same sweep) and its text."""
  from hydra.core.override_parser.overrides_parser import OverridesParser
  from shardlab.preflight import is_run_control
  parsed = OverridesParser.create().parse_overrides([str(o) for o in overrides])
  sweeps = [(o.get_key_element(), o.value(), o.input_line) for o in parsed if o.is_sweep_override()]
  fixed = {o.get_key_element(): (o.value(), o.input_line) for o in parsed
           if not o.is_sweep_override() and not is_run_control(o.key_or_group) and o.key_or_group != "train.steps"}
  return sweeps, fixed


def check_same_sweep(d: Path, overrides) -> None:
  """The sweep that made `d` (its multirun.yaml's overrides) against this command's: other sweep values, their
  order (which numbers the jobs) or other settings (run control aside: a requeue adds checkpoint.resume=true)
  are another sweep, refused. A multirun.yaml that does not read is left to each job's own checks."""
  import yaml
  from shardlab.errors import ConfigError
  if not (d / "multirun.yaml").is_file():
    return
  try:
    old_sweeps, old_fixed = _sweep_of(yaml.safe_load((d / "multirun.yaml").read_text())["hydra"]["overrides"]["task"])
  except Exception:  # noqa: BLE001  (unreadable, or not Hydra's: nothing to compare)
    return
  sweeps, fixed = _sweep_of(overrides)
  diff = []
  if [(k, v) for k, v, _ in sweeps] != [(k, v) for k, v, _ in old_sweeps]:
    diff.append(f"sweeps {' '.join(t for *_, t in sweeps) or 'none'} (that sweep: "
                f"{' '.join(t for *_, t in old_sweeps) or 'none'})")
  unset = (object(), "unset")
  for k in dict.fromkeys([*fixed, *old_fixed]):
    now, then = fixed.get(k, unset), old_fixed.get(k, unset)
    if now[0] != then[0]:
      diff.append(f"{now[1] if now is not unset else k + ' unset'} (that sweep: {then[1]})")
  if diff:
    raise ConfigError(f"hydra.sweep.dir={d}: holds another sweep (multirun.yaml: {', '.join(diff[:4])}"
                      f"{', ...' if len(diff) > 4 else ''}); it would mix its jobs with that sweep's: choose a new "
                      "hydra.sweep.dir, or rerun that sweep's own command")


def keep_multirun_yaml() -> None:
  """Hydra's BasicSweeper saves the sweep's config as <sweep dir>/multirun.yaml each time a sweep starts
  (hydra-core 1.3, before any job runs, with no setting to turn it off): a resumed sweep would rewrite the record
  of the launch that made the directory. Its save is made to skip a multirun.yaml that exists, which
  check_sweep_dir has found to be this sweep's."""
  from hydra._internal.core_plugins import basic_sweeper
  from omegaconf import OmegaConf
  if getattr(basic_sweeper.OmegaConf, "keeps_multirun_yaml", False):
    return

  class KeepMultirunYaml(OmegaConf):
    keeps_multirun_yaml = True

    @staticmethod
    def save(config, f, resolve: bool = False) -> None:
      if isinstance(f, (str, Path)) and Path(f).name == "multirun.yaml" and Path(f).exists():
        return
      OmegaConf.save(config, f, resolve=resolve)

  basic_sweeper.OmegaConf = KeepMultirunYaml


class SweepSummary(Callback):
  """Hydra callback (conf/config.yaml): refuses a sweep into another sweep's (or a single run's) directory
  before any job starts or multirun.yaml is written (and keeps a resumed sweep's), and writes the sweep summary
  when a multirun ends."""

  def __init__(self) -> None:
    self.failed: dict[str, str] = {}    # job dir name -> the error it failed with in this launch

  def on_multirun_start(self, config, **kwargs) -> None:
    from omegaconf import OmegaConf
    from shardlab.errors import ConfigError
    try:
      check_sweep_dir(OmegaConf.select(config, "hydra.sweep.dir"), bool(OmegaConf.select(config, "checkpoint.resume")),
                      OmegaConf.to_container(config.hydra.overrides.task))
    except ConfigError as e:
      print(f"shardlab: error: {e}", file=sys.stderr, flush=True)
      sys.exit(2)
    keep_multirun_yaml()

  def on_job_end(self, config, job_return, **kwargs) -> None:
    """A job that failed in this launch (run._task returns its error): its row may still say ok, since a refused
    resume keeps the summary.json it found. Seen for jobs run in this process (not submitit's)."""
    if isinstance(job_return.return_value, str):
      self.failed[Path(str(config.hydra.runtime.output_dir)).name] = job_return.return_value

  def on_multirun_end(self, config, **kwargs) -> None:
    rows = write(config.hydra.sweep.dir)
    failed = [r for r in rows if r["status"] != "ok" or r["job"] in self.failed]
    if failed:   # after the summary is written: a CI script must not read a sweep with failed jobs as success
      first = failed[0]
      why = self.failed.get(first["job"]) or first.get("error") or first["status"]
      print(f"shardlab: error: {len(failed)} of {len(rows)} sweep jobs failed (first: job {first['job']}: {why}); "
            f"see {Path(config.hydra.sweep.dir) / 'summary.md'}", file=sys.stderr)
      sys.exit(1)
    d = Path(config.hydra.sweep.dir)
    print(f"shardlab: sweep {d}: {len(rows)} of {len(rows)} jobs ok; {d / 'summary.md'} and summary.csv, "
          f"`python -m shardlab.report {d}` for the figures", flush=True)
