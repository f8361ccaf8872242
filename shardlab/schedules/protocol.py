"""What a schedule is, as typing Protocols: the extension points a new schedule overrides.

`Schedule` is all train.py needs. `LayerSchedule` is the explicit schedule's shape (schedules/explicit.py:
`ExplicitSchedule` implements it): each method is one decision about when and how bytes move, and a subclass
overrides only the one it changes. `TPContraction` is the model's view of tensor parallelism
(schedules/tp.py), picked by `schedule.tp` from `tp.TP` or as `package.module:Class`; `ContextStrategy` is
attention across the sequence's split (schedules/context.py), picked by `context.impl` the same way. A loaded
class is checked against its protocol before it is built and its instance after (loading.py), and
what its code raises before the step runs is one line naming the setting and your file's line.

Plugging in your own, from your own file (no change to this package):

    # my_schedule.py (on sys.path: the current directory, or PYTHONPATH)
    from shardlab import collectives as C
    from shardlab.schedules.explicit import ExplicitSchedule
    from shardlab.schedules.tp import AllGatherTP

    class MyTP(AllGatherTP): ...                 # a TP contraction class
    class MySchedule(ExplicitSchedule):
      def reduce_grad(self, grad, shard, decl, stacked=False): ...   # one hook

    python -m shardlab schedule.impl=my_schedule:MySchedule schedule.tp=my_schedule:MyTP

Every collective goes through `shardlab.collectives` (any `name=`): that is what makes it planned in the
audit (summary.json `audit.unplanned`); a bare `jax.lax` collective is flagged. `examples/user_schedule.py`
is a complete one, checked by `examples/test_user_schedule.py`.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class TPContraction(Protocol):
  """How the model's sharded contractions move bytes over `tensor` (the model's `ctx.tp`)."""
  seq_sharded: bool     # the residual stream between layers is sequence-sharded over tensor
  bidirectional: bool   # splits each sequence block in halves (model.seq_len must divide by 2 x tensor)
  axis: str | None      # the mesh axis its contractions run over
  layout: Any           # the run's sharding rules (layout.Layout; make_tp sets it)

  def honours(self) -> dict:
    """The layout rules it can honour, as data: {logical dim: [mesh axes it must map to]}."""
    ...

  def columns(self, x, ws: tuple, eqs: tuple) -> tuple:
    """Column-parallel: x[B, L(_tp), D] . w[D, .., N_tp] -> y[B, L, .., N_tp] for each (w, eq)."""
    ...

  def column(self, x, w, eq: str): ...

  def row(self, h, w, eq: str):
    """Row-parallel: h[B, L, .., N_tp] . w[.., N_tp, D] -> y[B, L(_tp), D], reduced over tensor."""
    ...

  def reduce(self, y):
    """y[B, L, D]{U_tp} -> y[B, L(_tp), D] (the embedding's reduction)."""
    ...

  # Optional, for the memory model: partial_products(tensor) -> int, the partial weight gradients per weight a
  # layer's backward holds at once (1 unless stated: a ring's one per step, schedules/tp.py).

  def vocab_max(self, x): ...
  def vocab_sum(self, x): ...
  def vocab_start(self, v_local: int): ...
  def head_start(self, h_local: int): ...
  def batch_sum(self, x): ...
  def seq_shard(self, x): ...
  def token_sum(self, x): ...


@runtime_checkable
class ContextStrategy(Protocol):
  """Attention across the sequence's split over `context` (`context.impl`), what the explicit schedule and its
  pipeline call. Built as `cls(model: ModelConfig, layout: Layout, cfg: ContextConfig)`. Optional: a class
  attribute `point_to_point` (whether its attention places a ppermute: a pipeline asks, schedules/capability.py),
  and a method `compiler_options(platform, shape) -> dict` (the XLA options its program asks for when compiled for
  `platform`, "cuda", "tpu" or "cpu", on a mesh of `shape`; the run's xla.flags win: Composition.target_flags)."""
  cfg: Any   # the ContextConfig it was built with: `cfg.impl` names it, `cfg.order(seq_len, parts)` the data's order

  def parts(self, shape: dict) -> int:
    """How many pieces the sequence is split into on a mesh of `shape` ({axis: size})."""
    ...

  def check(self, shape: dict) -> None:
    """One ConfigError line for a mesh of `shape` it cannot run on (validation calls it before anything compiles)."""
    ...

  def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_L):
    """The model's attention hook, inside shard_map: local queries against the whole sequence's keys, causal by
    the tokens' positions (the data may hold them out of order: `cfg.order`)."""
    ...


