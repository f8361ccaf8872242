"""Pipeline schedules side by side on llama3_70b over 2, 4 and 8 H100 nodes: tensor parallelism inside each node
(mesh.tensor=8, NVLink), one pipeline stage per node (mesh.pipeline = nodes, the nodes' NICs), 32 microbatches of
one 8192-token sequence. Every run is a dry run compiled by the H100 compiler for that many GPUs
(compile_for=target, hardware=h100_multinode): nothing is allocated or measured. Step times and bubbles are MODEL
PREDICTIONS (shardlab/analysis/pipeline_cost.py: the table replayed with each slot's compiled FLOPs and bytes);
memory per device is the compiler's own buffer assignment (memory_analysis) beside shardlab's memory model.

  python experiments/pipeline/study.py [DIR]    # 15 dry runs into DIR (default /tmp/shardlab-pipeline-study;
                                                # finished ones are kept): results.json, results.md, pictures

Each run: python -m shardlab dry_run=true compile_for=target hardware=h100_multinode model=llama3_70b
precision=bf16 model.attention=dot_product schedule.remat=full mesh.data=1 mesh.fsdp=1 mesh.tensor=8
mesh.pipeline=P pipeline=NAME pipeline.microbatches=32 train.batch_size=32 (interleaved: virtual_stages=2).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
BASE = ["dry_run=true", "compile_for=target", "hardware=h100_multinode", "model=llama3_70b", "precision=bf16",
        "model.attention=dot_product", "schedule.remat=full", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8",
        "pipeline.microbatches=32", "train.batch_size=32", "progress=false"]
NODES = (2, 4, 8)
SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "interleaved", "zb_h1")
PICTURES = {(4, "1f1b"), (4, "eager_1f1b"), (4, "interleaved"), (4, "zb_h1")}


def run(P: int, name: str, root: Path) -> dict:
  out = root / f"p{P}_{name}"
  args = BASE + [f"mesh.pipeline={P}", f"pipeline={name}", f"hydra.run.dir={out}"]
  if name == "interleaved":
    args.append("pipeline.virtual_stages=2")
  t0 = time.time()
  done = out / "summary.json"
  if not (done.exists() and json.loads(done.read_text()).get("status") == "ok"):   # an earlier run is kept
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "shardlab", *args], capture_output=True, text=True)
    if proc.returncode:
      return {"nodes": P, "schedule": name, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
  s = json.loads(done.read_text())
  if (P, name) in PICTURES:
    shutil.copy(out / "pipeline.png", HERE / f"pipeline_p{P}_{name}.png")
  pp, mem = s["pipeline_prediction"], s["memory"]
  comm = {f"{kind} {axis}": v["bytes"] for kind, axes in s["comm"].items() for axis, v in axes.items()}
  return {"nodes": P, "gpus": 8 * P, "schedule": name, "virtual_stages": pp["virtual_stages"],
          "microbatches": pp["microbatches"], "ticks": pp["ticks"], "slot_s": pp["slot_s"],
          "step_s": pp["step_s"], "bubble": pp["bubble"], "table_step_s": pp["table_step_s"],
          "table_bubble": pp["table_bubble"], "closed_form_bubble": pp["closed_form_bubble"],
          "in_flight_stage0": pp["in_flight"][0],
          "memory_compiled_gb": mem["peak"] / 1e9, "memory_model_gb": mem["components"]["peak"]["analytic"] / 1e9,
          "memory_error": mem["components"]["peak"]["error"], "fits_80gb": mem["fits"],
          "bytes_per_device": comm, "compile_s": round(time.time() - t0, 1),
          "command": "python -m shardlab " + " ".join(args[:-1])}


def table(rows: list[dict]) -> list[str]:
  lines = ["| nodes | schedule | step (s) | bubble | async table's bubble | closed form | stage 0 in flight | "
           "memory/GPU compiled (model) | fits 80 GB | pipeline sends/GPU | tensor AG+RS/GPU |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['nodes']} | {r['schedule']} | error: {' '.join(r['error'])} |||||||||")
      continue
    b = r["bytes_per_device"]
    tp = b.get("all-gather tensor", 0) + b.get("reduce-scatter tensor", 0)
    v = f" (V={r['virtual_stages']})" if r["virtual_stages"] > 1 else ""
    lines.append(f"| {r['nodes']} | {r['schedule']}{v} | {r['step_s']:.2f} | {r['bubble']:.1%} | "
                 f"{r['table_bubble']:.1%} | {r['closed_form_bubble']:.1%} | {r['in_flight_stage0']} | "
                 f"{r['memory_compiled_gb']:.1f} GB ({r['memory_model_gb']:.1f}, {r['memory_error']:+.1%}) | "
                 f"{'yes' if r['fits_80gb'] else 'no'} | {b.get('collective-permute pipeline', 0) / 1e9:.2f} GB | "
                 f"{tp / 1e9:.0f} GB |")
  return lines


def main() -> None:
  root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/shardlab-pipeline-study")
  rows = []
  for P in NODES:
    for name in SCHEDULES:
      rows.append(run(P, name, root))
      print(json.dumps({k: rows[-1].get(k) for k in ("nodes", "schedule", "step_s", "bubble", "memory_compiled_gb",
                                                        "error")}), flush=True)
      write(rows)


def write(rows: list[dict]) -> None:
  stamp = time.strftime("%Y-%m-%d")
  (HERE / "results.json").write_text(json.dumps({"date": stamp, "command": "python experiments/pipeline/study.py",
                                                 "rows": rows}, indent=1))
  (HERE / "results.md").write_text("\n".join(
      [f"Written by `python experiments/pipeline/study.py` ({stamp}, jax {_jax()}, on a 2-core x86_64 VM without a "
       "GPU). Step times and bubbles: MODEL PREDICTIONS; memory: the H100 compiler's buffer assignment (the model's "
       "figure and error beside it). Bytes: per GPU per step, from the compiled program.", "", *table(rows), ""]))


def _jax() -> str:
  import jax
  return jax.__version__


if __name__ == "__main__":
  main()
