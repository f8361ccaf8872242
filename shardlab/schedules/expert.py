"""Expert parallelism: a MoE layer's experts split over the `expert` mesh axis (the layout rule `experts ->
expert`), and how each token reaches the experts its router picked and comes back. Outside the MoE layers the
axis is one more batch axis (its own tokens; a weight replicated over it has its gradient summed over it), so
expert parallelism borrows the data ranks, as Megatron-Core and torchtitan do.

A dispatcher is the model's `ctx.experts(x, idx, gate, wi, wd) -> (y, dropped)` hook (schedules/parallel.py):
x [T, D] this device's tokens, idx / gate [T, k] each token's experts and weights (model.route), wi / wd this
device's experts' weights (E / N of them, gathered over fsdp by the schedule like every weight). Picked by the
Hydra group `expert/` (`expert.impl`: a name in DISPATCHERS or `package.module:Class`):

  all_to_all  GShard / DeepSpeed-MoE: each device fills `capacity` slots per expert with its assignments in
              token order (the rest dropped; capacity_factor 0: as many slots as it has tokens, dropless), one
              dense all_to_all over `expert` takes the [E, capacity, D] buffer to the experts' devices, each runs
              its experts on N x capacity rows, one all_to_all brings them back. Backward (AD): the same two
              all_to_alls the other way. Bytes per device per layer: 2 (N-1)/N x E x capacity x D each way.
  all_gather  Megatron-Core's allgather dispatcher, MaxText's ring of experts: tokens, routes and gates
              all-gathered over `expert`; each device runs its experts on the assignments routed to them (a
              grouped GEMM, jax.lax.ragged_dot) and psum_scatters the combined outputs. Dropless. Backward: the
              transposes (reduce-scatter of the tokens' gradients, all-gather of the outputs').
  hierarchical  all_to_all's buffers in two steps over two mesh axes (the layout rule `experts -> [data,
              expert]`): across the outer axis (nodes) to the device of the same inner rank, then inside; back
              the other way. The same capacity rule and the same bytes across nodes as one all_to_all (no
              de-duplication of a token bound for several experts of one node, which DeepEP adds): what it
              changes is that the inner step runs on the node's own links.
  ragged      dropless, only the routed rows travel: each device all-gathers the per-expert counts, sorts its
              assignments by expert and sends each device exactly its rows with ragged_all_to_all, which runs
              the grouped GEMM on them and sends them back. XLA:CPU has no ragged_all_to_all: on a CPU the same
              exchange runs through an all_to_all padded to the worst case (each device may send all its rows
              to one device), which gives the same numbers (tests/test_expert.py), so the tests run on fake
              devices; a program built for a GPU or TPU mesh (a target compile's) has the real collective.

Each dispatcher places its collectives through shardlab.collectives, named expert_*, so the ledger and the
audit read them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from shardlab import collectives as C
from shardlab import model as M
from shardlab.axes import DATA, EXPERT, TENSOR
from shardlab.config import ExpertConfig, ModelConfig
from shardlab.errors import ConfigError
from shardlab.layout import Layout
from shardlab.loading import load_object


@dataclass(frozen=True)
class Route:
  """One MoE layer on one device, for the cost terms: T tokens, each to k of E experts split over N devices,
  D-wide rows of e bytes (the compute dtype; gates are float32, routes and counts int32). `split`: the sizes of
  the mesh axes the experts are split over, outer first, when more than one (their product is N). The terms
  describe one dispatch of all T tokens: with expert.chunks and a capacity the slots are per chunk (c x
  ceil(f T k / (c E)), a little more), which they leave out."""
  T: int
  k: int
  E: int
  N: int
  D: int
  e: int = 2
  split: tuple = ()

  def moved(self, full: int, kind: str = "all-gather", n: int | None = None) -> int:
    """Bytes a device sends for a collective over n (default: the N) devices of a whole array of `full` bytes
    (analysis/hlo.py: moved_bytes, the ledger's convention)."""
    n = self.N if n is None else n
    return (2 if kind == "all-reduce" else 1) * full * (n - 1) // n


class Dispatcher:
  """What every dispatcher shares: the mesh axis the experts are split over, and the checks. Its cost terms
  (bytes_per_layer, buffer_bytes) are evaluated at a `Route`, so a subclass or a user's dispatcher is priced by its
  own terms, never by its name."""
  point_to_point = False   # places no ppermute (what a pipeline asks: schedules/capability.py)
  drops = False            # may drop assignments over a capacity

  def __init__(self, model: ModelConfig, layout: Layout, cfg: ExpertConfig | None = None):
    self.model, self.layout, self.cfg = model, layout, cfg or ExpertConfig()
    self.platform = "cpu"   # of the devices the step is built for (bind)

  def bind(self, mesh) -> None:
    """The mesh the step is built for (the schedule's bind): its devices' platform ("cpu", "gpu", "tpu"; a target
    compile's are the target's)."""
    self.platform = mesh.devices.flat[0].platform

  def axis(self):
    """The mesh axis the experts are split over on the mesh being traced, or None."""
    axes = self.layout.rule("experts", jax.sharding.get_abstract_mesh().axis_names)
    return axes[0] if axes else None

  def check(self, shape: dict) -> None:
    """One line for a mesh of `shape` ({axis: size}) or settings it cannot run."""
    axes = self.layout.rule("experts", tuple(shape))
    name = f"expert={self.cfg.name}" if self.cfg.name == self.cfg.impl else f"expert.impl={self.cfg.impl}"
    if len(axes) > 1:
      raise ConfigError(f"layout rule experts -> {' x '.join(axes)}: {name} splits experts over one mesh axis")
    if axes and axes[0] not in self.layout.batch_axes(tuple(shape)):
      raise ConfigError(f"layout rule experts -> {axes[0]} with batch -> {' x '.join(self.layout.batch_axes(tuple(shape))) or 'none'}: "
                        f"the expert axis must also carry the batch (each device routes its own tokens); add "
                        f"{axes[0]} to layout.rules.batch")
    self.check_settings()

  def check_settings(self) -> None:
    """The settings alone: a capacity only where it drops, chunks >= 1."""
    name = f"expert={self.cfg.name}" if self.cfg.name == self.cfg.impl else f"expert.impl={self.cfg.impl}"
    if self.cfg.capacity_factor < 0:
      raise ConfigError(f"expert.capacity_factor={self.cfg.capacity_factor}: must be >= 0 (0: dropless)")
    if self.cfg.chunks < 1:
      raise ConfigError(f"expert.chunks={self.cfg.chunks}: must be >= 1")
    if self.cfg.capacity_factor and not self.drops:
      raise ConfigError(f"expert.capacity_factor={self.cfg.capacity_factor}: {name} is dropless (every token "
                        f"reaches its experts); set expert.capacity_factor=0 or expert=all_to_all for a capacity")

  def runs_on(self, platform: str) -> str | None:
    """Why it cannot run on devices of `platform` ("cpu", "gpu", "tpu"), or None."""
    return None

  def honours(self) -> dict:
    """The layout rules it can run, as data ({logical dim: [mesh axes tuples]}): experts over `expert`, or whole."""
    return {"experts": [(EXPERT,), ()]}

  def dispatch(self, x_TD, idx_TK, gate_TK, wi, wd):
    raise NotImplementedError

  def bytes_per_layer(self, r: Route) -> dict:
    """{"forward", "backward"}: bytes one device sends over the expert axis per layer (the ledger's convention)."""
    raise NotImplementedError

  def buffer_bytes(self, r: Route) -> int:
    """Bytes of the dispatch buffers one layer holds on a device beside its tokens (memory)."""
    raise NotImplementedError

  def expected_bytes(self, r: Route) -> dict:
    """bytes_per_layer under balanced routing (what the planner prices); the same unless the rows a dispatcher
    sends are data-dependent."""
    return self.bytes_per_layer(r)

  def rows_held(self, r: Route) -> int:
    """Rows its expert GEMMs take in one buffer (what their activations are held for, memory_model)."""
    raise NotImplementedError

  def expert_rows(self, r: Route, dense_groups: bool) -> float:
    """Rows a device's expert GEMMs compute per layer (each row: one token through one SwiGLU expert), balanced
    routing. dense_groups: the compiler runs a grouped GEMM (jax.lax.ragged_dot) densely over every local expert
    (XLA:GPU, measured: experiments/moe/README.md) instead of over each group's rows."""
    raise NotImplementedError


class AllToAll(Dispatcher):
  """Capacity slots per expert, one dense all_to_all there and one back (GShard). With `layout.rules.expert_mlp=
  [tensor]` each expert's hidden width splits over `tensor` too (expert tensor parallelism): a device's slots are
  gathered over tensor (its tokens differ by tensor rank under sequence parallelism), each rank computes its
  slice of every expert's width, and the outputs are reduce-scattered back (or, with the tokens whole on every
  tensor rank, all-reduced)."""
  point_to_point = False   # all_to_alls over expert (schedules/capability.py)
  drops = True

  def honours(self) -> dict:
    return {**super().honours(), "expert_mlp": [(), (TENSOR,)]}

  def experts_on(self, h_ERD, wi, wd, R: int):
    """The experts' SwiGLU on h [E_local, rows, D]; over tensor when expert_mlp is split there."""
    if TENSOR not in self.layout.rule("expert_mlp", jax.sharding.get_abstract_mesh().axis_names):
      return M.expert_mlp(h_ERD, wi, wd)
    if TENSOR in C.varying_axes(h_ERD):        # each tensor rank's own rows: gather, compute a slice, scatter
      h = C.all_gather(h_ERD, TENSOR, 1, name="expert_tp_gather")
      return C.psum_scatter(M.expert_mlp(h, wi, wd), TENSOR, 1, name="expert_tp_scatter")
    return C.psum(M.expert_mlp(h_ERD, wi, wd), TENSOR, name="expert_tp_sum")

  def capacity(self, tokens: int) -> int:
    """Slots per expert on a device with `tokens` tokens: ceil(capacity_factor x tokens x top_k / experts), at
    least 1; capacity_factor 0: `tokens` (no expert can get more: a token picks an expert once)."""
    f, m = self.cfg.capacity_factor, self.model
    return tokens if not f else max(1, min(tokens, math.ceil(f * tokens * m.top_k / m.n_experts)))

  def dispatch(self, x_TD, idx_TK, gate_TK, wi, wd):
    T, K = idx_TK.shape
    D = x_TD.shape[-1]
    E, El = self.model.n_experts, wi.shape[0]
    N, cap = E // El, self.capacity(T)
    e_M = idx_TK.reshape(-1)                                         # assignments in token order
    pos_M = jnp.take_along_axis(jnp.cumsum(jax.nn.one_hot(e_M, E, dtype=jnp.int32), axis=0), e_M[:, None],
                                axis=1)[:, 0] - 1                    # its place in its expert's queue
    keep_M = pos_M < cap
    buf_ECD = jax.lax.stop_gradient(jnp.zeros_like(x_TD, shape=(E, cap, D)))   # varying like x
    buf_ECD = buf_ECD.at[e_M, jnp.where(keep_M, pos_M, cap)].set(x_TD[jnp.arange(T * K) // K], mode="drop")
    axis = self.axis()
    buf = buf_ECD.reshape(N, El, cap, D)
    if axis:                                                         # block j -> the device holding experts j
      buf = C.all_to_all(buf, axis, 0, 0, name="expert_dispatch")    # [N sources, El, cap, D]
    h_ERD = buf.transpose(1, 0, 2, 3).reshape(El, N * cap, D)
    out = self.experts_on(h_ERD, wi, wd, N * cap).reshape(El, N, cap, D).transpose(1, 0, 2, 3)
    if axis:
      out = C.all_to_all(out, axis, 0, 0, name="expert_combine")     # back to where the tokens live
    y_MD = out.reshape(E, cap, D)[e_M, jnp.minimum(pos_M, cap - 1)] * keep_M[:, None].astype(x_TD.dtype)
    return M.combine(y_MD.reshape(T, K, D), gate_TK), jnp.sum(~keep_M)

  def bytes_per_layer(self, r: Route) -> dict:
    """Two all_to_alls of the [E, capacity, D] buffer forward (there and back), their two transposes backward."""
    f = 2 * r.moved(r.E * self.capacity(r.T) * r.D * r.e)
    return {"forward": f, "backward": f}

  def buffer_bytes(self, r: Route) -> int:
    """The buffer sent, the one received and the experts' outputs: 3 x E x capacity x D."""
    return 3 * r.E * self.capacity(r.T) * r.D * r.e

  def expert_rows(self, r: Route, dense_groups: bool) -> float:
    """Every slot: its E / N experts over N x capacity rows (an einsum per expert; empty slots cost the same)."""
    return r.E * self.capacity(r.T)

  def rows_held(self, r: Route) -> int:
    """Its E / N experts' slots from every device: E x capacity."""
    return r.E * self.capacity(r.T)


class Hierarchical(AllToAll):
  """all_to_all's capacity buffers over two mesh axes, one after the other: outer (across nodes) first."""
  point_to_point = False   # all_to_alls over data, then expert (schedules/capability.py)
  levels = 2

  def honours(self) -> dict:
    """Experts over `data` (across nodes) and `expert` (inside), or whole (one device: nothing to dispatch); the
    experts' width whole or over tensor (as all_to_all)."""
    return {**super().honours(), "experts": [(DATA, EXPERT), ()]}

  def axes(self):
    """(outer, inner): the mesh axes the experts are split over on the mesh being traced, or () if fewer."""
    axes = self.layout.rule("experts", jax.sharding.get_abstract_mesh().axis_names)
    return axes if len(axes) == 2 else ()

  def check(self, shape: dict) -> None:
    axes = self.layout.rule("experts", tuple(shape))
    if len(axes) != 2:
      raise ConfigError(f"expert=hierarchical dispatches over two mesh axes (across nodes, then inside): set "
                        f"layout.rules.experts=[data,expert] with mesh.data and mesh.expert > 1 (it is "
                        f"{' x '.join(axes) or 'none'} on this mesh)")
    self.check_settings()
    for a in axes:
      if a not in self.layout.batch_axes(tuple(shape)):
        raise ConfigError(f"layout rule experts -> {' x '.join(axes)}: {a} must also carry the batch (each "
                          f"device routes its own tokens); add it to layout.rules.batch")

  def dispatch(self, x_TD, idx_TK, gate_TK, wi, wd):
    axes = self.axes()
    if not axes:
      return super().dispatch(x_TD, idx_TK, gate_TK, wi, wd)
    outer, inner = axes
    T, K = idx_TK.shape
    D = x_TD.shape[-1]
    E, El = self.model.n_experts, wi.shape[0]
    No, Ni = C.axis_size(outer), C.axis_size(inner)
    cap = self.capacity(T)
    e_M = idx_TK.reshape(-1)
    pos_M = jnp.take_along_axis(jnp.cumsum(jax.nn.one_hot(e_M, E, dtype=jnp.int32), axis=0), e_M[:, None],
                                axis=1)[:, 0] - 1
    keep_M = pos_M < cap
    buf = jax.lax.stop_gradient(jnp.zeros_like(x_TD, shape=(E, cap, D)))
    buf = buf.at[e_M, jnp.where(keep_M, pos_M, cap)].set(x_TD[jnp.arange(T * K) // K], mode="drop")
    # experts e = (o Ni + i) El + j live on the device of outer rank o, inner rank i
    buf = C.all_to_all(buf.reshape(No, Ni, El, cap, D), outer, 0, 0, name="expert_dispatch_outer")
    buf = C.all_to_all(buf.transpose(1, 0, 2, 3, 4), inner, 0, 0, name="expert_dispatch_inner")
    h = buf.transpose(2, 0, 1, 3, 4).reshape(El, Ni * No * cap, D)       # [El, (inner src, outer src, slot), D]
    out = self.experts_on(h, wi, wd, Ni * No * cap).reshape(El, Ni, No, cap, D).transpose(1, 2, 0, 3, 4)
    out = C.all_to_all(out, inner, 0, 0, name="expert_combine_inner")   # [Ni dest, No src, El, cap, D]
    out = C.all_to_all(out.transpose(1, 0, 2, 3, 4), outer, 0, 0, name="expert_combine_outer")
    y_MD = out.reshape(E, cap, D)[e_M, jnp.minimum(pos_M, cap - 1)] * keep_M[:, None].astype(x_TD.dtype)
    return M.combine(y_MD.reshape(T, K, D), gate_TK), jnp.sum(~keep_M)

  def bytes_per_layer(self, r: Route) -> dict:
    """all_to_all's bytes in two steps: the [E, capacity, D] buffer over the outer axis, then the inner, each way;
    the same backward."""
    full = r.E * self.capacity(r.T) * r.D * r.e
    f = 2 * sum(r.moved(full, n=n) for n in (r.split or (r.N,)))
    return {"forward": f, "backward": f}


class AllGather(Dispatcher):
  """Tokens gathered over the expert axis, local experts on the ones routed to them, outputs reduce-scattered."""
  point_to_point = False   # all_gather and psum_scatter over expert (schedules/capability.py)

  def dispatch(self, x_TD, idx_TK, gate_TK, wi, wd):
    axis = self.axis()
    if not axis:
      return M.local_experts(x_TD, idx_TK, gate_TK, wi, wd), 0
    first = jax.lax.axis_index(axis) * wi.shape[0]
    xg = C.all_gather(x_TD, axis, 0, name="expert_gather_tokens")
    ig = C.all_gather(idx_TK, axis, 0, name="expert_gather_routes")
    gg = C.all_gather(gate_TK, axis, 0, name="expert_gather_gates")
    y = M.local_experts(xg, ig, gg, wi, wd, first=first)            # this device's experts' share, every token
    return C.psum_scatter(y, axis, 0, name="expert_combine"), 0

  def bytes_per_layer(self, r: Route) -> dict:
    """Forward: N T rows of tokens, routes and gates gathered, N T rows of outputs reduce-scattered. Backward: the
    tokens' and gates' gradients reduce-scattered, the outputs' gradient gathered (routes carry none)."""
    rows, picks = r.N * r.T * r.D * r.e, r.N * r.T * r.k * 4
    return {"forward": r.moved(2 * rows + 2 * picks), "backward": r.moved(2 * rows + picks)}

  def buffer_bytes(self, r: Route) -> int:
    """The gathered tokens, their rows sorted by expert, the experts' outputs, those back in token order and
    combined: N T (2 + 3 k) D."""
    return r.N * r.T * (2 + 3 * r.k) * r.D * r.e

  def expert_rows(self, r: Route, dense_groups: bool) -> float:
    """Its share T k of the assignments; densely, every gathered assignment (N T k) through each local expert."""
    return r.N * r.T * r.k * (r.E // r.N) if dense_groups else r.T * r.k

  def rows_held(self, r: Route) -> int:
    """Every gathered assignment, N T k rows (the grouped GEMM's operand)."""
    return r.N * r.T * r.k


class Ragged(Dispatcher):
  """Counts exchanged, then exactly the routed rows, with ragged_all_to_all (a padded all_to_all on a CPU)."""
  point_to_point = False   # ragged_all_to_all (or a padded all_to_all) over expert (schedules/capability.py)

  def runs_on(self, platform: str) -> str | None:
    if platform == "cpu" and not self.cfg.cpu_fallback:
      return ("expert=ragged with expert.cpu_fallback=false cannot run on a CPU (XLA:CPU has no "
              "ragged_all_to_all); set expert.cpu_fallback=true, or compile_for=target dry_run=true to see the "
              "GPU/TPU program")
    return None

  def exchange(self, x_MD, rows: int, cap: int, in_off, send, out_off, recv, axis, name):
    """ragged_all_to_all of x's rows into a [rows, D] buffer; on a CPU (cpu_fallback) the same numbers through
    an all_to_all of [N, cap, D] (cap: the most rows one device sends to another)."""
    out = jax.lax.stop_gradient(jnp.zeros_like(x_MD, shape=(rows, x_MD.shape[-1])))   # (no gradient: a
    # buffer's varying zeros would transpose to an all-reduce of its cotangent)

    def real(x, out, in_off, send, out_off, recv):
      return C.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis, name=name)

    def padded(x, out, in_off, send, out_off, recv):
      N, D = send.shape[0], x.shape[-1]
      i = jnp.arange(x.shape[0])
      dest = jnp.searchsorted(jnp.cumsum(send), i, side="right")     # N: sent nowhere
      j = i - in_off[jnp.minimum(dest, N - 1)]
      buf = jax.lax.stop_gradient(jnp.zeros_like(x, shape=(N, cap, D))).at[dest, j].set(x, mode="drop")
      got = C.all_to_all(buf, axis, 0, 0, name=name)                 # [N sources, cap, D]
      at = C.all_to_all(out_off.reshape(N, 1), axis, 0, 0, name=name + "_offsets")[:, 0]   # where each put it
      k = jnp.arange(cap)[None, :]
      where = jnp.where(k < recv[:, None], at[:, None] + k, rows).reshape(-1)
      return out.at[where].set(got.reshape(N * cap, D), mode="drop")

    args = (x_MD, out, in_off, send, out_off, recv)
    return padded(*args) if self.platform == "cpu" and self.cfg.cpu_fallback else real(*args)

  def dispatch(self, x_TD, idx_TK, gate_TK, wi, wd):
    axis = self.axis()
    if not axis:
      return M.local_experts(x_TD, idx_TK, gate_TK, wi, wd), 0
    T, K = idx_TK.shape
    D = x_TD.shape[-1]
    E, El = self.model.n_experts, wi.shape[0]
    N, MK = E // El, T * K
    me = jax.lax.axis_index(axis)
    e_M = idx_TK.reshape(-1)
    order = jnp.argsort(e_M, stable=True)                            # by expert, so by destination
    counts = jnp.bincount(e_M, length=E).astype(jnp.int32)
    every = C.all_gather(counts[None], axis, 0, name="expert_counts")   # [N sources, E]
    sd = every.reshape(N, N, El).sum(axis=2)                         # rows source s sends to device d
    send, recv = sd[me], sd[:, me]
    ex = lambda a, axis_: jnp.cumsum(a, axis=axis_) - a              # exclusive prefix sums
    got = self.exchange(x_TD[order // K], N * MK, MK, ex(send, 0), send, ex(sd, 0)[me], recv, axis,
                        "expert_dispatch")                           # [N MK, D]: source by source
    mine = jax.lax.dynamic_slice_in_dim(every, me * El, El, axis=1).reshape(-1)   # [N sources x El] rows
    seg = jnp.searchsorted(jnp.cumsum(mine), jnp.arange(N * MK), side="right")
    local = jnp.where(seg < N * El, seg % El, El)                    # each row's local expert (El: empty)
    order2 = jnp.argsort(local, stable=True)
    out = M.grouped_mlp(got[order2], jnp.bincount(local, length=El + 1)[:El].astype(jnp.int32), wi, wd)
    out = jax.lax.stop_gradient(jnp.zeros_like(out)).at[order2].set(out)
    back = self.exchange(out, MK, MK, ex(recv, 0), recv, ex(sd, 1)[:, me], send, axis, "expert_combine")
    y_MD = jax.lax.stop_gradient(jnp.zeros_like(back)).at[order].set(back)
    return M.combine(y_MD.reshape(T, K, D), gate_TK), 0

  def bytes_per_layer(self, r: Route) -> dict:
    """On a GPU or TPU, at the most each exchange can send (its whole input: the rows are data-dependent): forward
    the per-expert counts gathered, T k rows there and the N T k-row buffer back; backward the two exchanges the
    other way, each with two all_to_alls of N offsets (jax's transpose). On a CPU (cpu_fallback) the padded
    all_to_alls of N x T k rows each way, and the offsets."""
    tk = r.T * r.k * r.D * r.e
    if self.platform == "cpu" and self.cfg.cpu_fallback:
      f = r.moved(r.N * r.E * 4) + 2 * r.moved(r.N * tk) + 2 * r.moved(r.N * 4)
      return {"forward": f, "backward": 2 * r.moved(r.N * tk)}
    offsets = 4 * r.moved(r.N * 4)
    return {"forward": r.moved(r.N * r.E * 4) + r.moved(tk) + r.moved(r.N * tk),
            "backward": r.moved(r.N * tk) + r.moved(tk) + offsets}

  def buffer_bytes(self, r: Route) -> int:
    """The receive buffer at its worst case (N T k rows), sorted by local expert, and the experts' outputs."""
    return 3 * r.N * r.T * r.k * r.D * r.e

  def expected_bytes(self, r: Route) -> dict:
    """Balanced routing on a GPU or TPU: a device's T k rows leave (N-1)/N of them each way, forward and
    backward, beside the counts and offsets (the ledger counts the worst case: bytes_per_layer)."""
    if self.platform == "cpu" and self.cfg.cpu_fallback:
      return self.bytes_per_layer(r)
    tk = r.T * r.k * r.D * r.e
    return {"forward": r.moved(r.N * r.E * 4) + 2 * r.moved(tk),
            "backward": 2 * r.moved(tk) + 4 * r.moved(r.N * 4)}

  def expert_rows(self, r: Route, dense_groups: bool) -> float:
    """The rows it receives (T k, balanced); densely, the whole N T k-row buffer through each local expert."""
    return r.N * r.T * r.k * (r.E // r.N) if dense_groups else r.T * r.k

  def rows_held(self, r: Route) -> int:
    """The receive buffer at its worst case, N T k rows (the grouped GEMM's operand)."""
    return r.N * r.T * r.k


DISPATCHERS = {"all_to_all": AllToAll, "all_gather": AllGather, "ragged": Ragged, "hierarchical": Hierarchical}


def chunked(dispatch, chunks: int):
  """`dispatch` over `chunks` equal runs of a device's tokens, one after the other (expert.chunks): each chunk's
  dispatch, experts and combine depend on that chunk alone, so the compiler may run one chunk's transfers while
  another's experts compute. -> (y, dropped) of the whole."""
  if chunks <= 1:
    return dispatch

  def run(x_TD, idx_TK, gate_TK, wi, wd):
    T = x_TD.shape[0]
    if T % chunks:
      raise ConfigError(f"expert.chunks={chunks} does not divide the {T} tokens each device routes per layer; "
                        f"choose chunks dividing them")
    n = T // chunks
    ys, dropped = [], 0
    for c in range(chunks):
      part = slice(c * n, (c + 1) * n)
      y, d = dispatch(x_TD[part], idx_TK[part], gate_TK[part], wi, wd)
      ys.append(y)
      dropped = dropped + d
    return jnp.concatenate(ys, axis=0), dropped
  return run


def make(cfg: ExpertConfig, model: ModelConfig, layout: Layout):
  """The dispatcher `expert.impl` names, built for the model, the run's layout and its settings; what a user's
  constructor raises is one line (loading.call_user)."""
  from shardlab.loading import call_user, check_instance
  from shardlab.schedules.protocol import ExpertDispatcher
  cls = load_object(cfg.impl, "expert.impl", DISPATCHERS, ExpertDispatcher)
  out = call_user(cls, cfg.impl, "expert.impl", model, layout, cfg)
  check_instance(out, cfg.impl, "expert.impl", ExpertDispatcher)
  return out
