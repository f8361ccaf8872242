"""Writing and testing a new schedule: FSDP all-gathers in two half-size chunks.

    pytest examples/            # shardlab's pytest plugin sets up 8 fake CPU devices; no conftest needed

A schedule is a class whose `loss_and_grads(params, batch, n_tokens)` runs inside shard_map and
returns the loss and reduced, parameter-sharded gradients. The quickest new one subclasses the explicit
schedule and changes one step. Here: each weight's FSDP all-gather is split along a dim that is not sharded
over fsdp, into two all-gathers of half the size (smaller messages a GPU scheduler can interleave with
compute more finely). Its claim: the same training as `baseline`, the same bytes, in twice as many messages.

    W[D_fsdp, .., N, ..] --split N--> 2 x W[D_fsdp, .., N/2, ..] --all_gather(fsdp) each--> W[D, .., N, ..]

Backward (AD): the transpose of each gather, a reduce-scatter of each half of the gradient over fsdp.

To run it from the command line, from this directory: `python -m shardlab schedule.impl=test_new_schedule:ChunkedGather`
(any `package.module:Class` on sys.path; see user_schedule.py).
"""
import jax.numpy as jnp

from shardlab import collectives as C
from shardlab import testing
from shardlab.axes import FSDP
from shardlab.schedules.explicit import ExplicitSchedule


class ChunkedGather(ExplicitSchedule):
  """baseline, with every FSDP all-gather split in two along the first even dim that fsdp does not shard."""

  def gather(self, shard, decl, stacked: bool = False):
    dim = decl.dim_of(FSDP)
    split = None if dim is None else next(
        (d for d in range(shard.ndim) if d != dim + stacked and shard.shape[d] % 2 == 0), None)
    if split is None:                                # norms W[D_fsdp]: nothing to split
      return super().gather(shard, decl, stacked)
    w = shard.astype(self.dtype) if self.cfg.gather_dtype == "compute" else shard
    halves = jnp.split(w, 2, axis=split)             # W[D_fsdp, .., N, ..] -> 2 x W[D_fsdp, .., N/2, ..]
    w = jnp.concatenate([C.all_gather(h, FSDP, dim + stacked, name="fsdp_all_gather") for h in halves], split)
    return C.pvary(w.astype(self.dtype), self.residual_axes, name="replicated_weight")


# 1. One line: the same loss and gradients as baseline (tiny model, float32) on two meshes, no more bytes on
#    any (kind, axis) row of the compiled ledger, and no collective added by the compiler.
def test_chunked_gather_matches_baseline():
  out = testing.assert_schedule_matches_baseline(ChunkedGather, mesh_shapes=["2x4", "4x2"], comm="baseline")
  for ledgers in out.values():                       # the ledgers come back: check the rest of the claim
    new, base = ledgers["ledger"]["all-gather"][FSDP], ledgers["baseline"]["all-gather"][FSDP]
    assert new["bytes"] == base["bytes"] and new["count"] > base["count"], (new, base)


# 2. Knob combinations need no class: a dict of knobs (or a ScheduleConfig). A claim can name rows and the
#    total: a TP ring moves the all-gather's bytes as collective-permutes, so its total is baseline's.
def test_prefetch_with_a_ring_moves_no_more_bytes_in_all():
  testing.assert_schedule_matches_baseline({"prefetch": 1, "tp": "ring"}, mesh_shapes=["2x4"],
                                           comm={"total": 1.0, "all-gather fsdp": 1.0})
