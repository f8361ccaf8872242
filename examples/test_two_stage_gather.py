"""Writing and testing a new collective: a two-stage all-gather over both mesh axes.

    pytest examples/            # shardlab's pytest plugin sets up 8 fake CPU devices; no conftest needed

x[N_(fsdp,tensor)] is split over all 8 devices, fsdp major: device (f, t) holds block f*T + t. A flat gather
over both axes sends blocks across every link at once; the two-stage gather first gathers over `tensor` (think:
the fast links inside a node), then over `fsdp` (between nodes), carrying T blocks per message:

    x[N_(fsdp,tensor)] --all_gather(tensor)--> x[N_fsdp] --all_gather(fsdp)--> x[N]

Bytes per device: (T-1)*b over tensor, then (F-1)*T*b over fsdp: (F*T-1)*b in all, what the flat gather moves.
Backward (AD, the transpose): reduce-scatter over fsdp, then over tensor.

The tests below use only the public kit: `shardlab.testing` and the plugin's `mesh` fixture.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlab import collectives as C
from shardlab import testing
from shardlab.mesh import FSDP, TENSOR


def two_stage_all_gather(x, dim: int = 0):
  """x[.., N_(fsdp,tensor), ..] -> x[.., N, ..]: over tensor (minor axis) first, then over fsdp."""
  x = C.all_gather(x, TENSOR, dim)   # x[N_(fsdp,tensor)] -> x[N_fsdp]: this fsdp row's T blocks, in order
  return C.all_gather(x, FSDP, dim)  # x[N_fsdp] -> x[N]


X_SPEC = P((FSDP, TENSOR))           # dim 0 split over both axes, fsdp major


# 1. Every device ends with x, in order, on every mesh shape; the gradient is right too. The plugin runs
#    this test once per mesh (1x8, 2x4, 4x2, 8x1). The input is rank-coded: value i sits at flat index i,
#    so a block that lands in the wrong place names the element and device it came from.
def test_matches_the_plain_function(mesh):
  x = testing.rank_coded((16, 3))
  testing.assert_matches_reference(two_stage_all_gather, lambda x: x, [x], X_SPEC, P(), meshes=mesh, source=0)


# 2. What a bug looks like: gathering over fsdp first interleaves the blocks. The kit says which element
#    (and which device's shard) arrived where another was expected.
@pytest.mark.meshes("2x4")
def test_the_wrong_stage_order_is_caught(mesh):
  wrong = lambda x: C.all_gather(C.all_gather(x, FSDP, 0), TENSOR, 0)
  with pytest.raises(AssertionError, match=r"got element \(8, 0\) of x \(device \(fsdp=1, tensor=0\)\), "
                                           r"expected element \(2, 0\) of x \(device \(fsdp=0, tensor=1\)\)"):
    testing.assert_matches_reference(wrong, lambda x: x, [testing.rank_coded((16, 3))], X_SPEC, P(),
                                     meshes=mesh, source=0)


# 3. The bytes: read from the compiled program (hlo.collectives on the optimized HLO), by kind and mesh axis.
#    `per_device` returns every device's copy, so the output needs no replication claim. The check also
#    fails if the compiler added a collective of its own.
def test_moves_the_bytes_of_a_flat_gather(mesh):
  f, t = mesh.shape[FSDP], mesh.shape[TENSOR]
  x = np.zeros((16, 3), np.float32)
  b = x.nbytes // (f * t)                                    # one device's block
  ledger = testing.assert_collectives(testing.per_device(two_stage_all_gather, mesh, X_SPEC), [x],
                                      {"all-gather": {TENSOR: (t - 1) * b, FSDP: (f - 1) * t * b}}, mesh)
  moved = sum(r["bytes"] for r in ledger.get("all-gather", {}).values())
  assert moved == (f * t - 1) * b


# 4. Gradients against finite differences too (jax.test_util.check_grads; shardlab's meshes have Auto axes,
#    which check_grads needs). Smooth function, small inputs: float32 finite differences are coarse.
@pytest.mark.meshes("4x2")
def test_gradients_match_finite_differences(mesh):
  x = np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)
  testing.assert_matches_reference(lambda x: jnp.tanh(two_stage_all_gather(x)), jnp.tanh, [x], X_SPEC, P(),
                                   meshes=mesh, numerical=True)
