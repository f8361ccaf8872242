"""Context parallelism, analysed: bytes per device per layer of each strategy (schedules/context.py), the causal
work each device does (balanced or not), a ring's makespan, a predicted step time per strategy, and the choice
among strategies and degrees for a model, a sequence and a cluster. Every time here is a MODEL PREDICTION.

Notation (one layer, one device): b sequences per device, L the whole sequence, C = mesh.context, H query heads
and G K/V heads after tensor parallelism, K the head dim, e bytes per element; a block is one device's queries
against one device's keys, [L/C, L/C].

Bytes each device sends (hand counts, checked against the compiled ledger in tests/test_context.py):
  all_gather  forward  K, V gathered:                 (C-1)/C x 2 b L G K e
              backward dK, dV reduce-scattered:        the same
  ring        forward  C-1 shifts of the K, V block:   (C-1) x 2 b (L/C) G K e
              backward the same, and C shifts of dK, dV (float32, the custom VJP accumulates them in float32):
                                                       + C x 2 b (L/C) G K 4
  ulysses     forward  q, k, v to head-sharded, o back: (C-1)/C x b (L/C) (2 H + 2 G) K e
              backward the same four the other way
  usp,        Ulysses' over U (context.ulysses) and the ring's over R = C/U on blocks b (L/R) (G/U) K; the
  a2a_p2p     all-to-alls at the links inside a group, the ring's shifts at those across (Rates.split_bandwidth)
(the positions, int32 and the same in every layer, move too: XLA gathers them once; left out here).

Causal work (`causal_work`): under a causal mask a kernel that skips masked blocks (flash attention, cuDNN's)
does, for queries of chunk a against keys of chunk b, a full block if b < a, half one if b = a, none if b > a.
Contiguous chunks (context.load_balance=false): device r does r + 1/2 blocks, the last C - 1/2, about twice the
average C/2. Zigzag (load_balance=true, data.zigzag: chunks r and 2C-1-r of 2C): every device C/2, and in a ring
every step does the same half block on every device. A ring runs at its busiest device's pace (`ring_makespan`):
a plain causal ring at C = 8 is at best 8/15 = 53% of ideal, a zigzag one 100% less its merges and exposed
transfers. shardlab's own ring (schedules/context.py) skips the sub-block pairs the mask hides wholly (its
`ring_plan`), so it gains this balance as ring-flash-attention and TransformerEngine do; a kernel that computed
every block whole (`skips_masked=False`) would do the same work on every device whatever the order.
"""
from __future__ import annotations

from shardlab import axes as AX

import math
from dataclasses import dataclass, field

from shardlab.analysis import closed_forms as PL
from shardlab.analysis.closed_forms import divisors
from shardlab.analysis.memory_model import dtype_bytes
from shardlab.analysis.links import mesh_links, switch_bandwidths, transfer_seconds
from shardlab.axes import CONTEXT, FSDP
from shardlab.config import ContextConfig, ModelConfig, placement_of
from shardlab.composition import Composition
from shardlab.layout import Layout
from shardlab.errors import ConfigError
from shardlab import flash_kernel as F
from shardlab.schedules import context as CP
from shardlab.loading import protocol_members
from shardlab.schedules.protocol import ContextCost

STRATEGIES = tuple(CP.STRATEGIES)   # the built-in ones a search tries (a user's by module:Class, `strategies`)
BWD_OVER_FWD = 2.5     # flash attention's backward FLOPs over its forward (FlashAttention-2, Dao 2023, sec. 3.1:
                       # 5 matmuls of the block against the forward's 2)


