"""A run's composition, read from its config once: the mesh's degrees, the layout, the model, the precision, the
batch, the target hardware, and the parts that split the model (the weights part, the TP contraction, the context
strategy, the MoE dispatcher), built from their classes (a user's `module:Class` like a built-in) once, on first
use.

Everything below the entry points that prices or plans a run (shardlab/analysis/: the memory model, the cost
model, the context, expert and pipeline costs, the planner) takes a Composition, never the whole config:
`resolve(cfg)` makes one where a run or a plan starts (trainer, preflight, plan), and the planner's candidates are
compositions changed group by group (`replace`), each with its own parts.

  c = resolve(cfg)
  c.split("batch"), c.local_tokens, c.stages, c.microbatches    what the mesh and the layout make of the batch
  c.weights, c.tp, c.cp, c.dispatcher                            the parts, asked for their own terms
  c.replace(mesh={"fsdp": 8}, schedule={"remat": "full"})         a candidate: another composition
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from shardlab.axes import PIPELINE
from shardlab.layout import Layout, from_config


@dataclasses.dataclass(frozen=True)
class Composition:
  """What one run is made of (module doc). The groups are the config's own (read, not copied); `layout` is
  resolved (layout.Layout, not the config's rules)."""
  mesh: Any                  # config.MeshConfig: the size of every declared axis
  layout: Layout
  model: Any                 # config.ModelConfig
  schedule: Any              # config.ScheduleConfig: the weights' schedule knobs and the TP contraction's name
  context: Any               # config.ContextConfig
  expert: Any                # config.ExpertConfig
  pipeline: Any              # config.PipelineConfig
  precision: Any             # config.PrecisionConfig
  train: Any                 # config.TrainConfig: the batch (and the planner's assumed MFU)
  hardware: Any              # hardware.HardwareConfig
  compile_for: str = "local"

  # ------------------------------------------------------------------------------------------ the mesh and batch
  @property
  def names(self) -> tuple[str, ...]:
    """The mesh's axes, outer to inner (fsdp and tensor always, other axes where their size is above 1)."""
    return tuple(self.mesh.shape)

  @property
  def sizes(self) -> dict:
    return self.mesh.sizes

  def split(self, logical: str) -> int:
    """How many pieces the mesh splits a logical dim into (its layout rule's axes' sizes multiplied)."""
    return math.prod(self.sizes[a] for a in self.layout.rule(logical, self.names))

  @property
  def global_tokens(self) -> int:
    """The global batch in tokens: train.global_batch_tokens, or batch_size x seq_len when that is 0."""
    return self.train.global_batch_tokens or self.train.batch_size * self.model.seq_len

  @property
  def stages(self) -> int:
    """Pipeline stages the run has: mesh.pipeline under a pipeline schedule, else 1."""
    return self.sizes.get(PIPELINE, 1) if self.pipeline.staged else 1

  @property
  def microbatches(self) -> int:
    """Microbatches a device splits its batch into: the pipeline's M, else schedule.microbatches."""
    P = self.stages
    return self.pipeline.count(P) if P > 1 else self.schedule.microbatches

  @property
  def local_tokens(self) -> float:
    """Tokens per device of one microbatch: the sequences its batch axes leave it (of the global batch), x the
    L/C tokens of each that its sequence (`length`) axes leave it. A whole number on a mesh that divides the
    batch; the planner asks about batches that do not (a fraction of a sequence per shard)."""
    t = self.global_tokens / self.split("batch") / self.microbatches / self.split("length")
    return int(t) if t == int(t) else t

  # ------------------------------------------------------------------------------------------------ the parts
  @functools.cached_property
  def tp(self):
    """The TP contraction `schedule.tp` names (schedules/tp.py), reading this layout."""
    from shardlab.schedules.tp import make_tp
    return make_tp(self.schedule.tp, self.layout)

  @functools.cached_property
  def weights(self):
    """The weights part `schedule.weights` names (schedules/weights.py: FSDP / HSDP / data parallel), built with
    its knobs, this layout and the TP contraction: its cost terms are what the analysis prices the weights by."""
    from shardlab.schedules import weights as WT
    return WT.make(self.schedule, self.model, self.layout, self.tp, self.precision.compute_dtype)

  @functools.cached_property
  def cp(self):
    """The context strategy `context.impl` names (schedules/context.py)."""
    from shardlab.schedules import context as CP
    return CP.make(self.context, self.model, self.layout)

  @functools.cached_property
  def dispatcher(self):
    """The MoE dispatcher `expert.impl` names (schedules/expert.py); None for a dense model, or under a schedule
    class that states it runs none (`dispatches = False`: gspmd, whose compiler places the dispatch)."""
    if not getattr(self.model, "moe", False):
      return None
    from shardlab.schedules import resolve as schedule_class
    if getattr(schedule_class(self.schedule.impl), "dispatches", True) is False:
      return None
    from shardlab.schedules import expert as EP
    return EP.make(self.expert, self.model, self.layout)

  def compiler_options(self, platform: str) -> dict:
    """The XLA options the context strategy asks for when the step is compiled for `platform` ("cuda", "tpu", "cpu":
    a target's, or the local devices' on a GPU machine), where the sequence is split: its
    `compiler_options(platform, mesh shape)`, where its class has one (a ring's two collectives in flight on a
    GPU; none elsewhere). What a user's class returns is checked: a dict, or one ConfigError line naming it."""
    if self.split("length") <= 1:
      return {}
    ask = getattr(self.cp, "compiler_options", None)
    if ask is None:
      return {}
    from shardlab.errors import ConfigError
    from shardlab.loading import user_code
    with user_code(str(self.context.impl), "context.impl", "compiler_options(platform, shape)"):
      out = ask(platform, dict(self.mesh.shape))
    if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
      raise ConfigError(f"context.impl={self.context.impl}: compiler_options(platform, shape) returned "
                        f"{type(out).__name__}, not a dict of XLA option names to values")
    return dict(out)

  def target_flags(self, flags: dict, platform: str | None = None) -> dict:
    """The options a compile of this step takes: the parts' for `platform` (compiler_options; default: the
    target's, hardware.target_platform), then `flags` (the run's xla.flags) over them."""
    return {**self.compiler_options(platform or self.hardware.target_platform), **dict(flags or {})}

  # ---------------------------------------------------------------------------------------- what the run checks
  def build_schedule(self):
    """The schedule the run builds from these parts (schedules.build: what user code raises there is one line)."""
    import jax.numpy as jnp
    from shardlab import schedules
    return schedules.build(self.schedule, self.model, getattr(jnp, self.precision.compute_dtype), self.layout,
                           self.context, self.pipeline, self.expert)

  def user_code(self, call: str):
    """A call into the schedule (a user's class, or one holding a user's TP or context strategy): what user code
    raises in it is one line naming the setting and the user's file and line (loading.user_code)."""
    from shardlab.loading import user_code
    return user_code(self.schedule.impl, "schedule.impl", call,
                     {"schedule.tp": str(self.schedule.tp), "context.impl": str(self.context.impl)})

  def microbatches_of(self, sched=None) -> tuple[int, str]:
    """(microbatches each device splits its batch into, the setting that says so), asked of the schedule: the
    pipeline's when it runs one, else schedule.microbatches."""
    if sched is None:
      return 1, "schedule.microbatches"
    on = getattr(sched, "microbatches_on", None)
    with self.user_code("microbatches_on(...)"):
      n = on(dict(self.mesh.shape)) if on else self.schedule.microbatches
    return n, "pipeline.microbatches" if self.pipeline.staged else "schedule.microbatches"

  def check(self, sched=None) -> None:
    """The layout's rules (declared axes, each allowed to shard its dim, no collisions), every dim divisible by
    the axes it is sharded over (params.requirements: declarations x rules x mesh sizes), and, given the
    schedule, every rule one it can honour on this mesh (its check_mesh): one ConfigError line."""
    from shardlab.params import check_divisible
    shape = self.mesh.shape
    self.layout.check(tuple(shape))
    ops = None if sched is None else sched.ops
    micro, setting = self.microbatches_of(sched)
    check_divisible(self.model, self.layout, shape, self.train.batch_size, micro, microbatch_setting=setting,
                    seq_parallel=ops is not None and ops.seq_sharded,
                    seq_halves=ops is not None and ops.bidirectional)
    if sched is not None:
      with self.user_code("check_mesh(...)"):
        sched.check_mesh(dict(shape), f"schedule {self.schedule.name}")

  def why_not_run(self) -> str:
    """The one line the run's own checks give for this composition (its schedule built from its parts and
    asked: check), or '' where it runs: what the planner asks of a candidate before it offers one."""
    from shardlab.errors import ConfigError
    try:
      self.check(self.build_schedule())
    except ConfigError as e:
      return str(e)
    return ""

  # -------------------------------------------------------------------------------------------- the candidates
  def replace(self, **groups) -> "Composition":
    """Another composition with fields of some groups replaced (`mesh={"fsdp": 8}`), or whole values (a Layout,
    `compile_for="target"`); its parts are built anew, for it."""
    out = {}
    for g, v in groups.items():
      out[g] = dataclasses.replace(getattr(self, g), **v) if isinstance(v, dict) else v
    return dataclasses.replace(self, **out)


def resolve(cfg) -> Composition:
  """The composition of a config.Config (the one place the analysis reads a whole config)."""
  return Composition(mesh=cfg.mesh, layout=from_config(cfg.layout), model=cfg.model, schedule=cfg.schedule,
                     context=cfg.context, expert=cfg.expert, pipeline=cfg.pipeline, precision=cfg.precision,
                     train=cfg.train, hardware=cfg.hardware, compile_for=cfg.compile_for)
