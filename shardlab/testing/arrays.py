"""Rank-coded arrays (each value says where it came from) and the blocks a sharding gives each device: a
misordered shard fails exactly, naming which element (and shard) arrived instead."""
from __future__ import annotations

import math

import numpy as np


def rank_coded(shape, dtype=np.float32, offset: int = 0) -> np.ndarray:
  """Values 0, 1, 2, ... in row-major order: any element that lands in the wrong place is identifiable
  (exact in float32 up to 2**24 elements)."""
  size = int(np.prod(shape))
  assert size + offset < 2**24, "rank-coded arrays must stay exact in float32"
  return (np.arange(size, dtype=np.float64) + offset).astype(dtype).reshape(shape)


def where(value, shape) -> tuple[int, ...]:
  """The index a rank-coded value came from."""
  return tuple(int(i) for i in np.unravel_index(int(round(float(value))), shape))


def _entries(spec, ndim: int) -> list[tuple[str, ...]]:
  """A PartitionSpec as, per dim, the tuple of mesh axes it is split over (major to minor)."""
  spec = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
  return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def coords(mesh) -> list[dict]:
  """Every device's coordinates, as {axis: index}, in the mesh's row-major order."""
  return [dict(zip(mesh.axis_names, c)) for c in np.ndindex(*mesh.devices.shape)]


def fmt(coord: dict) -> str:
  return "(" + ", ".join(f"{a}={i}" for a, i in coord.items()) + ")"


def slices(spec, shape, coord: dict, mesh) -> tuple:
  """The slices of a global array of `shape` that device `coord` holds under `spec`."""
  out = []
  for d, axes in enumerate(_entries(spec, len(shape))):
    n = math.prod(mesh.shape[a] for a in axes)
    if shape[d] % n:
      raise ValueError(f"dim {d} of shape {tuple(shape)} does not split over {'x'.join(axes)} ({n} devices)")
    k, i = shape[d] // n, 0
    for a in axes:
      i = i * mesh.shape[a] + coord[a]
    out.append(slice(i * k, (i + 1) * k))
  return tuple(out)


def block(x, spec, coord: dict, mesh) -> np.ndarray:
  """numpy: the block of global `x` that device `coord` holds under `spec`."""
  x = np.asarray(x)
  return x[slices(spec, x.shape, coord, mesh)]


def owner(index, spec, shape, mesh) -> dict:
  """The device coordinates whose block under `spec` holds global `index` ('*': any, replicated)."""
  own = {a: "*" for a in mesh.axis_names}
  for d, axes in enumerate(_entries(spec, len(shape))):
    if axes:
      k = shape[d] // math.prod(mesh.shape[a] for a in axes)
      own.update(zip(axes, np.unravel_index(index[d] // k, [mesh.shape[a] for a in axes])))
  return {a: int(i) if i != "*" else i for a, i in own.items()}


def origin(value, shape, spec=None, mesh=None, name: str = "the input") -> str:
  """Where a rank-coded value came from: 'element (3, 1) of x (device (fsdp=1, tensor=*))'."""
  try:
    index = where(value, shape)
  except ValueError:
    return f"{float(value)!r}, not an element of {name}"
  text = f"element {index} of {name}"
  return text + (f" (device {fmt(owner(index, spec, shape, mesh))})" if mesh is not None else "")


def assert_rank_coded_equal(got, want, shape, spec=None, mesh=None, label: str = "") -> None:
  """Exact equality of rank-coded values; a mismatch says which element of the input (and, given its spec
  and mesh, which device's shard) arrived instead of the expected one."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
  bad = np.argwhere(got != want)
  if len(bad):
    i = tuple(int(k) for k in bad[0])
    raise AssertionError(f"{label}: {len(bad)} of {got.size} values wrong; at {i} got "
                         f"{origin(got[i], shape, spec, mesh)}, expected {origin(want[i], shape, spec, mesh)}")
