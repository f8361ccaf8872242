#!/bin/bash
# One call on a lent GPU (the device tool): shardlab's Pallas flash kernel measured beside cuDNN's and XLA's
# (flash_gpu.py), then the single-device training steps measured beside their predictions (experiments/calibrate/
# study.py, whose blockwise case runs the same kernel inside a step), everything into $OUT/results.tgz.
#   run(command="bash experiments/context/device.sh", carry=[".whl"], timeout_s=420)
# FAST=1: cuDNN and shardlab's kernels only (flash_gpu.py fast=true), and the study's d2048 steps with cuDNN's and
# with shardlab's kernel (blockwise) alone. TILES=N: the first N tiles of flash_gpu.py; STUDY=0: no study.
set -u
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}   # flash_gpu's float32 reference, 8192 tokens: >60 GB
source experiments/device_env.sh   # Hydra's wheels, the GPU's and jax's description into $OUT
RES=/tmp/res; rm -rf "$RES"; mkdir -p "$RES"   # a warm machine keeps /tmp: start from nothing
pack() { tar -czf "$OUT/results.tgz" -C "$RES" . ; }
F=false; ONLY=; [ "${FAST:-0}" != 0 ] && F=true && ONLY="d2048;d2048 blockwise"
timeout 210 python3 experiments/context/flash_gpu.py out="$RES/flash" deadline_s=160 fast=$F tiles=${TILES:-9} > "$RES/flash.log" 2>&1
grep -E "^\| " "$RES/flash.log" | cut -c1-260; grep -E "Error|error:" "$RES/flash.log" | head -5 | cut -c1-300; pack
[ "${STUDY:-1}" = 0 ] && { date -u +%FT%TZ >> "$OUT/env.txt"; exit 0; }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$GPU" in *H200*) CAL=h200_run2 ;; *) CAL=h100_run2 ;; esac
timeout 180 python3 experiments/calibrate/study.py calibrated="experiments/calibrate/results/$CAL/gpu_measured.yaml" \
  out="$RES/study" deadline_s=120 steps=12 only="$ONLY" > "$RES/study.log" 2>&1
tail -12 "$RES/study.log" | cut -c1-260; pack
date -u +%FT%TZ >> "$OUT/env.txt"
