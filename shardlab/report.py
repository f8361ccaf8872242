"""`python -m shardlab.report DIR`: turn a run or sweep directory into report.md and PNG figures.

Figures (in DIR): step_time.png (measured on this machine and predicted on the run's hardware preset, side by side;
the title names the model of each prediction: calibrated replay of a target program or peak-rate model over a local
one; "no overlap" and "with overlap" are one bar where they agree for every run), bytes.png (bytes each device
moves per step, per mesh axis), memory.png (compiled peak memory per device), and the timeline of every run (or of
those --runs names: their timeline.png, copied as timeline_<job>.png); a run without one is named in report.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from shardlab.axes import CLASSIC, names as axis_names
from shardlab.outputs import PREDICTION_MODELS, prediction_label
from shardlab.sweep import bytes_per_axis, fmt


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
    label = p.name if p != d else f"{s.get('schedule', '?')}_{'x'.join(str(v) for v in mesh.values()) or '?'}"
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


def _bar(ax, labels, series: dict, ylabel: str, title: str, scale: float = 1.0, legend: bool = True):
  import numpy as np
  x = np.arange(len(labels))
  width = 0.8 / max(len(series), 1)
  for i, (name, vals) in enumerate(series.items()):
    v = [(val or 0) / scale for val in vals]
    bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, v, width, label=name)
    ax.bar_label(bars, labels=[f"{val:.3g}" if val else "" for val in v], fontsize=7, rotation=90, padding=2)
  ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.margins(y=0.25)
  if legend:
    ax.legend(fontsize=8)
  ax.grid(axis="y", alpha=0.3)


def _pred(j: dict) -> dict:
  return j["summary"].get("prediction") or {}


def predicted_series(ok: list[dict]) -> dict:
  """{series name: values} of the predicted step times: "no overlap" (serial) and "with overlap" bars, or one
  bar per run when the two are the same for every run (within 0.1%: nothing overlapped)."""
  serial = [_pred(j).get("t_serial_s") for j in ok]
  overlapped = [_pred(j).get("t_overlapped_s") for j in ok]
  same = all(a is None or b is None or abs(a - b) <= 1e-3 * max(abs(a), abs(b)) for a, b in zip(serial, overlapped))
  if same:
    return {"predicted (no overlap = with overlap)": overlapped}
  return {"no overlap": serial, "with overlap": overlapped}


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

  fig, (a1, a2) = plt.subplots(1, 2, figsize=(2 * width, 4.8))
  _bar(a1, labels, {"measured": [j["summary"].get("step_time_s_median") for j in ok]}, "ms per step",
       f"Measured step time ({ok[0]['summary'].get('device_kind', '?')}, median, compile excluded)", 1e-3,
       legend=False)
  _bar(a2, labels, predicted_series(ok), "ms per step", predicted_title(ok), 1e-3)
  fig.tight_layout()
  fig.savefig(out / "step_time.png", dpi=110)
  plt.close(fig)
  made.append("step_time.png")

  per_axis = [bytes_per_axis(j["summary"].get("comm") or {}) for j in ok]
  axes = sorted({a for p in per_axis for a in p})
  fig, ax = plt.subplots(figsize=(width, 4.8))
  _bar(ax, labels, {a: [p.get(a) for p in per_axis] for a in axes}, "MiB per device per step",
       "Bytes moved per mesh axis (from the compiled HLO)", 2**20)
  fig.tight_layout()
  fig.savefig(out / "bytes.png", dpi=110)
  plt.close(fig)
  made.append("bytes.png")

  fig, ax = plt.subplots(figsize=(width, 4.8))
  mem = [j["summary"].get("memory") or {} for j in ok]
  _bar(ax, labels, {"peak": [m.get("peak") for m in mem], "temporaries": [m.get("temp") for m in mem]},
       "MiB per device", "Compiled memory per device (memory_analysis)", 2**20)
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
  axes = [a for a in axis_names() if a in CLASSIC or any(a in b for b in per_axis)]   # every axis present
  cols = ["run", "status", "final loss", "step ms (measured)", "prediction", "pred. ms (overlap)", "pred. ms (serial)",
          *[f"MiB {a}" for a in axes], "peak MiB", "error"]
  lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for j in jobs:
    s, p = j["summary"], j["summary"].get("prediction") or {}
    b = bytes_per_axis(s.get("comm") or {})
    ms = lambda v: None if v is None else v * 1e3
    mib = lambda v: None if v is None else v / 2**20
    row = [j["label"], j["status"], s.get("final_loss"), ms(s.get("step_time_s_median")),
           prediction_label(s) if p else None, ms(p.get("t_overlapped_s")),
           ms(p.get("t_serial_s")), *[mib(b.get(a)) for a in axes], mib((s.get("memory") or {}).get("peak")),
           s.get("error")]
    lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
  lines.append("")
  for name in made:
    lines += [f"![{name}]({name})", ""]
  for j in chosen:
    dst = d / f"timeline_{j['label']}.png"
    if j["dir"] != d:
      shutil.copyfile(j["dir"] / "timeline.png", dst)
    else:
      dst = d / "timeline.png"
    lines += [f"### Predicted timeline: {j['label']} ({prediction_label(j['summary'])} on "
              f"{_pred(j).get('hardware', '?')})", "", f"![timeline {j['label']}]({dst.name})", ""]
  if without:
    lines += [f"No predicted timeline for {', '.join(without)} (the run wrote no timeline.png: it failed before "
              "its analysis, or ran with an older shardlab).", ""]
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
