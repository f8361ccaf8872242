"""`python -m shardlab.report DIR`: turn a run or sweep directory into report.md and PNG figures.

Figures (in DIR): step_time.png (measured on this machine and predicted on the run's hardware preset, side by side;
the title names the model of each prediction: calibrated replay of a target program or peak-rate model over a local
one; "compute + comm, serial" and "predicted step" are one bar where they agree for every run), bytes.png (bytes each device
moves per step, per mesh axis), memory.png (compiled peak memory per device), each in the unit that reads (GB or
MB, ms or us), every pipeline run's pipeline.png (copied as pipeline_<job>.png), and the timeline of every run (or
of those --runs names: their timeline.png, copied as timeline_<job>.png); a run without one is named in report.md.
The table has the columns of the parts the runs have (outputs.part_columns: a pipeline's bubble and microbatches in
flight, a mixture of experts' dropped tokens and load).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from shardlab.axes import label as mesh_label, names as axis_names
from shardlab.outputs import PREDICTION_MODELS, cell, part_columns, prediction_label, read_metrics
from shardlab.sweep import PART_COLUMNS, bytes_per_axis


def load_jobs(d: Path) -> list[dict]:
  """One entry per run: a run directory is one job, a sweep directory one per subdirectory."""
  dirs = [d] if (d / "summary.json").exists() else sorted(
      (p for p in d.iterdir() if (p / "summary.json").exists()),
      key=lambda p: (int(p.name.split("_")[0]) if p.name.split("_")[0].isdigit() else 1 << 30, p.name))
  jobs = []
  for p in dirs:
    s = _read_summary(p / "summary.json")
    cfg = s.get("config") if isinstance(s.get("config"), dict) else {}
    mesh = s.get("mesh") if isinstance(s.get("mesh"), dict) else {}
    label = p.name if p != d else f"{s.get('schedule', '?')}_{mesh_label(mesh) if mesh else '?'}"
    jobs.append({"dir": p, "label": label, "summary": s, "status": s.get("status"),
                 "schedule": s.get("schedule") or (cfg.get("schedule") or {}).get("name")})
  return jobs


class ReportError(ValueError):
  """Input the report cannot use (a malformed summary.json, an unknown run name): one line, exit 2."""


def _read_summary(path: Path) -> dict:
  try:
    s = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError) as e:
    raise ReportError(f"{path}: cannot read it ({e})") from None
  except ValueError as e:
    raise ReportError(f"{path}: not valid JSON ({e}); rerun that job or move the file away") from None
  if not isinstance(s, dict):
    raise ReportError(f"{path}: holds a JSON {type(s).__name__}, not an object (a shardlab summary); rerun that job "
                      "or move the file away")
  for k in ("mesh", "prediction", "memory", "comm"):
    if s.get(k) is not None and not isinstance(s[k], dict):
      raise ReportError(f"{path}: '{k}' is a {type(s[k]).__name__}, not an object: not a shardlab summary")
  return s


def unit_of(values, kind: str) -> tuple[float, str]:
  """(divisor, unit) that shows the largest of `values` (bytes or seconds) with 1 to 3 digits before the point."""
  top = max((abs(v) for v in values if v), default=0.0)
  steps = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B")) if kind == "bytes" else \
      ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns"))
  return next(((n, u) for n, u in steps if top >= n), steps[-1])


def _bar(ax, labels, series: dict, kind: str, what: str, title: str, legend: bool = True):
  """Grouped bars of `series` ({name: values}, bytes or seconds: `kind`), in the unit that reads (unit_of), each
  bar labelled with its value; the axis from zero in that unit."""
  import numpy as np
  scale, unit = unit_of([v for vals in series.values() for v in vals], kind)
  x = np.arange(len(labels))
  width = 0.8 / max(len(series), 1)
  for i, (name, vals) in enumerate(series.items()):
    v = [(val or 0) / scale for val in vals]
    bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, v, width, label=name)
    ax.bar_label(bars, labels=[f"{val:.3g}" if val else "" for val in v], fontsize=7, rotation=90, padding=2)
  ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
  ax.set_ylabel(f"{what} ({unit})")
  top = max((v or 0) / scale for vals in series.values() for v in vals) if series else 0
  ax.set_ylim(0, 1.45 * top if top > 0 else 1)         # room above the bars for their labels and the legend
  ax.set_title(title, fontsize=10, loc="left")
  if legend:                                             # inside the plot, in the room left above the bars
    ax.legend(fontsize=8, loc="upper right", ncol=len(series), frameon=False)
  ax.grid(axis="y", alpha=0.3)


def _pred(j: dict) -> dict:
  return j["summary"].get("prediction") or {}


def predicted_series(ok: list[dict]) -> dict:
  """{series name: values} of the predicted step times: the compute and communication time of one device added up
  (serial) and the predicted step (with overlap; a pipeline's with its bubble) bars, or one bar per run when the
  two are the same for every run (within 0.1%)."""
  serial = [_pred(j).get("t_serial_s") for j in ok]
  overlapped = [_pred(j).get("t_overlapped_s") for j in ok]
  same = all(a is None or b is None or abs(a - b) <= 1e-3 * max(abs(a), abs(b)) for a, b in zip(serial, overlapped))
  name = serial_label(ok)
  if same:
    return {f"predicted step (= {name})": overlapped}
  return {name: serial, "predicted step": overlapped}


def serial_label(jobs: list[dict]) -> str:
  """What t_serial_s is: the compute and communication of one device added up; with pipeline stages, of one
  device's program walked alone, without the bubble (the predicted step replays the schedule's table)."""
  if any(j["summary"].get("pipeline_prediction") for j in jobs):
    return "one device's program, serial (no bubble)"
  return "compute + comm, serial"


def predicted_title(ok: list[dict]) -> str:
  """'Predicted step time on h100 (peak-rate, cpu program)': the hardware and the model that made each
  prediction (outputs.prediction_label), every distinct one."""
  hw = sorted({_pred(j).get("hardware") for j in ok} - {None})
  models = sorted({prediction_label(j["summary"]) for j in ok if _pred(j)})
  if not hw:
    return "Predicted step time (no prediction)"
  return f"Predicted step time on {', '.join(hw)}\n(model: {'; '.join(models)})"


def figures(jobs: list[dict], out: Path) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ok = [j for j in jobs if j["status"] == "ok"]
  if not ok:
    return []
  labels = [j["label"] for j in ok]
  width = max(6, 1.1 * len(ok) + 3)
  made = []

  measured = [j["summary"].get("step_time_s_median") for j in ok]
  if any(measured):          # a dry-run sweep measured nothing: its panel would be empty
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(2 * width, 4.8))
    _bar(a1, labels, {"measured": measured}, "seconds", "per step",
         f"Measured step time ({ok[0]['summary'].get('device_kind', '?')}, median, compile excluded)", legend=False)
  else:
    fig, a2 = plt.subplots(figsize=(width, 4.8))
  _bar(a2, labels, predicted_series(ok), "seconds", "per step", predicted_title(ok))
  fig.tight_layout()
  fig.savefig(out / "step_time.png", dpi=110)
  plt.close(fig)
  made.append("step_time.png")

  per_axis = [bytes_per_axis(j["summary"].get("comm") or {}) for j in ok]
  axes = [a for a in axis_names() if any(p.get(a) for p in per_axis)]
  fig, ax = plt.subplots(figsize=(width, 4.8))
  _bar(ax, labels, {a: [p.get(a) for p in per_axis] for a in axes}, "bytes", "per device per step",
       "Bytes moved per mesh axis (from the compiled HLO)")
  fig.tight_layout()
  fig.savefig(out / "bytes.png", dpi=110)
  plt.close(fig)
  made.append("bytes.png")

  fig, ax = plt.subplots(figsize=(width, 4.8))
  mem = [j["summary"].get("memory") or {} for j in ok]
  _bar(ax, labels, {"peak": [m.get("peak") for m in mem], "temporaries": [m.get("temp") for m in mem]},
       "bytes", "per device", "Compiled memory per device (memory_analysis)")
  fig.tight_layout()
  fig.savefig(out / "memory.png", dpi=110)
  plt.close(fig)
  made.append("memory.png")
  return made


def write_report(d: Path, runs: list[str] | None = None) -> Path:
  jobs = load_jobs(d)
  if not jobs:
    raise ReportError(f"no summary.json in {d} or its subdirectories")
  if runs is not None:
    unknown = [r for r in runs if r not in {j["label"] for j in jobs}]
    if unknown:
      raise ReportError(f"--runs {','.join(runs)}: no run named {', '.join(unknown)} in {d}; runs here: "
                        f"{', '.join(j['label'] for j in jobs)}")
  made = figures(jobs, d)
  # Every run's timeline (or those --runs names): none is left out without saying so.
  chosen = [j for j in jobs if (j["dir"] / "timeline.png").exists() and (runs is None or j["label"] in runs)]
  without = [j["label"] for j in jobs if not (j["dir"] / "timeline.png").exists() and (runs is None or j["label"] in runs)]
  lines = [f"# Report: {d}", "", f"{sum(j['status'] == 'ok' for j in jobs)} of {len(jobs)} runs ok. Measured "
           "times are from the machine that ran them (on fake CPU devices they are a regression canary, not a "
           "claim about overlap); predicted times come from the cost model on the named hardware preset, by the "
           "model each row names: " + "; ".join(f"{k}: {v}" for k, v in PREDICTION_MODELS.items())
           + " (a run compiled for its target is predicted by the calibrated model, a local program by the "
           "peak-rate one).", ""]
  per_axis = [bytes_per_axis(j["summary"].get("comm") or {}) for j in jobs]
  axes = [a for a in axis_names() if any(b.get(a) for b in per_axis)]   # every axis some run moves bytes over
  parts = [part_columns(j["summary"], read_metrics(j["dir"])) for j in jobs]
  part_cols = [c for c in PART_COLUMNS if any(p.get(c) is not None for p in parts)]
  # (header, the cell's kind for outputs.cell: *_s seconds, *_bytes bytes, *bubble / *fraction a percentage)
  cols = [("run", ""), ("status", ""), ("final loss", ""), ("step (measured)", "_s"), ("prediction", ""),
          ("predicted step", "_s"), (serial_label(jobs), "_s"),
          *[(c.replace("_", " "), c) for c in part_cols], *[(f"bytes {a}", "_bytes") for a in axes],
          ("peak memory", "_bytes"), ("error", "")]
  rows = []
  for j, pc in zip(jobs, parts):
    s, p = j["summary"], j["summary"].get("prediction") or {}
    b = bytes_per_axis(s.get("comm") or {})
    rows.append([j["label"], j["status"], s.get("final_loss"), s.get("step_time_s_median"),
                 prediction_label(s) if p else None, p.get("t_overlapped_s"), p.get("t_serial_s"),
                 *[pc.get(c) for c in part_cols], *[b.get(a) for a in axes], (s.get("memory") or {}).get("peak"),
                 s.get("error")])
  keep = [i for i in range(len(cols)) if i < 2 or any(r[i] is not None for r in rows)]   # no column no run fills
  lines += ["| " + " | ".join(cols[i][0] for i in keep) + " |", "|" + "---|" * len(keep)]
  for row in rows:
    lines.append("| " + " | ".join(cell(cols[i][1], row[i]) for i in keep) + " |")
  lines.append("")
  for name in made:
    lines += [f"![{name}]({name})", ""]
  for j in jobs:            # every pipeline run's picture: which schedule leaves the least bubble
    if (j["dir"] / "pipeline.png").exists():
      dst = d / (f"pipeline_{j['label']}.png" if j["dir"] != d else "pipeline.png")
      if j["dir"] != d:
        shutil.copyfile(j["dir"] / "pipeline.png", dst)
      lines += [f"### Pipeline schedule: {j['label']} (prediction)", "", f"![pipeline {j['label']}]({dst.name})", ""]
  for j in chosen:
    dst = d / f"timeline_{j['label']}.png"
    if j["dir"] != d:
      shutil.copyfile(j["dir"] / "timeline.png", dst)
    else:
      dst = d / "timeline.png"
    lines += [f"### Predicted timeline: {j['label']} ({prediction_label(j['summary'])} on "
              f"{_pred(j).get('hardware', '?')})", "", f"![timeline {j['label']}]({dst.name})", ""]
  if without:
    lines += [f"No predicted timeline for {', '.join(without)} (the run wrote no timeline.png: it ran with "
              "figures=false, failed before its analysis, or ran with an older shardlab).", ""]
  (d / "report.md").write_text("\n".join(lines))
  return d / "report.md"


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m shardlab.report", description=__doc__.splitlines()[0])
  ap.add_argument("dir", type=Path, help="a run directory or a sweep directory")
  ap.add_argument("--runs", default=None, help="comma-separated run names whose timelines to include (default: "
                                                 "every run's)")
  a = ap.parse_args(argv)
  if not a.dir.is_dir():
    print(f"shardlab.report: error: {a.dir} is not a directory", file=sys.stderr)
    raise SystemExit(2)
  runs = [r.strip() for r in a.runs.split(",") if r.strip()] if a.runs is not None else None
  if runs == []:
    print(f"shardlab.report: error: --runs {a.runs!r}: name at least one run", file=sys.stderr)
    raise SystemExit(2)
  try:
    print(write_report(a.dir, runs))
  except ReportError as e:
    print(f"shardlab.report: error: {e}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
  main()