@runtime_checkable
class ExpertDispatcher(Protocol):
  """How a MoE layer's tokens reach their experts over `expert` and come back (`expert.impl`,
  schedules/expert.py). Built as `cls(model: ModelConfig, layout: Layout, cfg: ExpertConfig)`; subclassing
  schedules.expert.Dispatcher gives the checks."""
  cfg: Any   # the ExpertConfig it was built with

  def check(self, shape: dict) -> None:
    """One ConfigError line for a mesh of `shape` ({axis: size}) or settings it cannot run."""
    ...

  def runs_on(self, platform: str) -> str | None:
    """Why it cannot run on devices of `platform` ("cpu", "gpu", "tpu"), or None."""
    ...

  def dispatch(self, x_TD, idx_TK, gate_TK, wi, wd):
    """Inside shard_map: this device's tokens x [T, D], each token's experts idx [T, k] and gates [T, k], this
    device's experts' weights -> (y [T, D], the assignments dropped)."""
    ...


@runtime_checkable
class WeightsPart(Protocol):
  """How a device's parameter shard becomes the weights its layers compute with and how their gradients return
  to it (`schedule.weights`, schedules/weights.py: FSDP / HSDP / data parallel). Built as `cls(model: ModelConfig,
  layout: Layout, cfg: ScheduleConfig, tp: TPContraction, compute_dtype)`; subclassing
  schedules.weights.FSDPWeights gives the knob checks and the cost terms."""
  cfg: Any   # the ScheduleConfig it was built with (prefetch, reshard_after_forward, gather_dtype, grad_reduce)

  def honours(self, axis_names) -> dict:
    """The layout rules it can honour on a mesh of `axis_names`: {"embed": [...], "batch": [...]}."""
    ...

  def gather(self, shard, decl, stacked: bool = False):
    """Inside shard_map: W[D_fsdp, ..] -> W[D, ..] in the compute dtype, varying over the residual axes."""
    ...

  def reduce_grad(self, grad, shard, decl, stacked: bool = False):
    """The gradient of gather(shard) -> the gradient of `shard`, fully reduced (the same sum as gather's
    transpose)."""
    ...

  def stage(self, layer_fn, gather, reduce, policy):
    """The layer loop's stage unit (schedules/stage.py: Stage) for the schedule's per-layer gather and reduce."""
    ...

  once_per_step: bool   # every weight gathered once per step, every gradient reduced once (deferred)

  # Its cost terms, what the analysis asks (schedules/weights.py's docstring):
  def element_bytes(self, precision) -> int: ...
  regathers: int
  def live_layers(self, n: int) -> int: ...
  def cast_bytes(self, precision) -> int: ...


class ContextCost(Protocol):
  """A context strategy's cost terms (optional: schedules/context.py's classes have them, and a subclass inherits
  them): what the analysis evaluates to price it (analysis/context_cost.py, memory_model.py), so a user's
  strategy is priced like a built-in one. `a` is one layer's attention on one device (context_cost.Attn),
  `cost` the rates it is evaluated at (context_cost.Rates). Without them the strategy trains but the planner's
  context search cannot price it (one line), and memory counts the model's own attention for it."""

  def bytes_per_layer(self, a) -> dict:
    """{"forward", "backward"}: bytes one device sends over the context axes per layer."""
    ...

  def layer_time(self, a, cost) -> dict:
    """{"attention_s", "comm_s", "exposed_s"}: one layer's attention, forward and backward, on the busiest device."""
    ...

  def skips_masked(self) -> bool: ...
  def transient_bytes(self, a) -> float: ...
  def kept_attention(self) -> str: ...
  def kept_per_token(self, remat: str) -> int: ...
  def why_not(self, shape: dict) -> str | None: ...


