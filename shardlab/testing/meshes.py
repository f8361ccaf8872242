"""Fake CPU devices and meshes for tests: set the device count before JAX starts, every mesh shape a device
count allows, cached meshes over declared axes (shardlab/axes.py)."""
from __future__ import annotations

import functools
import math
import os


DEFAULT_DEVICES = 8
# XLA:CPU compiles tests' programs with LLVM's optimizations off and with its elemental IR emitters instead of its
# MLIR fusion emitters. XLA's HLO passes still run; with the elemental emitters XLA:CPU expands each scatter into a
# loop of its own (tests/test_target.py's trip-count test compiles its CPU side with the default emitters).
# tests/test_equivalence.py on 2 workers: 150 CPU-seconds with both flags, 372 with the first alone (2026-11-26).
# The emitter flag is XLA:CPU's: the HLO and schedule of a GPU or TPU compile do not change. Both compilers then
# generate machine code in one piece instead of splitting it for threads of their own (XLA:CPU splits a module
# into 32 by default), which on a machine whose cores the test workers already keep busy costs CPU and saves no
# time: two tiny steps (prefetch_ring on 2x4, a 1f1b pipeline) compiled for XLA:CPU, alternated in one process,
# 4.23 s of CPU against 4.99 s a round (four rounds); two compiled for 8 H100s (deviceless), 8.59 s against
# 10.23 s, and less wall time too (2-core VM, 2026-12-02). The compiled HLO text and memory_analysis() are the
# same either way (both compilers checked on prefetch_ring).
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1 --xla_gpu_force_compilation_parallelism=1")


def set_devices(n: int = DEFAULT_DEVICES, fast_compile: bool = True) -> None:
  """Ask for `n` fake CPU devices (through shardlab.mesh.set_cpu_devices, the one place that sets them).
  Must run before the first JAX operation; asking again for the same count later is harmless.
  `fast_compile` sets XLA_FLAGS to FAST_COMPILE unless it is already set: tests check numbers and bytes, not
  speed."""
  if fast_compile:
    os.environ.setdefault("XLA_FLAGS", FAST_COMPILE)
  from shardlab.mesh import set_cpu_devices
  set_cpu_devices(n)
  import jax   # the audit reads op_names: a cached program must carry its own (see shardlab.trainer.build)
  jax.config.update("jax_compilation_cache_include_metadata_in_key", True)


def configured_devices() -> int | None:
  """The fake CPU device count asked for so far (by set_devices or anyone else), if any."""
  import jax
  n = jax.config.jax_num_cpu_devices
  return n if n > 0 else None


def devices(n: int | None = None) -> list:
  """The first n devices the kit builds meshes on: the default backend's, or the fake CPU ones when the
  default backend has fewer (a machine with one GPU still runs the tests on 8 CPU devices)."""
  import jax
  n = n or device_count()
  devs = jax.devices()
  if len(devs) < n:
    devs = jax.devices("cpu")
  if len(devs) < n:
    raise ValueError(f"{n} devices needed, {len(devs)} present: run pytest with --shardlab-devices={n}")
  return devs[:n]


def device_count() -> int:
  """How many devices the kit's meshes span by default: the fake CPU count if one was set."""
  import jax
  return configured_devices() or len(jax.devices())


def mesh_shapes(n: int = 8, rank: int = 2, axes=None) -> list:
  """Every factorization of n into `rank` axes: (fsdp, tensor), or (data, fsdp, tensor) with rank=3. `axes`
  (declared axis names, outer to inner): every {axis: size} over those axes instead."""
  if axes is not None:
    if len(axes) == 1:
      return [{axes[0]: n}]
    return [{axes[0]: d, **rest} for d in range(1, n + 1) if n % d == 0
            for rest in mesh_shapes(n // d, axes=tuple(axes[1:]))]
  if rank not in (2, 3):
    raise ValueError(f"rank={rank}: meshes have 2 (fsdp x tensor) or 3 (data x fsdp x tensor) axes; "
                     f"name others with axes=(...)")
  return [tuple(s.values()) for s in mesh_shapes(n, axes=_classic()[3 - rank:])]


def _classic() -> tuple[str, ...]:
  from shardlab.axes import CLASSIC
  return CLASSIC


def mesh_id(shape) -> str:
  """(2, 4) or a mesh -> '2x4', (2, 2, 2) -> '2x2x2' (test ids and messages); a mesh or {axis: size} with other
  axes -> 'p2xf2xt2' (axes.label)."""
  from shardlab.axes import label, shape_of
  if hasattr(shape, "axis_names"):
    shape = dict(zip(shape.axis_names, shape.devices.shape))
  if isinstance(shape, dict):
    return label(shape_of(shape))
  return "x".join(str(s) for s in tuple(shape))


def parse_mesh_shape(shape) -> tuple[int, ...]:
  """'2x4', (2, 4) -> (2, 4); '2x2x2' -> (2, 2, 2) (data x fsdp x tensor). A named shape ({axis: size}, or a
  label such as 'p2xf2xt2') -> a tuple of (axis, size) pairs, outer to inner."""
  from shardlab.axes import parse_label, shape_of
  if isinstance(shape, dict):
    return tuple(shape_of(shape).items())
  if isinstance(shape, tuple) and shape and all(isinstance(s, tuple) for s in shape):
    return tuple(shape_of(dict(shape)).items())
  if isinstance(shape, str):
    if not all(p.isdigit() for p in shape.lower().split("x")):
      return tuple(parse_label(shape).items())
    shape = shape.lower().split("x")
  out = tuple(int(s) for s in shape)
  if len(out) not in (2, 3) or min(out) < 1:
    raise ValueError(f"mesh shape {shape!r}: expected 'FxT' (fsdp, tensor) or 'DxFxT' (data, fsdp, tensor), "
                     f"or a label naming its axes ('p2xf2xt2')")
  return out


def named_shape(shape) -> dict[str, int]:
  """Any shape parse_mesh_shape takes -> {axis: size} of the mesh it makes, outer to inner."""
  from shardlab.axes import CLASSIC, shape_of
  got = parse_mesh_shape(shape)
  if got and isinstance(got[0], tuple):
    return dict(got)
  return shape_of(dict(zip(CLASSIC[3 - len(got):], got)))


def mesh_of(*shape):
  """The `fsdp x tensor` (or `data x fsdp x tensor`) mesh (shardlab.mesh.make_mesh: Auto axes, so check_grads
  works; a data axis of 1 is no axis). Also mesh_of({axis: size}) or mesh_of('p2xf2xt2') for any axes. Cached."""
  if len(shape) == 1 and not isinstance(shape[0], int):
    shape = shape[0]
  return _mesh_of(tuple(named_shape(shape).items()))


@functools.lru_cache(maxsize=None)
def _mesh_of(items: tuple):
  from shardlab.mesh import make_mesh
  named = dict(items)
  return make_mesh(named, devices=devices(math.prod(named.values())))


def meshes_for(shapes) -> list:
  """None (every shape of the device count), a mesh, a shape, or a list of either -> [Mesh]."""
  if shapes is None:
    shapes = mesh_shapes(device_count())
  elif hasattr(shapes, "axis_names") or isinstance(shapes, str) or (
      isinstance(shapes, tuple) and all(isinstance(s, int) for s in shapes)):
    shapes = [shapes]
  return [m if hasattr(m, "axis_names") else mesh_of(_hashable(m)) for m in shapes]


def _hashable(shape):
  return tuple(named_shape(shape).items())
