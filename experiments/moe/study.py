"""Mixtral-8x7B and Qwen3-30B-A3B compiled by the targets' own compilers with each dispatcher, side by side
(8 and 64 H100s, a v5p slice of 64 chips), and one validation
against a published measurement. Every step time and memory here is a PREDICTION of shardlab's cost model for
the compiled program (deviceless compiles on this CPU machine); the published figure is a MEASUREMENT.

    python experiments/moe/study.py [out=experiments/moe/results] [only=SUBSTRING] [runs=/tmp/shardlab-moe-runs]

For each case: `python -m shardlab` as a dry run with compile_for=target (trainer.train), the summary's bytes per
collective per mesh axis, the ledger's differences (every byte the compiler moves against the program's: [] when
all are explained), the audit's unplanned collectives, the compiled and the analytic memory per device, and the
predicted step with its exposed communication. Writes results.json and results.md in `out`.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

COMMON = ["precision=bf16", "schedule.remat=full", "compile_for=target", "dry_run=true", "progress=false",
          "tensorboard=false", "checkpoint.enabled=false"]
DISPATCHERS = [("all_to_all, capacity 1.25", ["expert=all_to_all", "expert.capacity_factor=1.25"]),
               ("all_gather", ["expert=all_gather"]),
               ("ragged", ["expert=ragged"])]
# (target, hardware preset, mesh and batch): 8 nodes of 8 H100s, experts inside a node, FSDP across nodes; a v5p
# slice of 64 chips the same way. One sequence of 4096 tokens per device per microbatch.
H100_64 = ["hardware=h100_multinode", "mesh.expert=8", "mesh.fsdp=8", "mesh.tensor=1", "train.batch_size=64"]
H100_8 = ["hardware=h100", "mesh.expert=8", "mesh.fsdp=1", "mesh.tensor=1", "train.batch_size=8"]
V5P_64 = ["hardware=tpu_v5p", "mesh.expert=8", "mesh.fsdp=8", "mesh.tensor=1", "train.batch_size=64",
          "model.attention=blockwise", "model.attention_block=1024"]
TARGETS = [("Mixtral-8x7B, 64 H100 (8 nodes)", ["model=mixtral_8x7b", *H100_64]),
           ("Mixtral-8x7B, v5p, 64 chips", ["model=mixtral_8x7b", *V5P_64]),
           ("Mixtral-8x7B, 8 H100 (1 node)", ["model=mixtral_8x7b", *H100_8]),
           ("Qwen3-30B-A3B, 8 H100 (1 node)", ["model=qwen3_30b_a3b", *H100_8]),
           ("Qwen3-30B-A3B, 64 H100 (8 nodes)", ["model=qwen3_30b_a3b", *H100_64])]
# MaxText's Mixtral-8x7B on v5p-128 (64 chips): 251.94 TFLOP/s per chip, 54.89% MFU (end_to_end/tpu/mixtral/
# Run_Mixtral.md, a MEASUREMENT). The page gives no configuration; this is MaxText's benchmark recipe for
# Mixtral-8x7B dropless (benchmarks/maxtext_trillium_model_configs.py: per_device_batch_size 12, FSDP over every
# chip, 4096 tokens, remat full, flash attention, megablox grouped GEMMs): no expert parallelism, each chip runs
# every expert on its own tokens (shardlab: mesh.expert=1, expert=ragged: the local grouped GEMM).
MAXTEXT = ("MaxText recipe: Mixtral-8x7B, v5p, 64 chips, FSDP 64, 12 x 4096 tokens per chip",
           ["model=mixtral_8x7b", "hardware=tpu_v5p", "mesh.expert=1", "mesh.fsdp=64", "mesh.tensor=1", "train.batch_size=768",
            "expert=ragged", "model.attention=blockwise", "model.attention_block=1024"], 251.94e12)


def one(label: str, overrides: list[str], out: Path) -> dict:
  from shardlab.config import compose
  from shardlab.trainer import train
  from shardlab import params as PM
  cfg = compose(COMMON + overrides)
  t0 = time.perf_counter()
  s = train(cfg, out / "".join(c if c.isalnum() else "_" for c in label))
  wall = time.perf_counter() - t0
  pred, mem = s["prediction"], s["memory"]
  tokens = cfg.train.batch_size * cfg.model.seq_len
  flops = 6 * PM.count_active(cfg.model) * tokens / cfg.mesh.n_devices
  comm = {f"{kind} {axis}": v["bytes"] for kind, axes in s["comm"].items() for axis, v in axes.items()}
  return {"case": label, "overrides": overrides, "status": s["status"], "wall_s": wall,
          "predicted_step_s": pred["t_overlapped_s"], "predicted_exposed_comm_s": pred.get("exposed_comm_s"),
          "predicted_tflops_per_device": flops / pred["t_overlapped_s"] / 1e12, "mfu": pred.get("mfu"),
          "comm_bytes": comm, "ledger_differences": s["ledger"]["differences"],
          "unplanned": s["audit"]["unplanned"],
          "memory_compiled": max(mem.get("peak", 0), mem.get("allocated", {}).get("total", 0)),
          "memory_analytic": mem.get("analytic", {}).get("total"), "activations_from": mem.get("activations_from"),
          "hbm_bytes": mem.get("hbm_bytes"), "fits": mem.get("fits")}


def markdown(rows: list[dict]) -> str:
  out = ["| case | predicted step | exposed comm | TFLOP/s per device (6 N_active) | bytes over expert / device / step | "
         "ledger | unplanned | memory compiled / analytic (error) |", "|---|---:|---:|---:|---:|---|---|---:|"]
  for r in rows:
    if "error" in r:
      out.append(f"| {r['case']} | failed: {r['error'][:200]} | | | | | | |")
      continue
    ex = sum(v for k, v in r["comm_bytes"].items() if k.endswith(" expert"))
    ma = r["memory_analytic"]
    err = f" ({ma / r['memory_compiled'] - 1:+.0%})" if ma else ""
    out.append(f"| {r['case']} | {r['predicted_step_s']:.2f} s | {r['predicted_exposed_comm_s'] or 0:.2f} s | "
               f"{r['predicted_tflops_per_device']:.0f} | {ex / 1e9:.1f} GB | "
               f"{'all explained' if not r['ledger_differences'] else '; '.join(r['ledger_differences'])} | "
               f"{len(r['unplanned'])} | {r['memory_compiled'] / 1e9:.1f} / "
               f"{ma / 1e9 if ma else float('nan'):.1f} GB{err} |")
  return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
  opts = dict(a.split("=", 1) for a in argv if "=" in a)
  out = Path(opts.get("out", ROOT / "experiments" / "moe" / "results"))
  only = opts.get("only", "")
  runs = Path(opts.get("runs", f"/tmp/shardlab-moe-runs/{time.strftime('%Y%m%d-%H%M%S')}"))   # each run's dir
  from shardlab.mesh import set_cpu_devices
  set_cpu_devices(8)
  cases = [(f"{t} / {d}", d, to + do) for t, to in TARGETS for d, do in DISPATCHERS]
  cases.append((MAXTEXT[0], "ragged (local)", MAXTEXT[1]))
  # expert.chunks: does the compiler run one chunk's all_to_all behind another's experts? (the exposed column)
  for k in (2, 4):
    cases.append((f"Mixtral-8x7B, 64 H100 (8 nodes) / all_to_all, capacity 1.25, chunks {k}", "all_to_all",
                  ["model=mixtral_8x7b", *H100_64, *DISPATCHERS[0][1], f"expert.chunks={k}"]))
  rows = []
  path = out / "targets.json"
  if path.exists():
    rows = [r for r in json.loads(path.read_text())["rows"] if only and only not in r["case"]]
  for label, disp, overrides in cases:
    if only not in label:
      continue
    try:
      row = {**one(label, overrides, runs), "dispatcher": disp}
    except Exception as e:  # noqa: BLE001  (a case that does not compile: its row says why)
      row = {"case": label, "dispatcher": disp, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
    if label == MAXTEXT[0] and "predicted_tflops_per_device" in row:
      row["published_tflops_per_device"] = MAXTEXT[2] / 1e12
      row["error_vs_published"] = row["predicted_tflops_per_device"] * 1e12 / MAXTEXT[2] - 1
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "comm_bytes"}), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": "python experiments/moe/study.py " + " ".join(argv), "rows": rows},
                               indent=1) + "\n")
    (out / "targets.md").write_text(markdown(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
