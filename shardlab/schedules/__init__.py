"""Schedules: objects that decide when and how bytes move. A schedule is picked by the Hydra group
`schedule/`: its YAML names an implementation (`impl`) and sets its knobs.

`impl` is a registered name (REGISTRY) or `package.module:Class`, a class in any importable module (your own
file, outside this package): see `schedules/protocol.py` for the hooks a schedule overrides, and
`examples/` for one. A class needs `loss_and_grads(params, batch, n_tokens)` (run inside shard_map,
returning the loss and fully reduced, parameter-sharded gradients; a class with `shard_mapped = False` runs
under plain jit on global arrays instead, as `gspmd` does). It is built as `cls(cfg, model, compute_dtype,
layout)`, with `context=` and `pipeline=` only where its constructor takes them; one that runs pipeline stages
says so (`pipelines = True`, or by taking `pipeline=`). Tests pick up every YAML in conf/schedule/ by themselves.
"""
from __future__ import annotations

from shardlab.config import ScheduleConfig
from shardlab.errors import ConfigError
from shardlab.loading import accepts, check_instance, load_object, user_code
from shardlab.schedules.protocol import Schedule, TPContraction
from shardlab.schedules.explicit import ExplicitSchedule
from shardlab.schedules.gspmd import GSPMDSchedule
from shardlab.schedules.tp import TP

REGISTRY = {"explicit": ExplicitSchedule, "gspmd": GSPMDSchedule}


def resolve(impl: str):
  """The schedule class `schedule.impl` names, checked against the Schedule protocol."""
  return load_object(impl, "schedule.impl", REGISTRY, Schedule)


def runs_pipelines(cls) -> bool:
  """Whether schedule class `cls` can run pipeline stages, asked of the class (never its name): its constructor
  takes a `pipeline` (ExplicitSchedule's does) and it does not state `pipelines = False` (gspmd)."""
  return getattr(cls, "pipelines", None) is not False and accepts(cls, "pipeline")


def check_pipeline(cfg: ScheduleConfig, cls, pipeline) -> None:
  """A pipeline schedule (pipeline.impl other than none) on a schedule class that cannot run one: one line,
  before the class is built (it would fail on the argument, or run the layers unstaged)."""
  if not getattr(pipeline, "staged", False):
    return
  impl = pipeline.impl
  setting = f"pipeline={pipeline.name}" if getattr(pipeline, "name", impl) == impl else f"pipeline.impl={impl}"
  who = f"schedule={cfg.name} (schedule.impl={cfg.impl}, class {cls.__name__})"
  if not runs_pipelines(cls):
    why = ("it states pipelines = False" if getattr(cls, "pipelines", None) is False else
           "its constructor takes no pipeline=; a class that runs stages takes a `pipeline=None` argument "
           "(schedules/protocol.py: Schedule)")
    raise ConfigError(f"{setting}: {who} cannot run pipeline stages ({why}); choose a schedule that can "
                      f"(schedule.impl=explicit, e.g. schedule=baseline) or pipeline=none with mesh.pipeline=1")


def check_experts(cfg: ScheduleConfig, cls, model) -> None:
  """A MoE model on a schedule class that runs no dispatcher (its constructor takes no `expert=`): one line."""
  if getattr(model, "moe", False) and not accepts(cls, "expert"):
    raise ConfigError(f"model.n_experts={model.n_experts}: schedule={cfg.name} (schedule.impl={cfg.impl}, class "
                      f"{cls.__name__}) runs no MoE dispatch (its constructor takes no expert=); choose "
                      f"schedule.impl=explicit (e.g. schedule=baseline)")


def build(cfg: ScheduleConfig, model, compute_dtype, layout=None, context=None, pipeline=None, expert=None):
  """The schedule `cfg.impl` names, built for `model` with the run's sharding rules (default: layout.Layout())
  and context-parallel strategy (a ContextConfig; default: all_gather) and pipeline schedule (a PipelineConfig;
  default: none), each passed only where the class's constructor takes it. A `schedule.tp=module:Class` is
  checked against the TPContraction protocol before the schedule makes one, and the one it made after
  (attributes set in __init__). What user code raises while the schedule is built (its constructor, its TP
  contraction's, its context strategy's) is one line naming the setting and the user's file and line."""
  loaded_tp = ":" in str(cfg.tp)
  if loaded_tp:
    load_object(cfg.tp, "schedule.tp", TP, TPContraction)
  cls = resolve(cfg.impl)
  check_pipeline(cfg, cls, pipeline)
  check_experts(cfg, cls, model)
  extra = {k: v for k, v in (("context", context), ("pipeline", pipeline), ("expert", expert))
           if v is not None and accepts(cls, k)}
  others = {"schedule.tp": str(cfg.tp), "context.impl": str(getattr(context, "impl", "")),
            "expert.impl": str(getattr(expert, "impl", ""))}
  with user_code(cfg.impl, "schedule.impl", f"{cls.__name__}(...)", others):
    sched = cls(cfg, model, compute_dtype, layout, **extra)
  if loaded_tp:
    check_instance(sched.ops, cfg.tp, "schedule.tp", TPContraction)
  return sched
