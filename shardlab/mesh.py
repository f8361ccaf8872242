"""The mesh: built from the axis declarations (shardlab/axes.py), devices checked, fake CPU devices set in one
place.

A mesh holds the axes its configuration sizes, outer to inner in the registry's order: always `fsdp` and
`tensor` (the 2D `fsdp x tensor` mesh), and any other declared axis whose size is > 1 (`data` for HSDP,
`pipeline`, `context`). What each axis shards is not decided here but by the layout rules (shardlab/layout.py).
"""
from __future__ import annotations

import glob
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from shardlab import axes as X, fewer_gc_passes
from shardlab.axes import DATA, FSDP, TENSOR, describe  # noqa: F401  (re-exported)
from shardlab.errors import ConfigError  # noqa: F401  (re-exported: `from shardlab.mesh import ConfigError` still works)


# XLA:CPU's compile options for the programs a run compiles besides its step, which run once or for next to nothing
# (the parameters' initialization, the synthetic batches): LLVM's optimizations off, XLA's elemental emitters and
# the machine code generated in one piece (the tests' FAST_COMPILE, shardlab.testing, as compile options). The
# tiny model's initialization compiles in 1.6 s instead of 10.8 s (2-core VM, 2026-11-28) and gives the same values
# as under FAST_COMPILE, bit for bit (the integer batches are the same either way). The step keeps XLA's defaults:
# its speed is measured.
HELPER_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False,
                  "xla_cpu_parallel_codegen_split_count": 1}


_HELPERS: dict = {}   # compiled helpers by program and devices, most recent last (at most _KEEP_HELPERS)
_KEEP_HELPERS = 16


def _devices_of(info) -> tuple:
  """The devices, in order, of every sharding in a Lowered's out_info (None where a leaf has none): a compiled
  program is bound to them, and its text (shapes, shardings over a mesh's axes) does not name them."""
  out = []
  for leaf in jax.tree.leaves(info):
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    out.append(tuple(d.id for d in mesh.devices.flat) if mesh is not None and hasattr(mesh, "devices") else
               tuple(sorted(d.id for d in sharding.device_set)) if sharding is not None else None)
  return tuple(out)


def compile_helper(jitted, *args, platform: str):
  """`jitted.lower(*args).compile()`, with HELPER_COMPILE where the program runs on XLA:CPU (`platform`). The
  same program on the same devices is compiled once per process: the jobs of a sweep in one process, or runs
  resumed in a chain, build new closures for the same initialization and batches (0.7 s each to compile)."""
  lowered = jitted.lower(*args)
  build = lambda: lowered.compile(compiler_options=HELPER_COMPILE) if platform == "cpu" else lowered.compile()
  devices = _devices_of(lowered.out_info)
  if not any(devices):   # no output sharding names the devices (a program placed by jax.default_device): not kept
    return build()
  key = (platform, lowered.as_text(), devices)
  compiled = _HELPERS.pop(key, None)
  compiled = build() if compiled is None else compiled
  _HELPERS[key] = compiled
  while len(_HELPERS) > _KEEP_HELPERS:
    _HELPERS.pop(next(iter(_HELPERS)))
  return compiled


def set_cpu_devices(n: int) -> None:
  """Ask for `n` fake CPU devices. Must run before the first JAX operation: the count is fixed when the
  backend starts. The one place shardlab touches `jax_num_cpu_devices` (tests go through here too). Every
  process that runs or tests a step comes through here first: it also runs the collector less often
  (shardlab.fewer_gc_passes)."""
  fewer_gc_passes()
  if n < 1:
    raise ConfigError(f"cpu_devices={n}: must be >= 1")
  try:
    if os.environ.get("JAX_PLATFORMS") is None and not accelerator_present():
      # Installed GPU/TPU plugins (the target-compilation extras) would otherwise try to start, and log, here.
      jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)
    guard_persistent_cache()
  except RuntimeError:  # the backend already started (a second run in one process)
    have = len(jax.devices("cpu"))
    raise ConfigError(f"cpu_devices={n}: JAX already started with {have} CPU devices in this process; "
                      f"run one process per device count (sweeps: hydra/launcher=submitit_local)") from None


def guard_persistent_cache() -> None:
  """Keep out of JAX's persistent compilation cache (when one is set: JAX_COMPILATION_CACHE_DIR; the tests share
  one across processes) every XLA:CPU program whose collectives sit in more than one computation (a loop body or
  a branch, and outside it): jaxlib 0.10.2 restores a cached CPU program's collectives in order only within each
  computation (its thunk deserializer gives every nested sequence its own `kCollectiveCommunicator` resource:
  xla/backends/cpu/runtime/thunk_proto_serdes.cc), so two devices may start two collectives in different orders;
  every collective of a CPU program has channel_id 1, and they wait for each other until the rendezvous times out
  and aborts the process (the pipeline executor's tick loop, loaded from the cache: 40 s, then "Fatal Python error: Aborted").
  Those programs compile afresh in every process; the others are cached as before. set_cpu_devices calls it."""
  from shardlab.analysis.hlo import COLLECTIVES, collective_computations
  from shardlab.jax_private import skip_cache_writes

  def refuse(platform: str, text: str) -> bool:    # a program with no collective at all is kept without a parse
    return platform == "cpu" and any(k in text for k in COLLECTIVES) and len(collective_computations(text)) > 1
  skip_cache_writes(refuse)


def accelerator_present() -> bool:
  """An NVIDIA GPU or a TPU is attached to this machine (its device files exist)."""
  return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def shape_of(fsdp: int | dict, tensor: int = 1, data: int = 1) -> dict[str, int]:
  """{axis: size} of the mesh these sizes make, outer to inner (axes.shape_of): `shape_of({..})`, or the classic
  `shape_of(fsdp, tensor, data)`."""
  sizes = dict(fsdp) if isinstance(fsdp, dict) else {DATA: data, FSDP: fsdp, TENSOR: tensor}
  return X.shape_of(sizes)


def make_mesh(fsdp: int | dict, tensor: int = 1, devices=None, data: int = 1) -> Mesh:
  """A mesh over exactly the product of its sizes' devices (JAX would silently take a subset): `make_mesh({axis:
  size, ..}, devices=..)` for any declared axes, or the classic `make_mesh(fsdp, tensor, devices, data=..)`."""
  devices = jax.devices() if devices is None else devices
  if isinstance(fsdp, dict) and min(fsdp.values(), default=1) < 1:
    raise ConfigError(f"{describe(fsdp)}: axis sizes must be >= 1")
  try:
    shape = shape_of(fsdp, tensor, data)
  except KeyError as e:
    raise ConfigError(str(e.args[0])) from None
  if min(shape.values()) < 1 or (not isinstance(fsdp, dict) and data < 1):
    raise ConfigError(f"{describe(shape)}: axis sizes must be >= 1")
  n = X.n_devices(shape)
  if n != np.size(devices):
    raise ConfigError(f"{describe(shape)} = {n} devices, but {np.size(devices)} are present; choose a mesh whose "
                      f"product is {np.size(devices)}")
  # Auto axes: shard_map takes inputs placed with NamedSharding, and jax.test_util.check_grads works.
  devices = np.asarray(devices)
  dims = tuple(shape.values())
  grid = devices if devices.shape == dims else devices.reshape(dims)
  return Mesh(grid, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))
