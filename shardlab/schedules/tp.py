"""Tensor-parallel contractions: how the model's `ops.column` / `ops.row` move bytes over `tensor`.

Column-parallel (QKV, gate/up, unembedding): x[B, L_tp, D] . W[D, N_tp] -> y[B, L, N_tp]
Row-parallel (attention out, down):          h[B, L, N_tp] . W[N_tp, D] -> y[B, L_tp, D]

  allgather  all_gather(x over L), dot | dot, psum_scatter(over L)      (Megatron sequence parallelism)
  ring       the same bytes as a ppermute ring overlapped with per-block dots (collective matmul)
  ring_bidi  the ring with half-blocks travelling both ways
  allreduce  x[B, L, D] replicated over tensor: pvary(x), dot | dot, psum  (Megatron without SP)

In every mode the backward pass is the transpose: an all-gather's is a reduce-scatter and vice versa; the
pvary of `allreduce` becomes the psum of dgrad (Megatron's `f`), its psum the identity (`g`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from shardlab import collectives as C
from shardlab.axes import TENSOR
from shardlab.layout import Layout

SEQ_DIM = 1      # activations are [B, L, ...]
MATMUL = "matmul_out"  # the name remat="save_matmuls" keeps


def _dot(eq):
  return lambda a, w: jnp.einsum(eq, a, w)


def _dots(ws, eqs):
  """One activation block -> the tuple of its contractions with each weight (fused column-parallel)."""
  return lambda a: tuple(_dot(eq)(a, w) for w, eq in zip(ws, eqs))


class IdentityOps:
  """Every reduction and gather is the identity: the model's plain, unsharded math."""
  seq_sharded = False
  bidirectional = False      # a ring that splits each sequence block in halves (seq_len needs 2 x tensor)
  axis: str | None = None    # the mesh axis its contractions run over
  layout = Layout()          # the sharding rules (make_tp sets the run's): which axes the batch is split over
  point_to_point = False     # no collective at all (a ppermute would be True: schedules/capability.py)

  def partial_products(self, tensor: int) -> int:
    """Partial weight gradients per weight a layer's backward holds at once on a `tensor`-way split (the memory
    model's `layer_gradient`): one, the whole product."""
    return 1

  def honours(self) -> dict:
    """The layout rules this contraction can honour, as data: {logical dim: [mesh axes it must map to]}."""
    return {}

  def column(self, x, w, eq):
    return self.columns(x, (w,), (eq,))[0]

  def columns(self, x, ws, eqs):
    """Several column-parallel contractions of one input (Q and K/V): the input is gathered once."""
    return tuple(checkpoint_name(y, MATMUL) for y in self._column(x, _dots(ws, eqs)))

  def _column(self, x, f):
    return f(x)

  def head_start(self, h_local):
    """The global index of this device's first head (heads sharded over tensor)."""
    return 0

  def row(self, h, w, eq):
    return checkpoint_name(_dot(eq)(h, w), MATMUL)

  def reduce(self, y):
    return y

  def vocab_max(self, x):
    return x

  def vocab_sum(self, x):
    return x

  def vocab_start(self, v_local):
    return 0

  def batch_sum(self, x):
    return x

  def seq_shard(self, x):
    """x[B, L, ..], the same on every tensor rank -> the residual stream's layout (x[B, L_tp, ..], this rank's
    block, when sequence-parallel). No communication: the FFN-only model's input codes."""
    return x

  def token_sum(self, x):
    """A sum over this device's tokens of the residual stream -> the sum over every token: over the batch
    axes and, when the sequence is sharded, over tensor (the FFN-only model's loss)."""
    return self.batch_sum(x)


