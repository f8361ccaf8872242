"""Zero-bubble's cut of a layer's backward (shardlab/schedules/split.py): B and W together are the backward, and
nothing runs twice."""
import jax
import jax.numpy as jnp
import pytest

from shardlab import model as MD, params as PM
from shardlab.data import Batch
from shardlab.schedules.explicit import remat_policy
from shardlab.schedules.parallel import plain
from shardlab.schedules.split import INLINED, split
from shardlab.testing import assert_trees_close, tiny_batch, tiny_config


def _dots(jaxpr) -> int:
  """dot_generals in a jaxpr, those inside calls (jit, remat) included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return sum(_dots(e.params["jaxpr"]) if e.primitive.name in INLINED else e.primitive.name == "dot_general"
             for e in jaxpr.eqns)


@pytest.mark.parametrize("remat", ["none", "full", "save_matmuls"])
def test_b_and_w_are_the_backward_once(remat):
  m = tiny_config().model
  p = PM.init(jax.random.key(0), PM.declare(m), m)
  b = tiny_batch()
  layer = MD.block(plain(m, p), m, Batch(b[:, :-1], b[:, 1:], jnp.arange(m.seq_len)))
  policy = remat_policy(remat)
  f = layer if policy is None else jax.checkpoint(layer, policy=policy)
  w0 = jax.tree.map(lambda a: a[0], p["layers"])
  x = jax.random.normal(jax.random.key(1), (b.shape[0], m.seq_len, m.d_model))
  y, vjp = jax.vjp(f, x, w0)
  leaves, treedef = jax.tree.flatten(vjp)
  n = len(leaves)

  def backward(*a):
    dx, dw = jax.tree.unflatten(treedef, list(a[:n]))(a[n])
    return [dx, *jax.tree.leaves(dw)]
  ct = jnp.cos(y)
  ids = {id(a) for a in jax.tree.leaves(w0)}      # the vjp closure's leaves that are the weights
  cut = split(backward, [*leaves, ct], 1, held=1, weights=[i for i, a in enumerate(leaves) if id(a) in ids])
  (dx,), boundary = cut.b(*leaves, ct)
  args = [*leaves, ct]
  dw = cut.w([a for a, r in zip(args, cut.w_reads) if r], boundary)
  assert_trees_close([dx, *dw], backward(*leaves, ct), rtol=1e-5, atol=1e-6, label=f"remat={remat}: ")
  # Every weight gradient's contraction is W's: B's dots are the input gradient's (and, under remat, the
  # recomputed forward's that it reads); together they are the backward's, none of them twice.
  flat = jax.make_jaxpr(backward)(*leaves, ct)
  whole = _dots(flat)
  weights = sum(1 for a in jax.tree.leaves(w0) if a.ndim >= 2)     # the layer's matmul weights
  assert _dots(cut.w_jaxpr) == weights, (_dots(cut.w_jaxpr), weights)
  assert _dots(cut.b_jaxpr) + _dots(cut.w_jaxpr) == whole, (_dots(cut.b_jaxpr), _dots(cut.w_jaxpr), whole)
  # What W holds has no attention probabilities (L x L per head): the recomputation that only a weight gradient
  # reads runs in B from them, and hands W its (smaller) result.
  assert all(list(a.shape).count(m.seq_len) < 2 for a in cut.boundary_avals), cut.boundary_avals
  # W reads no weight: it gathers none
  assert not any(r and id(a) in ids for a, r in zip(leaves, cut.w_reads[:n]))
