"""Context parallelism, analysed: bytes per device per layer of each strategy (schedules/context.py), the causal
work each device does (balanced or not), a ring's makespan, one layer's attention and its transfers per strategy
(layer_time: what the time model, step_model.py, prices attention by). A step per strategy and the choice among
strategies and degrees: context_search.py. Every time here is a MODEL PREDICTION.

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

from dataclasses import dataclass, field

from shardlab.analysis.links import switch_bandwidths, transfer_seconds
from shardlab.config import ContextConfig, ModelConfig
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
    return self.a.block_flops() / rate, self.a.block_flops() * bwd_over_fwd(self.pallas) / rate

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


def bwd_over_fwd(pallas: bool) -> float:
  """A kernel's backward FLOPs over its forward's: shardlab's Pallas kernel's as it states them (its dQ kernel
  recomputes what its dK/dV kernel did: flash_kernel.BWD_OVER_FWD, 3.5), else FlashAttention-2's 2.5."""
  return F.BWD_OVER_FWD if pallas else BWD_OVER_FWD


def runs_pallas(strategy, a: Attn, hw) -> bool:
  """Whether the layer's attention kernel is shardlab's Pallas kernel on hw's target platform (pallas_on)."""
  return getattr(hw, "target_platform", "") in pallas_on(strategy, a)


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
  cost = Rates(a, hw, bandwidth, balanced, skips_masked, merge, pallas=runs_pallas(strategy, a, hw))
  by = bytes_per_layer(strategy, a)
  if a.C == 1:
    fwd, bwd = cost.block_s
    return LayerTime((fwd + bwd) * (0.5 if skips_masked else 1.0), 0.0, 0.0, by)
  t = strategy_of(strategy).layer_time(a, cost)
  return LayerTime(t["attention_s"], t["comm_s"], t["exposed_s"], by)


def own_kernel_skips(model) -> bool:
  """Whether the model's own attention kernel (what runs without a context split) skips the blocks a causal mask
  hides: blockwise (attention.py: the blocks above the diagonal) and cuDNN's flash kernel do, the plain one not."""
  return model.attention != "plain"
