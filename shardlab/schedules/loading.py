"""Loading a class named on the command line: a registry name, or `package.module:Name` from anywhere on
sys.path (a user's own file), checked against its protocol (schedules/protocol.py) before anything runs. Its own
module so that schedules and TP contractions can both use it."""
from __future__ import annotations

import importlib
import inspect

from shardlab.mesh import ConfigError


def protocol_members(proto) -> list[str]:
  """The methods and attributes a typing Protocol asks for (its own and its bases', public names)."""
  names: dict[str, None] = {}
  for base in reversed(proto.__mro__):
    if base in (object, proto.__mro__[-1]) or base.__name__ in ("Protocol", "Generic"):
      continue
    for n in (*getattr(base, "__annotations__", {}), *vars(base)):
      if not n.startswith("_"):
        names[n] = None
  return list(names)


def check_class(obj, spec: str, what: str, proto, methods_only: bool = False) -> None:
  """`obj` (what `spec` names) is a class with every method of `proto` (schedules/protocol.py), checked before
  anything runs; else a one-line ConfigError saying what is missing (a traced step would fail deep inside)."""
  where = f"shardlab/schedules/protocol.py: {proto.__name__}"
  if not inspect.isclass(obj):
    kind = "a module" if inspect.ismodule(obj) else f"a {type(obj).__name__}"
    raise ConfigError(f"{what}={spec}: is {kind}, not a class; name a class with the {proto.__name__} methods "
                      f"({where})")
  members = [n for n in protocol_members(proto) if not methods_only or callable(getattr(proto, n, None))]
  missing = [n for n in members if callable(getattr(proto, n, None)) and not callable(getattr(obj, n, None))]
  if missing:
    raise ConfigError(f"{what}={spec}: {obj.__name__} is not a {proto.__name__}: it has no {', '.join(missing)} "
                      f"({where}); subclass one of shardlab's or add them")


def check_instance(obj, spec: str, what: str, proto) -> None:
  """An instance of a loaded class against `proto`, attributes included (set in __init__, e.g. seq_sharded)."""
  missing = [n for n in protocol_members(proto) if not hasattr(obj, n)]
  if missing:
    raise ConfigError(f"{what}={spec}: an instance of {type(obj).__name__} has no {', '.join(missing)} "
                      f"(shardlab/schedules/protocol.py: {proto.__name__}); subclass one of shardlab's or add them")


def load_object(spec: str, what: str, registry: dict, proto=None):
  """A registry name, or `package.module:Name` imported from anywhere on sys.path; else one-line ConfigError.
  `proto`: a loaded `module:Name` must be a class with that protocol's methods (check_class)."""
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
  if proto is not None:
    check_class(obj, spec, what, proto)
  return obj
