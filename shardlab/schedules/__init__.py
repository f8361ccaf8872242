"""Schedules: objects that decide when and how bytes move. A schedule is picked by the Hydra group
`schedule/`: its YAML names an implementation (`impl`) and sets its knobs.

`impl` is a registered name (REGISTRY) or `package.module:Class`, a class in any importable module (your own
file, outside this package): see `schedules/protocol.py` for the hooks a schedule overrides, and
`examples/` for one. A class needs `loss_and_grads(params, tokens, targets, n_tokens)` (run inside shard_map,
returning the loss and fully reduced, parameter-sharded gradients; a class with `shard_mapped = False` runs
under plain jit on global arrays instead, as `gspmd` does). Tests pick up every YAML in shardlab/conf/schedule/
by themselves.
"""
from __future__ import annotations

import importlib

from shardlab.mesh import ConfigError
from shardlab.schedules.explicit import ExplicitSchedule
from shardlab.schedules.gspmd import GSPMDSchedule

REGISTRY = {"explicit": ExplicitSchedule, "gspmd": GSPMDSchedule}


def load_object(spec: str, what: str, registry: dict):
  """A registry name, or `package.module:Name` imported from anywhere on sys.path; else one-line ConfigError."""
  if spec in registry:
    return registry[spec]
  if ":" not in spec:
    raise ConfigError(f"{what}={spec}: unknown; known: {', '.join(registry)}, or package.module:Class")
  module, _, name = spec.partition(":")
  try:
    obj = importlib.import_module(module)
  except ImportError as e:
    raise ConfigError(f"{what}={spec}: cannot import {module} ({e}); is its directory on sys.path "
                      f"(PYTHONPATH, or the current directory)?") from None
  for part in name.split("."):
    if not hasattr(obj, part):
      raise ConfigError(f"{what}={spec}: {module} has no {name}")
    obj = getattr(obj, part)
  return obj


def resolve(impl: str):
  """The schedule class `schedule.impl` names."""
  return load_object(impl, "schedule.impl", REGISTRY)


def build(cfg, model, compute_dtype):
  return resolve(cfg.impl)(cfg, model, compute_dtype)
