#!/bin/bash
# One call on a lent GPU (the device tool): single-device MoE steps measured beside predicted, into $OUT.
#   run(command="bash experiments/moe/device.sh", carry=[".whl"], kind="nvidia-h200", timeout_s=420)
# The calibrated preset is the one `python -m shardlab.calibrate` measured on an H200 (experiments/calibrate/).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv > "$OUT/nvidia-smi.csv"
python3 -c "import jax; print(jax.__version__, jax.devices(), jax.devices()[0].device_kind)" > "$OUT/env.txt" 2>&1
date -u +%FT%TZ >> "$OUT/env.txt"
timeout 330 python3 experiments/calibrate/study.py set=moe \
  calibrated=experiments/calibrate/results/h200_run2/gpu_measured.yaml out="$OUT/moe" deadline_s=240 steps=12 \
  > "$OUT/study.log" 2>&1
tail -12 "$OUT/study.log"
date -u +%FT%TZ >> "$OUT/env.txt"
