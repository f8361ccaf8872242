"""A small kit for testing sharded code on fake CPU devices (shardlab's own tests use it).

  mesh_shapes(n)              every fsdp x tensor factorization of n
  rank_coded(shape)           an array whose every value says where it came from (index i -> value i)
  where(x, shape)             decode a rank-coded value back to its index in the original array
  assert_trees_close(a, b)    per-leaf comparison naming the leaf path and the first mismatching index
"""
from __future__ import annotations

import numpy as np


def mesh_shapes(n: int = 8) -> list[tuple[int, int]]:
  return [(f, n // f) for f in range(1, n + 1) if n % f == 0]


def rank_coded(shape, dtype=np.float32, offset: int = 0) -> np.ndarray:
  """Values 0, 1, 2, ... in row-major order: any element that lands in the wrong place is identifiable
  (exact in float32 up to 2**24 elements)."""
  size = int(np.prod(shape))
  assert size + offset < 2**24, "rank-coded arrays must stay exact in float32"
  return (np.arange(size, dtype=np.float64) + offset).astype(dtype).reshape(shape)


def where(value, shape) -> tuple[int, ...]:
  """The index a rank-coded value came from."""
  return tuple(int(i) for i in np.unravel_index(int(round(float(value))), shape))


def assert_trees_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6, label: str = "") -> None:
  """Every leaf of `actual` equals `expected` within tolerance; `atol` is relative to the leaf's scale
  (max |expected|), so that tiny and large parameters are held to the same standard."""
  import jax
  flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
  flat_e = jax.tree.leaves(expected)
  assert len(flat_a) == len(flat_e), f"{label}: {len(flat_a)} leaves vs {len(flat_e)}"
  for (path, a), e in zip(flat_a, flat_e):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    name = jax.tree_util.keystr(path)
    assert a.shape == e.shape, f"{label}{name}: shape {a.shape} != {e.shape}"
    scale = max(float(np.max(np.abs(e))) if e.size else 0.0, 1e-30)
    bad = np.abs(a - e) > atol * scale + rtol * np.abs(e)
    if bad.any():
      idx = tuple(int(i) for i in np.argwhere(bad)[0])
      err = float(np.max(np.abs(a - e)) / scale)
      raise AssertionError(f"{label}{name}: {int(bad.sum())} of {a.size} values differ; first at {idx}: "
                           f"{a[idx]!r} != {e[idx]!r}; max error {err:.2e} of the leaf's scale")
