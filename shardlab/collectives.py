"""Every collective shardlab performs, as thin named wrappers, and the ring collective matmuls.

Only this module and `schedules/` call `jax.lax` collectives (tests/test_structure.py greps for it). Each wrapper
runs under a named scope `shardlab.<name>` (`scope`), so profiles and HLO metadata read like the code, and that
prefix is the one rule of the audit: a collective placed through this module (under any name) is planned, any
other collective in a compiled program is not (analysis/hlo.py: `scope_of`; summary.json's `audit`, the ledger
tests and the testing kit all read it). Shapes use the Scaling Book's
notation: `x[B, L_tp, D]` is sharded over `tensor` on L; a result marked `{U_tp}` is unreduced over `tensor`.

Backward passes come from AD and are the transposes: all_gather <-> psum_scatter, psum of an invariant result
<-> pvary (identity), ppermute(+1) <-> ppermute(-1).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp


SCOPE_PREFIX = "shardlab."   # every collective placed here runs under a named scope with this prefix


def scope(name: str):
  """The named scope a collective placed under `name` runs in: `shardlab.<name>` (any name: the prefix marks it
  planned; the name is its ledger row's `scope`)."""
  if not re.fullmatch(r"\w+", name):
    raise ValueError(f"collective name {name!r}: letters, digits and underscores only (it names a ledger row)")
  return jax.named_scope(SCOPE_PREFIX + name)


@dataclass(frozen=True)
class Group:
  """Part of one mesh axis: `size` of its ranks, `stride` apart. Stride 1: runs of `size` consecutive ranks (an
  inner group, e.g. inside one node); stride k: every k-th rank (an outer group, across the inner ones). USP splits
  `context` so (schedules/context.py): Ulysses' all-to-all in Group(axis, U), the ring in Group(axis, C/U, U).
  Every wrapper here takes one where it takes an axis; its collectives carry the groups as replica groups."""
  axis: str
  size: int
  stride: int = 1

  def groups(self) -> list[list[int]]:
    """The axis's ranks in groups (each a list of ranks of `axis`), every rank in one."""
    span, n = self.size * self.stride, jax.lax.axis_size(self.axis)
    if n % span:
      raise ValueError(f"{self}: the axis has {n} ranks, not a multiple of {span}")
    return [[hi + lo + k * self.stride for k in range(self.size)] for hi in range(0, n, span)
            for lo in range(self.stride)]


def _named(axis):
  """(the mesh axis, axis_index_groups or None) of an axis name (tuple) or a Group."""
  return (axis.axis, axis.groups()) if isinstance(axis, Group) else (axis, None)


def axis_size(axis) -> int:
  return axis.size if isinstance(axis, Group) else jax.lax.axis_size(axis)


def axis_index(axis):
  """This device's rank along `axis` (within its group, for a Group)."""
  if isinstance(axis, Group):
    return (jax.lax.axis_index(axis.axis) // axis.stride) % axis.size
  return jax.lax.axis_index(axis)


def varying_axes(x) -> frozenset:
  """Mesh axes over which `x` may differ between devices (shard_map's varying-manual-axes type)."""
  return frozenset(jax.typeof(x).manual_axis_type.varying)


def zeros_like(x):
  """Zeros with x's shape, dtype and varying axes (an accumulator that x can be added to)."""
  return pvary(jnp.zeros(x.shape, x.dtype), varying_axes(x), name="zeros")


def all_gather(x, axis: str, dim: int, name: str = "all_gather"):
  """x[.., N_axis, ..] -> x[.., N, ..]: tiled all-gather of `dim`. Backward: psum_scatter of `dim`."""
  axis, groups = _named(axis)
  with scope(name):
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True, axis_index_groups=groups)


def psum_scatter(x, axis: str, dim: int, name: str = "psum_scatter"):
  """x[.., N, ..]{U_axis} -> x[.., N_axis, ..]: sum over `axis`, keep this device's block of `dim`.
  Backward: all_gather of `dim`."""
  with scope(name):
    return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def psum(x, axes, name: str = "psum"):
  """x{U_axes} -> x: all-reduce (sum). Backward: identity (pvary)."""
  with scope(name):
    return jax.lax.psum(x, axes)


def all_to_all(x, axis, split_dim: int, concat_dim: int, name: str = "all_to_all"):
  """x[.., S, .., N, ..] -> x[.., S / n, .., N n, ..]: `split_dim` cut into n blocks, block j sent to device j
  along `axis`, the blocks received concatenated along `concat_dim` (tiled). Backward: the all_to_all the other
  way round (split and concat dims swapped)."""
  axis, groups = _named(axis)
  with scope(name):
    return jax.lax.all_to_all(x, axis, split_dim, concat_dim, tiled=True, axis_index_groups=groups)


def ragged_all_to_all(x, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis: str,
                      name: str = "ragged_all_to_all"):
  """Rows of x[M, ..] to each device along `axis`: send_sizes[j] rows from input_offsets[j] go to device j, into
  its `out` at output_offsets[j] (an offset in j's buffer); recv_sizes[j] rows arrive from j. Only the rows sent
  travel (the MoE dispatch of MaxText's sparse matmul). XLA:CPU cannot run it (schedules/expert.py has the
  padded all_to_all that gives the same numbers there). Backward: the exchange the other way round."""
  with scope(name):
    return jax.lax.ragged_all_to_all(x, out, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis)


def pmax(x, axes, name: str = "pmax"):
  """All-reduce (max); only ever applied to values outside the gradient (stop_gradient'd)."""
  with scope(name):
    return jax.lax.pmax(x, axes)


def pvary(x, axes, name: str = "pvary"):
  """Mark an invariant value as varying over `axes` (no communication). Its transpose is the psum that
  sums the gradient contributions of the devices that used the same value (Megatron's `f` operator)."""
  axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in varying_axes(x))
  if not axes:
    return x
  with scope(name):
    return jax.lax.pcast(x, axes, to="varying")


