"""What a part can run beside, asked of its class, never of its name.

A part (a TP contraction, a context strategy, a schedule) states a capability as a class attribute, e.g.
`point_to_point = True`: its layer's collectives include a `ppermute`. A guard reads it with `stated`, which trusts
the statement only for the methods of the class that made it: a subclass that overrides a method (a user's
AllGatherTP with its own `_column`, as docs/schedules.md suggests) may move bytes another way, so the inherited
statement says nothing about it until that subclass states it again. A class written from the protocol alone states
nothing. Either way `stated` returns None, "not known", and a guard refuses what it does not know to be correct.

    class MyTP(AllGatherTP):
      point_to_point = True              # my _column rotates blocks with ppermute
      def _column(self, x, f): ...
"""
from __future__ import annotations

from typing import Any


def _methods(cls) -> list[str]:
  """The methods `cls` itself defines (not inherited), constructors and other dunders aside: what can place a
  collective."""
  return [k for k, v in vars(cls).items()
          if not (k.startswith("__") and k.endswith("__")) and (callable(v) or isinstance(v, (staticmethod,
                                                                                             classmethod, property)))]


def stated(part, name: str) -> Any:
  """The value of capability `name` (a class attribute) as `part`'s class vouches for it, or None when no class
  states it or a class below the one that states it overrides a method (see the module's docstring)."""
  cls = part if isinstance(part, type) else type(part)
  mro = cls.__mro__
  owner = next((c for c in mro if name in vars(c)), None)
  if owner is None:
    return None
  if any(_methods(c) for c in mro[:mro.index(owner)]):
    return None
  return vars(owner)[name]


def unstated_by(part, name: str) -> str:
  """Why `stated(part, name)` is None, in a few words: which class overrides which method without stating it."""
  cls = part if isinstance(part, type) else type(part)
  mro = cls.__mro__
  owner = next((c for c in mro if name in vars(c)), None)
  if owner is None:
    return f"{cls.__name__} does not state {name}"
  below = [(c.__name__, m) for c in mro[:mro.index(owner)] for m in _methods(c)]
  cls_name, method = below[0]
  return (f"{cls_name} overrides {method} but does not state {name} (inherited from {owner.__name__}, which "
          f"vouches only for its own methods)")
