"""The compiler's own sharding, as a baseline: the same model math under plain `jax.jit`, parameters and
batch placed with the same NamedShardings (the layout), activations constrained like the explicit
schedule's, and every collective left to XLA's SPMD partitioner. Compare its ledger with `baseline`'s to see
what hand placement buys. Knobs: `tp` (allgather: sequence-parallel activations | allreduce), `microbatches`,
`remat`; the others describe hand placement and are rejected. A mixture of experts runs its plain MoE layer
(every expert on this program's tokens, dropless: schedules/parallel.py, plain_experts) with the expert weights
where the layout puts them (`experts -> expert`), and the partitioner places the dispatch: no dispatcher of
schedules/expert.py runs (`dispatches = False`), so `expert.impl` names none and a capacity is refused.

As a part it states what it can run beside (`pipelines = False`, `dispatches = False`, `shard_mapped = False`) and
honours its layout rules (honours); the weights part's knobs are refused (the compiler places those collectives),
so the analysis prices it with the weights part at its defaults (schedules/weights.py: gathered before use,
re-gathered in backward, reduced per layer), the closed forms' estimate; what the partitioner really placed is
the compiled program's ledger (summary.json `audit.placed_by: compiler`).
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlab import model as M
from shardlab.axes import FSDP, TENSOR
from shardlab.config import ModelConfig, ScheduleConfig
from shardlab.data import Batch
from shardlab.layout import Layout, honoured
from shardlab.errors import ConfigError
from shardlab.params import declare, kv_sharded
from shardlab.schedules.explicit import remat_policy
from shardlab.schedules.parallel import accumulate, attention, microbatches, plain
from shardlab.schedules.tp import IdentityOps

# The weight letters of the model's column contractions (shardlab/model.py) and the logical dims they name.
WEIGHT_LETTERS = {"h": "heads", "g": "kv_heads", "f": "mlp", "v": "vocab"}


class ConstrainedOps(IdentityOps):
  """Plain math on global arrays with the explicit schedule's activation layouts as sharding hints."""

  axis = TENSOR

  def __init__(self, seq_parallel: bool, layout: Layout, model: ModelConfig):
    self.seq_parallel, self.layout, self.model = seq_parallel, layout, model
    self.seq_sharded = seq_parallel
    self.mesh = None

  @property
  def batch(self):
    """The batch dim's spec entry: the mesh axes the layout's batch rule names that this mesh has."""
    return self.layout.batch_spec(self.mesh.axis_names)[0]

  @property
  def residual(self):
    return P(self.batch, TENSOR if self.seq_parallel else None, None)   # x[B_batch, L_tp, D]

  def c(self, x, spec):
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def columns(self, x, ws, eqs):   # each y[B_batch, L, .., N_tp, ..]
    return tuple(self.c(y, self.spec_of(eq.split("->")[1], eq)) for y, eq in zip(super().columns(x, ws, eqs), eqs))

  def spec_of(self, letters: str, eq: str) -> P:
    """The spec of an activation with dims `letters` in contraction `eq`, from the layout: the batch letter over
    the batch axes, each weight letter whose logical dim the layout puts on `tensor` over `tensor` (q[B, L, H_tp,
    K] and kv[B, L, 2, G_tp, K], not their head_dim: the attention kernel then reads whole local heads, with no
    all-to-all in between)."""
    x_letters, w_letters = eq.split("->")[0].split(",")
    def axis(c):
      if c == x_letters[0]:
        return self.batch
      logical = WEIGHT_LETTERS.get(c) if c in w_letters else None
      if logical == "kv_heads" and not kv_sharded(self.model, dict(self.mesh.shape).get(TENSOR, 1)):
        return None                     # K/V heads tensor does not divide: replicated, as the declaration
      return TENSOR if logical and TENSOR in self.layout.rule(logical) else None
    return P(*map(axis, letters))

  def row(self, h, w, eq):
    """h[B, L, .., N_tp] held as the column gave it (heads or d_ff on tensor), and so is its cotangent: without
    it the partitioner computes dh sequence-sharded from the sequence-sharded dy and all-to-alls it back."""
    h = self.c(h, self.spec_of(eq.split("->")[0].split(",")[0], eq))
    return self.c(super().row(h, w, eq), self.residual)

  def reduce(self, y):
    return self.c(y, self.residual)

  def seq_shard(self, x):
    return self.c(x, self.residual)


