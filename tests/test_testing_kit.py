"""The testing kit (shardlab.testing and its pytest plugin) passes right implementations and catches wrong
ones, each with a message that points at the fault: a ring permuting the wrong way, a reduce-scatter of the
wrong dimension, a gather whose transpose loses a factor, a schedule that moves more bytes than it claims.

Functions are tiny (a few KB) so that each mesh costs one small compile; the schedule checks share the
tiny-model compiles with test_equivalence (same cache, same worker)."""
import math
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlab import collectives as C
from shardlab import testing as T
from shardlab.mesh import FSDP, TENSOR
from shardlab.schedules.explicit import ExplicitSchedule

pytest_plugins = ["pytester"]


# ------------------------------------------------------------------------------- the plugin and the mesh

@pytest.mark.meshes((2, 4), "4x2")
def test_mesh_marker_picks_the_shapes(mesh, request):
  assert T.mesh_id(mesh) == request.node.callspec.id
  assert T.mesh_id(mesh) in ("2x4", "4x2") and mesh.axis_names == (FSDP, TENSOR)


@pytest.mark.meshes(rank=3)
def test_mesh_marker_takes_every_data_fsdp_tensor_factorization(mesh, request):
  """meshes(rank=3): every data x fsdp x tensor factorization of the 8 devices (a data axis of 1 is none)."""
  shape = tuple(int(v) for v in request.node.callspec.id.split("x"))
  assert len(shape) == 3 and math.prod(shape) == 8
  want = (("data",) if shape[0] > 1 else ()) + (FSDP, TENSOR)
  assert mesh.axis_names == want and mesh.devices.shape == (shape if shape[0] > 1 else shape[1:])


def test_plugin_parametrizes_every_factorization_without_boilerplate(pytester):
  """A test file with no conftest and no imports of shardlab gets 8 devices and a mesh per shape."""
  pytester.makepyfile(test_user=textwrap.dedent("""
      import jax, pytest
      def test_all(mesh):
        assert len(jax.devices()) == 8 and mesh.devices.size == 8
      @pytest.mark.meshes(n=4)
      def test_four(mesh):
        assert mesh.devices.size == 4
  """), test_too_big=textwrap.dedent("""
      import pytest
      @pytest.mark.meshes("8x2")
      def test_too_big(mesh):
        pass
  """))
  result = pytester.runpytest_inprocess("-p", "no:xdist", "-v", "test_user.py")
  result.assert_outcomes(passed=7)
  ids = re.findall(r"\[(\d+x\d+)\] PASSED", result.stdout.str())
  assert ids == ["1x8", "2x4", "4x2", "8x1", "1x4", "2x2", "4x1"], result.stdout.str()
  result = pytester.runpytest_inprocess("-p", "no:xdist", "test_too_big.py")
  result.assert_outcomes(errors=1)
  assert "meshes(8x2) needs 16 devices; the tests have 8 (--shardlab-devices)" in result.stdout.str()
  # shardlab_mesh_axes = 3: the default fixture runs over every data x fsdp x tensor factorization of 8 (10)
  result = pytester.runpytest_inprocess("-p", "no:xdist", "-v", "-o", "shardlab_mesh_axes=3", "test_user.py::test_all")
  result.assert_outcomes(passed=10)
  assert "[2x2x2] PASSED" in result.stdout.str() and "[1x2x4] PASSED" in result.stdout.str()


def test_rank_coded_values_name_their_device():
  mesh = T.mesh_of(2, 4)
  x = T.rank_coded((16, 3))
  spec = P((FSDP, TENSOR))   # 16 rows over 8 devices, fsdp major: device (1, 2) holds rows 12, 13
  assert T.owner(T.where(x[13, 2], x.shape), spec, x.shape, mesh) == {FSDP: 1, TENSOR: 2}
  assert T.origin(x[13, 2], x.shape, spec, mesh, "x") == "element (13, 2) of x (device (fsdp=1, tensor=2))"
  y = T.rank_coded((4, 8))
  assert T.origin(y[3, 5], y.shape, P(None, TENSOR), mesh, "y") == "element (3, 5) of y (device (fsdp=*, tensor=2))"