def ring_shift(x, axis: str, shift: int = 1, name: str = "ring_shift"):
  """Send x to the device `shift` steps further along `axis` (cyclic); receive from `shift` steps back.
  Backward: the opposite shift."""
  if isinstance(axis, Group):   # each group a ring of its own
    pairs = [(g[i], g[(i + shift) % len(g)]) for g in axis.groups() for i in range(len(g))]
    with scope(name):
      return jax.lax.ppermute(x, axis.axis, perm=pairs)
  n = axis_size(axis)
  with scope(name):
    return jax.lax.ppermute(x, axis, perm=[(i, (i + shift) % n) for i in range(n)])


def ppermute(x, axis: str, pairs, name: str = "ppermute"):
  """Send x from device i to device j along `axis` for each (i, j) in `pairs`; a device no pair sends to
  receives zeros. Backward: the same pairs reversed."""
  with scope(name):
    return jax.lax.ppermute(x, axis, perm=list(pairs))


# ---- ring collective matmuls (Scaling Book jax-stuff.md; JAX shard_map notebook, "collective matmul") ----
#
# `f` maps a block of tokens to its matmul output, block-wise along `dim` (any per-token contraction).
# Every ppermute in a step depends only on the block received in the step before, never on that step's `f`:
# a GPU scheduler can run the permute of step s+1 behind the matmul of step s.


def _block(x, dim: int, index, size: int):
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim, allow_negative_indices=False)


