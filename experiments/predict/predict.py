"""Predicted step time of every schedule preset (shardlab/conf/schedule/) for LLaMA-3 8B dimensions on an H100 node and a
TPU v5p slice. MODEL PREDICTIONS from dry runs (compile and analyze on fake CPU devices, nothing allocated, no step
run), not measurements. Writes results.md and results.json here and copies some timeline charts to img/.

  python experiments/predict/predict.py          # every dry run, one after another (about 4 minutes on 2 cores)
  python experiments/predict/predict.py --table  # only rebuild the tables from outputs/predict/
  python experiments/predict/predict.py gspmd    # only these presets (then the tables)
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from shardlab.config import CONF_DIR  # noqa: E402
RUNS = ROOT / "outputs" / "predict"
COMMON = ["dry_run=true", "progress=false", "model=llama3_8b", "model.seq_len=2048", "precision=bf16"]
MACHINES = {   # 1024 tokens per device on both (h100: 1 sequence per fsdp rank, v5p: 2)
    "h100": ["hardware=h100", "cpu_devices=8", "mesh.fsdp=4", "mesh.tensor=2", "train.batch_size=4"],
    "tpu_v5p": ["hardware=tpu_v5p", "cpu_devices=64", "mesh.fsdp=16", "mesh.tensor=4", "mesh.fsdp_ici_axes=2",
                "train.batch_size=32"],
}
VARIANTS = {"fsdp_prefetch+bf16_gather": ["schedule=fsdp_prefetch", "schedule.gather_dtype=compute"]}
# 4 sequences cannot split into 4 fsdp ranks x 2 microbatches: on the H100 node deferred_reduce runs 1 microbatch.
OVERRIDES = {("h100", "deferred_reduce"): ["schedule.microbatches=1"]}
CHARTS = ("baseline", "fsdp_prefetch", "collective_matmul_bidi")


def presets() -> dict:
  names = sorted(p.stem for p in (CONF_DIR / "schedule").glob("*.yaml"))
  return {**{n: [f"schedule={n}"] for n in names}, **VARIANTS}


def run_all(only: list[str]) -> None:
  for machine, args in MACHINES.items():
    for name, extra in presets().items():
      if only and name not in only:
        continue
      out = RUNS / machine / name
      cmd = [sys.executable, "-m", "shardlab", *COMMON, *args, *extra, *OVERRIDES.get((machine, name), []),
             f"hydra.run.dir={out}"]
      print(" ".join(cmd[1:]), flush=True)
      subprocess.run(cmd, cwd=ROOT, check=False, stdout=subprocess.DEVNULL)


def row(name: str, s: dict) -> dict:
  # bytes of the traced program (XLA:CPU widens bf16 collectives); gspmd places none, so its compiled ones (+)
  comm = s["ledger"]["program"] or s["ledger"]["compiled"]
  p = s["prediction"]
  moved = lambda axis: sum(t["bytes"] for a in comm.values() for t in a.get(axis, {}).values()) / 1e9
  if not s["ledger"]["program"]:
    name += " (+)"
  return {"schedule": name, "t_compute_ms": p["t_compute_s"] * 1e3,
          "t_comm_fsdp_ms": p["t_comm_s"].get("fsdp", 0) * 1e3,
          "t_comm_tensor_ms": p["t_comm_s"].get("tensor", 0) * 1e3,
          "t_serial_ms": p["t_serial_s"] * 1e3, "t_overlapped_ms": p["t_overlapped_s"] * 1e3,
          "exposed_comm_ms": p["exposed_comm_s"] * 1e3, "mfu": p["mfu"],
          "critical_ms": {k: v * 1e3 for k, v in p["critical_path_s"].items()}, "gb_fsdp": moved("fsdp"),
          "gb_tensor": moved("tensor"), "peak_gb": s["memory"]["peak"] / 1e9,
          "analytic_gb": s["memory"]["analytic"]["total"] / 1e9, "compile_s": s["compile_time_s"]}


def replot(run: Path, summary: dict, png: Path) -> None:
  """timeline.png again from the run's timeline.json (the chart code may have changed since the run)."""
  from shardlab.analysis import costmodel, timeline as TL
  from shardlab.config import to_config
  trace = json.loads((run / "timeline.json").read_text())
  rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
  evs = [{"name": e["name"], "cat": e["cat"], "row": rows[e["tid"]], "start": e["ts"] / 1e6, "dur": e["dur"] / 1e6,
          "args": e["args"]} for e in trace["traceEvents"] if e["ph"] == "X"]
  TL.plot(evs, png, costmodel.title(to_config(summary["config"]), summary["prediction"]))


def table() -> None:
  results, lines = {}, []
  for machine in MACHINES:
    rows = []
    for name in presets():
      f = RUNS / machine / name / "summary.json"
      s = json.loads(f.read_text()) if f.exists() else {"status": "missing"}
      if s.get("status") != "ok":
        rows.append({"schedule": name, "error": s.get("error", s["status"])})
        continue
      rows.append(row(name + "*" * ((machine, name) in OVERRIDES), s))
      if name in CHARTS:
        (HERE / "img").mkdir(exist_ok=True)
        replot(f.parent, s, HERE / "img" / f"{machine}_{name}.png")
    results[machine] = rows
    hw = json.loads((RUNS / machine / "baseline" / "summary.json").read_text())["config"]["hardware"]["name"]
    lines += [f"### {machine} ({hw}): " + " ".join(MACHINES[machine]), "",
              "| schedule | compute ms | fsdp comm ms | tensor comm ms | serial ms | **overlapped ms** | exposed ms "
              "| critical path: compute / fsdp / tensor ms | MFU | GB fsdp | GB tensor | peak GB (XLA:CPU) "
              "| analytic GB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
      if "error" in r:
        lines.append(f"| {r['schedule']} | error: {r['error'][:80]} |" + " |" * 11)
        continue
      lines.append(f"| {r['schedule']} | {r['t_compute_ms']:.1f} | {r['t_comm_fsdp_ms']:.1f} "
                   f"| {r['t_comm_tensor_ms']:.1f} "
                   f"| {r['t_serial_ms']:.1f} | **{r['t_overlapped_ms']:.1f}** | {r['exposed_comm_ms']:.1f} "
                   f"| {r['critical_ms']['compute']:.0f} / {r['critical_ms'].get('fsdp', 0):.0f} / "
                   f"{r['critical_ms'].get('tensor', 0):.0f} "
                   f"| {r['mfu']:.0%} | {r['gb_fsdp']:.1f} | {r['gb_tensor']:.1f} | {r['peak_gb']:.0f} "
                   f"| {r['analytic_gb']:.0f} |")
    notes = [f"{n}: {' '.join(v)}" for (m, n), v in OVERRIDES.items() if m == machine] + [
        "(+) compiler-placed: bytes and times as XLA:CPU widened them (bf16 collectives become f32)"]
    lines += [f"\\* {'; '.join(notes)}", ""] if notes else [""]
  (HERE / "results.json").write_text(json.dumps(results, indent=1))
  (HERE / "results.md").write_text("\n".join(lines))
  print("\n".join(lines))


if __name__ == "__main__":
  if "--table" not in sys.argv:
    run_all([a for a in sys.argv[1:] if not a.startswith("-")])
  table()