@runtime_checkable
class Schedule(Protocol):
  """What train.py calls. Built as `cls(cfg: ScheduleConfig, model: ModelConfig, compute_dtype, layout)`, and with
  `context=` (a ContextConfig) and `pipeline=` (a PipelineConfig) where its constructor takes them
  (schedules.build passes only what it takes); the constructor rejects knobs it cannot honour with a one-line
  `shardlab.errors.ConfigError`. A schedule that runs pipeline stages says so with a class attribute `pipelines =
  True` (or, stating nothing, by taking `pipeline=`); `pipelines = False`, or neither, refuses a pipeline in
  one line before it is built."""
  shard_mapped: bool    # True: runs inside shard_map; False: plain jit on global arrays (gspmd)
  layout: Any           # the sharding rules it was built with (layout.Layout): the data's specs come from it
  ops: TPContraction    # the model's TP contractions

  def honours(self, axis_names) -> dict:
    """The layout rules it can honour on a mesh of `axis_names`, as data derived from its parts: {logical dim:
    [allowed tuples of mesh axes]}; validation rejects any other rule with one line (layout.honoured)."""
    ...

  def check_mesh(self, shape: dict, who: str | None = None) -> None:
    """One ConfigError line for a mesh of `shape` ({axis: size}) it cannot run on (a layout rule it does not honour there:
    layout.honoured; a sequence split its attention cannot take). Validation calls it before anything compiles."""
    ...

  def data_order(self, shape: dict):
    """The order the data holds each sequence's tokens in on a mesh of `shape` (a permutation of 0..L-1, e.g.
    causal load balancing's zigzag), or None for as they come. The data applies it to inputs, targets and
    positions alike (data.split)."""
    ...

  def bind(self, mesh) -> None:
    """The mesh the step is built for (called once by train.py, before tracing): check_mesh, then keep it."""
    ...

  def recording_residuals(self):
    """A context manager yielding a list: each layer loop traced inside appends one layer's residual bytes per
    device ({"saved", "unremat"}: Stage.residual_bytes), or nothing where the compiler decides (gspmd)."""
    ...

  def loss_and_grads(self, params: dict, batch, n_tokens: int) -> tuple[Any, dict]:
    """Inside shard_map (unless `shard_mapped = False`: plain jit on global arrays): this device's loss
    contribution (summed over devices it is the global mean) and gradients shaped, sharded and fully reduced
    like `params`. `batch`: data.Batch (inputs, targets, positions [B, L]), already shifted."""
    ...


@runtime_checkable
class LayerSchedule(Schedule, Protocol):
  """The explicit schedule's hooks, one decision each."""
  ops: TPContraction  # the TP contraction (schedule.tp)

  def gather(self, shard, decl, stacked: bool = False):
    """How a weight is gathered: W[D_fsdp, ..] -> W[D, ..] in the compute dtype, varying over the residual
    axes. `decl` is its params.Param (which dims are sharded over which axes); stacked: a leading layer dim."""
    ...

  def reduce_grad(self, grad, shard, decl, stacked: bool = False):
    """How a gradient is reduced: the gradient of gather(shard) -> the gradient of `shard`, fully reduced (the
    same sum as gather's transpose). Per layer, one layer later or deferred is `schedule.grad_reduce`; a
    bucketed or otherwise different reduction overrides this."""
    ...

  def context(self, params, gathered: bool = False):
    """The model's parallel context (schedules/parallel.py: Parallel): the TP contractions, the weights reader,
    the layer loop and the attention hook. Override to replace one (e.g. attention, for context parallelism)."""
    ...

  def layer_loop(self, x, stacked: dict, layer_fn: Callable, gathered: bool = False):
    """The layer loop: x -> layer_fn(.. layer_fn(x, W_0) .., W_{n-1}), deciding when each layer's weights are
    gathered (prefetch), what backward keeps, and when each layer's gradient is reduced (reduce_grad)."""
    ...
