"""Schedules: objects that decide when and how bytes move. A schedule is picked by the Hydra group
`schedule/`: its YAML names an implementation (`impl`) and sets its knobs.

`impl` is a registered name (REGISTRY) or `package.module:Class`, a class in any importable module (your own
file, outside this package): see `schedules/protocol.py` for the hooks a schedule overrides, and
`examples/` for one. A class needs `loss_and_grads(params, batch, n_tokens)` (run inside shard_map,
returning the loss and fully reduced, parameter-sharded gradients; a class with `shard_mapped = False` runs
under plain jit on global arrays instead, as `gspmd` does). Tests pick up every YAML in conf/schedule/
by themselves.
"""
from __future__ import annotations

from shardlab.schedules.loading import check_instance, load_object
from shardlab.schedules.protocol import Schedule, TPContraction
from shardlab.schedules.explicit import ExplicitSchedule
from shardlab.schedules.gspmd import GSPMDSchedule
from shardlab.schedules.tp import TP

REGISTRY = {"explicit": ExplicitSchedule, "gspmd": GSPMDSchedule}


def resolve(impl: str):
  """The schedule class `schedule.impl` names, checked against the Schedule protocol."""
  return load_object(impl, "schedule.impl", REGISTRY, Schedule)


def build(cfg, model, compute_dtype, layout=None, context=None, pipeline=None):
  """The schedule `cfg.impl` names, built for `model` with the run's sharding rules (default: layout.Layout())
  and context-parallel strategy (a ContextConfig; default: all_gather) and pipeline schedule (a PipelineConfig;
  default: none). A `schedule.tp=module:Class` is checked
  against the TPContraction protocol before the schedule makes one, and the one it made after (attributes set in
  __init__)."""
  loaded_tp = ":" in str(cfg.tp)
  if loaded_tp:
    load_object(cfg.tp, "schedule.tp", TP, TPContraction)
  cls = resolve(cfg.impl)
  extra = (context, pipeline) if pipeline is not None and getattr(pipeline, "impl", "none") != "none" else \
      (context,) if context is not None else ()
  sched = cls(cfg, model, compute_dtype, layout, *extra)
  if loaded_tp:
    check_instance(sched.ops, cfg.tp, "schedule.tp", TPContraction)
  return sched
