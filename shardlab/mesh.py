"""The mesh: its named axes defined once (`data`, `fsdp`, `tensor`, outer to inner), devices checked, fake CPU
devices set in one place.

A mesh holds the axes its configuration sizes: always `fsdp` and `tensor` (the 2D `fsdp x tensor` mesh), and
`data` in front of them when `mesh.data > 1` (HSDP: weights replicated over `data`, sharded over `fsdp`). What
each axis shards is not decided here but by the logical-to-mesh rules, `params.LAYOUT`.
"""
from __future__ import annotations

import glob
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA = "data"      # batch only: weights replicated (HSDP's replica groups, usually across nodes)
FSDP = "fsdp"      # batch and the `embed` dimension of every weight (ZeRO-3)
TENSOR = "tensor"  # heads, d_ff and vocab (Megatron TP); the sequence too when sequence-parallel
AXES = (DATA, FSDP, TENSOR)   # every axis a mesh may have, outer (slowest links) to inner


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


def shape_of(fsdp: int, tensor: int, data: int = 1) -> dict[str, int]:
  """{axis: size} of the mesh these sizes make, outer to inner: `data` only when it is > 1."""
  return {**({DATA: data} if data != 1 else {}), FSDP: fsdp, TENSOR: tensor}


def describe(shape: dict) -> str:
  """{data: 2, fsdp: 2, tensor: 2} -> 'mesh.data=2 x mesh.fsdp=2 x mesh.tensor=2' (messages)."""
  return " x ".join(f"mesh.{a}={n}" for a, n in shape.items())


def make_mesh(fsdp: int, tensor: int, devices=None, data: int = 1) -> Mesh:
  """A `[data x] fsdp x tensor` mesh over exactly data*fsdp*tensor devices (JAX would silently take a subset)."""
  devices = jax.devices() if devices is None else devices
  shape = shape_of(fsdp, tensor, data)
  if min(shape.values()) < 1 or data < 1:
    raise ConfigError(f"{describe(shape)}: axis sizes must be >= 1")
  n = int(np.prod(list(shape.values())))
  if n != np.size(devices):
    raise ConfigError(f"{describe(shape)} = {n} devices, but {np.size(devices)} are present; choose a mesh whose "
                      f"product is {np.size(devices)}")
  # Auto axes: shard_map takes inputs placed with NamedSharding, and jax.test_util.check_grads works.
  devices = np.asarray(devices)
  dims = tuple(shape.values())
  grid = devices if devices.shape == dims else devices.reshape(dims)
  return Mesh(grid, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))
