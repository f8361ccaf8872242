#!/bin/bash
# One call on a lent GPU (the device tool): single-device MoE steps measured beside predicted, into $OUT.
#   run(command="bash experiments/moe/device.sh", carry=[".whl"], kind="nvidia-h200", timeout_s=420)
# The calibrated preset is the one `python -m shardlab.calibrate` measured on an H200 (experiments/calibrate/).
set -u
source experiments/device_env.sh   # Hydra's wheels, the GPU's and jax's description into $OUT
timeout 330 python3 experiments/calibrate/study.py set=moe \
  calibrated=experiments/calibrate/results/h200_run2/gpu_measured.yaml out="$OUT/moe" deadline_s=240 steps=12 \
  > "$OUT/study.log" 2>&1
tail -12 "$OUT/study.log"
date -u +%FT%TZ >> "$OUT/env.txt"
