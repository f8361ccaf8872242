#!/bin/bash
# One call on a lent GPU (the device tool): calibrate it, then run the measured-vs-predicted study, everything
# into $OUT. The image's python3 has jax with CUDA; Hydra's three pure-Python wheels travel in .whl/.
#   run(command="bash experiments/calibrate/device.sh", carry=[".whl"], timeout_s=540)
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv > "$OUT/nvidia-smi.csv"
python3 -c "import jax; print(jax.__version__, jax.devices(), jax.devices()[0].device_kind)" > "$OUT/env.txt" 2>&1
date -u +%FT%TZ >> "$OUT/env.txt"
timeout 230 python3 -m shardlab.calibrate out="$OUT/gpu_measured.yaml" 2>&1 | tr '\r' '\n' | grep -v "it/s" > "$OUT/calibrate.log"
tail -60 "$OUT/calibrate.log"
if [ -f "$OUT/gpu_measured.yaml" ]; then
  timeout 250 python3 experiments/calibrate/study.py calibrated="$OUT/gpu_measured.yaml" out="$OUT/study" \
    deadline_s=150 steps=15 > "$OUT/study.log" 2>&1
  tail -25 "$OUT/study.log"
fi
date -u +%FT%TZ >> "$OUT/env.txt"