@dataclass(frozen=True)
class Attn:
  """One layer's attention on one device: b sequences, the whole sequence L split C ways, H and G heads after
  tensor parallelism, head dim K, e bytes per element; `inside`: the devices inside each context rank (the
  tensor axis: what places a part of the context axis inside a node or across nodes)."""
  b: int
  L: int
  C: int
  H: int
  G: int
  K: int
  e: int = 2
  inside: int = 1

  @property
  def block(self) -> int:
    """Elements of one K (or V) block: b (L/C) G K."""
    return self.b * (self.L // self.C) * self.G * self.K

  def block_flops(self) -> float:
    """Forward FLOPs of one full block (QK^T and PV): 4 b (L/C)^2 H K."""
    return 4.0 * self.b * (self.L / self.C) ** 2 * self.H * self.K


def attn_of(model, batch_per_device: int, C: int, tensor: int = 1, e: int = 2) -> Attn:
  """The Attn of a ModelConfig on a mesh with `tensor` and `C` (K/V heads replicated over tensor when it does not
  divide them, as params.declare does)."""
  g = model.kv_heads // tensor if model.kv_heads % tensor == 0 else model.kv_heads
  return Attn(batch_per_device, model.seq_len, C, model.n_heads // tensor, g, model.head_dim, e, tensor)


def strategy_of(strategy, model: ModelConfig | None = None, layout: Layout | None = None, load_balance: bool = False):
  """The context strategy object whose cost terms are evaluated here: `strategy` itself, or the one a name of
  schedules/context.py's STRATEGIES or a `package.module:Class` names, built for `model` (a user's strategy is
  priced by its own class's terms, like the one it copies: schedules/context.py, 'Its cost terms')."""
  part = strategy if not isinstance(strategy, str) else \
      CP.make(ContextConfig(name=strategy, impl=strategy, load_balance=load_balance), model or ModelConfig(),
              layout or Layout())
  missing = [n for n in protocol_members(ContextCost) if not callable(getattr(part, n, None))]
  if missing:
    raise ConfigError(f"context.impl={part.cfg.impl}: {type(part).__name__} states no cost terms ({', '.join(missing)}: "
                      "shardlab/schedules/protocol.py: ContextCost): it trains, but the analysis cannot price it; "
                      "subclass one of shardlab/schedules/context.py's strategies or add them")
  return part


def bytes_per_layer(strategy, a: Attn) -> dict:
  """{"forward", "backward"}: bytes one device sends over `context` per layer (module doc's hand count: the
  strategy's own `bytes_per_layer`)."""
  if a.C == 1:
    return {"forward": 0, "backward": 0}
  return strategy_of(strategy).bytes_per_layer(a)


# ---------------------------------------------------------------------------------------------- causal work


def chunks(C: int, balanced: bool) -> list[list[int]]:
  """The sequence chunks each device holds: [r] of C (contiguous), or [r, 2C-1-r] of 2C (zigzag)."""
  return [[r, 2 * C - 1 - r] if balanced else [r] for r in range(C)]


def pair_work(q_chunks: list[int], k_chunks: list[int], per_device: int) -> float:
  """Causal work of one device's queries (their chunks) against one device's keys, in full blocks, when masked
  work is skipped: a chunk pair is a whole sub-block below the diagonal, half one on it, none above."""
  w = sum(1.0 if b < a else 0.5 if a == b else 0.0 for a in q_chunks for b in k_chunks)
  return w / per_device ** 2


def causal_work(C: int, balanced: bool) -> list[list[float]]:
  """work[s][r]: full blocks device r computes at ring step s (it holds the keys of device r - s)."""
  ch = chunks(C, balanced)
  n = len(ch[0])
  return [[pair_work(ch[r], ch[(r - s) % C], n) for r in range(C)] for s in range(C)]


def imbalance(C: int, balanced: bool) -> float:
  """The busiest device's causal work over the average (1: balanced; (2C-1)/C contiguous)."""
  per = [sum(w[r] for w in causal_work(C, balanced)) for r in range(C)]
  return max(per) / (sum(per) / C)


def ring_makespan(work_s: list[list[float]], comm_s: float) -> float:
  """Seconds until every device has finished a ring whose step s costs device r work_s[s][r]: each device sends
  its block on at the start of a step (the ppermute that the next step needs) and starts step s when it has
  finished step s-1 and the block from r-1 has arrived (r-1 started step s-1, plus one transfer)."""
  C = len(work_s[0])
  start = [0.0] * C
  end = [work_s[0][r] for r in range(C)]
  for s in range(1, len(work_s)):
    start, end = ([max(end[r], start[(r - 1) % C] + comm_s) for r in range(C)],
                  [max(end[r], start[(r - 1) % C] + comm_s) + work_s[s][r] for r in range(C)])
  return max(end)


# ------------------------------------------------------------------------------------------ time per layer


@dataclass
class LayerTime:
  """One layer's attention on one device, forward + backward (seconds), and what it sends over `context`."""
  attention_s: float            # the attention kernels (and a ring's merges) of the busiest device
  comm_s: float                 # every context transfer, one after another
  exposed_s: float              # the wait the attention cannot hide: layer time = attention_s + exposed_s
  bytes: dict = field(default_factory=dict)


def merge_bytes(a: Attn) -> tuple[float, float]:
  """HBM bytes of one ring step's online-softmax merge outside the attention kernel, (forward, backward): the
  float32 running output read and written and the block's output read (4 + 4 + e per element of o); backward
  the float32 dQ and dK, dV accumulators, each += its block's."""
  out = a.b * (a.L // a.C) * a.H * a.K
  return out * (8 + a.e), (out + 2 * a.block) * (8 + a.e)


def ring_pass(work: list[list[float]], kernel_s: float, merge_s: float, comm_s: float) -> tuple[float, float]:
  """(makespan, busiest device's compute) of one ring pass: step s costs device r work[s][r] x kernel_s, plus
  merge_s at every step after the first that has work."""
  secs = [[w * kernel_s + (merge_s if s and w else 0.0) for w in row] for s, row in enumerate(work)]
  return ring_makespan(secs, comm_s), max(sum(row[r] for row in secs) for r in range(len(work[0])))


@dataclass
class Rates:
  """What a strategy's `layer_time` evaluates its terms with (schedules/context.py): one full block's forward and
  backward seconds at the preset's rate of the kernel that runs (HardwareConfig.attention_rate), the causal work
  per ring step and device, transfers over `context`, and a ring's merges (`merge`: count them at HBM rate,
  kernels outside the attention kernel as ring-flash-attention runs them)."""
  a: Attn
  hw: object
  bandwidth: float
  balanced: bool
  skips: bool
  merge: bool = True
  pallas: bool = False          # the attention kernel is shardlab's Pallas kernel on the preset's platform

  @property
  def block_s(self) -> tuple[float, float]:
    rate = self.hw.attention_rate(self.pallas)
    return self.a.block_flops() / rate, self.a.block_flops() * BWD_OVER_FWD / rate

  def work(self) -> list[list[float]]:
    """work[s][r]: full blocks device r computes at ring step s (every block whole unless the kernel skips)."""
    C = self.a.C
    return causal_work(C, self.balanced) if self.skips else [[1.0] * C for _ in range(C)]

  def busiest(self) -> float:
    """The busiest device's blocks over a whole pass."""
    w = self.work()
    return max(sum(row[r] for row in w) for r in range(self.a.C))

  def transfer(self, nbytes: float, hops: int = 1, bandwidth: float | None = None) -> float:
    return transfer_seconds(nbytes, bandwidth or self.bandwidth, self.hw, hops)

  def ring_bandwidth(self) -> float:
    """Bytes/s of one shift of a ring over the C context ranks: a ring step is as slow as its slowest hop, so once
    the ranks (each `a.inside` devices) span more than a node, a hop across nodes on one GPU's NIC
    (dcn_bandwidth); else the context axis's own."""
    hw = self.hw
    if hw.torus or not hw.domain_devices or not hw.dcn_bandwidth or self.a.inside * self.a.C <= hw.domain_devices:
      return self.bandwidth
    return min(self.bandwidth, hw.dcn_bandwidth)

  def split_bandwidth(self, inner: int) -> tuple[float, float]:
    """(bytes/s inside groups of `inner` consecutive context ranks, bytes/s of the ring across them): on GPU nodes
    the groups' links are NVLink while `inner` x the devices inside each rank fit in a node, the ring's the nodes'
    NICs once it spans nodes (links.switch_bandwidths); on a torus (or a preset without nodes) both the context
    axis's own."""
    if self.hw.torus or not self.hw.domain_devices or not self.hw.dcn_bandwidth:
      return self.bandwidth, self.bandwidth
    _, bw_in, bw_out = switch_bandwidths(self.hw, [self.a.inside, inner, self.a.C // inner])
    return bw_in, bw_out

  def merge_s(self) -> tuple[float, float]:
    """One ring step's merge, (forward, backward) seconds: its HBM bytes (merge_bytes) and a kernel launch."""
    if not self.merge:
      return 0.0, 0.0
    hbm = self.hw.hbm_bandwidth * self.hw.hbm_efficiency
    mf, mb = merge_bytes(self.a)
    return mf / hbm + self.hw.kernel_launch_s, mb / hbm + self.hw.kernel_launch_s

  def ring_pass(self, kernel_s: float, merge_s: float, comm_s: float) -> tuple[float, float]:
    return ring_pass(self.work(), kernel_s, merge_s, comm_s)


def pallas_on(strategy, a: Attn) -> tuple:
  """The platforms on which the layer's attention kernel is shardlab's Pallas kernel (flash_kernel.platforms): the
  model's own kernel without a context split (model.attention=blockwise), else what the strategy says it runs
  (its `pallas_on`; none for a strategy that does not say)."""
  part = strategy_of(strategy)
  if a.C == 1:           # a user's part need not keep the model: then no kernel of shardlab's is known to run
    blockwise = getattr(getattr(part, "model", None), "attention", None) == "blockwise"
    return F.platforms(a.L, a.L, a.K) if blockwise else ()
  said = getattr(part, "pallas_on", None)
  return said(a) if callable(said) else ()


def layer_time(strategy, a: Attn, hw, bandwidth: float, balanced: bool, skips_masked: bool = True,
               merge: bool = True) -> LayerTime:
  """A prediction of one layer's attention, forward and backward, on the busiest device (module doc): the
  strategy's own `layer_time` terms evaluated at these rates (Rates). `skips_masked`: the inner kernel skips
  masked blocks (flash, cuDNN); False: every block computed whole (shardlab's ring, the plain kernel under
  all_gather). `merge`: count a ring's online-softmax merges at HBM rate."""
  cost = Rates(a, hw, bandwidth, balanced, skips_masked, merge,
               pallas=getattr(hw, "target_platform", "") in pallas_on(strategy, a))
  by = bytes_per_layer(strategy, a)
  if a.C == 1:
    fwd, bwd = cost.block_s
    return LayerTime((fwd + bwd) * (0.5 if skips_masked else 1.0), 0.0, 0.0, by)
  t = strategy_of(strategy).layer_time(a, cost)
  return LayerTime(t["attention_s"], t["comm_s"], t["exposed_s"], by)


# ------------------------------------------------------------------------------------------ a step, a choice

def with_context(c: Composition, C: int, strategy: str, balanced: bool | None = None, fsdp: int | None = None,
                 shard_weights: bool = True, ulysses: int | None = None) -> Composition:
  """c with mesh.context=C (and mesh.fsdp=fsdp), context.impl=strategy, load balancing as given (None: kept), the
  Ulysses degree of a strategy that has one (context.ulysses; None: kept) and the hardware's node size where the
  config gives none (context.node_devices: a2a_p2p's groups); `shard_weights`: every weight's embed dim over
  (fsdp, context) as well (torchtitan's dp_shard_cp), so that the training state is split over every device."""
  layout = c.layout
  if shard_weights and C > 1:
    embed = tuple(dict.fromkeys([*layout.rule("embed"), FSDP, CONTEXT]))
    layout = Layout.of({**layout.rules, "embed": embed}, f"{layout.name}+embed_context")
  return c.replace(mesh={AX.CONTEXT: C, **({} if fsdp is None else {AX.FSDP: fsdp})}, layout=layout,
                   context={"impl": strategy, "name": strategy,
                            "load_balance": c.context.load_balance if balanced is None else balanced,
                            "ulysses": c.context.ulysses if ulysses is None else ulysses,
                            "node_devices": c.context.node_devices or c.hardware.domain_devices})


def own_kernel_skips(model) -> bool:
  """Whether the model's own attention kernel (what runs without a context split) skips the blocks a causal mask
  hides: blockwise (attention.py: the blocks above the diagonal) and cuDNN's flash kernel do, the plain one not."""
  return model.attention != "plain"


def predict(c: Composition, skips_masked: bool | None = None) -> dict:
  """A prediction of one training step per device for c's mesh and context strategy (c.context.impl,
  load_balance): the matmuls of every layer at the preset's GEMM rate, each layer's attention and its context
  transfers (layer_time), bytes per mesh axis, memory (memory_model.breakdown), over every microbatch.
  `skips_masked`: the inner kernel skips masked blocks (None: what the run's kernel does: the strategy's own
  `skips_masked` on a context split, the model's own kernel without one, own_kernel_skips).

  Left out, the same for every strategy at one mesh: FSDP's gathers and reduce-scatters and the gradient
  all-reduce over `context` (their bytes are reported; a prefetching schedule runs them behind the matmuls),
  recomputation under remat, tensor parallelism's own collectives. Memory adds to the breakdown the scores an
  attention without a flash kernel holds while it runs (attention_transient_bytes)."""
  from shardlab.analysis import memory_model as MM
  m, hw, mesh, s = c.model, c.hardware, c.mesh, c.schedule
  C, T, X = mesh.context, mesh.tensor, mesh.fsdp
  strategy = strategy_of(c.cp) if C > 1 else None
  own = own_kernel_skips(m) if strategy is None else strategy.skips_masked()
  skips = own if skips_masked is None else skips_masked
  e = dtype_bytes(c.precision.compute_dtype)
  k = c.microbatches
  tokens = c.local_tokens                                   # of one microbatch
  a = attn_of(m, tokens // (m.seq_len // C), C, T, e)
  bw = mesh_links(c)[1].get(CONTEXT, hw.ici_bandwidth)
  lt = layer_time(strategy or c.cp, a, hw, bw, c.context.balanced, skips)
  dense = 6.0 * k * tokens * (m.n_layers * PL.layer_params(m) + m.vocab_size * m.d_model) / T
  t_dense = dense / (hw.peak_flops * hw.gemm_efficiency)
  t_attn = k * m.n_layers * lt.attention_s
  exposed = k * m.n_layers * lt.exposed_s
  gb = c.weights.element_bytes(c.precision)
  # the weights' gathers (forward, and a re-gather in backward) and gradient reduce-scatter, per microbatch or
  # (gathered once per step) per step: the weights part's terms
  passes = (1 if c.weights.once_per_step else k) * (2 + c.weights.regathers)
  layer_w = PL.layer_params(m) / T
  over = math.prod(c.sizes[x] for x in c.layout.rule("embed", c.names))    # the axes weights are sharded over
  replicas = C if CONTEXT not in c.layout.rule("embed", c.names) else 1   # gradient all-reduced over context
  mem = MM.breakdown(c)
  transient = attention_transient_bytes(strategy, a, m)
  return {
      "strategy": c.context.impl if C > 1 else "none", AX.CONTEXT: C, AX.FSDP: X, AX.TENSOR: T,
      "load_balance": c.context.load_balance, "remat": s.remat, "microbatches": k,
      "ulysses": c.context.ulysses if C > 1 else 0,
      "weights_over_context": C > 1 and replicas == 1,
      "skips_masked": skips, "tokens_per_device": k * tokens,
      "t_step_s": t_dense + t_attn + exposed, "t_matmul_s": t_dense, "t_attention_s": t_attn,
      "exposed_comm_s": exposed, "context_comm_s": k * m.n_layers * lt.comm_s,
      "bytes_per_step": {CONTEXT: k * m.n_layers * (lt.bytes["forward"] + lt.bytes["backward"]),
                         FSDP: passes * m.n_layers * (over - 1) / over * layer_w * gb,
                         f"{CONTEXT} (gradient all-reduce)": 2 * (replicas - 1) / replicas * PL.param_count(m)
                         / (over * T) * 4},
      "bytes_per_layer": lt.bytes, "context_bandwidth": bw,
      "memory_bytes": mem["total"] + transient, "activation_bytes": mem["activations"],
      "attention_transient_bytes": transient, "fits": mem["total"] + transient <= hw.hbm_bytes,
      "note": "model prediction, not a measurement"}


def attention_transient_bytes(strategy, a: Attn, model) -> float:
  """Float32 scores and probabilities one layer's attention holds while it runs, beyond the memory model's
  residuals: the strategy's own `transient_bytes` (all_gather's plain attention [b, H, L/C, L], a plain kernel
  under Ulysses [b, H/C, L, L], the ring's sub-block pair [b, H, n, n]; none for a flash kernel). `strategy`
  None: no context split, the model's own attention ([b, H, L, L] when it is the plain one)."""
  if strategy is None:
    return 2 * 4.0 * a.b * a.H * a.L * a.L if model.attention == "plain" else 0.0
  return strategy_of(strategy, model).transient_bytes(a)


def why_not(c: Composition, C: int, strategy) -> str | None:
  """Why shardlab cannot run `strategy` at context C for c (one line), or None: a sequence that does not cut
  into the chunks, or what the strategy itself says it cannot split (its `why_not`: Ulysses' heads)."""
  m, chunks = c.model, 2 * C if c.context.placement == "zigzag" else C
  if m.seq_len % chunks:
    return f"the sequence ({m.seq_len}) does not cut into {chunks} chunks"
  if C == 1:
    return None
  shape = {**dict(c.mesh.shape), CONTEXT: C}
  return strategy_of(strategy, m, c.layout).why_not(shape)


def ulysses_degrees(c: Composition, C: int, strategy: str) -> tuple[int, ...]:
  """The Ulysses degrees (context.ulysses) to price `strategy` at at context C: what its class offers
  (`ulysses_choices`: usp every divisor of C between 1 and C the heads allow, a2a_p2p its node's; none: nothing
  the ring or Ulysses does not price already); (0,) for a strategy without one, or at C = 1."""
  if C == 1:
    return (0,)
  part = with_context(c, C, strategy, shard_weights=False, ulysses=0).cp
  choices = getattr(part, "ulysses_choices", None)
  if not callable(choices):
    return (0,)
  a = attn_of(c.model, 1, C, c.mesh.tensor)
  return tuple(choices(C, a.H, a.G, a.inside))


def runnable(c: Composition, C: int, strategy: str, balanced: bool, fsdp: int,
             ulysses: int = 0) -> tuple[Composition | None, str]:
  """(the composition of `strategy` at context C over fsdp, or None; why not): the training state split over
  every device (weights over fsdp x context, with_context) where the run's schedule honours that layout, else
  replicated over context; each asked of the schedule the run would build (Composition.why_not_run), so that
  only what the trainer accepts is offered."""
  why = ""
  for shard_weights in (True, False):
    sub = with_context(c, C, strategy, balanced, fsdp, shard_weights, ulysses)
    why = why_not(sub, C, strategy) or sub.why_not_run()
    if not why:
      return sub, ""
  return None, why


def placements(c: Composition, C: int) -> tuple[bool, ...]:
  """The token placements to price at context C: as given (context.load_balance) and the other (contiguous
  chunks, and zigzag where the sequence cuts into 2C); one at C = 1."""
  if C == 1:
    return (c.context.load_balance,)
  return (c.context.load_balance, not c.context.load_balance)


def fitting(c: Composition, skips_masked: bool | None, remats: tuple[str, ...]) -> dict:
  """predict(c) at the least recomputation (of `remats`, in order) and then the fewest microbatches (dividing
  each batch shard's sequences) that fit in HBM: the layout search's choice (layout_search.CHOICE); nothing
  fits: the configured setting's prediction."""
  shard = c.global_tokens / c.split("batch") / c.model.seq_len
  counts = divisors(int(shard)) if shard >= 1 and shard == int(shard) else [1]
  for remat in remats:
    for k in counts:
      p = predict(c.replace(schedule={"remat": remat, "microbatches": k}), skips_masked)
      if p["fits"]:
        return p
  return predict(c, skips_masked)


def choose(c: Composition, devices: int | None = None, degrees: tuple[int, ...] | None = None,
           skips_masked: bool | None = None, strategies: tuple[str, ...] = STRATEGIES,
           remats: tuple[str, ...] | None = None) -> dict:
  """The fastest predicted (strategy, context degree, token placement) that fits in HBM on `devices` (default:
  c's mesh) and that the run accepts (runnable), tensor as configured and fsdp the rest (it must divide the
  batch): {"best", "reason", "candidates", "excluded": {label: why}}. No context split (C = 1) is a candidate
  of its own, priced with the model's own kernel. Each candidate at the least recomputation and the fewest
  microbatches that fit (fitting; `remats`: the policies to try, default the configured one and then every one
  with more recomputation), its `overrides` the settings that run it. MODEL PREDICTIONS."""
  from shardlab.analysis.layout_search import REMAT_BY_RECOMPUTE
  T = c.mesh.tensor
  devices = devices or c.mesh.n_devices
  degrees = degrees or tuple(d for d in range(1, devices // T + 1) if (devices // T) % d == 0)
  if remats is None:
    order = REMAT_BY_RECOMPUTE
    remats = order[order.index(c.schedule.remat):] if c.schedule.remat in order else (c.schedule.remat,)
  cands, excluded, seen = [], {}, set()
  for C in degrees:
    X = devices // (T * C)
    tried = [(s, ulysses_degrees(c, C, s)) for s in (strategies if C > 1 else ("none",))]
    for strategy, _ in [t for t in tried if not t[1]]:
      excluded[f"{strategy} C={C}"] = ("no Ulysses degree between 1 and C that the heads allow (U = 1 is the ring, "
                                       "U = C Ulysses)")
    for strategy, u in [(s, u) for s, us in tried for u in us]:
      for balanced in placements(c, C):
        named = lambda p: ("" if not u else f" U={u}") + ("" if placement_of(p) == "none" else f" {placement_of(p)}")
        label = f"{strategy}{named(balanced)} C={C}" if C > 1 else "no context (C=1)"
        first = f"{strategy}{named(placements(c, C)[0])} C={C}"     # the placement priced first's label
        sub, why = None, f"fsdp {X} does not divide the batch of {c.train.batch_size} sequences"
        if X * T * C == devices and c.train.batch_size % X == 0:
          sub, why = runnable(c, C, c.context.impl if C == 1 else strategy, balanced, X, u)
        if sub is not None:
          p = fitting(sub, skips_masked, remats)
          why = "" if p["fits"] else (f"{p['memory_bytes'] / 1e9:.0f} GB per device does not fit "
                                      f"{c.hardware.hbm_bytes / 1e9:.0f} GB at any remat policy and microbatch count")
        if why:
          if excluded.get(first) != why:          # said once where both placements are out for one reason
            excluded[label] = why
          continue
        same = (strategy, u, C, p["t_step_s"], p["memory_bytes"])     # a placement that changes nothing: one
        if same in seen:
          continue
        seen.add(same)
        cands.append({**p, "label": label, "overrides": overrides(sub, p)})
  if not cands:
    return {"best": None, "reason": "nothing fits: " + "; ".join(f"{k}: {v}" for k, v in excluded.items()),
            "candidates": [], "excluded": excluded}
  cands.sort(key=lambda p: p["t_step_s"])
  return {"best": cands[0], "reason": reason(cands), "candidates": cands, "excluded": excluded}


def overrides(c: Composition, p: dict) -> list[str]:
  """The settings that run candidate `p` (of composition c) with `python -m shardlab`: the mesh, the strategy,
  its placement, the weights' layout rule where they are sharded over context, the remat and microbatches."""
  out = [f"mesh.{AX.CONTEXT}={p[AX.CONTEXT]}", f"mesh.{AX.FSDP}={p[AX.FSDP]}", f"mesh.{AX.TENSOR}={p[AX.TENSOR]}"]
  if p[AX.CONTEXT] > 1:
    out += [f"context.impl={c.context.impl}", f"context.load_balance={str(p['load_balance']).lower()}"]
    if p.get("ulysses"):
      out.append(f"context.ulysses={p['ulysses']}")
    if p["weights_over_context"]:
      out.append(f"layout.rules.embed=[{','.join(c.layout.rule('embed'))}]")
  return out + [f"schedule.remat={p['remat']}", f"schedule.microbatches={p['microbatches']}"]


def reason(cands: list[dict]) -> str:
  """Why the first of `cands` (sorted by predicted step) beats the first of another strategy or degree."""
  best = cands[0]
  differs = lambda p: p["strategy"] != best["strategy"] or p[AX.CONTEXT] != best[AX.CONTEXT]
  same = lambda p: abs(p["t_step_s"] - best["t_step_s"]) <= 1e-3 * best["t_step_s"]
  ties = [p["label"] for p in cands[1:] if differs(p) and same(p)]     # a2a_p2p in one node is Ulysses, say
  other = next((p for p in cands[1:] if differs(p) and not same(p)), None)
  tied = f" ({', '.join(ties)}: the same predicted step)" if ties else ""
  say = lambda p: (f"{p['label']}: predicted step {p['t_step_s'] * 1e3:.0f} ms (attention {p['t_attention_s'] * 1e3:.0f}, "
                   f"exposed context comm {p['exposed_comm_s'] * 1e3:.0f}; {p['bytes_per_layer']['forward'] / 1e6:.1f} MB"
                   f" per layer forward over context)")
  if other is None:
    return say(best) + tied + ("; the only candidate" if not ties else "")
  gain = other["t_step_s"] / best["t_step_s"] - 1
  pct = f"{gain:.1%}" if gain < 0.01 else f"{gain:.0%}"      # under 1%: one decimal, not "0% faster"
  return (f"{say(best)}{tied}, {pct} faster than {say(other)}; "
          f"memory {best['memory_bytes'] / 1e9:.0f} GB vs {other['memory_bytes'] / 1e9:.0f} GB per device")
