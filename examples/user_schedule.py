"""A schedule that lives in your own file, not in shardlab: it overrides one hook of the explicit schedule (how
a gradient is reduced) and brings its own TP contraction class. Run it from this directory:

    python -m shardlab schedule.impl=user_schedule:ExplicitReduce schedule.tp=user_schedule:NamedAllGatherTP

(`python -m` puts the current directory on sys.path; from elsewhere, add this directory to PYTHONPATH.) It
trains exactly as `baseline`, and summary.json's `audit.unplanned` is empty: every collective below goes through
`shardlab.collectives`, under names of its own, and that is what the audit counts as planned.
examples/test_user_schedule.py checks both with the testing kit.
"""
import jax

from shardlab import collectives as C
from shardlab.axes import FSDP, TENSOR
from shardlab.schedules.explicit import ExplicitSchedule
from shardlab.schedules.tp import SEQ_DIM, AllGatherTP


class NamedAllGatherTP(AllGatherTP):
  """Megatron sequence parallelism (tp=allgather), with the sequence gathers and reduce-scatters written out
  under this file's own scope names."""

  def _column(self, x, f):
    return f(C.all_gather(x, TENSOR, SEQ_DIM, name="user_seq_gather"))      # x[B, L_tp, D] -> x[B, L, D]

  def reduce(self, y):
    return C.psum_scatter(y, TENSOR, SEQ_DIM, name="user_seq_scatter")     # y[B, L, D]{U_tp} -> y[B, L_tp, D]

  def row(self, h, w, eq):
    return AllGatherTP.row(self, h, w, eq)   # unchanged: its reduce-scatter keeps the name tp_reduce_scatter


class ExplicitReduce(ExplicitSchedule):
  """baseline, with the gradient reduction written out instead of taken from AD's transpose of the gather.

  gather (ExplicitSchedule.gather): [pvary over tensor if K/V are replicated there, and over HSDP's data axis]
  -> all_gather over fsdp -> pvary over the other residual axes it does not vary on. The same sum, transposed in
  reverse order: psum over those residual axes, psum_scatter over fsdp, psum over tensor / data on the shard."""

  def reduce_grad(self, grad, shard, decl, stacked=False):
    g = grad.astype(shard.dtype)
    dim = decl.dim_of(FSDP)
    early = (TENSOR,) if decl.tensor_replicated else ()   # K/V heads replicated over tensor, read by TP compute
    if dim is not None:                                    # HSDP: the data replicas' sum, on the fsdp shard
      early += self.layout.replica_axes(jax.sharding.get_abstract_mesh().axis_names)
    late = tuple(a for a in self.residual_axes if a not in decl.mesh_axes() and a not in early)
    if late:                                    # e.g. norm scales under sequence parallelism
      g = C.psum(g, late, name="user_grad_psum")
    if dim is not None:
      g = C.psum_scatter(g, FSDP, dim + stacked, name="user_grad_reduce_scatter")
    if early:
      g = C.psum(g, early, name="user_grad_psum")
    return g