class _TensorParallel(IdentityOps):
  """Reductions over the vocab and batch shards, shared by every TP mode."""
  seq_sharded = True
  axis = TENSOR

  def honours(self) -> dict:
    """Heads, d_ff and vocab over `tensor` (and the residual stream's sequence when sequence-parallel)."""
    dims = ("heads", "kv_heads", "mlp", "vocab") + (("seq",) if self.seq_sharded else ())
    return {d: [(self.axis,)] for d in dims}

  def vocab_max(self, x):
    return C.pmax(x, TENSOR, name="vocab_max")

  def vocab_sum(self, x):
    return C.psum(x, TENSOR, name="vocab_sum")

  def vocab_start(self, v_local):
    return jax.lax.axis_index(TENSOR) * v_local

  def head_start(self, h_local):
    return jax.lax.axis_index(TENSOR) * h_local

  def batch_sum(self, x):
    """Over the mesh axes the tokens are split on (the layout's batch and length rules on the mesh traced)."""
    return C.psum(x, self.layout.token_axes(jax.sharding.get_abstract_mesh().axis_names), name="loss_sum")

  def seq_shard(self, x):
    if not self.seq_sharded:
      return x
    n = x.shape[SEQ_DIM] // C.axis_size(TENSOR)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(TENSOR) * n, n, SEQ_DIM)

  def token_sum(self, x):
    axes = self.layout.token_axes(jax.sharding.get_abstract_mesh().axis_names) + ((TENSOR,) if self.seq_sharded else ())
    return C.psum(x, axes, name="loss_sum")


class AllGatherTP(_TensorParallel):
  point_to_point = False   # all-gathers and reduce-scatters over tensor (schedules/capability.py)

  def _column(self, x, f):
    return f(C.all_gather(x, TENSOR, SEQ_DIM, name="tp_all_gather"))   # x[B, L_tp, D] -> x[B, L, D]

  def row(self, h, w, eq):
    y = _dot(eq)(h, w)                                                 # y[B, L, D]{U_tp}
    return checkpoint_name(C.psum_scatter(y, TENSOR, SEQ_DIM, name="tp_reduce_scatter"), MATMUL)

  def reduce(self, y):
    return C.psum_scatter(y, TENSOR, SEQ_DIM, name="tp_reduce_scatter")


class RingTP(AllGatherTP):
  point_to_point = True    # its rings rotate blocks with ppermute (collectives.all_gather_matmul)

  def __init__(self, bidirectional: bool = False):
    self.bidirectional = bidirectional

  def _column(self, x, f):
    return C.all_gather_matmul(x, f, TENSOR, SEQ_DIM, self.bidirectional)

  def partial_products(self, tensor: int) -> int:
    """One partial weight gradient per ring step (collectives.all_gather_matmul), two per step in half-blocks when
    bidirectional; XLA fuses their sum, so all are live at once."""
    return tensor * (2 if self.bidirectional else 1) if tensor > 1 else 1

  def row(self, h, w, eq):
    f = lambda blk: _dot(eq)(blk, w)
    return checkpoint_name(C.matmul_reduce_scatter(h, f, TENSOR, SEQ_DIM, self.bidirectional), MATMUL)


class AllReduceTP(_TensorParallel):
  seq_sharded = False
  point_to_point = False   # psums over tensor

  def _column(self, x, f):
    return f(C.pvary(x, TENSOR, name="tp_enter"))                     # backward: psum of dgrad over tensor

  def row(self, h, w, eq):
    return checkpoint_name(C.psum(_dot(eq)(h, w), TENSOR, name="tp_all_reduce"), MATMUL)

  def reduce(self, y):
    return C.psum(y, TENSOR, name="tp_all_reduce")


class BidiRingTP(RingTP):
  def __init__(self):
    super().__init__(bidirectional=True)


# schedule.tp: a name here, or package.module:Class (a class in your own file; subclass one of these and
# override `_column` / `row` / `reduce`). Every collective through shardlab.collectives, under any name.
TP = {"allgather": AllGatherTP, "ring": RingTP, "ring_bidi": BidiRingTP, "allreduce": AllReduceTP}


def make_tp(mode: str, layout: Layout | None = None):
  """An instance of the contraction class `schedule.tp` names, reading the run's sharding rules."""
  from shardlab.loading import load_object
  ops = load_object(mode, "schedule.tp", TP)()
  ops.layout = layout or Layout()
  return ops
