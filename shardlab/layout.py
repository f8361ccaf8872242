"""The sharding rules as a value: logical dim -> mesh axes (a tuple, major to minor), one table for weights and
activations alike (jax-llm-examples' ShardingRules). It is the Hydra group `layout/` (conf/layout/default.yaml is
today's table), passed to whatever shards: parameter declarations, schedules, the data, the testing kit.

  layers    -> pipeline        the layer stack's stages
  embed     -> fsdp            every weight's d_model dim (ZeRO-3); () replicates weights (plain data parallelism)
  heads, kv_heads, mlp, vocab -> tensor   Megatron's column/row-parallel dims
  batch     -> data, fsdp, expert   activations' batch (HSDP: replicas over data, each FSDP-sharded; the
                              expert axis carries batch outside the MoE layers)
  experts   -> expert          a MoE layer's experts (expert parallelism)
  expert_mlp -> (none)         each expert's hidden width (tensor: expert tensor parallelism, docs/experts.md)
  length    -> context         every activation's sequence (and the data's)
  seq       -> tensor          the residual stream's sequence between layers, when sequence-parallel

An axis the mesh does not have drops out of every spec made here (`data` on a 2D mesh). `check` rejects a rule
that names an undeclared axis, maps a dim onto an axis whose declaration does not allow it, or maps two dims of
one array onto one axis; params.requirements derives, once, every divisibility a mesh imposes on the model and
the batch (validation, the planner and the testing kit all call it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jax.sharding import PartitionSpec as P

from shardlab import axes as X
from shardlab.errors import ConfigError

DEFAULT_RULES = {
    "layers": (X.PIPELINE,),
    "embed": (X.FSDP,),
    "heads": (X.TENSOR,),
    "kv_heads": (X.TENSOR,),
    "mlp": (X.TENSOR,),
    "vocab": (X.TENSOR,),
    "experts": (X.EXPERT,),
    "expert_mlp": (),
    "batch": (X.DATA, X.FSDP, X.EXPERT),
    "length": (X.CONTEXT,),
    "seq": (X.TENSOR,),
}
ACTIVATION_DIMS = ("batch", "length", "seq")   # the rest are weight dims

# The model setting each logical weight dim comes from (messages name it).
SETTING = {"layers": "model.n_layers", "embed": "model.d_model", "heads": "model.n_heads",
           "kv_heads": "model.n_kv_heads", "mlp": "model.d_ff", "vocab": "model.vocab_size",
           "experts": "model.n_experts", "expert_mlp": "model.expert_d_ff"}


def known_dims() -> tuple[str, ...]:
  """The logical dims a rule may name: the default table's, and any a declared mesh axis shards (axes.declare)."""
  return tuple(dict.fromkeys([*DEFAULT_RULES, *(d for a in X.REGISTRY.values() for d in a.shards)]))


def _axes(logical, v) -> tuple[str, ...]:
  """A rule's value as a tuple of mesh axis names (None: replicated; one name: that axis); anything else, or a
  logical dim no one knows (a typo would silently replicate what it meant to shard), is one line naming the key."""
  setting = f"layout.rules.{logical}={_show(v)}"
  if logical not in known_dims():
    raise ConfigError(f"{setting}: no logical dim {logical!r}; a rule names one of {', '.join(known_dims())} "
                      f"(docs/layout.md)")
  got = () if v is None else (v,) if isinstance(v, str) else tuple(v) if isinstance(v, (list, tuple)) else None
  if got is None or not all(isinstance(a, str) for a in got):
    raise ConfigError(f"{setting}: a rule maps a logical dim to a list of mesh axis names, e.g. "
                      f"layout.rules.{logical}=[{', '.join(DEFAULT_RULES.get(logical, ()))}] ([] replicates; "
                      f"declared axes: {', '.join(X.names())})")
  return got


def _show(v) -> str:
  """A rule's value as it is written on the command line: [a,b], null, 5."""
  if isinstance(v, (list, tuple)):
    return f"[{','.join(map(_show, v))}]"
  return "null" if v is None else str(v)


