"""Ulysses x ring (context=usp) and TransformerEngine's a2a+p2p (context=a2a_p2p) compiled for H100s, beside the
ring and Ulysses: one node (8 GPUs, 64K tokens) and two nodes (16 GPUs, 128K tokens), 8K tokens per GPU in both.

  python experiments/context/hybrid.py          # 9 target dry runs, ~5 min on 2 cores: writes hybrid.json, hybrid.md

Every configuration: llama3_8b with 2 layers (32 query and 8 K/V heads), one sequence over context C, bf16, remat
save_qkv_attn_out, zigzag placement, hardware=h100 (NVLink inside a node of 8, one 400 Gbps NIC per GPU across
nodes: conf/hardware/h100.yaml). Each run is `python -m shardlab dry_run=true compile_for=target ...`: the H100
compiler's program (memory: the compiler's, a measurement of the compiled program) and the calibrated replay of
its scheduled order (a MODEL PREDICTION), with context_search.predict's analytic figure (also a prediction) beside.
Ulysses cannot split 8 K/V heads 16 ways: at C = 16 the run's own refusal is recorded instead.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ring import analytic, dry_run, row  # noqa: E402  (the same dry run and row as ring.py's)

HERE = Path(__file__).parent
COMMON = ["model=llama3_8b", "model.n_layers=2", "train.batch_size=1", "mesh.fsdp=1", "mesh.tensor=1",
          "precision=bf16", "model.attention=dot_product", "schedule.remat=save_qkv_attn_out", "hardware=h100",
          "context.load_balance=true"]
NODES = {1: ["model.seq_len=65536", "mesh.context=8"], 2: ["model.seq_len=131072", "mesh.context=16"]}
STRATEGIES = [("ring", ["context=ring"]), ("ulysses", ["context=ulysses"]),
              ("usp U=2", ["context=usp", "context.ulysses=2"]), ("usp U=4", ["context=usp", "context.ulysses=4"]),
              ("a2a_p2p (U = the node's 8)", ["context=a2a_p2p"])]


def refusal(overrides: list[str]) -> str:
  """The one line a run refuses these settings with (exit 2)."""
  r = subprocess.run([sys.executable, "-m", "shardlab", "dry_run=true", "compile_for=target", "progress=false",
                      *overrides], capture_output=True, text=True)
  assert r.returncode == 2, r.stderr[-2000:]
  return r.stderr.strip().splitlines()[-1]


def table(rows: list[dict]) -> str:
  lines = ["| nodes | run | predicted step, compiled (s) | fused attention kernels (s) | other kernels (s) | "
           "exposed comm (ms) | attention's bytes over context per step (MB) | compiled peak (GB) | "
           "ring shifts hidden | analytic: step, attention, exposed (s) |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    if "refused" in r:
      lines.append(f"| {r['nodes']} | {r['run']} | refused: {r['refused']} | | | | | | | |")
      continue
    hid = f"{r['hidden']} of {r['shifts']}" if r["shifts"] else "-"
    a = r["analytic"]
    lines.append(f"| {r['nodes']} | {r['run']} | {r['predicted_step_s']:.3f} | {r['attention_kernels_s']:.3f} | "
                 f"{r['other_kernels_s']:.3f} | {r['exposed_comm_s'] * 1e3:.1f} | {r['context_bytes'] / 1e6:.0f} | "
                 f"{r['compiled_peak_bytes'] / 1e9:.1f} | {hid} | {a['t_step_s']:.3f}, {a['t_attention_s']:.3f}, "
                 f"{a['exposed_comm_s']:.4f} |")
  return "\n".join(lines)


def main() -> None:
  rows = []
  for nodes, mesh in NODES.items():
    for label, extra in STRATEGIES:
      overrides = COMMON + mesh + extra
      t0 = time.perf_counter()
      if label == "ulysses" and nodes == 2:
        rows.append({"nodes": nodes, "run": label, "refused": refusal(overrides)})
        print(f"{nodes} node(s), {label}: refused", flush=True)
        continue
      s, cmd = dry_run(overrides)
      r = row(label, s, cmd, analytic(overrides))
      r["nodes"] = nodes
      # the attention's own bytes over context: every collective there but the weight gradients' all-reduce
      r["context_bytes"] = sum(v.get("context", {}).get("bytes", 0) for k, v in s["comm"].items()
                               if k != "all-reduce")
      rows.append(r)
      print(f"{nodes} node(s), {label}: {r['predicted_step_s']:.3f} s predicted "
            f"({time.perf_counter() - t0:.0f} s to compile)", flush=True)
  (HERE / "hybrid.json").write_text(json.dumps({"written": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
  md = [f"Written by `python experiments/context/hybrid.py` ({time.strftime('%Y-%m-%d')}). Compiled by the H100 "
        "compiler on a CPU machine; times are MODEL PREDICTIONS (the calibrated replay of the compiled program), "
        "memory is the compiler's.", "", table(rows)]
  (HERE / "hybrid.md").write_text("\n".join(md) + "\n")
  print(f"wrote {HERE / 'hybrid.md'}")


if __name__ == "__main__":
  main()
