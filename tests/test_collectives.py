"""Every wrapper in shardlab/collectives.py against numpy, and the ring collective matmuls against the plain
all_gather / psum_scatter versions with the same in/out specs, forward and backward.

Inputs are rank-coded (value = global flat index), so a block that lands on the wrong device names itself.
Every device's copy of a result is checked: functions under test return `y[None, None]` with out_specs
P('fsdp', 'tensor'), so the global output is out[f, t, ...] = device (f, t)'s local value.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import MESHES, mesh_of
from shardlab import collectives as C
from shardlab.mesh import FSDP, TENSOR

AXES = (FSDP, TENSOR)
from shardlab import testing as K
from shardlab.testing import assert_trees_close, block, owner, rank_coded, where

MESHES_2D = [(2, 4), (4, 2)]
OTHER = {FSDP: TENSOR, TENSOR: FSDP}
mesh_id = lambda s: f"{s[0]}x{s[1]}"


# ---------------------------------------------------------------------------------------------- helpers

def per_device(mesh, fn, in_specs):
  """The kit's per_device, jitted: out[f, t, ...] is device (f, t)'s local result (every copy checked)."""
  return jax.jit(K.per_device(fn, mesh, in_specs))


def assert_rank_coded_equal(got, want, shape, label):
  K.assert_rank_coded_equal(got, want, shape, label=label)


def _split(axis, dim):
  """x[8, 8, 3] sharded over `axis` on `dim` and over the other axis on the other dim: every block distinct."""
  spec = [None, None, None]
  spec[dim], spec[1 - dim] = axis, OTHER[axis]
  return spec


# ------------------------------------------------------------------------------------- wrappers vs numpy

@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("axis", [FSDP, TENSOR])
@pytest.mark.parametrize("mesh_shape", MESHES_2D, ids=mesh_id)
def test_all_gather(mesh_shape, axis, dim):
  mesh = mesh_of(*mesh_shape)
  x = rank_coded((8, 8, 3))
  spec = _split(axis, dim)
  out = per_device(mesh, lambda x: C.all_gather(x, axis, dim), (P(*spec),))(x)
  gathered = list(spec)
  gathered[dim] = None
  for c in K.coords(mesh):
    assert_rank_coded_equal(out[c[FSDP], c[TENSOR]], block(x, gathered, c, mesh), x.shape,
                            f"all_gather over {axis} of dim {dim}, device {c}")


def _stacked_input(mesh, axis):
  """x[A, 8, 8, 2*O]: device (a, o) holds x[a, :, :, o-th block], a different slab per device of `axis`."""
  a, o = mesh.shape[axis], mesh.shape[OTHER[axis]]
  return rank_coded((a, 8, 8, 2 * o)), P(axis, None, None, OTHER[axis])


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("axis", [FSDP, TENSOR])
@pytest.mark.parametrize("mesh_shape", MESHES_2D, ids=mesh_id)
def test_psum_scatter(mesh_shape, axis, dim):
  mesh = mesh_of(*mesh_shape)
  x, spec = _stacked_input(mesh, axis)
  out = per_device(mesh, lambda x: C.psum_scatter(x[0], axis, dim), (spec,))(x)
  total = x.sum(0)  # sums of integers < 2**24: exact in any order
  out_spec = [None, None, OTHER[axis]]
  out_spec[dim] = axis
  for c in K.coords(mesh):
    np.testing.assert_array_equal(out[c[FSDP], c[TENSOR]], block(total, out_spec, c, mesh),
                                  err_msg=f"psum_scatter over {axis} of dim {dim}, device {c}")


@pytest.mark.parametrize("axes", [FSDP, TENSOR, AXES], ids=str)
@pytest.mark.parametrize("mesh_shape", MESHES_2D, ids=mesh_id)
def test_psum(mesh_shape, axes):
  mesh = mesh_of(*mesh_shape)
  x = rank_coded((mesh.shape[FSDP], mesh.shape[TENSOR], 4, 3))
  out = per_device(mesh, lambda x: C.psum(x[0, 0], axes), (P(FSDP, TENSOR),))(x)
  summed = (0, 1) if axes == AXES else (0,) if axes == FSDP else (1,)
  want = x.sum(summed, keepdims=True)
  for c in K.coords(mesh):
    i, j = (0 if 0 in summed else c[FSDP]), (0 if 1 in summed else c[TENSOR])
    np.testing.assert_array_equal(out[c[FSDP], c[TENSOR]], want[i, j], err_msg=f"psum over {axes}, device {c}")


@pytest.mark.parametrize("shift", [1, -1])
@pytest.mark.parametrize("axis", [FSDP, TENSOR])
@pytest.mark.parametrize("mesh_shape", MESHES_2D, ids=mesh_id)
def test_ring_shift(mesh_shape, axis, shift):
  mesh = mesh_of(*mesh_shape)
  spec = P(FSDP, TENSOR)
  x = rank_coded((2 * mesh.shape[FSDP], 3 * mesh.shape[TENSOR]))
  out = per_device(mesh, lambda x: C.ring_shift(x, axis, shift), (spec,))(x)
  n = mesh.shape[axis]
  for c in K.coords(mesh):
    src = dict(c, **{axis: (c[axis] - shift) % n})  # device i's block arrives at i + shift
    got, want = np.asarray(out[c[FSDP], c[TENSOR]]), block(x, spec, src, mesh)
    if not np.array_equal(got, want):
      came = owner(where(got.flat[0], x.shape), spec, x.shape, mesh)
      raise AssertionError(f"ring_shift({axis}, {shift:+d}): device {c} received the block of device {came}, "
                           f"expected that of device {src}")


@pytest.mark.parametrize("axis", [FSDP, TENSOR])
@pytest.mark.parametrize("mesh_shape", MESHES_2D, ids=mesh_id)
def test_pvary_is_identity_forward_and_psum_backward(mesh_shape, axis):
  mesh = mesh_of(*mesh_shape)
  n = mesh.shape[axis]
  x = rank_coded((4, 3))                      # replicated: invariant over both axes
  c = rank_coded((n, 1, 3), offset=1)         # device i along `axis` scales by c[i]

  def body(x, c):
    v = C.pvary(x, axis)
    assert C.varying_axes(v) == {axis} and C.pvary(v, axis) is v
    return v * c[0]                           # each device's contribution to the loss differs

  fwd = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(axis))
  y = jax.jit(fwd)(x, c)
  np.testing.assert_array_equal(y, np.concatenate([x * c[i] for i in range(n)]))  # pvary(x) == x
  g = jax.jit(jax.grad(lambda x: fwd(x, c).sum()))(x)
  # The transpose of pvary is a psum over `axis`: d/dx sum_i sum(x * c[i]) = sum_i c[i].
  np.testing.assert_array_equal(g, np.broadcast_to(c.sum(0), x.shape))
  ones = jax.jit(jax.grad(lambda x: fwd(x, np.ones_like(c)).sum()))(x)
  np.testing.assert_array_equal(ones, np.full(x.shape, n, np.float32))  # n devices, each contributing 1


# ------------------------------------------------------------------------------ backward = the transpose

@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("axis", [FSDP, TENSOR])
@pytest.mark.parametrize("mesh_shape", MESHES_2D, ids=mesh_id)
def test_all_gather_backward_is_psum_scatter(mesh_shape, axis, dim):
  mesh = mesh_of(*mesh_shape)
  x = rank_coded((8, 8, 3))
  spec = _split(axis, dim)
  fn = per_device(mesh, lambda x: C.all_gather(x, axis, dim), (P(*spec),))
  y, vjp = jax.vjp(fn, x)
  ct = rank_coded(y.shape)                    # a different cotangent on every device
  (dx,) = jax.jit(vjp)(ct)
  for c in K.coords(mesh):
    # psum_scatter of the cotangent: sum over the devices along `axis`, keep this device's block of `dim`.
    summed = sum(np.asarray(ct[(c | {axis: i})[FSDP], (c | {axis: i})[TENSOR]], np.float64)
                 for i in range(mesh.shape[axis]))
    want = block(summed, [axis if d == dim else None for d in range(3)], c, mesh)
    np.testing.assert_array_equal(block(np.asarray(dx), spec, c, mesh), want,
                                  err_msg=f"grad of all_gather over {axis} of dim {dim}, device {c}")


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("axis", [FSDP, TENSOR])
@pytest.mark.parametrize("mesh_shape", MESHES_2D, ids=mesh_id)
def test_psum_scatter_backward_is_all_gather(mesh_shape, axis, dim):
  mesh = mesh_of(*mesh_shape)
  x, spec = _stacked_input(mesh, axis)
  fn = per_device(mesh, lambda x: C.psum_scatter(x[0], axis, dim), (spec,))
  y, vjp = jax.vjp(fn, x)
  ct = rank_coded(y.shape)
  (dx,) = jax.jit(vjp)(ct)
  for c in K.coords(mesh):
    # all_gather of the cotangent along `dim`, over the devices along `axis`.
    parts = [np.asarray(ct[(c | {axis: i})[FSDP], (c | {axis: i})[TENSOR]]) for i in range(mesh.shape[axis])]
    assert_rank_coded_equal(block(np.asarray(dx), spec, c, mesh)[0], np.concatenate(parts, axis=dim), ct.shape,
                            f"grad of psum_scatter over {axis} of dim {dim}, device {c}")


# -------------------------------------------------------------------------------- ring collective matmuls
#
# Column-parallel all-gather-matmul: x[B_fsdp, L_tp, D] . W[D, E_tp] -> y[B_fsdp, L, E_tp]
# Row-parallel matmul-reduce-scatter: h[B_fsdp, L, N_tp] . W[N_tp, E] -> y[B_fsdp, L_tp, E]
# Every device's output block is distinct, so the global output checks every device. L = 16 is divisible by
# 2 * tensor on every mesh (the bidirectional ring splits each block in halves).

B, L, D, E = 8, 16, 4, 8
DIM = 1
EQ = "bld,de->ble"
AG_SPECS = (P(FSDP, TENSOR, None), P(None, TENSOR)), P(FSDP, None, TENSOR)
RS_SPECS = (P(FSDP, None, TENSOR), P(TENSOR, None)), P(FSDP, TENSOR, None)


def _inputs(kind):
  rng = np.random.default_rng(0)
  a = rank_coded((B, L, D if kind == "ag" else 8)) / (B * L * 8)
  w = rng.standard_normal((a.shape[-1], E)).astype(np.float32)
  ct = rng.standard_normal((B, L, E)).astype(np.float32)
  return a, w, ct


def plain_ag(x, w):
  return jnp.einsum(EQ, C.all_gather(x, TENSOR, DIM), w)


def plain_rs(h, w):
  return C.psum_scatter(jnp.einsum(EQ, h, w), TENSOR, DIM)


def ring_ag(bidirectional):
  return lambda x, w: C.all_gather_matmul(x, lambda blk: jnp.einsum(EQ, blk, w), TENSOR, DIM, bidirectional)


def ring_rs(bidirectional):
  return lambda h, w: C.matmul_reduce_scatter(h, lambda blk: jnp.einsum(EQ, blk, w), TENSOR, DIM, bidirectional)


def fwd_bwd(mesh, body, kind):
  """One compiled function: (a, w, ct) -> (y, da, dw), the forward and the vjp of the shard_mapped body."""
  in_specs, out_specs = AG_SPECS if kind == "ag" else RS_SPECS
  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

  def run(a, w, ct):
    y, vjp = jax.vjp(fn, a, w)
    return (y, *vjp(ct))
  return fn, jax.jit(run)


@functools.lru_cache(maxsize=None)
def results(mesh_shape, kind, variant):
  """(y, da, dw) for `variant` in plain / ring / ring_bidi, shared by the tests."""
  body = {"plain": plain_ag if kind == "ag" else plain_rs}.get(variant) or \
      (ring_ag if kind == "ag" else ring_rs)(variant == "ring_bidi")
  return jax.device_get(fwd_bwd(mesh_of(*mesh_shape), body, kind)[1](*_inputs(kind)))


def check_against_plain(got, want, label):
  for name, g, w in zip(("y", "d_activation", "d_weight"), got, want):
    assert_trees_close(g, w, rtol=1e-6, atol=1e-6, label=f"{label} {name}")


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("mesh_shape", MESHES, ids=mesh_id)
def test_plain_matches_numpy(mesh_shape, kind):
  a, w, ct = (x.astype(np.float64) for x in _inputs(kind))
  y = np.einsum(EQ, a, w)
  want = (y, np.einsum("ble,de->bld", ct, w), np.einsum("bld,ble->de", a, ct))
  check_against_plain(results(mesh_shape, kind, "plain"), want, f"plain {kind} on {mesh_shape}:")


@pytest.mark.parametrize("variant", ["ring", "ring_bidi"])
@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("mesh_shape", MESHES, ids=mesh_id)
def test_ring_matches_plain(mesh_shape, kind, variant):
  check_against_plain(results(mesh_shape, kind, variant), results(mesh_shape, kind, "plain"),
                      f"{variant} {kind} on {mesh_shape}:")


def primitives(jaxpr):
  """Names of every primitive in a jaxpr, nested jaxprs (shard_map, pjit, ...) included."""
  names = []
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    for v in eqn.params.values():
      for sub in v if isinstance(v, (list, tuple)) else [v]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          names += primitives(sub)
  return names


@pytest.mark.parametrize("variant", ["ring", "ring_bidi"])
@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("mesh_shape", MESHES, ids=mesh_id)
def test_ring_jaxpr_is_ppermutes_only(mesh_shape, kind, variant):
  mesh = mesh_of(*mesh_shape)
  body = (ring_ag if kind == "ag" else ring_rs)(variant == "ring_bidi")
  fn, _ = fwd_bwd(mesh, body, kind)
  a, w, ct = _inputs(kind)
  jaxpr = jax.make_jaxpr(fn)(a, w)
  text, names = str(jaxpr), primitives(jaxpr.jaxpr)
  n = mesh.shape[TENSOR]
  per_ring = (n - 1) * (2 if variant == "ring_bidi" else 1)
  assert names.count("ppermute") == per_ring, (names.count("ppermute"), per_ring)
  assert (n == 1) or "ppermute" in text
  for banned in ("all_gather", "reduce_scatter", "psum"):
    assert banned not in text, f"{banned} in the {variant} {kind} forward"
  # The backward is a ring too (the other way round): as many ppermutes again, still no gather or scatter.
  both = primitives(jax.make_jaxpr(lambda a, w, ct: jax.vjp(fn, a, w)[1](ct))(a, w, ct).jaxpr)
  assert both.count("ppermute") == 2 * per_ring
  assert not {"all_gather", "reduce_scatter"} & set(both)


# ------------------------------------------------------------------------------- the check can fail

def hand_ring_ag(shift):
  """A unidirectional all-gather-matmul ring written out by hand; its block placement assumes the blocks
  travel +1 (after s steps device r holds block r-s). shift=-1 is the bug: the permute goes the wrong way."""
  def body(x, w):
    n, r = jax.lax.axis_size(TENSOR), jax.lax.axis_index(TENSOR)
    blk, out = x, jnp.zeros((x.shape[0], x.shape[1] * n, w.shape[1]), x.dtype)
    for s in range(n):
      out = jax.lax.dynamic_update_slice_in_dim(out, jnp.einsum(EQ, blk, w), ((r - s) % n) * x.shape[1], DIM)
      blk = jax.lax.ppermute(blk, TENSOR, perm=[(i, (i + shift) % n) for i in range(n)])
    return out
  return body


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)], ids=mesh_id)  # n = 2: +1 and -1 are the same perm
def test_wrong_ring_direction_is_caught(mesh_shape):
  mesh = mesh_of(*mesh_shape)
  plain = results(mesh_shape, "ag", "plain")
  right = jax.device_get(fwd_bwd(mesh, hand_ring_ag(+1), "ag")[1](*_inputs("ag")))
  check_against_plain(right, plain, "hand ring +1:")  # the hand ring is right when it permutes +1 ...
  wrong = jax.device_get(fwd_bwd(mesh, hand_ring_ag(-1), "ag")[1](*_inputs("ag")))
  with pytest.raises(AssertionError, match="y: "):
    check_against_plain(wrong, plain, "hand ring -1:")  # ... and the comparison fails when it permutes -1
  with pytest.raises(AssertionError):
    check_against_plain(wrong[1:2], plain[1:2], "hand ring -1:")  # the backward is wrong too


def test_wrong_ring_shift_is_caught_by_the_numpy_check(monkeypatch):
  """The wrappers' own test fails on a ring_shift whose perm goes the wrong way."""
  real = C.ring_shift
  monkeypatch.setattr(C, "ring_shift", lambda x, axis, shift=1, name="": real(x, axis, -shift))
  with pytest.raises(AssertionError, match="received the block of device"):
    test_ring_shift((2, 4), TENSOR, 1)
  with pytest.raises(AssertionError):  # and the shared ring matmul built on it
    check_against_plain(jax.device_get(fwd_bwd(mesh_of(2, 4), ring_rs(False), "rs")[1](*_inputs("rs"))),
                        results((2, 4), "rs", "plain"), "ring_rs with ring_shift flipped:")
