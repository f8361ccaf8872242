"""Why a GEMM measured alone runs slower than the GEMMs of a training step: the same bf16 GEMMs timed three ways,
with the GPU's SM clock, power and throttle reasons sampled by nvidia-smi meanwhile.

  sustained   shardlab.calibrate's way: back-to-back calls filling 20 ms per sample, 7 samples
  rested      one call at a time, each after 200 ms idle (the GPU cools and its clock recovers), blocking;
              the host's dispatch (measured) subtracted
  zeros       sustained, on zeros instead of normal random data (less switching power)
  init        sustained, activations N(0, 1) against weights N(0, 0.02^2) (a model's initial scale)

    python experiments/calibrate/gemm_probe.py OUT_DIR      # on a GPU; writes OUT_DIR/gemm_probe.json
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = [(8192, 8192, 8192), (16384, 8192, 8192), (8192, 14336, 4096)]


def main(out: Path) -> int:
  import jax
  import jax.numpy as jnp
  from shardlab.calibrate import timed
  out.mkdir(parents=True, exist_ok=True)
  smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
                          "--format=csv,noheader", "-lms", "100"], stdout=subprocess.PIPE, text=True)
  t0 = time.time()
  dispatch = timed(jax.jit(lambda a: a + 1), (jnp.ones((8,)),), 2, 7)["s"]
  rows = []
  for m, n, k in SHAPES:
    f = jax.jit(lambda a, b: a @ b)
    key = jax.random.key(0)
    a = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(key, (k, n), jnp.float32).astype(jnp.bfloat16)
    flops = 2.0 * m * n * k
    start = time.time() - t0
    sus = timed(f, (a, b), 2, 7)["s"]
    mid = time.time() - t0
    jax.block_until_ready(f(a, b))
    rest = []
    for _ in range(10):
      time.sleep(0.2)
      t = time.perf_counter()
      jax.block_until_ready(f(a, b))
      rest.append(time.perf_counter() - t - dispatch)
    end = time.time() - t0
    za, zb = jnp.zeros_like(a), jnp.zeros_like(b)
    zero = timed(f, (za, zb), 2, 7)["s"]
    init = timed(f, (a, (b.astype(jnp.float32) * 0.02).astype(jnp.bfloat16)), 2, 7)["s"]
    rows.append({"shape": [m, n, k], "flops": flops, "sustained_s": sus, "rested_s": statistics.median(rest),
                 "zeros_s": zero, "init_s": init, "init_flops_per_s": flops / init, "sustained_flops_per_s": flops / sus,
                 "rested_flops_per_s": flops / statistics.median(rest), "zeros_flops_per_s": flops / zero,
                 "window_sustained": [start, mid], "window_rested": [mid, end]})
    print(json.dumps(rows[-1]), flush=True)
  smi.terminate()
  samples = []
  for line in smi.stdout.read().splitlines():
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 4:
      samples.append({"at": parts[0], "sm_mhz": parts[1], "power": parts[2], "throttle": parts[3]})
  (out / "gemm_probe.json").write_text(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                                   "dispatch_s": dispatch, "rows": rows, "smi": samples,
                                                   "started_unix": t0}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main(Path(sys.argv[1])))