class GSPMDSchedule:
  shard_mapped = False   # train.py builds a plain jit step for it
  pipelines = False      # no pipeline stages: the compiler places the whole layer stack (schedules.build asks)
  dispatches = False     # a MoE layer's dispatch is the compiler's too: no dispatcher runs (the analysis asks)

  def __init__(self, cfg: ScheduleConfig, model: ModelConfig, compute_dtype=jnp.float32, layout: Layout | None = None,
               context=None, expert=None):   # context: no sequence split here (honours: length -> none)
    default = ScheduleConfig()
    for knob in ("prefetch", "reshard_after_forward", "gather_dtype", "grad_reduce", "weights"):
      if getattr(cfg, knob) != getattr(default, knob):
        raise ConfigError(f"schedule.{knob}={getattr(cfg, knob)}: the gspmd schedule leaves communication to the "
                          f"compiler; it takes only tp, microbatches and remat")
    if cfg.tp not in ("allgather", "allreduce"):
      raise ConfigError(f"schedule.tp={cfg.tp}: the gspmd schedule takes tp=allgather or tp=allreduce")
    if cfg.microbatches < 1:
      raise ConfigError(f"schedule.microbatches={cfg.microbatches}: must be >= 1")
    if getattr(model, "moe", False) and getattr(expert, "capacity_factor", 0):
      raise ConfigError(f"expert.capacity_factor={expert.capacity_factor}: the gspmd schedule runs the MoE layer "
                        f"dropless (the compiler places its dispatch); set expert.capacity_factor=0 or "
                        f"schedule.impl=explicit")
    self.cfg, self.model, self.dtype = cfg, model, compute_dtype
    self.layout = layout or Layout()
    self.decls = declare(model, layout=self.layout)
    self.ops = ConstrainedOps(seq_parallel=cfg.tp == "allgather", layout=self.layout, model=model)
    self.policy = remat_policy(cfg.remat)

  @contextlib.contextmanager
  def recording_residuals(self):
    """No stage unit: the compiler decides what is saved, so nothing is recorded (the memory breakdown falls
    back to its per-token estimate)."""
    yield []

  def honours(self, axis_names) -> dict:
    """Its activation constraints put heads, d_ff and vocab (and the sequence, tp=allgather) on `tensor`; weights
    go where the layout puts them (the partitioner follows); every layer and whole sequences on every device."""
    dims = ("heads", "kv_heads", "mlp", "vocab") + (("seq",) if self.ops.seq_parallel else ())
    return {**{d: [(TENSOR,)] for d in dims}, "embed": [(FSDP,), ()], "layers": [()], "length": [()],
            "expert_mlp": [()]}

  def data_order(self, shape: dict):
    """Sequences as they come (no sequence split)."""
    return None

  def check_mesh(self, shape: dict, who: str | None = None) -> None:
    honoured(self.layout, self.honours(tuple(shape)), tuple(shape), who or "the gspmd schedule")

  def bind(self, mesh) -> None:
    """The mesh the activation constraints refer to (set when the step is built); rules checked against it."""
    self.check_mesh(dict(mesh.shape))
    self.ops.mesh = mesh

  def loss_and_grads(self, params, batch: Batch, n_tokens: int):
    """On global arrays, under jit with the mesh set. Gradients come back sharded like `params`. Microbatch j
    takes rows j, j+k, ...: every device keeps its own rows (the batch stays sharded)."""
    def ctx(p):
      p = jax.tree.map(lambda a: a.astype(self.dtype), p)
      return dataclasses.replace(plain(self.model, p, self.ops, self.policy), attend=self.attend())
    k = self.cfg.microbatches
    rows = lambda a: (a[None] if k == 1 else
                      self.ops.c(a.reshape(a.shape[0] // k, k, *a.shape[1:]).swapaxes(0, 1), P(None, self.ops.batch)))
    if self.model.moe:       # a MoE model's router statistics third, as the explicit schedule's
      loss_fn = lambda p, b: M.loss_and_stats(ctx(p), self.model, b, n_tokens)
      (loss, stats), g = accumulate(jax.value_and_grad(loss_fn, has_aux=True), params,
                                    microbatches(batch, k, rows), zero_aux=M.zero_stats(self.model))
      return loss, g, stats
    loss_fn = lambda p, b: M.loss(ctx(p), self.model, b, n_tokens)
    return accumulate(jax.value_and_grad(loss_fn), params, microbatches(batch, k, rows))

  def attend(self):
    """Attention as a careful GSPMD user runs it (MaxText's attention_op wraps its fused kernels the same way): a
    shard_map over the batch rows and the heads each device already holds, so the kernel sees whole local heads
    and needs no collective. JAX's cuDNN partitioner refuses a head-sharded operand ("Sharding on head dim is not
    allowed"), and XLA's own attention is partitioned the same way. Where `tensor` does not divide the key/value
    heads, the plain call (the partitioner's choice)."""
    inner = attention(self.model)
    t = dict(self.ops.mesh.shape).get(TENSOR, 1)
    if self.model.kv_heads % t or self.model.n_heads % t:
      return inner
    spec = P(self.ops.batch, None, TENSOR, None)
    local = jax.shard_map(lambda q, k, v: inner(q, k, v, None), mesh=self.ops.mesh, in_specs=(spec,) * 3,
                          out_specs=spec)
    return lambda q, k, v, positions: local(q, k, v)
