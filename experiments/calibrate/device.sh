#!/bin/bash
# One call on a lent GPU (the device tool): calibrate it, then run the measured-vs-predicted study, everything
# into $OUT. The image's python3 has jax with CUDA; Hydra's three pure-Python wheels travel in .whl/.
#   run(command="bash experiments/calibrate/device.sh", carry=[".whl"], timeout_s=540)
# PROBE=1 first runs gemm_probe.py (sustained, rested and zeros GEMMs with the SM clock sampled).
set -u
source experiments/device_env.sh   # Hydra's wheels, the GPU's and jax's description into $OUT
if [ "${PROBE:-0}" != 0 ]; then
  timeout 90 python3 experiments/calibrate/gemm_probe.py "$OUT/study" > /tmp/probe.log 2>&1
  tail -4 /tmp/probe.log
fi
[ "${PROBE:-0}" = only ] && exit 0
timeout 230 python3 -m shardlab.calibrate out="$OUT/gpu_measured.yaml" 2>&1 | tr '\r' '\n' | grep -v "it/s" > "$OUT/calibrate.log"
grep -A12 "preset gpu_measured" "$OUT/calibrate.log"; tail -4 "$OUT/calibrate.log"
if [ -f "$OUT/gpu_measured.yaml" ]; then
  timeout 250 python3 experiments/calibrate/study.py calibrated="$OUT/gpu_measured.yaml" out="$OUT/study" \
    deadline_s=150 steps=15 > /tmp/study.log 2>&1
  tail -14 /tmp/study.log
fi
date -u +%FT%TZ >> "$OUT/env.txt"
