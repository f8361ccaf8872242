"""Context parallelism: the sequence of every activation split over the `context` mesh axis (the layout rule
`length -> context`), and attention across the split. Outside attention the axis is one more batch axis: the MLP
and norms see local tokens, the loss sums over it, and a weight replicated over it has its gradient summed over
it (the schedule's gather marks the fsdp shard varying there, as for HSDP's replicas).

A strategy is the model's attention hook, `attend(q, k, v, positions)` (schedules/parallel.py), picked by the
Hydra group `context/` (`context.impl`: a name in STRATEGIES or `package.module:Class`):

  all_gather  K and V (and their positions) all-gathered over `context`; each device's queries attend to the
              whole sequence's keys with the causal mask built from the positions (the data's: right however
              the tokens are placed). Backward (AD): the transpose of the gather, dK and dV reduce-scattered
              over `context`. Bytes per device per layer: (C-1)/C of the gathered K/V forward, the same backward;
              GQA moves only its G K/V heads. The attention is the plain one (scores [B, H, L/C, L]).
  ring        ring attention: K/V blocks rotated by ppermute, an online softmax over them, a custom VJP that
              rotates K/V again with dK/dV (no other device's K/V kept). Each step attends its block with a flash
              kernel (context.kernel: shardlab's Pallas kernels, flash_kernel.py, in a program lowered for a GPU
              or a TPU; elsewhere pure JAX in sub-blocks, scores of [B, H, n, n] at most) that skips the block pairs the
              causal mask hides wholly, so a causal ring step costs what its visible keys cost: the
              busiest device of a contiguous ring does C - 1/2 blocks, every device of a zigzag one (C+1)/2 or
              less (ring_plan). Bytes per device per layer: (C-1) blocks of K and V forward, the same and C blocks
              of dK and dV backward; each step's K/V shift depends only on the block that step reads, and a
              backward step sends the next K/V block and the dK/dV of the block held before in one collective
              (added by its next holder after its own compute), so a GPU can run every shift behind a step's
              attention with one collective in flight; the ring asks for two on a GPU target (compiler_options),
              so that another collective of the backward does not take the last shift's slot (the H100 target's
              overlap report says which shifts were hidden: `ring_steps`).
  ulysses     DeepSpeed-Ulysses: Q, K and V all-to-all'd from sequence-sharded to head-sharded ([B, L/C, H, K]
              -> [B, L, H/C, K]), attention over the whole sequence on H/C heads (the model's own kernel:
              plain, blockwise or cuDNN's), the output all-to-all'd back. Backward (AD): the same all-to-alls the
              other way. Bytes per device per layer: (C-1)/C of q, k, v and o each way; needs the heads after
              tensor parallelism (query and K/V) divisible by C.
  usp         Ulysses x ring (USP): Ulysses' all-to-alls among U consecutive context ranks (context.ulysses), the
              ring over the C/U groups on the group's U chunks and H/U heads. Bytes: Ulysses' over U, the ring's
              over C/U on blocks of b (L U/C) (G/U) K.
  a2a_p2p     TransformerEngine's hierarchical form (all-to-all inside a node, the ring across nodes): usp with
              the Ulysses group the context ranks of one node (context.node_devices: hardware.domain_devices).

With no `context` axis in the mesh a strategy is the model's own attention (model.attention).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from shardlab import attention as A
from shardlab import collectives as C
from shardlab import flash_kernel as F
from shardlab.config import ContextConfig, ModelConfig
from shardlab.layout import Layout
from shardlab.errors import ConfigError
from shardlab.loading import load_object

SEQ_DIM = 1   # q, k, v are [B, L, heads, K]
GPU_OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"   # async collectives in flight at once


class AllGatherKV:
  """K/V all-gathered over the context axes; local queries, the causal mask from positions."""
  point_to_point = False   # all-gathers over context (what a pipeline asks: schedules/capability.py)

  def __init__(self, model: ModelConfig, layout: Layout, cfg: ContextConfig | None = None):
    self.model, self.layout, self.cfg = model, layout, cfg or ContextConfig()

  def compiler_options(self, platform: str, shape: dict) -> dict:
    """The XLA options this strategy's program asks for when compiled for `platform` ("cuda", "tpu", "cpu") on a
    mesh of `shape`, where the sequence is split (Composition.compiler_options; the run's xla.flags win over
    them): none."""
    return {}

  def parts(self, shape: dict) -> int:
    """How many pieces the sequence is split into on a mesh of `shape`."""
    return math.prod(shape[a] for a in self.layout.rule("length", tuple(shape)))

  def check_balance(self, shape: dict) -> None:
    """With load balancing, a sequence that cuts into 2 C chunks."""
    c = self.parts(shape)
    if self.cfg.placement == "zigzag" and c > 1 and self.model.seq_len % (2 * c):
      raise ConfigError(f"model.seq_len={self.model.seq_len} is not divisible by 2 * mesh.context={2 * c} "
                        f"(context.load_balance=true cuts each sequence into 2 C chunks); choose seq_len a multiple "
                        f"of {2 * c} or context.load_balance=false")

  def check(self, shape: dict) -> None:
    """What this strategy needs on a mesh of `shape` with a `length` rule: a sequence load balancing can cut
    into 2 C chunks, and the plain attention (a general mask)."""
    self.check_balance(shape)
    if self.layout.rule("length", tuple(shape)) and self.model.attention != "plain":
      raise ConfigError(f"model.attention={self.model.attention}: context=all_gather runs the plain attention "
                        f"(a causal mask from the tokens' positions); set model.attention=plain or mesh.context=1")

  def heads_per_device(self, shape: dict) -> tuple[int, int, int, int]:
    """(context split c, tensor split t, query heads, K/V heads per device after tensor parallelism; 0 where the
    K/V heads are replicated over tensor, which a head split cannot split) on a mesh of `shape`."""
    c = math.prod(shape[a] for a in self.layout.rule("length", tuple(shape)))
    t = math.prod(shape[a] for a in self.layout.rule("heads", tuple(shape)))
    m = self.model
    return c, t, m.n_heads // t, m.kv_heads // t if m.kv_heads % t == 0 else 0

  def context_axis(self):
    """The mesh axes the sequence is split over on the mesh being traced (a name, or a tuple), None if none."""
    axes = self.layout.rule("length", jax.sharding.get_abstract_mesh().axis_names)
    return None if not axes else axes[0] if len(axes) == 1 else axes

  def own(self, q_BLHK, k_BLGK, v_BLGK):
    """The model's own attention (model.attention) over the sequence it is given, causal in index order."""
    return A.attend(self.model.attention, q_BLHK, k_BLGK, v_BLGK, self.model.attention_block)

  def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_L):
    axis = self.context_axis()
    if axis is None:
      return self.own(q_BLHK, k_BLGK, v_BLGK)
    # k[B, L_ctx, G, K] -> k[B, L, G, K]; backward: dK[B, L, G, K]{U_ctx} -> dK[B, L_ctx, G, K] (reduce-scatter)
    k_BMGK = C.all_gather(k_BLGK, axis, SEQ_DIM, name="cp_kv_all_gather")
    v_BMGK = C.all_gather(v_BLGK, axis, SEQ_DIM, name="cp_kv_all_gather")
    pos_M = C.all_gather(positions_L, axis, 0, name="cp_positions")     # ints: no gradient
    causal_LM = positions_L[:, None] >= pos_M[None, :]
    return checkpoint_name(A.plain(q_BLHK, k_BMGK, v_BMGK, causal_LM), A.ATTN_OUT)

  # Its cost terms, which the analysis evaluates (analysis/context_cost.py, memory_model.py): a strategy is priced
  # by what its class says, so a subclass, or a strategy of a user's, is priced like the one it copies. `a` is one
  # layer's attention on one device (context_cost.Attn: b sequences, L tokens split C ways, H and G heads, head
  # dim K, e bytes; a.block = b L/C G K elements of one K or V block); `cost` evaluates rates (context_cost.Rates).

  def bytes_per_layer(self, a) -> dict:
    """Bytes one device sends over the context axes per layer: K and V gathered, (C-1)/C x 2 b L G K e, forward;
    the same reduce-scattered backward."""
    f = (a.C - 1) * 2 * a.b * a.L * a.G * a.K * a.e // a.C
    return {"forward": f, "backward": f}

  def skips_masked(self) -> bool:
    """Whether its attention kernel skips the blocks the causal mask hides: the plain attention computes them."""
    return False

  def pallas_on(self, a) -> tuple:
    """The platforms on which its attention kernel is shardlab's Pallas kernel (context_cost.pallas_on: priced at
    the preset's flash_kernel_efficiency there): none, the plain attention against the gathered keys."""
    return ()

  def layer_time(self, a, cost) -> dict:
    """Each device's queries against every key (the busiest device paces the layer); K/V gathered before and
    dK/dV scattered after the attention: exposed."""
    fwd, bwd = cost.block_s
    comm = 2 * cost.transfer(self.bytes_per_layer(a)["forward"], hops=a.C // 2)
    return {"attention_s": cost.busiest() * (fwd + bwd), "comm_s": comm, "exposed_s": comm}

  def transient_bytes(self, a) -> float:
    """Float32 scores and probabilities one layer holds while it runs: [b, H, L/C, L] (the plain attention)."""
    return 2 * 4.0 * a.b * a.H * (a.L // a.C) * a.L

  def kept_attention(self) -> str:
    """The attention whose residuals a layer keeps (memory_model.activation_elements_per_token)."""
    return self.model.attention

  def kept_per_token(self, remat: str) -> int:
    """Elements per local token per layer it keeps beyond the remat policy's set."""
    return 0

  def why_not(self, shape: dict) -> str | None:
    """What this strategy itself refuses on a mesh of `shape` (the planner's `excluded`), or None: its own `check`,
    so that the planner never prices what the run would refuse (all_gather with an attention other than the plain
    one, say). (The sequence's own divisibility is the analysis's too: context_cost.why_not.)"""
    try:
      self.check(shape)
    except ConfigError as e:
      return str(e)
    return None


class Ulysses(AllGatherKV):
  """Sequence-sharded <-> head-sharded by all_to_all around the model's own attention."""
  point_to_point = False   # all-to-alls over context

  def _split_heads(self, shape: dict) -> tuple[int, int] | None:
    """(context split c, tensor split t) when the heads each device holds after tensor parallelism, query and
    K/V, do not split again c ways; else None."""
    c, t, h, g = self.heads_per_device(shape)
    return (c, t) if c > 1 and (h % c or not g or g % c) else None

  def why_not(self, shape: dict) -> str | None:
    split = self._split_heads(shape)
    if split is None:
      return None
    c, t = split
    return (f"ulysses splits the heads: {self.model.n_heads // t} query and {self.model.kv_heads // t} K/V heads "
            f"per device do not divide by {c}")

  def check(self, shape: dict) -> None:
    """The heads each device holds after tensor parallelism, query and K/V, split again over the context axes."""
    if not self.layout.rule("length", tuple(shape)):
      return
    m = self.model
    self.check_balance(shape)
    split = self._split_heads(shape)
    if split is not None:
      c, t = split
      raise ConfigError(f"context=ulysses splits the heads over the context axes: model.n_heads={m.n_heads} and "
                        f"model.n_kv_heads={m.kv_heads} over tensor={t} leave {m.n_heads // t} and "
                        f"{m.kv_heads // t if m.kv_heads % t == 0 else 'replicated'} per device, not multiples of "
                        f"context={c}; use context=all_gather or a smaller mesh.context")

  def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_L):
    axis = self.context_axis()
    if axis is None:
      return self.own(q_BLHK, k_BLGK, v_BLGK)
    # x[B, L_ctx, N, K] -> x[B, L, N_ctx, K]; backward: the all_to_all back
    heads = lambda x: C.all_to_all(x, axis, 2, SEQ_DIM, name="cp_ulysses")
    q, k, v = heads(q_BLHK), heads(k_BLGK), heads(v_BLGK)
    if self.model.attention == "plain":     # the causal mask from the gathered positions
      pos_M = C.all_gather(positions_L, axis, 0, name="cp_positions")
      o = checkpoint_name(A.plain(q, k, v, pos_M[:, None] >= pos_M[None, :]), A.ATTN_OUT)
    elif self.cfg.balanced:   # the whole sequence in the data's order (zigzag, striped): back to index order for
      order = self.cfg.order(q.shape[SEQ_DIM], q.shape[SEQ_DIM] // q_BLHK.shape[SEQ_DIM])  # the kernel, and back
      back = np.argsort(order)
      o = jnp.take(self.own(*(jnp.take(x, back, axis=SEQ_DIM) for x in (q, k, v))), order, axis=SEQ_DIM)
    else:   # the whole sequence, in index order: the kernel's own causal mask
      o = self.own(q, k, v)
    return C.all_to_all(o, axis, SEQ_DIM, 2, name="cp_ulysses")   # o[B, L, H_ctx, K] -> o[B, L_ctx, H, K]

  def bytes_per_layer(self, a) -> dict:
    """q, k, v to head-sharded and o back: (C-1)/C x b (L/C) (2 H + 2 G) K e, forward; the same backward."""
    f = (a.C - 1) * a.b * (a.L // a.C) * (2 * a.H + 2 * a.G) * a.K * a.e // a.C
    return {"forward": f, "backward": f}

  def skips_masked(self) -> bool:
    """The model's own kernel: it skips masked blocks unless it is the plain one."""
    return self.model.attention != "plain"

  def pallas_on(self, a) -> tuple:
    """The model's own kernel over the whole sequence: shardlab's Pallas kernel where it is blockwise."""
    return F.platforms(a.L, a.L, a.K) if self.model.attention == "blockwise" else ()

  def layer_time(self, a, cost) -> dict:
    """Every device the whole sequence on H/C heads (balanced in any order); the four all-to-alls (q, k, v, o)
    each way on the critical path."""
    fwd, bwd = cost.block_s
    comm = 2 * 4 * cost.transfer(self.bytes_per_layer(a)["forward"] / 4, hops=a.C // 2)
    return {"attention_s": a.C * (0.5 if cost.skips else 1.0) * (fwd + bwd), "comm_s": comm, "exposed_s": comm}

  def transient_bytes(self, a) -> float:
    """The plain kernel's scores [b, H/C, L, L] (float32, with the probabilities); none for a flash kernel."""
    return super().transient_bytes(a) if self.model.attention == "plain" else 0.0

  def kept_per_token(self, remat: str) -> int:
    """Under a policy that saves the attention output, the kernel's own output in its head-sharded layout ([B, L,
    H/C, K]: D per local token) beside the sequence-sharded one the all-to-all returns (the H100 compiler's buffers
    for llama3_8b at 32K tokens, context 4: experiments/context/README.md)."""
    return self.model.d_model if remat in ("save_qkv_attn_out", "save_matmuls_attn_out") else 0


class Ring(AllGatherKV):
  """Ring attention (Liu et al. 2023, haoliuhl/ringattention): K/V blocks rotated around the context axis by
  ppermute, each combined into an online softmax as it arrives; a custom VJP whose backward rotates the K/V
  blocks again with their dK/dV, so no device keeps another device's K/V as a residual (only its q, k, v, the
  output and the log-sum-exp). Inside a ring step the block is attended in sub-blocks of n tokens (a flash
  kernel: no score larger than [B, H, n, n] is held), and a sub-block pair whose keys all follow its queries
  is skipped (`ring_plan`), so a causal step costs what its visible keys cost."""
  point_to_point = True    # K/V rotated by ppermute

  def ring_size(self, shape: dict) -> int:
    """The ranks a K/V block visits on a mesh of `shape`: the context split."""
    return self.parts(shape)

  def compiler_options(self, platform: str, shape: dict) -> dict:
    """On a GPU, where the ring has two ranks or more, two collectives in flight (XLA's default is one): the
    ring's shifts then run beside the other collectives the layer's backward issues instead of queueing behind
    them, as TransformerEngine's ring runs its sends on a stream of their own (`cp_stream`). At one in flight the
    compiler put the weights' gradient all-reduce over context, not the ring's last dK/dV shift, behind the last
    backward step (llama3_8b, 2 layers, 64K tokens on 8 H100s: 15 of 16 shifts hidden, 16 of 16 at two; the
    predicted step the same, 0.228 s: experiments/context/ring.md)."""
    return {GPU_OVERLAP_LIMIT: 2} if platform == "cuda" and self.ring_size(shape) > 1 else {}

  def check(self, shape: dict) -> None:
    self.check_balance(shape)
    axes = self.layout.rule("length", tuple(shape))
    if len(axes) > 1:
      raise ConfigError(f"layout rule length -> {' x '.join(axes)}: context=ring rotates over one mesh axis")

  def step_tokens(self, seq_len: int, shape: dict) -> int:
    """The tokens of each ring step's block (the `local` its kernel runs on) for a sequence of `seq_len` on a mesh
    of `shape`: seq_len / C."""
    return seq_len // self.heads_per_device(shape)[0]

  def kernel(self, local: int, head_dim: int) -> tuple:
    """The platforms on which this run's ring steps are the fused Pallas kernels (flash_kernel.on_platforms):
    `auto`, a GPU (Triton) and a TPU (Mosaic) target where the kernel's tiles fit these shapes; `pallas`, those and
    every other platform (this CPU: Triton's kernels by the interpreter); `jax`, none (the pure-JAX ring)."""
    kernel = getattr(self.cfg, "kernel", "auto")
    if kernel == "jax":
      return ()
    return F.platforms(local, local, head_dim) + (("default",) if kernel == "pallas" else ())

  def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_L):
    axis = self.context_axis()
    if axis is None:
      return self.own(q_BLHK, k_BLGK, v_BLGK)
    parts = C.axis_size(axis)
    return self.ring(q_BLHK, k_BLGK, v_BLGK, positions_L, axis, self.cfg.order(q_BLHK.shape[SEQ_DIM] * parts, parts))

  def ring(self, q_BLHK, k_BLGK, v_BLGK, positions_L, axis, order):
    """The ring over `axis` (a mesh axis, or a collectives.Group of one: USP's), each rank holding the tokens of
    its row of `order` (the data's positions, a row per ring rank; None: contiguous chunks)."""
    local = q_BLHK.shape[SEQ_DIM]
    parts = C.axis_size(axis)
    plan = ring_plan(parts, local, self.model.attention_block, order)
    kernel = self.kernel(local, q_BLHK.shape[-1])
    if kernel:           # per step, the block pairs each kernel visits on the busiest device
      plan = (*plan, tuple((name, kernel_pairs(parts, local, order, *F.KERNELS[name][2])) for name in F.KERNELS))
    return checkpoint_name(ring_attention(q_BLHK, k_BLGK, v_BLGK, positions_L, axis, plan, kernel), A.ATTN_OUT)

  def bytes_per_layer(self, a) -> dict:
    """C-1 shifts of the K, V block, (C-1) x 2 b (L/C) G K e, forward; backward the same and C shifts of dK, dV:
    C-1 in float32 (the custom VJP accumulates them in float32), + (C-1) x 2 b (L/C) G K 4, the last home in K's
    dtype, + 2 b (L/C) G K e."""
    f = (a.C - 1) * 2 * a.block * a.e
    return {"forward": f, "backward": f + (a.C - 1) * 2 * a.block * 4 + 2 * a.block * a.e}

  def skips_masked(self) -> bool:
    """A flash kernel per step that skips the sub-block pairs the mask hides wholly (ring_plan)."""
    return True

  def pallas_on(self, a) -> tuple:
    """The ring steps' kernel (Ring.kernel) on the local L/C tokens."""
    return self.kernel(a.L // a.C, a.K)

  def layer_time(self, a, cost) -> dict:
    """A ring pass forward and one backward at the busiest device's pace (context_cost.ring_makespan): each step
    a block's attention and its online-softmax merge, each shift behind the step before; dK, dV's last shift
    home after the backward."""
    fwd, bwd = cost.block_s
    bw = cost.ring_bandwidth()                                   # across nodes: one NIC per crossing hop
    kv = cost.transfer(2 * a.block * a.e, bandwidth=bw)          # one shift of K and V
    kv_dkv = cost.transfer(2 * a.block * a.e + 2 * a.block * 4, bandwidth=bw)  # backward: with dK, dV
    merge_f, merge_b = cost.merge_s()
    tf, cf = cost.ring_pass(fwd, merge_f, kv)
    tb, cb = cost.ring_pass(bwd, merge_b, kv_dkv)
    home = cost.transfer(2 * a.block * a.e, bandwidth=bw)
    return {"attention_s": cf + cb, "comm_s": (a.C - 1) * (kv + kv_dkv) + home, "exposed_s": tf + tb + home - cf - cb}

  def transient_bytes(self, a) -> float:
    """One sub-block pair's float32 scores and probabilities [b, H, n, n] (n at most model.attention_block)."""
    n = min(self.model.attention_block, a.L // a.C)
    return 2 * 4.0 * a.b * a.H * n * n

  def kept_attention(self) -> str:
    """The blockwise kernel's residual set (its local q, k, v, output and log-sum-exp), whatever model.attention
    says."""
    return "blockwise"


class USP(Ring):
  """Ulysses x ring (USP: Fang and Zhao 2024, arXiv:2405.07719, the YunChang library): the C ranks of the context
  axis split into groups of U consecutive ranks (context.ulysses). q, k and v are all-to-all'd inside each group
  from sequence-sharded to head-sharded ([B, L/C, H, K] -> [B, U L/C, H/U, K]: the group's U chunks, H/U heads);
  a ring (Ring.ring: the same kernels, shifts and custom VJP) runs over the R = C/U groups, ranks u, u+U, ..., on
  that U-fold longer sequence; the output all-to-all'd back. The all-to-alls stay inside a group (inside a node
  when U C-ranks fit in one), the ring's shifts cross groups. U = C is Ulysses with the ring's kernel, U = 1 the
  ring. Bytes per device per layer: Ulysses' over U, (U-1)/U x b (L/C) (2 H + 2 G) K e each way, and the ring's
  over R on blocks of b (L/R) (G/U) K. Needs the heads after tensor parallelism divisible by U."""
  point_to_point = True     # the ring's ppermutes (and all-to-alls inside each group)

  def ulysses_degree(self, C: int, heads: int, kv_heads: int, inside: int) -> int:
    """U for a context split of C with `heads` and `kv_heads` per device after tensor parallelism, `inside`
    devices inside each context rank (the tensor axis): context.ulysses, or (0) the largest proper divisor of C
    that divides both head counts (Ulysses as far as the heads allow, as USP's authors advise, and a ring of two
    or more; 1 at C = 1)."""
    return self.cfg.ulysses or max(_head_divisors(C, heads, kv_heads) or [1])

  def ulysses_choices(self, C: int, heads: int, kv_heads: int, inside: int) -> list[int]:
    """The degrees a search prices (context_cost.ulysses_degrees): context.ulysses where set, else every divisor of C
    between 1 and C both head counts allow (U = 1 is the ring and U = C Ulysses, each priced as itself)."""
    return [self.cfg.ulysses] if self.cfg.ulysses else [d for d in _head_divisors(C, heads, kv_heads) if d > 1]

  def ring_size(self, shape: dict) -> int:
    """R = C/U, the groups the ring runs over (1 where U = C: no shift, Ulysses with the ring's kernel)."""
    c, u, _, _ = self._split(shape)
    return c // u

  def _split(self, shape: dict) -> tuple[int, int, int, int]:
    """(C, U, query heads, K/V heads per device) on a mesh of `shape` (an ordered {axis: size})."""
    axes, names = self.layout.rule("length", tuple(shape)), list(shape)
    c, _, h, g = self.heads_per_device(shape)
    inside = math.prod(shape[a] for a in names[names.index(axes[-1]) + 1:]) if axes else 1
    return c, self.ulysses_degree(c, h, g, inside), h, g

  def check(self, shape: dict) -> None:
    """One context axis (the ring within it); U dividing C and the heads each device holds."""
    axes = self.layout.rule("length", tuple(shape))
    if not axes:
      return
    self.check_balance(shape)
    name = self.cfg.impl
    if len(axes) > 1:
      raise ConfigError(f"layout rule length -> {' x '.join(axes)}: context={name} splits one mesh axis")
    c, u, h, g = self._split(shape)
    if u < 1 or c % u:
      raise ConfigError(f"context.ulysses={u}: context={name} needs a Ulysses degree that divides mesh.context={c}")
    if h % u or not g or g % u:
      raise ConfigError(f"context={name} splits the heads {u} ways (context.ulysses={u}): {h} query and "
                        f"{g or 'replicated'} K/V heads per device after tensor parallelism are not multiples of "
                        f"{u}; set context.ulysses to a divisor of both")

  def attend(self, q_BLHK, k_BLGK, v_BLGK, positions_L):
    axis = self.context_axis()
    if axis is None:
      return self.own(q_BLHK, k_BLGK, v_BLGK)
    mesh = jax.sharding.get_abstract_mesh()
    c, u, _, _ = self._split(dict(zip(mesh.axis_names, mesh.axis_sizes)))
    inner, outer = C.Group(axis, u), C.Group(axis, c // u, u)
    # x[B, L_ctx, N, K] -> x[B, L_grp, N_grp, K]: the group's U chunks, in rank order, on N/U heads
    heads = lambda x: C.all_to_all(x, inner, 2, SEQ_DIM, name="cp_ulysses")
    pos = C.all_gather(positions_L, inner, 0, name="cp_positions")
    # ring rank j holds the chunks of context ranks jU .. jU+U-1: the data's order, a row per ring rank
    o = self.ring(heads(q_BLHK), heads(k_BLGK), heads(v_BLGK), pos, outer,
                  self.cfg.order(q_BLHK.shape[SEQ_DIM] * c, c))
    return C.all_to_all(o, inner, SEQ_DIM, 2, name="cp_ulysses")   # o[B, L_grp, H_grp, K] -> o[B, L_ctx, H, K]

  def step_tokens(self, seq_len: int, shape: dict) -> int:
    """The ring's block: the group's U chunks, U seq_len / C tokens."""
    c, u, _, _ = self._split(shape)
    return seq_len * u // c

  def _parts_of(self, a) -> tuple[int, object]:
    """(U, the ring's Attn: R = C/U ranks of U x a.inside devices each, H/U and G/U heads) of one layer's
    attention `a`."""
    u = self.ulysses_degree(a.C, a.H, a.G, a.inside)
    return u, dataclasses.replace(a, C=a.C // u, H=a.H // u, G=a.G // u, inside=a.inside * u)

  def pallas_on(self, a) -> tuple:
    """The ring's steps over R ranks (Ring.pallas_on of the ring's Attn: U L / C tokens per rank), a ring of one
    rank (R = 1) too: `attend` runs the group's attention through the ring's kernel either way."""
    return super().pallas_on(self._parts_of(a)[1])

  def bytes_per_layer(self, a) -> dict:
    """Ulysses' all-to-alls over U, (U-1)/U x b (L/C) (2 H + 2 G) K e each way, and the ring's shifts over R
    (Ring.bytes_per_layer of blocks b (L/R) (G/U) K; none when R = 1)."""
    u, ring = self._parts_of(a)
    f = (u - 1) * a.b * (a.L // a.C) * (2 * a.H + 2 * a.G) * a.K * a.e // u
    r = super().bytes_per_layer(ring) if ring.C > 1 else {"forward": 0, "backward": 0}
    return {"forward": f + r["forward"], "backward": f + r["backward"]}

  def layer_time(self, a, cost) -> dict:
    """The four all-to-alls each way over the group (its links: inside a node where U C-ranks fit) on the
    critical path, and the ring's pass over R ranks (Ring.layer_time at the links across groups)."""
    u, ring = self._parts_of(a)
    inner_bw, outer_bw = cost.split_bandwidth(u)
    a2a = (u - 1) * a.b * (a.L // a.C) * a.K * a.e // u      # per head of one array
    comm = 2 * sum(cost.transfer(a2a * n, hops=u // 2, bandwidth=inner_bw) for n in (a.H, a.G, a.G, a.H))
    sub = dataclasses.replace(cost, a=ring, bandwidth=outer_bw)
    if ring.C == 1:
      fwd, bwd = sub.block_s
      t = {"attention_s": (0.5 if cost.skips else 1.0) * (fwd + bwd), "comm_s": 0.0, "exposed_s": 0.0}
    else:
      t = super().layer_time(ring, sub)
    return {"attention_s": t["attention_s"], "comm_s": t["comm_s"] + comm, "exposed_s": t["exposed_s"] + comm}

  def transient_bytes(self, a) -> float:
    """The ring's sub-block pair on H/U heads."""
    return super().transient_bytes(self._parts_of(a)[1])

  kept_per_token = Ulysses.kept_per_token   # the output in both layouts under a policy that keeps it


class A2AP2P(USP):
  """TransformerEngine's hierarchical context parallelism (`cp_comm_type="a2a+p2p"`: all-to-all inside a node, a
  ring of point-to-point shifts across nodes): USP with the Ulysses group the context ranks of one node
  (context.node_devices, hardware.domain_devices in its preset, over the devices inside each context rank: the
  tensor axis), unless context.ulysses sets it. Without a node size (0) every rank is in one node: Ulysses."""

  def ulysses_degree(self, C: int, heads: int, kv_heads: int, inside: int) -> int:
    if self.cfg.ulysses:
      return self.cfg.ulysses
    node = self.cfg.node_devices
    return math.gcd(C, max(1, node // max(inside, 1))) if node else C

  def ulysses_choices(self, C: int, heads: int, kv_heads: int, inside: int) -> list[int]:
    """Its one degree: the node's (or context.ulysses)."""
    return [self.ulysses_degree(C, heads, kv_heads, inside)]


def _head_divisors(C: int, heads: int, kv_heads: int) -> list[int]:
  """The Ulysses degrees below C that split C, the query heads and the K/V heads per device."""
  return [d for d in range(1, C) if C % d == 0 and heads % d == 0 and kv_heads % d == 0]


def ring_plan(parts: int, local: int, block: int, order=None) -> tuple:
  """(n, visible): the sub-block size of a ring step (the largest divisor of the runs of consecutive positions in
  a device's tokens that is at most `block`, _piece: a zigzag device's two chunks never share a sub-block) and,
  per ring step, how many of its (L/C/n)^2 sub-block pairs have a key at or before a query on the busiest device,
  from the positions the data gives each device (`order`, ContextConfig.order: None for contiguous chunks, or
  zigzag's or striped's).
  Step s runs a loop of exactly visible[s] pairs on every device: the visible ones first, then (on a device with
  fewer) wholly masked ones that add nothing. A static trip count, no branch: the program holds the count, and
  a step takes its busiest device's work, the pace a ring runs at. The count assumes the data's order: positions
  in another order could have more visible pairs than it and lose the rest."""
  order = _order(parts, local, order)
  piece = _piece(order)
  n = max(d for d in range(1, min(block, piece) + 1) if piece % d == 0)
  blocks = np.asarray(order).reshape(parts, local // n, n)
  last, first = blocks.max(-1), blocks.min(-1)                        # [rank, sub-block]
  visible = []
  for step in range(parts):       # after `step` shifts device r holds the block of rank r - step
    src = (np.arange(parts) - step) % parts
    visible.append(int((last[:, :, None] >= first[src][:, None, :]).sum((1, 2)).max()))
  return n, tuple(visible)


KERNEL_SETTINGS = ("auto", "jax", "pallas")       # context.kernel


def _order(parts: int, local: int, order) -> np.ndarray:
  """The positions each device holds, in a row per device: `order` (None: contiguous chunks)."""
  return np.asarray(np.arange(local * parts) if order is None else order).reshape(parts, local)


def _piece(order: np.ndarray) -> int:
  """The length every run of consecutive positions in a device's row is a multiple of (a sub-block within one
  never straddles two chunks): a row's length for contiguous chunks, half of it for zigzag's two, a Ulysses
  group's chunks for USP's ring; tokens placed one by one (striped: no runs) take the whole row."""
  starts = np.flatnonzero(np.diff(order, axis=1, prepend=order[:, :1] - 2).reshape(-1) != 1)
  runs = np.diff(np.append(starts, order.size))
  return order.shape[1] if runs.min() == 1 else math.gcd(*runs.tolist())


def kernel_pairs(parts: int, local: int, order=None, block_q: int = F.BLOCK_Q, block_k: int = F.BLOCK_K) -> tuple:
  """Per ring step, how many of the Pallas kernel's (query block, key block) pairs the busiest device visits (the
  blocks with a key at or before a query, flash_kernel.pair_counts), from the positions the data gives each device
  (`order`, as ring_plan takes it): the FLOPs each step's kernels state (the work of the pace-setting device, as
  ring_plan's counts are)."""
  order = _order(parts, local, order)
  return tuple(max(F.pair_counts(order[r], order[(r - step) % parts], block_q, block_k) for r in range(parts))
               for step in range(parts))


def _visible_pairs(pq_b, pk_b, count: int):
  """The (query sub-block, key sub-block) pairs a step computes, as two int32 arrays of length `count`: those
  with a key at or before a query first (i-major), then wholly masked ones; from this device's positions."""
  nb = pk_b.shape[0]
  seen = (jnp.max(pq_b, axis=1)[:, None] >= jnp.min(pk_b, axis=1)[None, :]).reshape(-1)
  first = jnp.argsort(~seen, stable=True)[:count].astype(jnp.int32)
  return first // nb, first % nb


def _sub_scores(q_BNGRK, k_BMGK, pq_N, pk_M):
  """Scaled scores s[B, G, R, N, M] in float32 and the causal mask [N, M] from the positions."""
  s = jnp.einsum("bngrk,bmgk->bgrnm", q_BNGRK, k_BMGK, preferred_element_type=jnp.float32)
  return s / np.sqrt(q_BNGRK.shape[-1]), pq_N[:, None] >= pk_M[None, :]


def _ring_forward(q_BLHK, k_BLGK, v_BLGK, pos_L, pos_all, axis, plan):
  """The ring's forward: per step, a scan over the step's sub-block pairs (`_visible_pairs`), an online softmax
  per query sub-block carried in place. pos_all: every device's positions (_positions)."""
  n, visible = plan[:2]
  B, L, H, K = q_BLHK.shape
  G = k_BLGK.shape[2]
  R, nb = H // G, L // n
  qb, pq = A.blocks(q_BLHK.reshape(B, L, G, R, K), n), pos_L.reshape(nb, n)       # q[nb, B, n, G, R, K]
  axes = A.varying(q_BLHK, k_BLGK, v_BLGK, pos_L)
  m = A.varying_zeros((nb, B, G, R, n), axes, -jnp.inf)                     # running max, sum of p, sum of p v
  l, acc = A.varying_zeros((nb, B, G, R, n), axes), A.varying_zeros((nb, B, G, R, n, K), axes)
  kv = jnp.stack([k_BLGK, v_BLGK])            # K and V travel as one array: one shift per step
  for step in range(len(visible)):
    kb, vb, pk = A.blocks(kv[0], n), A.blocks(kv[1], n), _block_positions(pos_all, axis, step, nb)

    def pair(state, ij, kb=kb, vb=vb, pk=pk):
      m, l, acc = state
      i, j = ij
      s, mask = _sub_scores(A.at(qb, i), A.at(kb, j), A.at(pq, i), A.at(pk, j))
      s = jnp.where(mask, s, -jnp.inf)
      m_i = A.at(m, i)
      m_new = jnp.maximum(m_i, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)             # a row with no visible key yet
      p = jnp.exp(s - m_safe[..., None])
      corr = jnp.exp(m_i - m_safe)
      pv = jnp.einsum("bgrnm,bmgk->bgrnk", p.astype(vb.dtype), A.at(vb, j), preferred_element_type=jnp.float32)
      return (A.set_at(m, m_new, i), A.set_at(l, A.at(l, i) * corr + jnp.sum(p, axis=-1), i),
              A.set_at(acc, A.at(acc, i) * corr[..., None] + pv, i)), None

    with jax.named_scope(f"ring_fwd_step{step}"):   # the shift of the block this step reads, and its compute
      if step < len(visible) - 1:
        kv = C.ring_shift(kv, axis, +1, name="cp_ring")
      (m, l, acc), _ = jax.lax.scan(pair, (m, l, acc), _visible_pairs(pq, pk, visible[step]))
      # the next step's shift takes the block this one received only once this step's compute is done: one
      # shift in flight behind each step (else XLA may run the whole rotation first, holding every block)
      kv, m, l, acc = jax.lax.optimization_barrier((kv, m, l, acc))
  o = jnp.einsum("ibgrnk->ibngrk", acc / l[..., None])
  lse = m + jnp.log(l)             # every query sees at least itself: m is finite
  return A.unblocks(o).reshape(B, L, H, K).astype(q_BLHK.dtype), lse


def _positions(pos_L, axis):
  """Every device's token positions [C, L/C] (int32, all-gathered once per layer: a ring step reads the
  positions of the block it holds from here rather than shifting them with the block)."""
  return C.all_gather(pos_L[None], axis, 0, name="cp_positions")


def _block_positions(pos_all, axis, step: int, nb: int):
  """The positions of the block a device holds after `step` shifts (rank r - step's), in sub-blocks [nb, n]."""
  parts = pos_all.shape[0]
  return A.at(pos_all, (C.axis_index(axis) - step) % parts).reshape(nb, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def ring_attention(q_BLHK, k_BLGK, v_BLGK, pos_L, axis, plan, kernel=()):
  """Causal attention of the local queries against every device's keys along `axis`, K/V rotated by ppermute;
  plan = ring_plan(...) (sub-block size, pairs per step; with the Pallas kernels, each one's kernel_pairs(...) after
  them); kernel: the platforms whose program runs the Pallas kernels (Ring.kernel; () none)."""
  return _ring_fwd(q_BLHK, k_BLGK, v_BLGK, pos_L, axis, plan, kernel)[0]


def _ring_fwd(q, k, v, pos, axis, plan, kernel):
  pos_all = _positions(pos, axis)     # outside the platform choice: a remat that recomputes it reruns no ring
  o, lse = F.on_platforms(kernel, lambda *a: _ring_forward(*a, axis, plan),
                          lambda *a, backend, interpret: _ring_forward_fused(*a, axis, plan, backend, interpret),
                          q, k, v, pos, pos_all)
  # local blocks only, O(L / C) per device (and the L positions); the output and its log-sum-exp named as the
  # blockwise kernel names them, so a remat policy that keeps the attention output does not rerun the ring
  return o, (q, k, v, pos, pos_all, checkpoint_name(o, A.ATTN_OUT), checkpoint_name(lse, A.ATTN_OUT))


def _ring_forward_fused(q_BLHK, k_BLGK, v_BLGK, pos_L, pos_all, axis, plan, backend: str, interpret: bool):
  """The ring with one fused kernel per step (flash_kernel.block_attention: the step's output and log-sum-exp),
  merged into the running output by their log-sum-exps (the online softmax across steps); the shifts placed as in
  the pure ring (_ring_forward)."""
  n, visible, pairs = plan[0], plan[1], dict(plan[2])[backend]
  forward = F.KERNELS[backend][0]
  L = pos_L.shape[0]
  kv = jnp.stack([k_BLGK, v_BLGK])
  o = lse = None
  for step in range(len(visible)):
    k, v = kv[0], kv[1]
    pk = _block_positions(pos_all, axis, step, 1).reshape(L)
    with jax.named_scope(f"ring_fwd_step{step}"):
      if step < len(visible) - 1:
        kv = C.ring_shift(kv, axis, +1, name="cp_ring")
      o_s, lse_s = forward(q_BLHK, k, v, pos_L, pk, pairs=pairs[step], interpret=interpret)
      if o is None:               # the device's own block: every query sees at least itself
        o, lse = o_s, lse_s
      else:
        new = jnp.logaddexp(lse, lse_s)
        w = lambda x: jnp.transpose(jnp.exp(x - new), (0, 2, 1))[..., None]    # [B, H, L] -> [B, L, H, 1]
        o, lse = o * w(lse) + o_s * w(lse_s), new
      kv, o, lse = jax.lax.optimization_barrier((kv, o, lse))
  return o.astype(q_BLHK.dtype), F.lse_blocks(lse, k_BLGK.shape[2], n)


def _ring_bwd(axis, plan, kernel, res, do_BLHK):
  """The ring's backward (_ring_bwd_pure, or _ring_bwd_fused with the Pallas kernel), and no cotangent for the
  positions."""
  grads = F.on_platforms(kernel, lambda *a: _ring_bwd_pure(axis, plan, a[:-1], a[-1]),
                         lambda *a, backend, interpret: _ring_bwd_fused(axis, plan, a[:-1], a[-1], backend, interpret),
                         *res, do_BLHK)
  return (*grads, np.zeros(res[3].shape, jax.dtypes.float0))


def _ring_bwd_fused(axis, plan, res, do_BLHK, backend: str, interpret: bool):
  """The pure ring's backward (_ring_bwd_pure) with one pair of fused kernels per step
  (flash_kernel.block_attention_bwd: the step's dQ, dK, dV from the final log-sum-exp), the shifts placed alike."""
  visible, pairs = plan[1], dict(plan[2])[backend]
  backward = F.KERNELS[backend][1]
  q_BLHK, k_BLGK, v_BLGK, pos_L, pos_all, o_BLHK, lse_b = res
  L = pos_L.shape[0]
  lse = F.lse_rows(lse_b)
  delta = jnp.einsum("blhk,blhk->bhl", do_BLHK.astype(jnp.float32), o_BLHK.astype(jnp.float32))
  dq = None
  kv, dkv = jnp.stack([k_BLGK, v_BLGK]), None
  for step in range(len(visible)):
    k, v = kv[0], kv[1]
    pk = _block_positions(pos_all, axis, step, 1).reshape(L)
    with jax.named_scope(f"ring_bwd_step{step}"):
      kv, arrived = _bwd_shifts(kv, dkv, step, len(visible), axis)
      dq_s, dk_s, dv_s = backward(q_BLHK, k, v, pos_L, pk, lse, do_BLHK, delta, pairs=pairs[step],
                                  interpret=interpret)
      dq = dq_s if dq is None else dq + dq_s
      kv, dq, dkv = _bwd_after(kv, dq, arrived, jnp.stack([dk_s, dv_s]), step, len(visible), axis, k_BLGK.dtype)
  return dq.astype(q_BLHK.dtype), dkv[0].astype(k_BLGK.dtype), dkv[1].astype(v_BLGK.dtype)


def _ring_bwd_pure(axis, plan, res, do_BLHK):
  """FlashAttention's backward per ring step, over the same sub-block pairs as forward: p recomputed from the
  log-sum-exp, dq accumulated at home, dK/dV accumulated on the block as it travels (and shifted home after the
  last step)."""
  n, visible = plan[:2]
  q_BLHK, k_BLGK, v_BLGK, pos_L, pos_all, o_BLHK, lse = res
  B, L, H, K = q_BLHK.shape
  G = k_BLGK.shape[2]
  R, nb = H // G, L // n
  grouped = lambda x: A.blocks(x.reshape(B, L, G, R, K), n)                        # [nb, B, n, G, R, K]
  qb, dob, pq = grouped(q_BLHK), grouped(do_BLHK), pos_L.reshape(nb, n)
  f32 = lambda x: x.astype(jnp.float32)
  delta = jnp.einsum("ibngr->ibgrn", jnp.sum(f32(dob) * f32(grouped(o_BLHK)), axis=-1))   # [nb, B, G, R, n]
  # matmuls in the compute dtype with float32 accumulation, P and dS cast down first (FlashAttention-2's backward)
  dt = q_BLHK.dtype
  mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  axes = A.varying(q_BLHK, k_BLGK, v_BLGK, pos_L, do_BLHK)
  dq = A.varying_zeros(qb.shape, axes)
  kv, dkv = jnp.stack([k_BLGK, v_BLGK]), None
  zero_kv = A.varying_zeros((nb, B, n, G, K), axes)
  for step in range(len(visible)):   # the blocks travel as in forward, each with its dK/dV accumulating on the way
    kb, vb, pk = A.blocks(kv[0], n), A.blocks(kv[1], n), _block_positions(pos_all, axis, step, nb)

    def pair(carry, ij, kb=kb, vb=vb, pk=pk):
      dq, dk, dv = carry
      i, j = ij
      q_i, do_i = A.at(qb, i), A.at(dob, i)
      k_j, v_j = A.at(kb, j), A.at(vb, j)
      s, mask = _sub_scores(q_i, k_j, A.at(pq, i), A.at(pk, j))
      p = jnp.where(mask, jnp.exp(s - A.at(lse, i)[..., None]), 0.0)
      dp = mm("bngrk,bmgk->bgrnm", do_i, v_j)
      ds = (p * (dp - A.at(delta, i)[..., None]) / np.sqrt(K)).astype(dt)
      return (A.set_at(dq, A.at(dq, i) + mm("bgrnm,bmgk->bngrk", ds, k_j), i),
              A.set_at(dk, A.at(dk, j) + mm("bgrnm,bngrk->bmgk", ds, q_i), j),
              A.set_at(dv, A.at(dv, j) + mm("bgrnm,bngrk->bmgk", p.astype(dt), do_i), j)), None

    with jax.named_scope(f"ring_bwd_step{step}"):
      kv, arrived = _bwd_shifts(kv, dkv, step, len(visible), axis)
      # this step's dK/dV for the block it holds, from zero: the step does not wait for the dK/dV arriving with
      # the block (added after), so that shift runs behind this step's compute as the K/V shift does
      (dq, dk_step, dv_step), _ = jax.lax.scan(pair, (dq, zero_kv, zero_kv), _visible_pairs(pq, pk, visible[step]))
      kv, dq, dkv = _bwd_after(kv, dq, arrived, jnp.stack([A.unblocks(dk_step), A.unblocks(dv_step)]), step,
                               len(visible), axis, k_BLGK.dtype)
  return (A.unblocks(dq).reshape(B, L, H, K).astype(q_BLHK.dtype), dkv[0].astype(k_BLGK.dtype),
          dkv[1].astype(v_BLGK.dtype))


def _bwd_shifts(kv, pending, step: int, steps: int, axis):
  """The shifts a backward ring step issues as it starts, every one of them behind this step's attention: the next
  step's K/V block and the dK/dV summed so far for the block held in the step before (its next holder holds it
  now, and adds its own after its compute). Both travel in one collective (_shift_together), so XLA's default of
  one collective in flight on a GPU hides both; step 0 has no dK/dV yet, the last step no K/V to send. Returns
  (K/V for the next step, the dK/dV arriving for the block held now, or None)."""
  if pending is None:
    return (kv if step == steps - 1 else C.ring_shift(kv, axis, +1, name="cp_ring")), None
  if step == steps - 1:
    return kv, C.ring_shift(pending, axis, +1, name="cp_ring_grad")
  return _shift_together(kv, pending, axis)


def _bwd_after(kv, dq, arrived, dkv_step, step: int, steps: int, axis, dtype):
  """After a backward ring step's attention: its results and the shifts' tied together (the next step's shifts
  leave once this step's compute is done: one collective in flight behind each step), the block's dK/dV summed
  with the arriving one; after the last step, complete, sent home in K's dtype (bf16 K/V: half the bytes of the
  sums). Returns (K/V, dq, the dK/dV to send on: at the end, this device's own)."""
  kv, dq, arrived, dkv_step = jax.lax.optimization_barrier((kv, dq, arrived, dkv_step))
  dkv = dkv_step if arrived is None else arrived + dkv_step
  if step == steps - 1:
    dkv = dkv.astype(dtype) if steps == 1 else C.ring_shift(dkv.astype(dtype), axis, +1, name="cp_ring_home")
  return kv, dq, dkv


def _shift_together(kv, dkv, axis):
  """K/V (the compute dtype) and dK/dV (float32) shifted by one collective: K/V's bits as float32 words (two
  bfloat16 per word; a bit cast, no conversion and no extra bytes) beside dK/dV. K/V of another width travel alone."""
  width = kv.dtype.itemsize
  if width not in (2, 4) or dkv.dtype != jnp.float32:
    return C.ring_shift(kv, axis, +1, name="cp_ring"), C.ring_shift(dkv, axis, +1, name="cp_ring_grad")
  words = jax.lax.bitcast_convert_type(kv.reshape(*kv.shape[:-1], -1, 4 // width) if width == 2 else kv,
                                       jnp.float32)
  both = C.ring_shift(jnp.concatenate([words, dkv], axis=-1), axis, +1, name="cp_ring_kv_grad")
  words, dkv = both[..., :words.shape[-1]], both[..., words.shape[-1]:]
  return jax.lax.bitcast_convert_type(words, kv.dtype).reshape(kv.shape), dkv


ring_attention.defvjp(_ring_fwd, _ring_bwd)


STRATEGIES = {"all_gather": AllGatherKV, "ulysses": Ulysses, "ring": Ring, "usp": USP, "a2a_p2p": A2AP2P}


def make(cfg: ContextConfig, model: ModelConfig, layout: Layout):
  """The strategy `context.impl` names, built for the model, the run's layout and its settings. A user's class is
  checked against the ContextStrategy protocol (schedules/protocol.py) before it is built and after (`cfg`, set
  in __init__), and what its constructor raises is one line (loading.call_user): the step would fail deep inside."""
  from shardlab.loading import call_user, check_instance, kind_of
  from shardlab.schedules.protocol import ContextStrategy
  cls = load_object(cfg.impl, "context.impl", STRATEGIES, ContextStrategy)
  strategy = call_user(cls, cfg.impl, "context.impl", model, layout, cfg)
  check_instance(strategy, cfg.impl, "context.impl", ContextStrategy)
  if not callable(getattr(strategy.cfg, "order", None)):
    raise ConfigError(f"context.impl={cfg.impl}: {type(strategy).__name__}.cfg is {kind_of(strategy.cfg)}, not the "
                      f"ContextConfig it was built with (cfg.order gives the data's order); keep it as self.cfg")
  return strategy
