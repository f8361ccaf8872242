"""Parameters, declared once (shape, logical axes, initializer), and the one table that maps logical axes to
mesh axes. Change `LAYOUT` to try another sharding; no layer changes. A schedule checks the rules it can honour
before compiling (schedules/explicit.py: HONOURS; e.g. `LAYOUT["embed"] = None` replicates every weight over
`fsdp`, plain data parallelism, and still trains as the reference) and rejects the others with one line.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlab.config import ModelConfig
from shardlab.mesh import DATA, FSDP, TENSOR

# logical axis -> mesh axis (or a tuple of them, major to minor). `layers` (the scan dimension) and `head_dim` are
# never sharded. An axis the mesh does not have (`data` on a 2D mesh) drops out of every spec made here.
LAYOUT = {
    "embed": FSDP,    # every weight's d_model dim: FSDP (ZeRO-3) shards all parameter state over `fsdp`
    "heads": TENSOR,  # attention heads: column-parallel QKV, row-parallel output projection
    "kv_heads": TENSOR,  # key/value heads when mesh.tensor divides them (else declared replicated: see declare)
    "mlp": TENSOR,    # d_ff: column-parallel gate/up, row-parallel down
    "vocab": TENSOR,  # vocabulary-parallel embedding, unembedding and cross-entropy
    "batch": (DATA, FSDP),  # activations: the batch (over data x fsdp: HSDP replicas, each FSDP-sharded)
    "seq": TENSOR,    # activations: the sequence, between layers, when the TP contraction is sequence-parallel
}


@dataclass(frozen=True)
class Param:
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]   # logical axis per dim
  init: str = "normal"           # normal | ones
  decay: bool = True             # AdamW weight decay (not on norm scales)
  # Replicated over `tensor` but read by tensor-parallel compute (K/V heads that tensor does not divide): each
  # tensor rank's gradient is partial, and the schedule sums it over `tensor` (the pvary in its gather).
  tensor_replicated: bool = False

  def spec(self) -> P:
    return P(*(LAYOUT.get(a) if a else None for a in self.axes))

  def mesh_axes(self) -> tuple[str, ...]:
    """Mesh axes this parameter is sharded over."""
    return tuple(m for m in self.spec() if m is not None)

  def dim_of(self, mesh_axis: str) -> int | None:
    """Index of the dim sharded over `mesh_axis`, or None."""
    s = tuple(self.spec())
    return s.index(mesh_axis) if mesh_axis in s else None

  def per_layer(self) -> "Param":
    """The declaration of one layer's slice of a stacked (`layers`, ...) parameter."""
    assert self.axes[0] == "layers"
    return dataclasses.replace(self, shape=self.shape[1:], axes=self.axes[1:])


def rule(logical: str, axis_names) -> tuple[str, ...]:
  """The mesh axes LAYOUT maps `logical` to, as a tuple, keeping only those in `axis_names` (the mesh's)."""
  got = LAYOUT.get(logical)
  got = () if got is None else (got,) if isinstance(got, str) else tuple(got)
  return tuple(a for a in got if a in axis_names)


def batch_axes(axis_names) -> tuple[str, ...]:
  """The mesh axes the batch is split over (LAYOUT['batch'] on this mesh): what the residual stream varies
  over, and what the loss and a replicated weight's gradient are summed over."""
  return rule("batch", axis_names)


def batch_spec(axis_names) -> P:
  """tokens[B, L] on this mesh: B split over the batch axes."""
  axes = batch_axes(axis_names)
  return P(None if not axes else axes[0] if len(axes) == 1 else axes)


def replica_axes(axis_names) -> tuple[str, ...]:
  """Batch axes no weight is sharded over (HSDP's `data`): every weight is replicated there, and its gradient is
  all-reduced over them (after the reduce-scatter over the axes it is sharded on)."""
  weight_axes = {a for k, v in LAYOUT.items() if k not in ("batch", "seq") for a in rule(k, axis_names)}
  return tuple(a for a in batch_axes(axis_names) if a not in weight_axes)


def kv_sharded(m: ModelConfig, tensor: int | None) -> bool:
  """K/V heads are sharded over `tensor` when its size divides them (None: assume it does)."""
  return tensor is None or m.kv_heads % tensor == 0


def declare(m: ModelConfig, tensor: int | None = None) -> dict:
  """Every parameter of the model: W[D, 2, G, K] reads 'd_model x (k,v) x kv heads x head_dim'.

  tensor: the size of the mesh's `tensor` axis. K/V heads (G = model.kv_heads) are sharded over it when it
  divides G, and replicated over it otherwise (e.g. G=1, multi-query attention, on any tensor size); None:
  sharded. Query heads always are (validation requires tensor | H).

  model.kind=ffn: the Scaling Book's blocks only, W_in[D, F] and W_out[F, D] per layer (no embeddings, norms or
  attention: analysis/planner.py counts the same 2 D F per layer)."""
  D, F, H, K, V, NL = m.d_model, m.d_ff, m.n_heads, m.head_dim, m.vocab_size, m.n_layers
  if m.kind == "ffn":
    return {"layers": {"wi": Param((NL, D, F), ("layers", "embed", "mlp")),
                       "wd": Param((NL, F, D), ("layers", "mlp", "embed"))}}
  G = m.kv_heads
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
          "wi": Param((NL, D, 2, F), ("layers", "embed", None, "mlp")),   # SwiGLU gate and up, fused
          "wd": Param((NL, F, D), ("layers", "mlp", "embed")),
      },
      "final_norm": Param((D,), ("embed",), "ones", decay=False),
      "unembed": Param((D, V), ("embed", "vocab")),
  }


def is_param(x) -> bool:
  return isinstance(x, Param)


def specs(decls) -> dict:
  return jax.tree.map(lambda d: d.spec(), decls, is_leaf=is_param)


def init(key, decls, m: ModelConfig, dtype=jnp.float32) -> dict:
  """Initial values, a pure function of `key`: the same numbers whatever the sharding (JAX's threefry is
  partitionable), so the sharded run and the reference start equal."""
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
  shardings = jax.tree.map(lambda d: NamedSharding(mesh, d.spec()), decls, is_leaf=is_param)
  return jax.jit(lambda: init(jax.random.key(seed), decls, m, dtype), out_shardings=shardings)()


def count(decls) -> int:
  import math
  return sum(math.prod(d.shape) for d in jax.tree.leaves(decls, is_leaf=is_param))
