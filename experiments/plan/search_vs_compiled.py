"""The layout search's time model against the compiled replay of the same layouts.

  JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python experiments/plan/search_vs_compiled.py
      # needs the cuda12 extra; three deviceless H100 compiles of Llama 3 70B on 64 GPUs (about 2 min on 2 cores)

The question is the README's: Llama 3 70B on 8 nodes of 8 H100, a 4M-token batch of 8K sequences, bf16 matmuls.
`python -m shardlab.plan ... top=3` ranks every data x fsdp x tensor layout by the time model
(shardlab/analysis/step_model.py: each layout's program priced kernel by kernel, no compile) and then compiles the
best three for the H100 target and replays each compiled program (shardlab/analysis/calibrated.py). Both are
MODEL PREDICTIONS (no GPU runs here); the point is how far the search's figure is from the replay of the program
the compiler actually builds, which is what the search stands in for. Writes search_vs_compiled.json and
search_vs_compiled.md beside this file.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

HERE = Path(__file__).parent
ARGS = ["model=llama3_70b", "hardware=h100", "devices=64", "precision=bf16", "train.global_batch_tokens=4194304",
        "top=3"]


def main() -> None:
  import jax
  from shardlab.plan import run
  t0 = time.time()
  got = run(ARGS)
  rows = []
  for l in got["layouts"][:3]:
    t, sm = l["target"], l["step_model"]
    rows.append({"layout": f"{l['data']} x {l['fsdp']} x {l['tensor']}", "remat": l["remat"],
                 "microbatches": l["microbatches"], "search_step_s": l["step_time_s"],
                 "compiled_step_s": t["step_time_s"], "search_error": t["search_error"],
                 "search_mfu": l["mfu"], "compiled_mfu": t["mfu"],
                 "search_breakdown_s": {k: sm[k] for k in ("t_gemm_s", "t_attention_s", "t_recompute_s",
                                                           "t_other_kernels_s", "t_exposed_comm_s")},
                 "memory_analytic_gb": l["memory_per_device_bytes"] / 1e9,
                 "memory_compiled_gb": t["memory_compiled_bytes"] / 1e9})
  out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {platform.system()}, "
         f"{__import__('os').cpu_count()} CPUs", "jax": jax.__version__,
         "command": "python -m shardlab.plan " + " ".join(ARGS), "wall_s": round(time.time() - t0, 1), "rows": rows,
         "same_order": [r["compiled_step_s"] for r in rows] == sorted(r["compiled_step_s"] for r in rows)}
  (HERE / "search_vs_compiled.json").write_text(json.dumps(out, indent=1))
  lines = [f"`{out['command']}` ({out['date']}, {out['machine']}, jax {out['jax']}, {out['wall_s']} s). "
           "Both columns are MODEL PREDICTIONS: the search's time model and the calibrated replay of the program "
           "the H100 compiler built for each layout.", "",
           "| # | data x fsdp x tensor | remat | micro | search: step (MFU) | compiled replay: step (MFU) | search "
           "error | search: GEMMs / attention / recompute / other / exposed comm | memory: analytic / compiled |",
           "|---|---|---|---:|---:|---:|---:|---|---|"]
  for i, r in enumerate(rows):
    b = r["search_breakdown_s"]
    lines.append(f"| {i + 1} | {r['layout']} | {r['remat']} | {r['microbatches']} | {r['search_step_s']:.1f} s "
                 f"({r['search_mfu']:.0%}) | {r['compiled_step_s']:.1f} s ({r['compiled_mfu']:.0%}) | "
                 f"{r['search_error']:+.1%} | {b['t_gemm_s']:.1f} / {b['t_attention_s']:.1f} / "
                 f"{b['t_recompute_s']:.1f} / {b['t_other_kernels_s']:.1f} / {b['t_exposed_comm_s']:.1f} s | "
                 f"{r['memory_analytic_gb']:.1f} / {r['memory_compiled_gb']:.1f} GB |")
  lines += ["", f"The compiled replay ranks them in the search's order: {'yes' if out['same_order'] else 'NO'}."]
  (HERE / "search_vs_compiled.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