# ----------------------------------------------------------------------- assert_matches_reference: passes

def gather_both(x):
  """x[N_(fsdp,tensor)] -> x[N]: all-gather over tensor (the minor axis) first, then over fsdp."""
  return C.all_gather(C.all_gather(x, TENSOR, 0), FSDP, 0)


@pytest.mark.meshes((2, 4), (8, 1))
def test_right_gather_passes_forward_and_backward(mesh):
  T.assert_matches_reference(gather_both, lambda x: x, [T.rank_coded((16, 3))], P((FSDP, TENSOR)), P(),
                             meshes=mesh, source=0, rtol=0, atol=0)


def test_numerical_gradient_check_runs_on_auto_axes():
  x = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
  T.assert_matches_reference(lambda x: jnp.sin(C.all_gather(x, TENSOR, 0)), jnp.sin, [x], P(TENSOR), P(),
                             meshes=(2, 4), numerical=True)


# ---------------------------------------------------------------------- ... and catches wrong ones

def ring_gather(shift):
  """all_gather(x, tensor, 0) as a ring of ppermutes; the placement assumes blocks travel +1 (after s steps
  device r holds block r-s). shift=-1 is the bug."""
  def fn(x):
    n, r = jax.lax.axis_size(TENSOR), jax.lax.axis_index(TENSOR)
    out, blk = jnp.zeros((n * x.shape[0], *x.shape[1:]), x.dtype), x
    for s in range(n):
      out = jax.lax.dynamic_update_slice_in_dim(out, blk, ((r - s) % n) * x.shape[0], 0)
      if s < n - 1:
        blk = C.ring_shift(blk, TENSOR, shift)
    return out
  return fn


def test_ring_with_the_wrong_direction_is_caught():
  x = T.rank_coded((8, 3))   # 2 rows per tensor device, replicated over fsdp
  check = lambda fn: T.assert_matches_reference(fn, lambda x: x, [x], P(TENSOR), P(), meshes=(2, 4), source=0)
  check(ring_gather(+1))
  with pytest.raises(AssertionError) as e:
    check(ring_gather(-1))
  # Device 0, step 1: it holds block 1 (from device 1) but writes it where block 3 goes (0 - 1 = 3 mod 4).
  assert re.search(r"mesh 2x4, output 0: \d+ of 192 values differ; first on device \(fsdp=0, tensor=0\), local "
                   r"index \(2, 0\) \(global \(2, 0\)\): got element \(6, 0\) of x \(device \(fsdp=\*, "
                   r"tensor=3\)\), expected element \(2, 0\) of x \(device \(fsdp=\*, tensor=1\)\)", str(e.value)), e.value


def test_reduce_scatter_of_the_wrong_dimension_is_caught():
  # x[T, 8, 8]: device t holds an unreduced x[t]; the sum is promised scattered over tensor along dim 0.
  x = T.rank_coded((4, 8, 8))
  with pytest.raises(AssertionError) as e:
    T.assert_matches_reference(lambda x: C.psum_scatter(x[0], TENSOR, 1), lambda x: x.sum(0), [x],
                               P(TENSOR), P(TENSOR), meshes=(2, 4))
  assert str(e.value) == ("mesh 2x4, output 0: each device's block has shape (8, 2), but out_specs P('tensor',)"
                          " of the reference's (8, 8) gives (2, 8); dim 0: 4x too large, "
                          "dim 1: 4x too small: a gather or scatter on the wrong dimension?")
  T.assert_matches_reference(lambda x: C.psum_scatter(x[0], TENSOR, 0), lambda x: x.sum(0), [x],
                             P(TENSOR), P(TENSOR), meshes=(2, 4))


@jax.custom_vjp
def lossy_gather(x):
  return C.all_gather(x, TENSOR, 0)


