"""Parameters, declared once (shape, logical axes, initializer), and resolved against the sharding rules
(shardlab/layout.py: a `Layout` value, the config's `layout` group) on a mesh's axes. Change the layout to try
another sharding; no layer changes. `requirements` derives every divisibility the mesh imposes, once.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlab import axes as X
from shardlab.config import ModelConfig
from shardlab.layout import SETTING, Layout
from shardlab.errors import ConfigError

# The axes a declaration is resolved on when no mesh is named: the ones every mesh has (fsdp, tensor).
ALWAYS = tuple(n for n, a in X.REGISTRY.items() if a.always)


@dataclass(frozen=True)
class Param:
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]   # logical axis per dim
  init: str = "normal"           # normal | ones
  decay: bool = True             # AdamW weight decay (not on norm scales)
  # Replicated over `tensor` but read by tensor-parallel compute (K/V heads that tensor does not divide): each
  # tensor rank's gradient is partial, and the schedule sums it over `tensor` (the pvary in its gather).
  tensor_replicated: bool = False
  mesh_spec: tuple = ()          # the mesh axes of each dim (None, an axis, or a tuple), set by `declare`

  def spec(self) -> P:
    return P(*self.mesh_spec) if self.mesh_spec else P(*([None] * len(self.shape)))

  def mesh_axes(self) -> tuple[str, ...]:
    """Mesh axes this parameter is sharded over."""
    return tuple(a for m in self.spec() if m is not None for a in ((m,) if isinstance(m, str) else m))

  def dim_of(self, mesh_axis: str) -> int | None:
    """Index of the dim sharded over `mesh_axis`, or None."""
    for i, m in enumerate(self.spec()):
      if m == mesh_axis or (isinstance(m, tuple) and mesh_axis in m):
        return i
    return None

  def per_layer(self) -> "Param":
    """The declaration of one layer's slice of a stacked (`layers`, ...) parameter."""
    assert self.axes[0] == "layers"
    return dataclasses.replace(self, shape=self.shape[1:], axes=self.axes[1:], mesh_spec=self.mesh_spec[1:])


def kv_sharded(m: ModelConfig, tensor: int | None) -> bool:
  """K/V heads are sharded over `tensor` when its size divides them (None: assume it does)."""
  return tensor is None or m.kv_heads % tensor == 0


def _logical(m: ModelConfig, tensor: int | None) -> dict:
  """Every parameter's shape and logical axes (unresolved)."""
  D, F, H, K, V, NL = m.d_model, m.d_ff, m.n_heads, m.head_dim, m.vocab_size, m.n_layers
  if m.kind == "ffn":
    return {"layers": {"wi": Param((NL, D, F), ("layers", "embed", "mlp")),
                       "wd": Param((NL, F, D), ("layers", "mlp", "embed"))}}
  G = m.kv_heads
  mlp = {}
  if m.mlp_ff:   # the dense SwiGLU (a MoE layer's shared experts)
    mlp = {"wi": Param((NL, D, 2, m.mlp_ff), ("layers", "embed", None, "mlp")),   # SwiGLU gate and up, fused
           "wd": Param((NL, m.mlp_ff, D), ("layers", "mlp", "embed"))}
  if m.moe:      # the router and the routed experts (model.moe_mlp)
    E, FE = m.n_experts, m.expert_ff
    mlp.update(router=Param((NL, D, E), ("layers", "embed", None)),
               we_i=Param((NL, E, D, 2, FE), ("layers", "experts", "embed", None, "expert_mlp")),
               we_d=Param((NL, E, FE, D), ("layers", "experts", "expert_mlp", "embed")))
  kv = Param((NL, D, 2, G, K), ("layers", "embed", None, "kv_heads", "head_dim"))
  if not kv_sharded(m, tensor):
    kv = Param(kv.shape, ("layers", "embed", None, None, "head_dim"), tensor_replicated=True)
  return {
      "embed": Param((V, D), ("vocab", "embed")),
      "layers": {
          "attn_norm": Param((NL, D), ("layers", "embed"), "ones", decay=False),
          "wq": Param((NL, D, H, K), ("layers", "embed", "heads", "head_dim")),
          "wkv": kv,
          "wo": Param((NL, H, K, D), ("layers", "heads", "head_dim", "embed")),
          "mlp_norm": Param((NL, D), ("layers", "embed"), "ones", decay=False),
          **mlp,
      },
      "final_norm": Param((D,), ("embed",), "ones", decay=False),
      "unembed": Param((D, V), ("embed", "vocab")),
  }


def declare(m: ModelConfig, tensor: int | None = None, layout: Layout | None = None, axis_names=None) -> dict:
  """Every parameter of the model, resolved by `layout` (default: today's table) on a mesh of `axis_names`
  (default: fsdp and tensor, the axes every mesh has). W[D, 2, G, K] reads 'd_model x (k,v) x kv heads x
  head_dim'. A layout that maps two dims of one array onto one mesh axis is one ConfigError line.

  tensor: the size of the mesh's `tensor` axis. K/V heads (G = model.kv_heads) are sharded over it when it
  divides G, and replicated over it otherwise (e.g. G=1, multi-query attention, on any tensor size); None:
  sharded. Query heads always are (validation requires tensor | H).

  model.kind=ffn: the Scaling Book's blocks only, W_in[D, F] and W_out[F, D] per layer (no embeddings, norms or
  attention: analysis/planner.py counts the same 2 D F per layer)."""
  layout = layout or Layout()
  names = ALWAYS if axis_names is None else tuple(axis_names)

  def resolve(path, d):
    layout.check_array(path, d.axes, names)
    return dataclasses.replace(d, mesh_spec=tuple(layout.spec(d.axes, names)))
  return {k: resolve(k, v) if is_param(v) else {n: resolve(f"{k}/{n}", p) for n, p in v.items()}
          for k, v in _logical(m, tensor).items()}


