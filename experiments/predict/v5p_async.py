"""The LLaMA-3 8B step on a TPU v5p-64 slice with and without libtpu's async collective fusion (the libtpu options
of MaxText's v5p recipes: conf/xla/maxtext_v5p.yaml), for two schedule presets. MODEL PREDICTIONS from dry runs
(libtpu's program compiled on this CPU machine, replayed by the calibrated model), not measurements.

  python experiments/predict/v5p_async.py       # four target dry runs (about 2 minutes each here): v5p_async.json/.md

Without the options libtpu writes every collective synchronous: the compute waits for each whole. With them it
fuses each weight all-gather into a start, the compute fusions it runs beside and a done (the reduce-scatters and
all-reduces stay synchronous), and the replay (shardlab/analysis/calibrated.py) runs the transfer beside those
fusions. The setup is experiments/predict/README.md's v5p column (4 x 4096 tokens per chip, bf16, remat
save_matmuls_attn_out, blockwise attention, fsdp 16 x tensor 4).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMON = ["dry_run=true", "progress=false", "compile_for=target", "hardware=tpu_v5p", "model=llama3_8b",
          "model.seq_len=4096", "precision=bf16", "schedule.remat=save_matmuls_attn_out", "model.attention=blockwise",
          "mesh.fsdp=16", "mesh.tensor=4", "mesh.fsdp_ici_axes=2", "train.batch_size=256"]
SCHEDULES = ["baseline", "fsdp_prefetch"]
XLA = ["none", "maxtext_v5p"]


def main() -> None:
  root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/shardlab-v5p-async")
  rows = []
  for schedule in SCHEDULES:
    for xla in XLA:
      args = [*COMMON, f"schedule={schedule}", f"xla={xla}"]
      out = root / f"{schedule}-{xla}"
      shutil.rmtree(out, ignore_errors=True)
      t0 = time.time()
      done = subprocess.run([sys.executable, "-m", "shardlab", *args, f"hydra.run.dir={out}"],
                            capture_output=True, text=True)
      if done.returncode:
        sys.exit(f"{' '.join(args)}: exit {done.returncode}\n{done.stderr[-2000:]}")
      s = json.loads((out / "summary.json").read_text())
      p = s["prediction"]
      rows.append({"schedule": schedule, "xla": xla, "step_s": p["t_overlapped_s"], "mfu": p["mfu"],
                   "exposed_comm_s": p["exposed_comm_s"], "comm_s": p["t_comm_s"], "compute_s": p["t_compute_s"],
                   "memory_gb": s["memory"]["peak"] / 1e9, "wall_s": round(time.time() - t0, 1),
                   "command": "python -m shardlab " + " ".join(args)})
      r = rows[-1]
      print(f"{schedule:>14} xla={xla:<12} step {r['step_s'] * 1e3:7.0f} ms (MFU {r['mfu']:.1%}), exposed "
            f"communication {r['exposed_comm_s'] * 1e3:5.0f} ms, compute {r['compute_s'] * 1e3:6.0f} ms, compiled "
            f"peak {r['memory_gb']:.1f} GB", flush=True)
  import jax
  (HERE / "v5p_async.json").write_text(json.dumps(
      {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "command": "python experiments/predict/v5p_async.py",
       "rows": rows}, indent=1))
  lines = ["| schedule | xla | predicted step ms | MFU | exposed communication ms | compute ms | compiled peak GB |",
           "|---|---|---:|---:|---:|---:|---:|"]
  lines += [f"| {r['schedule']} | {r['xla']} | {r['step_s'] * 1e3:.0f} | {r['mfu']:.1%} | "
            f"{r['exposed_comm_s'] * 1e3:.0f} | {r['compute_s'] * 1e3:.0f} | {r['memory_gb']:.1f} |" for r in rows]
  (HERE / "v5p_async.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
