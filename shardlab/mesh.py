"""The 2D `fsdp x tensor` mesh: axis names defined once, devices checked, fake CPU devices set in one place."""
from __future__ import annotations

import glob
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

FSDP = "fsdp"      # batch and the `embed` dimension of every weight (ZeRO-3)
TENSOR = "tensor"  # heads, d_ff and vocab (Megatron TP); the sequence too when sequence-parallel
AXES = (FSDP, TENSOR)


class ConfigError(ValueError):
  """A setting that cannot work; its message is one line naming the setting and the fix."""


def set_cpu_devices(n: int) -> None:
  """Ask for `n` fake CPU devices. Must run before the first JAX operation: the count is fixed when the
  backend starts. The one place shardlab touches `jax_num_cpu_devices` (tests go through here too)."""
  if n < 1:
    raise ConfigError(f"cpu_devices={n}: must be >= 1")
  try:
    if os.environ.get("JAX_PLATFORMS") is None and not accelerator_present():
      # Installed GPU/TPU plugins (the target-compilation extras) would otherwise try to start, and log, here.
      jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # the backend already started (a second run in one process)
    have = len(jax.devices("cpu"))
    raise ConfigError(f"cpu_devices={n}: JAX already started with {have} CPU devices in this process; "
                      f"run one process per device count (sweeps: hydra/launcher=submitit_local)") from None


def accelerator_present() -> bool:
  """An NVIDIA GPU or a TPU is attached to this machine (its device files exist)."""
  return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def make_mesh(fsdp: int, tensor: int, devices=None) -> Mesh:
  """A `fsdp x tensor` mesh over exactly fsdp*tensor devices (JAX would silently take a subset)."""
  devices = jax.devices() if devices is None else devices
  if fsdp < 1 or tensor < 1:
    raise ConfigError(f"mesh.fsdp={fsdp} mesh.tensor={tensor}: axis sizes must be >= 1")
  if fsdp * tensor != np.size(devices):
    raise ConfigError(f"mesh.fsdp={fsdp} x mesh.tensor={tensor} = {fsdp * tensor} devices, but "
                      f"{np.size(devices)} are present; choose a mesh whose product is {np.size(devices)}")
  # Auto axes: shard_map takes inputs placed with NamedSharding, and jax.test_util.check_grads works.
  devices = np.asarray(devices)
  grid = devices if devices.shape == (fsdp, tensor) else devices.reshape(fsdp, tensor)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)