@dataclass(frozen=True)
class Layout:
  """{logical dim: mesh axes}, frozen (hashable: a jit static). Build with `Layout.of(dict)`."""
  items: tuple[tuple[str, tuple[str, ...]], ...] = tuple(DEFAULT_RULES.items())
  name: str = "default"

  @classmethod
  def of(cls, rules: dict | None = None, name: str = "custom") -> "Layout":
    """A layout from {logical: axis | [axes] | None}; logical dims it leaves out are replicated. A key that is no
    logical dim, or a value that is no list of axis names, is one ConfigError line (the config's `layout.rules`
    comes here first: from_config)."""
    if rules is None:
      return cls()
    return cls(tuple((k, _axes(k, v)) for k, v in rules.items()), name)

  @property
  def rules(self) -> dict[str, tuple[str, ...]]:
    return dict(self.items)

  def rule(self, logical: str, axis_names=None) -> tuple[str, ...]:
    """The mesh axes `logical` is sharded over, keeping only those in `axis_names` (the mesh's), if given."""
    got = self.rules.get(logical, ())
    return got if axis_names is None else tuple(a for a in got if a in axis_names)

  def spec(self, logical_axes, axis_names) -> P:
    """The PartitionSpec of an array whose dims are `logical_axes` (None: replicated) on a mesh of `axis_names`."""
    out = []
    for a in logical_axes:
      got = self.rule(a, axis_names) if a else ()
      out.append(None if not got else got[0] if len(got) == 1 else got)
    return P(*out)

  def batch_axes(self, axis_names) -> tuple[str, ...]:
    """The mesh axes the batch is split over: what the residual stream varies over, and what the loss and a
    replicated weight's gradient are summed over."""
    return self.rule("batch", axis_names)

  def batch_spec(self, axis_names) -> P:
    """Every array of the data (inputs, targets, positions [B, L]): B over the batch axes, L over `length`'s."""
    return self.spec(("batch", "length"), axis_names)

  def token_axes(self, axis_names) -> tuple[str, ...]:
    """The mesh axes the tokens are split over (the batch's, then the sequence's `length`): what the residual
    stream varies over, the loss is summed over, and a weight used by every token has its gradient summed over."""
    return self.batch_axes(axis_names) + self.rule("length", axis_names)

  def weight_axes(self, axis_names) -> tuple[str, ...]:
    """Mesh axes some weight dim is sharded over."""
    return tuple(dict.fromkeys(a for k, v in self.items if k not in ACTIVATION_DIMS for a in v if a in axis_names))

  def replica_axes(self, axis_names) -> tuple[str, ...]:
    """Token axes no weight is sharded over (HSDP's `data`, `context`): every weight is replicated there, and its
    gradient is all-reduced over them (after the reduce-scatter over the axes it is sharded on)."""
    w = self.weight_axes(axis_names)
    return tuple(a for a in self.token_axes(axis_names) if a not in w)

  def check(self, axis_names=None) -> None:
    """One line for a rule that names an undeclared axis, maps a dim onto an axis that may not shard it, or names
    one axis twice. `axis_names`: also check against these meshes' axes."""
    for logical, got in self.items:
      for a in got:
        if a not in X.REGISTRY:
          raise ConfigError(f"layout rule {logical} -> {a}: no mesh axis {a!r} is declared "
                            f"(declared: {', '.join(X.names())})")
        if logical not in X.get(a).shards:
          raise ConfigError(f"layout rule {logical} -> {a}: the {a} axis does not shard {logical} (it shards "
                            f"{', '.join(X.get(a).shards)}); map {logical} to one of "
                            f"{', '.join(X.sharding(logical)) or 'no axis (replicated)'}")
      if len(set(got)) < len(got):
        raise ConfigError(f"layout rule {logical} -> {', '.join(got)}: names one mesh axis twice")

  def check_array(self, name: str, logical_axes, axis_names) -> None:
    """Two dims of one array on one mesh axis: one line naming the rules and the array."""
    seen = {}
    for logical in logical_axes:
      for a in self.rule(logical, axis_names) if logical else ():
        if a in seen and seen[a] != logical:
          raise ConfigError(f"layout rules {seen[a]} -> {a} and {logical} -> {a} collide in {name} "
                            f"({' x '.join(str(l) for l in logical_axes)}): one mesh axis cannot shard two dims "
                            f"of one array; change one rule")
        seen[a] = logical


def from_config(cfg: "LayoutConfig") -> Layout:
  """The Layout of a config's `layout` group."""
  return Layout.of(dict(cfg.rules), cfg.name)


# What a rule no schedule honours yet needs (messages).
NOT_YET = {"layers": "pipeline stages need a pipeline schedule: pipeline=gpipe, 1f1b, eager_1f1b, interleaved, zb_h1, "
                     "zb_h2, zb_v, dualpipev or looped_bfs (docs/pipeline.md), or mesh.pipeline=1",
           "length": "this schedule does not split the sequence (the explicit ones do); use mesh.context=1"}


def honoured(layout: Layout, honours: dict, axis_names, who: str) -> None:
  """Each rule of `layout` on this mesh is one `who` can honour (`honours`: {logical: [allowed axis tuples]},
  data a schedule derives from its parts); one line otherwise. A logical dim missing from `honours` may be
  mapped anywhere."""
  for logical, allowed in honours.items():
    got = layout.rule(logical, axis_names)
    if got not in [tuple(a) for a in allowed]:
      show = lambda t: " x ".join(t) if t else "none (replicated)"
      hint = f": {NOT_YET[logical]}" if logical in NOT_YET and allowed == [()] else ""
      raise ConfigError(f"layout rule {logical} -> {show(got)}: {who} cannot honour it on this mesh; it takes "
                        f"{' or '.join(show(tuple(a)) for a in allowed)}{hint}")


@dataclass
class LayoutConfig:
  """The Hydra group `layout/`: {logical dim: [mesh axes]} (conf/layout/default.yaml, docs/layout.md)."""
  name: str = "default"
  rules: dict[str, Any] = field(default_factory=lambda: {k: list(v) for k, v in DEFAULT_RULES.items()})