lossy_gather.defvjp(lambda x: (lossy_gather(x), None),
                    lambda _, ct: (C.psum_scatter(ct, TENSOR, 0) / jax.lax.axis_size(TENSOR),))  # the bug: / n


def test_gather_whose_transpose_loses_a_factor_is_caught():
  x = T.rank_coded((8, 3))
  with pytest.raises(AssertionError) as e:
    T.assert_matches_reference(lossy_gather, lambda x: x, [x], P(TENSOR), P(), meshes=(2, 4))
  msg = str(e.value)
  assert msg.startswith("mesh 2x4, gradient of argument 0 (x): 24 of 24 values differ; first at (0, 0) "
                        "(device (fsdp=*, tensor=0))"), msg
  assert msg.endswith("every differing value is 0.25x the reference (1/4 = 1/size of tensor): a lost or extra "
                      "factor"), msg
  with pytest.raises(AssertionError, match="mesh 2x4: AD gradients differ from finite differences"):
    T.assert_matches_reference(lossy_gather, lambda x: x, [x / 24], P(TENSOR), P(), meshes=(2, 4), grads=False,
                               numerical=True)


# ------------------------------------------------------------------------------------ assert_collectives

def test_collectives_are_counted_by_kind_axis_and_bytes():
  mesh = T.mesh_of(2, 4)
  fn = jax.jit(jax.shard_map(lambda x: C.psum(C.all_gather(x, TENSOR, 0), FSDP), mesh=mesh,
                             in_specs=P(TENSOR), out_specs=P(TENSOR)))   # each device's copy, stacked
  x = np.ones((8, 4), np.float32)                   # 32 bytes per device; 128 gathered
  ledger = T.assert_collectives(fn, [x], {"all-gather": {TENSOR: 96}, "all-reduce": {FSDP: {"bytes": 128,
                                                                                             "count": 1}}}, mesh)
  assert ledger["all-gather"][TENSOR] == {"count": 1, "bytes": 96}
  with pytest.raises(AssertionError) as e:
    T.assert_collectives(fn, [x], {"all-gather": {TENSOR: 48}}, mesh)
  assert str(e.value).startswith("mesh 2x4: all-gather over tensor moves 96 bytes per device in 1 collectives, "
                                 "expected 48 (2x); unexpected all-reduce over fsdp: 128 bytes in 1 collectives"), e.value


def test_collectives_the_compiler_adds_are_caught():
  mesh = T.mesh_of(2, 4)
  fn = jax.jit(jax.shard_map(lambda x: C.all_gather(x, TENSOR, 0), mesh=mesh, in_specs=P(TENSOR),
                             out_specs=P(TENSOR)))
  x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P(FSDP)))   # laid out over the other axis
  with pytest.raises(AssertionError, match=r"the compiler added a collective-permute over fsdp\+tensor \(.*\) "
                                           r"that no collective in the code placed"):
    T.assert_collectives(fn, [x], {"all-gather": {TENSOR: 96}}, mesh)


# ------------------------------------------------------------------------------------------- schedules

@pytest.mark.slow   # the kit's byte-claim check stays quick in test_schedule_that_moves_more_bytes_than_it_claims_is_caught
def test_prefetch_matches_baseline_and_moves_no_more_bytes():
  out = T.assert_schedule_matches_baseline({"prefetch": 1}, mesh_shapes=["2x4"], comm="baseline")
  assert out["2x4"]["ledger"]["all-gather"][FSDP] == out["2x4"]["baseline"]["all-gather"][FSDP]


class GathersTensorToo(ExplicitSchedule):
  """Same numbers as baseline, but gathers each weight's tensor-parallel dim too and keeps only its own
  block: extra bytes over `tensor` that a claim of "baseline's bytes" does not cover."""

  def gather(self, shard, decl, stacked=False):
    w = super().gather(shard, decl, stacked)
    dim = decl.dim_of(TENSOR)
    if dim is None:
      return w
    k = w.shape[dim + stacked]
    full = C.all_gather(w, TENSOR, dim + stacked)
    return jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(TENSOR) * k, k, dim + stacked)


