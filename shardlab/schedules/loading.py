"""Loading a class named on the command line: a registry name, or `package.module:Name` from anywhere on
sys.path (a user's own file). Its own module so that schedules and TP contractions can both use it."""
from __future__ import annotations

import importlib

from shardlab.mesh import ConfigError


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