def flat(decls) -> list[tuple[str, Param]]:
  """[('layers/wq', Param), ...]: every declaration with its path."""
  leaves = jax.tree_util.tree_flatten_with_path(decls, is_leaf=is_param)[0]
  return [("/".join(str(getattr(k, "key", k)) for k in path), d) for path, d in leaves]


def is_param(x) -> bool:
  return isinstance(x, Param)


def specs(decls) -> dict:
  return jax.tree.map(lambda d: d.spec(), decls, is_leaf=is_param)


def init(key, decls, m: ModelConfig, dtype=jnp.float32) -> dict:
  """Initial values, a pure function of `key`: the same numbers whatever the sharding (JAX's threefry is
  partitionable), so the sharded run and the reference start equal. Compiled as one program (init_sharded) and
  evaluated op by op (an eager call) they differ in the last bit: up to 7.5e-9 in a quarter of the tiny model's
  entries, XLA:CPU, 2026-11-28."""
  leaves, treedef = jax.tree.flatten(decls, is_leaf=is_param)
  out = []
  for i, d in enumerate(leaves):
    if d.init == "ones":
      out.append(jnp.ones(d.shape, dtype))
    else:
      out.append(m.init_std * jax.random.normal(jax.random.fold_in(key, i), d.shape, dtype))
  return jax.tree.unflatten(treedef, out)


def init_sharded(seed: int, decls, m: ModelConfig, mesh, dtype=jnp.float32) -> dict:
  """Parameters created directly in their shards (no device ever holds the full model)."""
  from shardlab.mesh import compile_helper
  shardings = jax.tree.map(lambda d: NamedSharding(mesh, d.spec()), decls, is_leaf=is_param)
  fn = jax.jit(lambda: init(jax.random.key(seed), decls, m, dtype), out_shardings=shardings)
  return compile_helper(fn, platform=mesh.devices.flat[0].platform)()


def count(decls) -> int:
  return sum(math.prod(d.shape) for d in jax.tree.leaves(decls, is_leaf=is_param))


def count_active(m: ModelConfig) -> int:
  """Parameters one token computes with: all of them, less a MoE layer's experts it is not routed to
  (n_experts - top_k of them per layer): what 6 N tokens counts for a MoE model's FLOPs."""
  idle = m.n_layers * (m.n_experts - m.top_k) * 3 * m.d_model * m.expert_ff if m.moe else 0
  return count(declare(m)) - idle


class Need(NamedTuple):
  """One divisibility a mesh imposes: `setting`=`value` must be a multiple of the product of `axes`' sizes."""
  setting: str
  value: int
  axes: tuple[str, ...]
  size: int
  why: str

  def by(self) -> str:
    return " * ".join(f"mesh.{a}" if a in X.REGISTRY else a for a in self.axes)

  def message(self) -> str:
    return (f"{self.setting}={self.value} is not divisible by {self.by()}={self.size} ({self.why}); "
            f"choose {self.setting.split('.')[-1]} a multiple of {self.size} or change {self.by()}")


def requirements(model, layout: Layout, shape: dict, batch_size: int | None = None, microbatches: int = 1,
                 seq_parallel: bool = False, seq_halves: bool = False,
                 microbatch_setting: str = "schedule.microbatches") -> list[Need]:
  """Every divisibility of the model's dims and the batch by the axes they are sharded over on a mesh of
  `shape` ({axis: size}): weights from the declarations (params.declare x layout), the batch over its axes (and
  its microbatches), the sequence over `length`'s axes and, when sequence-parallel, `seq`'s too (twice over
  for a bidirectional ring, which splits each block in halves)."""
  names = tuple(shape)
  size = lambda axs: math.prod(shape[a] for a in axs)
  out, seen = [], set()
  decls = declare(model, shape.get(X.TENSOR), layout, names)
  for path, d in flat(decls):
    for dim, logical in enumerate(d.axes):
      axs = layout.rule(logical, names) if logical else ()
      if not axs or (logical, axs) in seen:
        continue
      seen.add((logical, axs))
      out.append(Need(SETTING.get(logical, f"{path} dim {dim}"), d.shape[dim], axs, size(axs),
                      f"layout rule {logical} -> {' x '.join(axs)}: {path} dim {dim}"))
  if batch_size is not None:
    axs = layout.batch_axes(names)
    out.append(Need("train.batch_size", batch_size, axs, size(axs), f"layout rule batch -> {' x '.join(axs)}"))
    if microbatches > 1:
      out.append(Need("train.batch_size", batch_size, axs + (microbatch_setting,), size(axs) * microbatches,
                      "each device splits its batch into microbatches"))
  length = layout.rule("length", names)
  if length:
    out.append(Need("model.seq_len", model.seq_len, length, size(length),
                    f"layout rule length -> {' x '.join(length)}: every activation's sequence"))
  if seq_parallel:
    axs = length + layout.rule("seq", names)
    k = 2 if seq_halves else 1
    out.append(Need("model.seq_len", model.seq_len, axs + (("2",) if seq_halves else ()), size(axs) * k,
                    "the bidirectional ring splits each sequence block in halves" if seq_halves else
                    "sequence parallelism shards it over " + " x ".join(axs)))
  return out


def problems(*args, **kw) -> list[Need]:
  """The requirements (see `requirements`) a configuration does not meet."""
  return [n for n in requirements(*args, **kw) if n.size > 0 and n.value % n.size]


def check_divisible(*args, **kw) -> None:
  """The first unmet requirement -> one-line ConfigError naming the rule, the dim and the fix."""
  bad = problems(*args, **kw)
  if bad:
    raise ConfigError(bad[0].message())


