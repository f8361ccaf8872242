# Sourced by the prepared device scripts (experiments/*/device.sh): Hydra's pure-Python wheels from .whl/ (the
# lent machine's image has jax but no Hydra), and what the GPU and jax are, into $OUT.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv > "$OUT/nvidia-smi.csv"
python3 -c "import jax; print(jax.__version__, jax.devices(), jax.devices()[0].device_kind)" > "$OUT/env.txt" 2>&1
date -u +%FT%TZ >> "$OUT/env.txt"
