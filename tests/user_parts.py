"""Parts as a user writes them in a file of their own (imported by module path: `schedule.tp=user_parts:RingColumn`,
with tests/ on sys.path): what the guards at the joints must judge by what each class is and states, never by its
name (tests/test_joints.py)."""
from shardlab import collectives as C
from shardlab.schedules.context import AllGatherKV, Ring
from shardlab.schedules.expert import AllGather, Dispatcher
from shardlab.schedules.tp import SEQ_DIM, TENSOR, AllGatherTP
from shardlab.schedules.weights import FSDPWeights, itemsize


class AllGatherCopy(AllGatherTP):
  """The all-gather contraction under another name: the same verdict as schedule.tp=allgather."""


class RingColumn(AllGatherTP):
  """docs/schedules.md's suggestion: the column contraction as a ring, the row one inherited. It does not state
  whether it places ppermutes (it does)."""

  def _column(self, x, f):
    return C.all_gather_matmul(x, f, TENSOR, SEQ_DIM, False)


class StatedRingColumn(RingColumn):
  point_to_point = True


class Liar(RingColumn):
  """Says it places no ppermute, and does: the pipeline's trace-time check catches it."""
  point_to_point = False


class ProtocolTP:
  """A TP contraction written from the protocol alone (schedules/protocol.py: TPContraction), no shardlab base
  class: every method delegates to an all-gather contraction. It states nothing."""

  def __init__(self):
    self._tp = AllGatherTP()

  @property
  def layout(self):
    return self._tp.layout

  @layout.setter
  def layout(self, value):
    self._tp.layout = value

  seq_sharded = True
  bidirectional = False
  axis = TENSOR

  def honours(self): return self._tp.honours()
  def columns(self, x, ws, eqs): return self._tp.columns(x, ws, eqs)
  def column(self, x, w, eq): return self._tp.column(x, w, eq)
  def row(self, h, w, eq): return self._tp.row(h, w, eq)
  def reduce(self, y): return self._tp.reduce(y)
  def vocab_max(self, x): return self._tp.vocab_max(x)
  def vocab_sum(self, x): return self._tp.vocab_sum(x)
  def vocab_start(self, v): return self._tp.vocab_start(v)
  def head_start(self, h): return self._tp.head_start(h)
  def batch_sum(self, x): return self._tp.batch_sum(x)
  def seq_shard(self, x): return self._tp.seq_shard(x)
  def token_sum(self, x): return self._tp.token_sum(x)


class RingCopy(Ring):
  """Ring attention under another name: the same verdict as context=ring."""


class OptionsNotADict(Ring):
  """A ring whose compiler_options returns no dict: one line naming it, before anything compiles."""

  def compiler_options(self, platform, shape):
    return None


class GatherKVCopy(AllGatherKV):
  """All-gather attention under another name: the same verdict as context=all_gather."""


class ProtocolCP:
  """A context strategy written from the protocols alone (schedules/protocol.py: ContextStrategy, and
  ContextCost for its price), no shardlab base class: K/V all-gathered, as context=all_gather does, and the same
  cost terms stated by hand."""
  point_to_point = False

  def __init__(self, model, layout, cfg):
    self.model, self.cfg, self._kv = model, cfg, AllGatherKV(model, layout, cfg)

  def parts(self, shape): return self._kv.parts(shape)
  def check(self, shape): return self._kv.check(shape)
  def attend(self, q, k, v, positions): return self._kv.attend(q, k, v, positions)

  def bytes_per_layer(self, a):
    f = (a.C - 1) * 2 * a.b * a.L * a.G * a.K * a.e // a.C
    return {"forward": f, "backward": f}

  def layer_time(self, a, cost):
    fwd, bwd = cost.block_s
    comm = 2 * cost.transfer(self.bytes_per_layer(a)["forward"], hops=a.C // 2)
    return {"attention_s": cost.busiest() * (fwd + bwd), "comm_s": comm, "exposed_s": comm}

  def skips_masked(self): return False
  def transient_bytes(self, a): return 2 * 4.0 * a.b * a.H * (a.L // a.C) * a.L
  def kept_attention(self): return self.model.attention
  def kept_per_token(self, remat): return 0
  def why_not(self, shape): return None


class Unpriced:
  """A context strategy with the run's protocol and no cost terms: it trains, and the planner says it cannot
  price it."""

  def __init__(self, model, layout, cfg):
    self.model, self.cfg, self._kv = model, cfg, AllGatherKV(model, layout, cfg)

  def parts(self, shape): return self._kv.parts(shape)
  def check(self, shape): return self._kv.check(shape)
  def attend(self, q, k, v, positions): return self._kv.attend(q, k, v, positions)


class CastFirst(FSDPWeights):
  """A weights part of a user's: every shard cast to the compute dtype before its gather, whatever
  schedule.gather_dtype says (half the bytes under bf16), and the cost terms that say so."""

  def gather(self, shard, decl, stacked=False):
    return super().gather(shard.astype(self.dtype), decl, stacked)

  def element_bytes(self, precision):
    return itemsize(precision.compute_dtype)

  def cast_bytes(self, precision):
    pb, cb = itemsize(precision.param_dtype), itemsize(precision.compute_dtype)
    return cb if cb != pb else 0


class ProtocolWeights:
  """A weights part written from the protocol alone (schedules/protocol.py: WeightsPart), no shardlab base class:
  every method delegates to the FSDP part, cost terms included."""

  def __init__(self, model, layout, cfg, tp, compute_dtype):
    self.cfg, self._w = cfg, FSDPWeights(model, layout, cfg, tp, compute_dtype)

  def honours(self, axis_names): return self._w.honours(axis_names)
  def gather(self, shard, decl, stacked=False): return self._w.gather(shard, decl, stacked)
  def reduce_grad(self, grad, shard, decl, stacked=False): return self._w.reduce_grad(grad, shard, decl, stacked)
  def stage(self, layer_fn, gather, reduce, policy): return self._w.stage(layer_fn, gather, reduce, policy)

  @property
  def once_per_step(self): return self._w.once_per_step

  @property
  def regathers(self): return self._w.regathers

  def element_bytes(self, precision): return self._w.element_bytes(precision)
  def live_layers(self, n): return self._w.live_layers(n)
  def cast_bytes(self, precision): return self._w.cast_bytes(precision)


class GatherDispatcher(Dispatcher):
  """A dispatcher of a user's as docs/experts.md writes one: a Dispatcher subclass with its own `dispatch` (here
  all_gather's) and none of the cost terms, which the base leaves unstated (they raise NotImplementedError)."""
  dispatch = AllGather.dispatch
