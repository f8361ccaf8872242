"""Zero-bubble's split backward, measured on the H100 compiler: a 1024-wide, 8-layer model on pipeline 4 x fsdp 2,
16 microbatches, every schedule compiled for 8 H100s (compile_for=target, deviceless, on this CPU machine).

  python experiments/pipeline/zero_bubble.py [DIR]     # 8 dry runs into DIR: zero_bubble.json, zero_bubble.md
  python experiments/pipeline/zero_bubble.py --send-us 13   # zero_bubble.json's slots replayed with another send

Slot times, steps and bubbles are PREDICTIONS (each slot's compiled program timed by the run's model, the table
replayed in shardlab's ticks: summary.json `pipeline_prediction`); memory is the H100 compiler's buffer
assignment, with shardlab's memory model beside it. What it checks: zb_h1's W slot (the weight gradient alone,
schedules/split.py) against the fused backward of 1f1b (B + W in one slot), the split's B and W against it, the
microbatches each schedule holds, and each executed bubble against its closed form (zb_h2, zb_v and dualpipev
beside zb_h1 and eager_1f1b).

Each run: python -m shardlab dry_run=true compile_for=target hardware=h100 mesh.pipeline=4 mesh.fsdp=2
mesh.tensor=1 model.n_layers=8 model.d_model=1024 model.d_ff=4096 model.n_heads=8 pipeline=NAME
pipeline.microbatches=16 train.batch_size=32 (interleaved, zb_v, dualpipev: 2 chunks per stage, their presets).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
BASE = ["dry_run=true", "compile_for=target", "hardware=h100", "mesh.pipeline=4", "mesh.fsdp=2", "mesh.tensor=1",
        "model.n_layers=8", "model.d_model=1024", "model.d_ff=4096", "model.n_heads=8", "pipeline.microbatches=16",
        "train.batch_size=32", "progress=false"]
SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "interleaved", "zb_h1", "zb_h2", "zb_v", "dualpipev")


def run(name: str, root: Path) -> dict:
  out = root / name
  args = BASE + [f"pipeline={name}", f"hydra.run.dir={out}"] + (
      ["pipeline.virtual_stages=2"] if name == "interleaved" else [])
  shutil.rmtree(out, ignore_errors=True)
  t0 = time.time()
  proc = subprocess.run([sys.executable, "-m", "shardlab", *args], capture_output=True, text=True)
  if proc.returncode:
    return {"schedule": name, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
  s = json.loads((out / "summary.json").read_text())
  pp, mem = s["pipeline_prediction"], s["memory"]
  return {"schedule": name, "virtual_stages": pp["virtual_stages"], "slot_s": pp["slot_s"], "step_s": pp["step_s"],
          "bubble": pp["bubble"], "table_bubble": pp["table_bubble"],
          "closed_form_bubble": pp["closed_form_bubble"], "in_flight": pp["in_flight"],
          "memory_compiled_gb": mem["peak"] / 1e9, "memory_model_gb": mem["components"]["peak"]["analytic"] / 1e9,
          "memory_error": mem["components"]["peak"]["error"], "wall_s": round(time.time() - t0, 1),
          "command": "python -m shardlab " + " ".join(args[:-1])}


def table(rows: list[dict]) -> list[str]:
  ms = lambda t: f"{1e3 * t:.3f}"
  fused = next((r["slot_s"]["B"] for r in rows if r["schedule"] == "1f1b" and "slot_s" in r), None)
  lines = ["| schedule | F (ms) | B (ms) | W (ms) | W / 1f1b's fused B | step (ms) | bubble | table's bubble "
           "(async) | closed form | in flight per stage | memory/GPU compiled (model) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['schedule']} | error: {' '.join(r['error'])} ||||||||||")
      continue
    sl, v = r["slot_s"], f" (V={r['virtual_stages']})" if r["virtual_stages"] > 1 else ""
    w = f"{sl['W'] / fused:.0%}" if sl["W"] and fused else ""
    lines.append(f"| {r['schedule']}{v} | {ms(sl['F'])} | {ms(sl['B'])} | {ms(sl['W']) if sl['W'] else ''} | {w} | "
                 f"{ms(r['step_s'])} | {r['bubble']:.1%} | {r['table_bubble']:.1%} | "
                 f"{r['closed_form_bubble']:.1%} | {', '.join(map(str, r['in_flight']))} | "
                 f"{r['memory_compiled_gb']:.2f} GB ({r['memory_model_gb']:.2f}, {r['memory_error']:+.1%}) |")
  return lines


def replay_with_send(send_s: float) -> None:
  """Each schedule's executed bubble from zero_bubble.json's compiled slots, every tick's sends priced at `send_s`
  instead of the link model's figure (a what-if: the slots' own collectives are not re-priced). No compile."""
  from shardlab import pipeline_tables as PL
  from shardlab.analysis import pipeline_replay as PR
  P, M = (int(next(a.split("=")[1] for a in BASE if a.startswith(k))) for k in ("mesh.pipeline=",
                                                                               "pipeline.microbatches="))
  for r in json.loads((HERE / "zero_bubble.json").read_text())["rows"]:
    s, V = r["slot_s"], r["virtual_stages"]
    ticks = PL.build(r["schedule"], P, M, V)
    what_if = PR.replay(ticks, s["F"], s["B"], s["W"] or 0.0, send_s, sync=True, t_head=s["head"])["bubble"]
    print(f"{r['schedule']:<12} V={V}  executed bubble {r['bubble']:.1%} with {1e6 * s['send']:.1f} us sends, "
          f"{what_if:.1%} with {1e6 * send_s:.1f} us; closed form {r['closed_form_bubble']:.1%}")


def main() -> None:
  if sys.argv[1:2] == ["--send-us"]:
    return replay_with_send(float(sys.argv[2]) * 1e-6)
  root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/shardlab-zero-bubble")
  rows = []
  for name in SCHEDULES:
    rows.append(run(name, root))
    print(json.dumps({k: rows[-1].get(k) for k in ("schedule", "slot_s", "step_s", "bubble", "error")}), flush=True)
  stamp = time.strftime("%Y-%m-%d")
  import jax
  (HERE / "zero_bubble.json").write_text(json.dumps({"date": stamp, "jax": jax.__version__, "rows": rows}, indent=1))
  (HERE / "zero_bubble.md").write_text("\n".join(
      [f"Written by `python experiments/pipeline/zero_bubble.py` ({stamp}, jax {jax.__version__}, a 2-core x86_64 VM "
       "without a GPU, compiled for 8 H100s). Slot times, steps and bubbles: MODEL PREDICTIONS from the compiled "
       "slots; memory: the H100 compiler's buffer assignment (the model's figure beside it). In flight: "
       "microbatch-chunks per stage, until W where the backward is split.", "", *table(rows), ""]))


if __name__ == "__main__":
  main()
