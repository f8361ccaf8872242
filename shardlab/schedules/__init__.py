"""Schedules: objects that decide when and how bytes move. A schedule is picked by the Hydra group
`schedule/`: its YAML names an implementation (`impl`) registered here and sets its knobs.

To add one: write a class with `loss_and_grads(params, tokens, targets, n_tokens)` (run inside shard_map,
returning the loss and fully reduced, parameter-sharded gradients; a class with `shard_mapped = False` runs
under plain jit on global arrays instead, as `gspmd` does), register it below, and add a YAML to
shardlab/conf/schedule/. Tests pick up every YAML there by themselves.
"""
from __future__ import annotations

from shardlab.mesh import ConfigError
from shardlab.schedules.explicit import ExplicitSchedule
from shardlab.schedules.gspmd import GSPMDSchedule

REGISTRY = {"explicit": ExplicitSchedule, "gspmd": GSPMDSchedule}


def build(cfg, model, compute_dtype):
  if cfg.impl not in REGISTRY:
    raise ConfigError(f"schedule.impl={cfg.impl}: unknown schedule implementation; known: {', '.join(REGISTRY)}")
  return REGISTRY[cfg.impl](cfg, model, compute_dtype)
