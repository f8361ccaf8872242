#!/bin/bash
# One call on a lent GPU (the device tool): calibrate it, then run the measured-vs-predicted study, everything
# into $OUT. The image's python3 has jax with CUDA; Hydra's three pure-Python wheels travel in .whl/.
#   run(command="bash experiments/calibrate/device.sh", carry=[".whl"], timeout_s=540)
# PROBE=1 first runs gemm_probe.py (sustained, rested and zeros GEMMs with the SM clock sampled).
# MOE=1 then runs the mixture-of-experts steps (study.py set=moe) with the preset just measured.
# The results are packed into $OUT/results.tgz after each stage (the device tool returns at most 8 files).
set -u
source experiments/device_env.sh   # Hydra's wheels, the GPU's and jax's description into $OUT
RES=/tmp/res; rm -rf "$RES"; mkdir -p "$RES/study"   # a warm machine keeps /tmp: start from nothing
pack() { tar -czf "$OUT/results.tgz" -C "$RES" . ; }
if [ "${PROBE:-0}" != 0 ]; then
  timeout 90 python3 experiments/calibrate/gemm_probe.py "$RES/study" > "$RES/probe.log" 2>&1
  tail -4 "$RES/probe.log"; pack
fi
[ "${PROBE:-0}" = only ] && exit 0
timeout 230 python3 -m shardlab.calibrate out="$RES/gpu_measured.yaml" 2>&1 | tr '\r' '\n' | grep -v "it/s" > "$RES/calibrate.log"
grep -A12 "preset gpu_measured" "$RES/calibrate.log"; tail -4 "$RES/calibrate.log"; pack
if [ -f "$RES/gpu_measured.yaml" ]; then
  timeout 250 python3 experiments/calibrate/study.py calibrated="$RES/gpu_measured.yaml" out="$RES/study" \
    deadline_s=150 steps=15 > "$RES/study.log" 2>&1
  tail -14 "$RES/study.log"; pack
  if [ "${MOE:-0}" != 0 ]; then
    timeout 230 python3 experiments/calibrate/study.py set=moe calibrated="$RES/gpu_measured.yaml" out="$RES/moe" \
      deadline_s=150 steps=12 > "$RES/moe.log" 2>&1
    tail -12 "$RES/moe.log"; pack
  fi
fi
date -u +%FT%TZ >> "$OUT/env.txt"
