"""The mesh axes, each declared once, in one ordered registry, outer (slowest links) to inner.

  pipeline  the `layers` dim: stages of the layer stack (across nodes on multi-node clusters)
  data      the batch only; weights replicated (HSDP's replica groups, usually across nodes); a MoE layer's
            experts may split over it and `expert` both (expert=hierarchical: across nodes, then inside)
  fsdp      the batch and every weight's `embed` dim (ZeRO-3)
  expert    a MoE layer's experts (expert parallelism); the batch everywhere else, like a data axis
  context   the sequence of every activation (context parallelism, long sequences)
  tensor    heads, d_ff and vocab (Megatron TP); the residual stream's sequence when sequence-parallel

An `Axis` says what a layout rule may map onto it (`shards`: logical dims), which link it rides when the mesh
is larger than the fast domain (`link`), and what an array replicated over it needs in backward (`replicated`:
its gradient summed over the axis). A mesh holds `fsdp` and `tensor` always (`always`), and every other axis
whose size is > 1, in registry order. Everything else (mesh construction, labels, validation, the divisibility
rules, the analysis) iterates over these declarations; nothing else writes an axis name as a literal.
`declare(Axis(...), before=...)` adds one (tests/test_axes.py declares a toy axis in the test file alone).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Axis:
  name: str
  shards: tuple[str, ...]     # logical dims a layout rule may map onto this axis (layout.Layout checks it)
  link: str = "fast"          # fast: inner, inside the fast domain first; slow: outer, across nodes / slices first
  replicated: str = "sum"     # an array replicated over the axis but used by per-device compute: its gradient
                              # is summed over the axis (the transpose of a pvary)
  always: bool = False        # present in every mesh, size 1 included (2D configs and names stay as they are)
  short: str = ""             # one letter for labels that name their axes ("p2xf2xt2")
  doc: str = ""


PIPELINE, DATA, FSDP, EXPERT, CONTEXT, TENSOR = "pipeline", "data", "fsdp", "expert", "context", "tensor"

REGISTRY: dict[str, Axis] = {}


def declare(axis: Axis, before: str | None = None) -> Axis:
  """Add `axis` to the registry, innermost (or just outside `before`). Declaring the same axis again is harmless;
  a different axis under a known name is an error."""
  if axis.name in REGISTRY:
    if REGISTRY[axis.name] != axis:
      raise ValueError(f"mesh axis {axis.name!r} is already declared differently")
    return axis
  items = list(REGISTRY.items())
  at = len(items) if before is None else [n for n, _ in items].index(before)
  items.insert(at, (axis.name, axis))
  REGISTRY.clear()
  REGISTRY.update(items)
  return axis


for _axis in (
    Axis(PIPELINE, ("layers",), link="slow", short="p", doc="pipeline stages (the layers dim)"),
    Axis(DATA, ("batch", "experts"), link="slow", short="d",
         doc="HSDP replicas: the batch, weights replicated (a MoE layer's experts too, with expert=hierarchical)"),
    Axis(FSDP, ("batch", "embed"), always=True, short="f", doc="batch and every weight's embed dim (ZeRO-3)"),
    Axis(EXPERT, ("batch", "experts"), short="e",
         doc="a MoE layer's experts; outside the MoE layers the batch (its gradients summed over it)"),
    Axis(CONTEXT, ("length", "embed"), short="c", doc="the sequence of every activation"),
    Axis(TENSOR, ("heads", "kv_heads", "mlp", "vocab", "seq", "expert_mlp"), always=True, short="t",
         doc="heads, d_ff, vocab; the residual stream's sequence when sequence-parallel"),
):
  declare(_axis)

CLASSIC = (DATA, FSDP, TENSOR)   # meshes of only these are labelled by sizes alone ('4x2', '2x2x2')


def names() -> tuple[str, ...]:
  """Every declared axis, outer to inner."""
  return tuple(REGISTRY)


def get(name: str) -> Axis:
  if name not in REGISTRY:
    raise KeyError(f"mesh axis {name!r}: not declared; declared: {', '.join(REGISTRY)}")
  return REGISTRY[name]


def shape_of(sizes: dict[str, int]) -> dict[str, int]:
  """{axis: size} of the mesh these sizes make, outer to inner: the `always` axes, and the others when > 1.
  An undeclared name raises KeyError."""
  for a in sizes:
    get(a)
  return {a: int(sizes.get(a, 1)) for a, ax in REGISTRY.items() if ax.always or sizes.get(a, 1) != 1}


def describe(shape: dict) -> str:
  """{data: 2, fsdp: 2, tensor: 2} -> 'mesh.data=2 x mesh.fsdp=2 x mesh.tensor=2' (messages)."""
  return " x ".join(f"mesh.{a}={n}" for a, n in shape.items())


def label(shape: dict) -> str:
  """The mesh's name in run directories and reports: sizes alone ('4x2' fsdp x tensor, '2x2x2' data x fsdp x
  tensor) when it has only those axes; otherwise every axis with its letter, outer to inner ('p2xf2xt2')."""
  if all(a in CLASSIC for a in shape):
    return "x".join(str(n) for n in shape.values())
  return "x".join(f"{get(a).short or a}{n}" for a, n in shape.items())


def parse_label(text: str) -> dict[str, int]:
  """label's inverse: '4x2' -> {fsdp: 4, tensor: 2}; '2x2x2' -> data x fsdp x tensor; 'p2xf2xt2' -> named."""
  parts = text.lower().split("x")
  if all(p.isdigit() for p in parts):
    if len(parts) not in (2, 3):
      raise ValueError(f"mesh {text!r}: sizes alone name fsdp x tensor (FxT) or data x fsdp x tensor (DxFxT); "
                       f"name other axes by letter ({', '.join(f'{a.short}=' + n for n, a in REGISTRY.items())})")
    return dict(zip(CLASSIC[3 - len(parts):], map(int, parts)))
  letters = {a.short: n for n, a in REGISTRY.items() if a.short}
  out = {}
  for p in parts:
    letter, size = p[:1], p[1:]
    if letter not in letters or not size.isdigit():
      raise ValueError(f"mesh {text!r}: {p!r} is not an axis letter and a size (letters: "
                       f"{', '.join(f'{k}={v}' for k, v in letters.items())})")
    out[letters[letter]] = int(size)
  return shape_of(out)


def n_devices(shape: dict) -> int:
  return math.prod(shape.values())


def sharding(logical: str) -> tuple[str, ...]:
  """The declared axes that may shard the logical dim `logical`, outer to inner."""
  return tuple(n for n, a in REGISTRY.items() if logical in a.shards)


# ---- `python -m shardlab.axes`: the axis-name literals in the package ----

ALLOWED = ("axes.py", "collectives.py", "schedules/")   # where axis names may be written out


def literals(root=None) -> list[tuple[str, int, str]]:
  """[(file, line, name)]: every string constant in the package equal to a declared axis name, outside the axis
  declarations, collectives.py and schedules/ (a docstring or message that mentions one is not a literal)."""
  import ast
  import pathlib
  root = pathlib.Path(root or pathlib.Path(__file__).resolve().parent)
  out = []
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    if rel.startswith(ALLOWED[-1]) or rel in ALLOWED:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in REGISTRY:
        out.append((rel, node.lineno, node.value))
  return out


if __name__ == "__main__":
  found = literals()
  for rel, line, name in found:
    print(f"shardlab/{rel}:{line}: {name!r}")
  print(f"{len(found)} axis-name literals outside {', '.join(ALLOWED)}")
  raise SystemExit(1 if found else 0)