def test_schedule_that_moves_more_bytes_than_it_claims_is_caught():
  with pytest.raises(AssertionError) as e:
    T.assert_schedule_matches_baseline(GathersTensorToo, mesh_shapes=[(2, 4)], comm="baseline")
  assert re.match(r"GathersTensorToo on 2x4: moves \d+ bytes per device per step as all-gather over tensor, more "
                  r"than it claims: 1x the baseline's \d+; moves \d+ bytes per device per step as "
                  r"reduce-scatter over tensor, .*; moves \d+ bytes per device per step in all", str(e.value)), e.value


def test_against_compares_with_another_schedule():
  """against=: the comparison (numbers and byte claims) is with that schedule, and messages name it."""
  out = T.assert_schedule_matches_baseline(GathersTensorToo, mesh_shapes=["2x4"], against={"prefetch": 1},
                                           comm={"all-gather fsdp": 1.0})
  assert out["2x4"]["baseline"]["all-gather"][FSDP] == out["2x4"]["ledger"]["all-gather"][FSDP]
  with pytest.raises(AssertionError, match=r"GathersTensorToo on 2x4: moves \d+ bytes .* as all-gather over tensor"):
    T.assert_schedule_matches_baseline(GathersTensorToo, mesh_shapes=["2x4"], against={"prefetch": 1},
                                       comm="baseline")


def test_overlap_assertion_sees_prefetched_gathers_and_catches_unprefetched_ones():
  """prefetch=1: every FSDP all-gather in the layer loops is independent of all of its body's matmuls; without
  prefetch the gathered weight feeds them, and the claim fails with the collective named."""
  claim = {"kind": "all-gather", "scope": "fsdp_all_gather", "behind": "all"}
  T.assert_schedule_matches_baseline({"prefetch": 1}, mesh_shapes=["2x4"], overlap=claim)
  with pytest.raises(AssertionError, match=r"baseline on 2x4: \d+ of \d+ all-gather \(fsdp_all_gather\) cannot "
                                           r"run behind all matmuls of their computation: e\.g\. "):
    T.assert_schedule_matches_baseline(mesh_shapes=["2x4"], overlap=claim)



def test_a_runs_helper_programs_compile_with_the_options_the_tests_compile_with():
  """shardlab.mesh.HELPER_COMPILE (the options of a run's parameter initialization and synthetic batches on
  XLA:CPU) is the kit's FAST_COMPILE as compile options: a run starts from the parameters a test's run starts
  from, bit for bit (under XLA's default options the initialization differs in the last bits, and took 10.8 s
  to compile against 1.6 s for the tiny model on the 2-core VM)."""
  from shardlab.mesh import HELPER_COMPILE
  from shardlab.testing import FAST_COMPILE
  flags = dict(f.removeprefix("--").split("=") for f in FAST_COMPILE.split())
  cpu = {k: v for k, v in flags.items() if not k.startswith("xla_gpu_")}   # the GPU compiler's: not a CPU program's
  assert {k: str(v).lower() for k, v in HELPER_COMPILE.items()} == cpu and len(cpu) < len(flags)


def test_a_model_with_another_sequence_length_runs_on_batches_of_that_length():
  """compile_schedule and reference_loss_and_grads with model={"seq_len": 16}: both run the batch of that length
  (the tiny batch had 32 tokens whatever the model said, so a test of another length checked something else)."""
  compiled, (loss, grads) = T.compile_schedule({}, {"fsdp": 2, "context": 4}, {"seq_len": 16}, context="ring")
  ref_loss, ref_grads = T.reference_loss_and_grads({"seq_len": 16})
  assert T.tiny_batch(None, 16).shape == (16, 17)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  assert float(ref_loss) != float(T.reference_loss_and_grads()[0])
  T.assert_trees_close(grads, ref_grads, rtol=1e-4, atol=2e-6)