def all_gather_matmul(x, f: Callable, axis: str, dim: int, bidirectional: bool = False,
                      name: str = "ag_matmul_ring"):
  """f(all_gather(x, axis, dim)) by a ring: x[.., L_axis, ..] -> f(x)[.., L, ..]. `f` may return a tuple
  (several contractions of the same block: one ring for all of them).

  Unidirectional: n-1 ppermutes of one block each, (n-1)/n of the gathered bytes, as the all-gather it
  replaces. Bidirectional: the block is split in halves travelling opposite ways; same bytes, half the
  bytes per link direction per step. Backward (AD): a matmul-reduce-scatter ring the other way round.
  """
  n = axis_size(axis)
  if bidirectional and x.shape[dim] % 2:
    raise ValueError(f"bidirectional all_gather_matmul splits the local block in halves: "
                     f"dim {dim} has {x.shape[dim]}")
  if n == 1:
    return f(x)
  r = jax.lax.axis_index(axis)
  with scope(name):
    put = lambda out, y, block: jax.tree.map(
        lambda o, b: jax.lax.dynamic_update_slice_in_dim(o, b, block * b.shape[dim], axis=dim,
                                                        allow_negative_indices=False), out, y)
    if not bidirectional:
      blk = x
      for s in range(n):
        y = f(blk)                      # after s shifts of +1, this device holds the block of rank r-s
        out = jax.tree.map(lambda b: y_full(b, dim, n), y) if s == 0 else out
        out = put(out, y, (r - s) % n)
        if s < n - 1:
          blk = ring_shift(blk, axis, +1)
      return out
    half = x.shape[dim] // 2
    lo, hi = jax.lax.slice_in_dim(x, 0, half, axis=dim), jax.lax.slice_in_dim(x, half, 2 * half, axis=dim)
    for s in range(n):
      y_lo, y_hi = f(lo), f(hi)         # lo travels +1 (holds rank r-s), hi travels -1 (holds rank r+s)
      if s == 0:
        out = jax.tree.map(lambda b: y_full(b, dim, 2 * n), y_lo)
      out = put(out, y_lo, 2 * ((r - s) % n))        # in half-blocks
      out = put(out, y_hi, 2 * ((r + s) % n) + 1)
      if s < n - 1:
        lo, hi = ring_shift(lo, axis, +1), ring_shift(hi, axis, -1)
    return out


def y_full(y, dim: int, n: int):
  """Zeros with `y`'s block repeated n times along `dim` (the output buffer of a ring)."""
  shape = list(y.shape)
  shape[dim] *= n
  return jnp.zeros(shape, y.dtype)


def matmul_reduce_scatter(h, f: Callable, axis: str, dim: int, bidirectional: bool = False,
                          name: str = "matmul_rs_ring"):
  """psum_scatter(f(h), axis, dim) by a ring: h[.., L, ..] -> f(h)[.., L_axis, ..], summed over `axis`.

  Step s computes f on the block destined for rank r-s-1 and adds it to the partial sum received from
  rank r-1 (which computed the same block one step earlier): after n-1 ppermutes of one block each, rank r
  holds block r summed over the ring. Bytes: (n-1)/n of f(h), as the reduce-scatter it replaces.
  Backward (AD): an all-gather-matmul ring the other way round.
  """
  n = axis_size(axis)
  if h.shape[dim] % (2 * n if bidirectional else n):
    raise ValueError(f"matmul_reduce_scatter over {n} devices{' in half-blocks' if bidirectional else ''}: "
                     f"dim {dim} has {h.shape[dim]}, not a multiple of {2 * n if bidirectional else n}")
  if n == 1:
    return f(h)
  r = jax.lax.axis_index(axis)
  size = h.shape[dim] // n
  with scope(name):
    if not bidirectional:
      acc = f(_block(h, dim, (r - 1) % n, size))
      for s in range(1, n):
        acc = ring_shift(acc, axis, +1) + f(_block(h, dim, (r - s - 1) % n, size))
      return acc
    half = size // 2
    lo = f(_block(h, dim, 2 * ((r - 1) % n), half))      # first halves travel +1
    hi = f(_block(h, dim, 2 * ((r + 1) % n) + 1, half))  # second halves travel -1
    for s in range(1, n):
      lo = ring_shift(lo, axis, +1) + f(_block(h, dim, 2 * ((r - s - 1) % n), half))
      hi = ring_shift(hi, axis, -1) + f(_block(h, dim, 2 * ((r + s + 1) % n) + 1, half))
    return jnp.concatenate([lo, hi], axis=dim)
