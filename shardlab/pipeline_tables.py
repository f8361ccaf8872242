"""Pipeline schedules as tables: what each pipeline stage runs, in which order, and when. Pure Python (no JAX):
the executor (schedules/pipeline.py), the memory model, the planner and the replay (analysis/pipeline_replay.py)
all read the same tables.

P stages (devices on the `pipeline` axis), M microbatches, V chunks per stage (interleaved: device s holds model
stages s, s + P, ..., s + (V-1) P, Megatron's assignment; chunk c of device s is virtual stage c P + s; in a V,
zb_v's and dualpipev's, device s holds model stages s and 2P - 1 - s: `Ticks.v_shape`). An action
is the forward (F), the backward (B: input gradient, and the weight gradient unless split off) or the split-off
weight gradient (W, zero-bubble) of one microbatch on one chunk. A schedule is, per stage, the order of its
actions (`orders`, torch.distributed.pipelining's `pipeline_order`); `table` places them on ticks, at most one
F, then one B, then one W per stage per tick (one action per tick where the backward is split or the chunks sit
in a V), each as soon as its inputs exist (an activation or cotangent sent at
the end of tick t is there in tick t+1): the static table the executor (schedules/pipeline.py: `Pipeline`) runs,
the cost model replays with the compiled slots' times (analysis/pipeline_replay.py: `replay`, `draw`).

  gpipe        every forward, then every backward (GPipe, Huang et al. 2019): M microbatches of activations
  1f1b         P - 1 - s forwards to warm up, then one forward one backward, then the rest of the backwards
               (PipeDream-flush, Narayanan et al. 2021): at most P - s microbatches in flight on stage s
  eager_1f1b   1f1b warming up with 2 (P - 1 - s) forwards: in ticks where a message takes one tick per hop each
               way (this executor's), the steady state runs one F and one B on every stage every tick, so its
               bubble is 1f1b's closed form, for up to 2 (P - s) - 1 microbatches in flight (jaxpp's Eager1F1B)
  interleaved  1f1b over V chunks per stage, microbatches in groups of P (Megatron-LM's interleaved schedule,
               Narayanan et al. 2021): bubble (P-1)/(V M + P-1) for V times the point-to-point messages; with
               `pipeline.consecutive=N`, in groups of N (Llama 3's flexible interleave, arXiv:2407.21783 sec.
               3.3.2: N >= P microbatches back to back per chunk, M any multiple of N; more in flight as N grows,
               (V-1) N + 2 (P-1-s) warm-up forwards as torch's ScheduleInterleaved1F1B counts them)
  zb_h1        1f1b with each backward split into B (input gradient: on the critical path) and W (weight
               gradient: deferred into what would be bubble), holding no more microbatches than 1f1b (ZB-H1, Qi
               et al. 2023, arXiv:2401.10241)
  zb_h2        zb_h1 warmed up with 2 (P - 1 - s) forwards: up to 2P - 1 in flight until W (ZB-H2)
  zb_v         two chunks per stage in a V, each backward split (ZB-V, Qi et al. sec. 6; torch's
               ScheduleZBVZeroBubble): 2P half-stage chunks in flight, 1F1B's memory
  dualpipev    two chunks in a V, one chunk's forward beside the other's backward in its main phase (DeepSeek-V3's
               DualPipe cut in half; torch's ScheduleDualPipeV): M >= 2P, 2P + 1 half-stage chunks in flight
  looped_bfs   breadth first over V chunks: every microbatch's forward through chunk 0, then chunk 1, ..., then
               the backwards in the reverse order (torch's ScheduleLoopedBFS, Lamy-Poirier 2023,
               arXiv:2211.05953): GPipe per chunk, M V microbatch-chunks in flight, the bubble of interleaved

Closed forms with uniform per-microbatch stage times and free links (`closed_form_bubble`): gpipe and 1f1b leave
a bubble of (P-1)/(M+P-1) of the step, interleaved (P-1)/(V M+P-1); with T_F = T_B = T_W, zb_h1 and zb_h2
(P-1)/(3M+P-1) (Qi et al.'s ZB-H1), zb_v and dualpipev (P-1)/(6M+P-1). tests/test_pipeline_tables.py checks
`replay(sync=False)` against each; in the executor's neighbour-synchronised ticks (`sync=True`) gpipe, eager_1f1b,
interleaved and the zero-bubble tables (one action per tick) keep theirs and 1f1b pays a tick per hop: its P - 1
- s warm-up forwards are too few to keep every stage busy when the backward wave takes a whole tick per stage (50%
at P = 4, M = 8, T_B = 2 T_F, against 27%).

`check` rejects a table that reads an activation before it was sent, misses or repeats an action, or never runs a
backward; `table` rejects orders that deadlock. Each is one ConfigError line naming the stage, tick and action.

A schedule also travels as a file in torch.distributed.pipelining's CSV format (torchtitan's
`--parallelism.pipeline_parallel_schedule_csv`): one row per rank, each cell `{stage}{action}{microbatch}` in the
rank's order. `read_csv` takes it (`pipeline.table=PATH.csv`), `write_csv` writes any schedule's orders as one
(`python -m shardlab.pipeline export ...`).
"""
from __future__ import annotations

import csv
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlab.errors import ConfigError
from shardlab.loading import call_user, kind_of, load_object

KINDS = ("F", "B", "W")
SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "interleaved", "zb_h1", "zb_h2", "zb_v", "dualpipev", "looped_bfs")
V_SHAPED = ("zb_v", "dualpipev")          # two chunks per stage in a V: chunk 0 is model stage s, chunk 1 2P - 1 - s
CHUNKED = ("interleaved", "looped_bfs", *V_SHAPED)   # the schedules that run several chunks (virtual stages) per stage


class Ticks(list):
  """A table: [tick][stage] -> the actions that stage runs in that tick; `v_shape`: where its chunks sit (False:
  looped, chunk c of stage s is model stage c P + s; True: in a V, chunk 1 of stage s is model stage 2P - 1 - s).
  A plain list of ticks (a user's table) is looped."""
  v_shape = False

  def __init__(self, rows=(), v_shape: bool = False):
    super().__init__(rows)
    self.v_shape = v_shape


def v_shaped(ticks) -> bool:
  """Whether a table's chunks sit in a V (a plain list of ticks: looped)."""
  return getattr(ticks, "v_shape", False)


@dataclass(frozen=True, order=True)
class Action:
  kind: str        # F | B | W
  mb: int          # microbatch
  chunk: int = 0   # which of the stage's V chunks (virtual stage chunk * P + stage)

  def __str__(self) -> str:
    return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def vstage(stage: int, chunk: int, P: int, v_shape: bool = False) -> int:
  """The model stage (0 .. V P - 1, in the order layers run) of chunk `chunk` on pipeline stage `stage`: c P + s,
  looped; in a V (ZB-V, DualPipeV) the odd chunks run back up the stages, c P + P - 1 - s."""
  return chunk * P + (P - 1 - stage if v_shape and chunk % 2 else stage)


def _where(v: int, P: int, v_shape: bool = False) -> tuple[int, int]:
  """Virtual stage v -> (pipeline stage, chunk)."""
  c, r = divmod(v, P)
  return (P - 1 - r if v_shape and c % 2 else r), c


# ------------------------------------------------------------------------------------------- per-stage orders

def _one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
  """`warmup` forwards, then alternate one forward and one backward, then the remaining backwards."""
  out, f, b = list(fwd[:warmup]), warmup, 0
  while f < len(fwd) or b < len(bwd):
    if f < len(fwd):
      out.append(fwd[f])
      f += 1
    if b < len(bwd):
      out.append(bwd[b])
      b += 1
  return out


def _zb_v(P: int, M: int, s: int) -> list[Action]:
  """Stage s of ZB-V (Qi et al., arXiv:2401.10241 sec. 6; torch's ScheduleZBVZeroBubble): chunk 0 (model stage s)
  and chunk 1 (2P - 1 - s), each backward split into B and W. Warm up with 2 (P - s) - 1 forwards of chunk 0, s
  pairs of forwards (chunk 1, chunk 0), P - s rounds of chunk 1's F, B, W; then rounds of F, B, W on chunk 0 and
  on chunk 1; then the backwards left, their W's last. Built for at least 2P - 1 microbatches and cut to M."""
  n, out = max(2 * P - 1, M), []
  f, b, w = [0, 0], [0, 0], [0, 0]

  def run(kind: str, c: int) -> None:
    count = {"F": f, "B": b, "W": w}[kind]
    out.append(Action(kind, count[c], c))
    count[c] += 1
  for _ in range(2 * (P - s) - 1):
    run("F", 0)
  for _ in range(s):
    run("F", 1), run("F", 0)
  for _ in range(P - s):
    run("F", 1), run("B", 1), run("W", 1)
  while f[1] < f[0] or f[0] < n:
    if f[0] < n:
      run("F", 0)
    run("B", 0), run("W", 0), run("F", 1), run("B", 1), run("W", 1)
  for _ in range(s):
    run("B", 0), run("B", 1)
  for _ in range(P - s):
    run("B", 0), run("W", 0)
  while w[1] < b[1]:
    run("W", 1)
  while w[0] < b[0]:
    run("W", 0)
  return [a for a in out if a.mb < M]


def _dualpipe_v(P: int, M: int, s: int) -> list[Action]:
  """Stage s of DualPipeV (DeepSeek-V3's DualPipe cut in half, deepseek-ai/DualPipe `dualpipev.py`; torch's
  ScheduleDualPipeV): in its main phase each step runs a forward of one chunk beside a whole backward (B and W) of
  the other, overlapped on a GPU; this executor, one action per tick in a V, runs them in consecutive ticks. Phases: 2 (P - 1 - s) forwards of chunk 0;
  s + 1 pairs of forwards (chunk 0, chunk 1); P - 1 - s rounds of chunk 1's B (its W queued) and F; M - 2P + s + 1
  main steps (F chunk 0 beside B chunk 1, F chunk 1 beside B chunk 0); P - 1 - s of chunk 1's B beside F chunk 1
  and B chunk 0; s + 1 pairs of backwards (chunk 1, chunk 0), split from the middle on; P - 1 - s backwards of
  chunk 0 after a queued W; the W's left. M >= 2P."""
  out: list[Action] = []
  f, b = [0, 0], [0, 0]
  queue: list[Action] = []

  def fwd(c: int) -> None:
    out.append(Action("F", f[c], c))
    f[c] += 1

  def bwd(c: int, split: bool = False) -> None:
    out.append(Action("B", b[c], c))
    (queue if split else out).append(Action("W", b[c], c))
    b[c] += 1

  def weight() -> None:
    if queue:
      out.append(queue.pop(0))
  for _ in range(2 * (P - 1 - s)):
    fwd(0)
  for _ in range(s + 1):
    fwd(0), fwd(1)
  for _ in range(P - 1 - s):
    bwd(1, split=True), weight(), fwd(1)
  for _ in range(M - 2 * P + s + 1):
    fwd(0), bwd(1), fwd(1), bwd(0)
  for _ in range(P - 1 - s):
    bwd(1), fwd(1), bwd(0)
  split = False
  for i in range(s + 1):
    split = split or (i == (s + 1) // 2 and s % 2 == 1)
    bwd(1, split)
    split = split or (i == (s + 1) // 2 and s % 2 == 0)
    bwd(0, split)
  for _ in range(P - 1 - s):
    weight(), bwd(0, split)
  while queue:
    weight()
  return out


def orders(name: str, P: int, M: int, V: int = 1, consecutive: int = 0) -> list[list[Action]]:
  """Per stage, its actions in the order it runs them, for a named schedule (interleaved: microbatches in groups
  of `consecutive`, 0: of P)."""
  check_shape(name, P, M, V, consecutive)
  out = []
  for s in range(P):
    if name == "gpipe":
      out.append([Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)])
    elif name in ("1f1b", "eager_1f1b", "zb_h1", "zb_h2"):
      warmup = min((2 if name in ("eager_1f1b", "zb_h2") else 1) * (P - 1 - s), M)
      order = _one_f_one_b([Action("F", m) for m in range(M)], [Action("B", m) for m in range(M)], warmup)
      if name in ("zb_h1", "zb_h2"):   # each B's weight gradient W: placed by `table` into the ticks B leaves idle
        order = [a for x in order for a in ((x, Action("W", x.mb)) if x.kind == "B" else (x,))]
      out.append(order)
    elif name == "zb_v":
      out.append(_zb_v(P, M, s))
    elif name == "dualpipev":
      out.append(_dualpipe_v(P, M, s))
    elif name == "looped_bfs":   # breadth first: every microbatch through chunk 0, then chunk 1, ..; backwards
      out.append([Action("F", m, c) for c in range(V) for m in range(M)] +      # the other way (torch's
                 [Action("B", m, c) for c in reversed(range(V)) for m in range(M)])   # ScheduleLoopedBFS)
    else:                   # interleaved: microbatches in groups of N (P: Megatron-LM), chunks in turn
      N = consecutive or P
      fwd = [Action("F", g * N + i, c) for g in range(M // N) for c in range(V) for i in range(N)]
      bwd = [Action("B", g * N + i, c) for g in range(M // N) for c in reversed(range(V)) for i in range(N)]
      warmup = min((P - 1 - s) * 2 + (V - 1) * N, len(fwd))
      out.append(_one_f_one_b(fwd, bwd, warmup))
  return out


def chunks_per_stage(name: str) -> int:
  """The V a search runs the named schedule at: 2 where its table runs several chunks per stage (check_shape says
  which), else 1."""
  try:
    check_shape(name, 2, 8, 2)
  except ConfigError:
    return 1
  return 2


def check_shape(name: str, P: int, M: int, V: int, consecutive: int = 0) -> None:
  """The settings a named schedule can run with; one line otherwise."""
  if name not in SCHEDULES:
    raise ConfigError(f"pipeline={name}: unknown; choose one of {', '.join(SCHEDULES)}")
  if P < 1 or M < 1 or V < 1:
    raise ConfigError(f"pipeline: stages {P}, microbatches {M}, virtual stages {V}: each must be >= 1")
  if name in V_SHAPED and V != 2:
    raise ConfigError(f"pipeline={name} runs two chunks per stage in a V (stage s holds model stages s and 2P - 1 - "
                      f"s): set pipeline.virtual_stages=2, not {V}")
  if name == "dualpipev" and M < 2 * P:
    raise ConfigError(f"pipeline=dualpipev needs at least 2 x mesh.pipeline = {2 * P} microbatches (its main phase "
                      f"runs one chunk's forward beside the other's backward); pipeline.microbatches={M}")
  if name not in CHUNKED and V != 1:
    raise ConfigError(f"pipeline.virtual_stages={V}: only pipeline={' or '.join(CHUNKED)} run several chunks per "
                      f"stage")
  if consecutive and name != "interleaved":
    raise ConfigError(f"pipeline.consecutive={consecutive}: only pipeline=interleaved runs microbatches in groups "
                      f"(set pipeline.consecutive=0)")
  if consecutive < 0 or 0 < consecutive < P:
    raise ConfigError(f"pipeline.consecutive={consecutive}: groups of at least mesh.pipeline={P} microbatches (0: "
                      f"{P}): a smaller group's next chunk waits for microbatches still in the stages behind, as "
                      f"torch's ScheduleInterleaved1F1B keeps its rounds of at least P")
  if name == "interleaved" and consecutive and M % consecutive:
    raise ConfigError(f"pipeline.microbatches={M} is not a multiple of pipeline.consecutive={consecutive} "
                      f"(interleaved runs microbatches in groups of it); choose microbatches a multiple of "
                      f"{consecutive}")
  if name == "interleaved" and not consecutive and M % P:
    raise ConfigError(f"pipeline.microbatches={M} is not a multiple of mesh.pipeline={P} (interleaved runs "
                      f"microbatches in groups of P); choose microbatches a multiple of {P}, or set "
                      f"pipeline.consecutive to a group size that divides them")


# ------------------------------------------------------------------------------------------ dependencies, ticks

SLOT = {"F": 0, "B": 1, "W": 2}   # the order of a tick's slots on one stage


def needs(a: Action, stage: int, P: int, V: int, v_shape: bool = False) -> list[tuple[int, Action]]:
  """(stage, action) pairs that must be done (and, from another stage, sent) before `a` runs on `stage`."""
  v, last = vstage(stage, a.chunk, P, v_shape), V * P - 1
  if a.kind == "F":
    if v == 0:
      return []
    s, c = _where(v - 1, P, v_shape)
    return [(s, Action("F", a.mb, c))]
  if a.kind == "B":
    need = [(stage, Action("F", a.mb, a.chunk))]
    if v < last:
      s, c = _where(v + 1, P, v_shape)
      need.append((s, Action("B", a.mb, c)))
    return need
  return [(stage, Action("B", a.mb, a.chunk))]   # W after its own B


def _ready(a: Action, s: int, t: int, cell, done: dict, P: int, V: int, v_shape: bool = False) -> bool:
  """`a` can run on stage s in tick t after the actions already in `cell`: an input from another stage, or from
  another chunk of this stage (a V's turn), was made in an earlier tick (it is sent, or filed, at the end of that
  tick); one of this chunk's own earlier or earlier in this tick."""
  return all((n in done and done[n] < t) or (n[0] == s and n[1] in cell and n[1].chunk == a.chunk)
             for n in needs(a, s, P, V, v_shape))


def table(orders_: list[list[Action]], V: int = 1, v_shape: bool = False) -> Ticks:
  """The static table [tick][stage] -> the actions that stage runs in that tick, in slot order: at most one
  forward, then one backward, then one weight gradient (what one executor tick does; a 1F1B steady state runs
  one F and one B per tick). Each stage takes the next action of its order at the first tick its inputs are
  there (one from another stage: sent at the end of the tick it was made). A table that splits the backward
  (zero-bubble) or sits in a V runs one action per tick: the executor's neighbours keep step tick by tick, so a
  hop costs a tick, and a tick of one action costs a hop what an asynchronous runtime pays (zb_h1's bubble at P =
  4, M = 8, T_F = T_B = T_W: 11.1% so, 36.8% in ticks of F, B and W); in a V it also means a stage sends at most
  one activation or gradient per tick. A W (split weight gradient) may run later than listed: in a tick where the
  stage has nothing else ready, or before the stage's next forward when it holds as many microbatch-chunks
  (forward run, W not yet) as the most any stage's order runs forwards before its first backward (1f1b's peak, P:
  ZB-H1 keeps 1F1B's memory, Qi et al.). Orders that can never finish deadlock: one line naming the stuck
  stages. `v_shape`: the chunks sit in a V (Ticks)."""
  P = len(orders_)
  done: dict[tuple[int, Action], int] = {}
  pending = [list(o) for o in orders_]
  deferred: list[list[Action]] = [[] for _ in range(P)]
  most = max(next((i for i, a in enumerate(a for a in o if a.kind != "W") if a.kind == "B"), len(o))
             for o in orders_)
  live = [0] * P      # per stage, microbatch-chunks whose forward ran and whose W has not (split tables)
  split = any(a.kind == "W" for o in orders_ for a in o)
  one = split or v_shape   # one action per tick
  ticks, t = [], 0
  limit = 4 * sum(len(o) for o in orders_) + 4
  while any(pending) or any(deferred):
    row = []
    for s in range(P):
      cell: list[Action] = []
      full = split and live[s] >= most    # the W's wait: the next forward waits for one of them
      for kind in ("F", "B"):
        while pending[s] and pending[s][0].kind == "W":    # W's wait in the stage's deferred queue
          deferred[s].append(pending[s].pop(0))
        if (pending[s] and pending[s][0].kind == kind and not (kind == "F" and full) and not (one and cell)
                and _ready(pending[s][0], s, t, cell, done, P, V, v_shape)):
          cell.append(pending[s].pop(0))
          live[s] += cell[-1].kind == "F"
      while pending[s] and pending[s][0].kind == "W":
        deferred[s].append(pending[s].pop(0))
      if deferred[s] and not cell and _ready(deferred[s][0], s, t, cell, done, P, V, v_shape):
        cell.append(deferred[s].pop(0))
        live[s] -= 1
      row.append(tuple(cell))
    for s, cell in enumerate(row):
      for a in cell:
        done[(s, a)] = t
    if not any(row):
      stuck = "; ".join(f"stage {s} waits to run {(pending[s] or deferred[s])[0]}" for s in range(P)
                        if pending[s] or deferred[s])
      raise ConfigError(f"pipeline table deadlocks at tick {t}: {stuck}")
    ticks.append(row)
    t += 1
    if t > limit:
      raise ConfigError("pipeline table does not finish")
  return Ticks(ticks, v_shape)


def check(ticks, M: int, V: int = 1) -> None:
  """A table [tick][stage] -> (actions) runs: each cell holds at most one F, B and W, in that order; every
  stage runs F and B (and W, if any B is split) of every microbatch and chunk exactly once, and nothing before
  its inputs were sent (the end of an earlier tick, for an input from another stage). One line otherwise."""
  if not ticks or not ticks[0]:
    raise ConfigError("pipeline table: it has no ticks or no stages")
  P, v_shape = len(ticks[0]), v_shaped(ticks)
  split = any(a.kind == "W" for row in ticks for cell in row for a in cell)
  when: dict[tuple[int, Action], tuple[int, int]] = {}
  for t, row in enumerate(ticks):
    if len(row) != P:
      raise ConfigError(f"pipeline table: tick {t} has {len(row)} stages, tick 0 has {P}")
    for s, cell in enumerate(row):
      kinds = [a.kind for a in cell]
      if kinds != sorted(kinds, key=SLOT.get) or len(set(kinds)) < len(kinds):
        raise ConfigError(f"pipeline table: stage {s} at tick {t} runs {', '.join(map(str, cell))}; a tick "
                          f"holds at most one forward, then one backward, then one weight gradient")
      if v_shape and len(cell) > 1:
        raise ConfigError(f"pipeline table: stage {s} at tick {t} runs {', '.join(map(str, cell))}; a tick of a "
                          f"V-shaped table holds one action (its output goes one way)")
      for i, a in enumerate(cell):
        if (s, a) in when:
          raise ConfigError(f"pipeline table: stage {s} runs {a} twice (ticks {when[(s, a)][0]} and {t})")
        when[(s, a)] = (t, i)
  want = {(s, Action(k, m, c)) for s in range(P) for m in range(M) for c in range(V)
          for k in (("F", "B", "W") if split else ("F", "B"))}
  missing = sorted(want - set(when), key=lambda x: (x[1].kind != "B", x))
  if missing:
    s, a = missing[0]
    what = "never runs a backward" if a.kind == "B" else "never runs"
    raise ConfigError(f"pipeline table: stage {s} {what}: {a} is missing ({len(missing)} actions missing)")
  extra = sorted(set(when) - want)
  if extra:
    s, a = extra[0]
    raise ConfigError(f"pipeline table: stage {s} runs {a}, which is not an action of {M} microbatches x {V} chunks")
  for (s, a), (t, i) in sorted(when.items(), key=lambda x: x[1]):
    for n in needs(a, s, P, V, v_shape):
      ok = n in when and (when[n][0] < t or (n[0] == s and n[1].chunk == a.chunk and when[n] < (t, i)))
      if not ok:
        src = "never" if n not in when else f"at tick {when[n][0]}"
        raise ConfigError(f"pipeline table: stage {s} runs {a} at tick {t}, but its input {n[1]} from stage "
                          f"{n[0]} is made {src}: it reads an activation before it was sent")


def build(name: str, P: int, M: int, V: int = 1, consecutive: int = 0) -> Ticks:
  """The checked table of a named schedule."""
  ticks = table(orders(name, P, M, V, consecutive), V, name in V_SHAPED)
  check(ticks, M, V)
  return ticks


def in_flight(ticks, until: str = "B") -> list[int]:
  """Per stage, the most microbatch-chunks whose activations it holds at once, from each F until its B (the
  residuals the backward reads): M for gpipe, at most P - s for 1f1b and zb_h1 on stage s. until="W": until the
  weight gradient of a split table (the residuals and output gradients a waiting W still holds)."""
  P = len(ticks[0])
  out = []
  for s in range(P):
    live = peak = 0
    for row in ticks:
      for a in row[s]:
        live += 1 if a.kind == "F" else -1 if a.kind == until else 0
        peak = max(peak, live)
    out.append(peak)
  return out


def closed_form_bubble(name: str, P: int, M: int, V: int = 1) -> float:
  """(P-1)/(M+P-1) for gpipe, 1f1b and eager_1f1b, (P-1)/(V M+P-1) for interleaved and looped_bfs (the fill
  and drain of chunks 1/V of a stage; interleaved in groups of N >= P as well, each stage busy from its first
  forward; groups of N < P wait for their first microbatch to come round). With the backward split and T_F = T_B
  = T_W, the least a table can idle is the first forward's walk to the last stage: zb_h1 and zb_h2 reach it from
  M = P on, (P-1)/(3M+P-1) (Qi et al.'s ZB-H1 figure), and zb_v and dualpipev over chunks of half a stage,
  (P-1)/(6M+P-1)."""
  if name in ("zb_h1", "zb_h2"):
    return (P - 1) / (3 * M + P - 1)
  if name in V_SHAPED:
    return (P - 1) / (3 * V * M + P - 1)
  return (P - 1) / ((V if name in CHUNKED else 1) * M + P - 1)


# ---------------------------------------------------------------------------------------- the executor's plan
#
# One program runs every stage (SPMD). Each tick, a stage runs its F slot, its B slot and its W slot (each a
# lax.cond: skipped when the table leaves it empty), then sends its forward output to the next stage and its
# input gradient to the previous one (two ppermutes over `pipeline`, every tick, whatever was computed). What a
# stage holds between slots lives in buffers of static slots, allocated here from the table (`Plan`), so a stage
# holds no more microbatches than its table has in flight: P for 1f1b, M for gpipe.

PHASE = {"F": 0, "B": 1, "W": 2, "recv": 3}   # order of the parts of a tick


def _allocate(intervals: dict) -> tuple[dict, int]:
  """{key: (first, last)} use of a buffer, each a (tick, phase) -> ({key: slot}, slots): the fewest slots such
  that no two keys whose uses overlap share one (interval colouring, by start)."""
  ends: list = []
  out = {}
  for key, (first, last) in sorted(intervals.items(), key=lambda kv: kv[1]):
    slot = next((i for i, e in enumerate(ends) if e < first), len(ends))
    if slot == len(ends):
      ends.append(last)
    ends[slot] = last
    out[key] = slot
  return out, len(ends)


class Plan:
  """The static arrays the executor reads, per tick and stage, from a checked table: which slots run, on which
  microbatch and chunk, and which buffer slot each input is read from and each result written to. A buffer
  slot index equal to the buffer's slot count is an idle slot's (the executor's write of it writes nothing)."""

  FIELDS = ("f_on", "f_mb", "f_chunk", "f_first", "f_last", "f_in", "f_res", "f_dy",
            "b_on", "b_mb", "b_chunk", "b_first", "b_res", "b_dy", "b_w",
            "w_on", "w_chunk", "w_res", "w_w", "r_in", "r_dy", "r_in_up", "r_dy_down", "r_in_own", "r_dy_own")
  # Where what a tick sends is filed: r_in, a forward output received from s - 1 (around the ring, looped); r_dy,
  # an input gradient from s + 1. A V-shaped table's stage may get both kinds from both sides and from itself
  # (the V's turn, from one chunk to the other) in one tick: r_in_up, a forward output from s + 1; r_dy_down, an
  # input gradient from s - 1; r_in_own and r_dy_own, its own.

  def __init__(self, ticks, M: int, V: int):
    P, T = len(ticks[0]), len(ticks)
    last, vs = V * P - 1, v_shaped(ticks)
    self.P, self.M, self.V, self.T, self.v_shape = P, M, V, T, vs
    where = lambda v: _where(v, P, vs)
    self.split = any(a.kind == "W" for row in ticks for cell in row for a in cell)
    at = {(s, a): t for t, row in enumerate(ticks) for s, cell in enumerate(row) for a in cell}
    use = {"in": {}, "res": {}, "dy": {}, "w": {}}
    for (s, a), t in at.items():
      v, key = vstage(s, a.chunk, P, vs), (s, a.mb, a.chunk)
      if a.kind == "F":
        if v > 0:                      # its input arrives at the end of the tick its producer ran
          src = where(v - 1)
          use["in"][key] = ((at[(src[0], Action("F", a.mb, src[1]))], PHASE["recv"]), (t, PHASE["F"]))
        end = at[(s, Action("W" if self.split else "B", a.mb, a.chunk))]
        use["res"][key] = ((t, PHASE["F"]), (end, PHASE["W" if self.split else "B"]))
      elif a.kind == "B":
        if v == last:                  # the head wrote it in this stage's F slot
          made = (at[(s, Action("F", a.mb, a.chunk))], PHASE["F"])
        else:
          src = where(v + 1)
          made = (at[(src[0], Action("B", a.mb, src[1]))], PHASE["recv"])
        use["dy"][key] = (made, (t, PHASE["B"]))
        if self.split:
          use["w"][key] = ((t, PHASE["B"]), (at[(s, Action("W", a.mb, a.chunk))], PHASE["W"]))
    per_stage = {k: [_allocate({key: u for key, u in d.items() if key[0] == s}) for s in range(P)]
                 for k, d in use.items()}
    self.slots = {k: max(n for _, n in v) for k, v in per_stage.items()}   # slots per buffer, on the busiest stage
    slot = lambda k, s, key: per_stage[k][s][0][key]
    arr = {f: np.zeros((T, P), np.int32) for f in self.FIELDS}
    buffer = {"f_in": "in", "r_in": "in", "r_in_up": "in", "r_in_own": "in", "f_res": "res", "b_res": "res",
              "w_res": "res", "f_dy": "dy", "b_dy": "dy", "r_dy": "dy", "r_dy_down": "dy", "r_dy_own": "dy",
              "b_w": "w", "w_w": "w"}
    for f, b in buffer.items():
      arr[f][:] = self.slots[b]   # idle
    for (s, a), t in at.items():
      v, key = vstage(s, a.chunk, P, vs), (s, a.mb, a.chunk)
      if a.kind == "F":
        arr["f_on"][t, s], arr["f_mb"][t, s], arr["f_chunk"][t, s] = 1, a.mb, a.chunk
        arr["f_first"][t, s], arr["f_last"][t, s] = v == 0, v == last
        arr["f_res"][t, s] = slot("res", s, key)
        if v > 0:
          arr["f_in"][t, s] = slot("in", s, key)
        if v == last:
          arr["f_dy"][t, s] = slot("dy", s, key)
        else:                          # sent at the end of tick t: the next virtual stage files it
          ns, nc = where(v + 1)
          f = "r_in_own" if ns == s else "r_in_up" if vs and ns == s - 1 else "r_in"
          arr[f][t, ns] = slot("in", ns, (ns, a.mb, nc))
      elif a.kind == "B":
        arr["b_on"][t, s], arr["b_mb"][t, s], arr["b_chunk"][t, s], arr["b_first"][t, s] = 1, a.mb, a.chunk, v == 0
        arr["b_res"][t, s], arr["b_dy"][t, s] = slot("res", s, key), slot("dy", s, key)
        if self.split:
          arr["b_w"][t, s] = slot("w", s, key)
        if v > 0:
          ps, pc = where(v - 1)
          f = "r_dy_own" if ps == s else "r_dy_down" if vs and ps == s + 1 else "r_dy"
          arr[f][t, ps] = slot("dy", ps, (ps, a.mb, pc))
      else:
        arr["w_on"][t, s], arr["w_chunk"][t, s] = 1, a.chunk
        arr["w_res"][t, s], arr["w_w"][t, s] = slot("res", s, key), slot("w", s, key)
    self.arrays = arr

  def buffers(self) -> dict:
    """What a stage holds, in units (the memory model's terms; a buffer no action uses still has one slot): `res`,
    microbatch-chunks of residuals; `x`, residual-stream blocks of one microbatch (every microbatch's embedding
    and its input gradient, the received activations and output gradients, the two sends); `w`, microbatch-
    chunks of per-layer output gradients kept for a split-off weight gradient."""
    n = self.slots
    one = lambda k: max(n[k], 1)
    return {"res": one("res"), "x": 2 * self.M + one("in") + one("dy") + 2, "w": one("w") if self.split else 0}

  def sends(self) -> tuple[list, list]:
    """The ppermute pairs over `pipeline`: forward (s -> s+1) and backward (s -> s-1), around the ring when
    looped chunks wrap from the last stage to the first (V > 1; a V turns on its last stage instead)."""
    P = self.P
    if self.V > 1 and not self.v_shape:
      return [(s, (s + 1) % P) for s in range(P)], [(s, (s - 1) % P) for s in range(P)]
    return [(s, s + 1) for s in range(P - 1)], [(s + 1, s) for s in range(P - 1)]


def runs(slot: str, n: int, of: int) -> str:
  """The named scope that declares that a lax.cond (a pipeline slot: F, B, W or head) runs its branch n times
  in `of` executions of its context (on each device of the busiest stage): the static count the ledger and the
  HLO analysis read (analysis/hlo.py: declared_runs), since a conditional's count is not in the program."""
  return f"pipeline_{slot}_runs_{n}_of_{of}"


def load_table(impl: str, P: int, M: int, V: int, consecutive: int = 0):
  """The table of `pipeline.impl`: a named schedule, or `module:Name` in the user's own file: a class (built with
  no arguments) or object with a method `orders(P, M, V)` (per stage, its list of Actions: placed on ticks by
  `table`) or `table(P, M, V)` (the ticks themselves), or a plain function, taken as `orders(P, M, V)`. Checked
  either way (`check`), before anything compiles: what the user's code returns that is not that, or raises, is one
  line naming the setting (and the user's file and line: loading.call_user)."""
  if ":" not in impl:
    return build(impl, P, M, V, consecutive)
  setting, obj = f"pipeline.impl={impl}", load_object(impl, "pipeline.impl", {}, None)
  has = lambda o, k: not inspect.ismodule(o) and callable(getattr(o, k, None))
  if inspect.isclass(obj) and (has(obj, "table") or has(obj, "orders")):
    obj = call_user(obj, impl, "pipeline.impl")
  if has(obj, "table") or has(obj, "orders"):
    kind, fn = ("table", obj.table) if has(obj, "table") else ("orders", obj.orders)
  elif callable(obj) and not inspect.isclass(obj):
    kind, fn = "orders", obj                        # a plain function: the orders (docs/pipeline.md)
  else:
    what = obj.__name__ if inspect.isclass(obj) else f"it is {kind_of(obj)} and"
    raise ConfigError(f"{setting}: {what} has neither orders(P, M, V) nor table(P, M, V); name a class with one "
                      f"of them, or a function f(P, M, V) returning each stage's list of Actions (docs/pipeline.md)")
  got, call = call_user(fn, impl, "pipeline.impl", P, M, V), f"{getattr(fn, '__name__', kind)}({P}, {M}, {V})"

  def action(a, where: str) -> Action:
    """One item of what the user's code returned: an Action of a known kind, else one line saying which."""
    if not isinstance(a, Action) or a.kind not in KINDS:
      raise ConfigError(f"{setting}: {call} returned {a!r} at {where}: not an Action of kind F, B or W; write "
                        f"Action('F', microbatch, chunk) (from shardlab.schedules.pipeline import Action)")
    return a

  def rows(x, n: int | None, where: str, want: str) -> list:
    """`x` as a list (of `n` items, if given), else one line saying what it should have been."""
    if not isinstance(x, (list, tuple)) or (n is not None and len(x) != n):
      got = f"a {type(x).__name__} of {len(x)}" if isinstance(x, (list, tuple)) else repr(x)[:60]
      raise ConfigError(f"{setting}: {call} returned {got}{where}; it must be {want} (docs/pipeline.md)")
    return list(x)

  per_stage = f"one per stage (mesh.pipeline={P})"
  if kind == "orders":
    ticks = table([[action(a, f"stage {s} item {i}") for i, a in enumerate(rows(o, None, f" for stage {s}",
                                                                                "a list of Actions"))]
                   for s, o in enumerate(rows(got, P, "", f"a list of {P} lists of Actions, {per_stage}"))], V)
  else:
    cell = lambda c, where: (() if c is None else (action(c, where),) if isinstance(c, Action) else
                             tuple(action(a, where) for a in rows(c, None, f" at {where}", "a tuple of Actions")))
    ticks = [[cell(c, f"tick {t} stage {s}") for s, c in enumerate(rows(row, P, f" at tick {t}", f"a list of {P} cells, {per_stage}"))]
             for t, row in enumerate(rows(got, None, "", "a list of ticks"))]
  check(ticks, M, V)
  return ticks


# ------------------------------------------------------------------------------- torch's CSV schedule format

CSV_CELL = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|F|I|W|B)(\d*)")
CSV_COMPUTE = {"F", "I", "W", "B"}


def read_csv(path) -> tuple[list[list[Action]], int, int, int, bool]:
  """(orders, P, V, M, v_shape) of a schedule in torch.distributed.pipelining's CSV format: one row per rank, each cell
  `{stage}{action}{microbatch}` in the rank's order, actions F (forward), I (input gradient), W (weight
  gradient), B (both), and the communication and FSDP actions SEND_F, RECV_F, SEND_B, RECV_B, UNSHARD, RESHARD.
  shardlab places those itself; where present each is checked (a send after the action that makes what it sends,
  a receive before the action that reads it, on a stage the rank holds). torch's stage s runs on rank s mod P
  (its looped placement, Megatron's interleave: shardlab's chunk s // P of stage s % P) or, in a V (torch's
  style "v": ZB-V, DualPipeV), stages r and 2P - 1 - r on rank r (`v_shape`). I is shardlab's B of a split
  backward; a B in a table that splits others is its B and W at once. What is not that is one line."""
  where = f"pipeline.table={path}"
  try:
    text = Path(path).read_text(encoding="utf-8")
  except OSError as e:
    raise ConfigError(f"{where}: cannot read it ({e.strerror or e})") from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"{where}: not a text CSV (byte {e.start} is not UTF-8; save it as UTF-8 text)") from None
  try:
    rows = [[c.strip() for c in r if c.strip()] for r in csv.reader(text.splitlines())]
  except csv.Error as e:
    raise ConfigError(f"{where}: not a CSV ({e})") from None
  rows = [r for r in rows if r]
  if not rows:
    raise ConfigError(f"{where}: no actions (one row per rank of cells like 0F0, 0I0, 0W0)")
  P, parsed = len(rows), []
  for r, row in enumerate(rows):
    out = []
    for i, cell in enumerate(row):
      m = CSV_CELL.fullmatch(cell)
      if m is None or (m.group(2) in CSV_COMPUTE or m.group(2).startswith(("SEND", "RECV"))) and not m.group(3):
        raise ConfigError(f"{where}: rank {r}, cell {i + 1}: {cell!r} is not an action ({{stage}}{{F|I|W|B|SEND_F|"
                          f"RECV_F|SEND_B|RECV_B}}{{microbatch}}, or {{stage}}UNSHARD / RESHARD)")
      stage, kind, mb = int(m.group(1)), m.group(2), int(m.group(3) or 0)
      out.append((stage, kind, mb, cell))
    parsed.append(out)
  odd = [(r, st, cell) for r, row in enumerate(parsed) for st, _, _, cell in row if (st // P) % 2]
  v_shape = bool(odd) and all(_where(st, P, True)[0] == r for r, st, _ in odd)
  for r, row in enumerate(parsed):
    for stage, _, _, cell in row:
      if _where(stage, P, v_shape)[0] != r:
        raise ConfigError(f"{where}: rank {r} runs stage {stage} ({cell}): a rank runs stages s with s mod P = "
                          f"its rank (torch's looped placement) or, in a V, stages r and 2P - 1 - r; here "
                          f"stage {stage} belongs on rank {_where(stage, P, v_shape)[0]}")
  stages = 1 + max(st for row in parsed for st, *_ in row)
  if stages % P:
    raise ConfigError(f"{where}: {stages} stages on {P} ranks: each rank must hold the same number of stages")
  V = stages // P
  M = 1 + max((mb for row in parsed for _, k, mb, _ in row if k in CSV_COMPUTE), default=-1)
  split = any(k in ("I", "W") for row in parsed for _, k, _, _ in row)
  orders = []
  for r, row in enumerate(parsed):
    order, done = [], []
    for i, (stage, kind, mb, cell) in enumerate(row):
      c = _where(stage, P, v_shape)[1]
      if kind in CSV_COMPUTE:
        if (stage, kind, mb) in done:
          raise ConfigError(f"{where}: rank {r} runs {cell} twice")
        done.append((stage, kind, mb))
        if kind == "F":
          order.append(Action("F", mb, c))
        elif kind == "W":
          order.append(Action("W", mb, c))
        else:
          order += [Action("B", mb, c)] + ([Action("W", mb, c)] if kind == "B" and split else [])
        continue
      made = {"SEND_F": ("F",), "RECV_F": ("F",), "SEND_B": ("I", "B"), "RECV_B": ("I", "B")}.get(kind)
      if made:                     # communication present in the file: in an order that can run
        ran = any((stage, k, mb) in done for k in made)
        later = any(x[0] == stage and x[2] == mb and x[1] in made for x in row[i + 1:])
        if kind.startswith("SEND") and not ran:
          raise ConfigError(f"{where}: rank {r}, {cell}: sends before {stage}{made[0]}{mb} ran on this rank")
        if kind.startswith("RECV") and not later:
          raise ConfigError(f"{where}: rank {r}, {cell}: receives what no later {stage}{made[0]}{mb} on this rank "
                            f"reads")
    orders.append(order)
  have = {(vstage(s, a.chunk, P, v_shape), a.kind, a.mb) for s, o in enumerate(orders) for a in o}   # (B: B and W)
  for st in range(stages):
    for mb in range(M):
      for k in ("F", "B", "W") if split else ("F", "B"):
        if (st, k, mb) not in have:
          shown = "I" if k == "B" and split else k
          raise ConfigError(f"{where}: rank {_where(st, P, v_shape)[0]} never runs {st}{shown}{mb} (every stage "
                            f"runs the forward and the backward{' (I and W)' if split else ''} of every microbatch, "
                            f"0 .. {M - 1})")
  return orders, P, V, M, v_shape


def write_csv(orders_: list[list[Action]], path, v_shape: bool = False) -> None:
  """Per-stage `orders_` (what `table` places on ticks) in torch.distributed.pipelining's CSV format: a row per
  rank, its compute actions in its order, stage c P + s for chunk c of stage s (in a V, 2P - 1 - s for chunk 1),
  a split backward's B as I (the communication and FSDP actions are the runtime's: left out). read_csv gives the
  same orders back."""
  P = len(orders_)
  split = any(a.kind == "W" for o in orders_ for a in o)
  name = {"F": "F", "B": "I" if split else "B", "W": "W"}
  with open(path, "w", newline="") as f:
    csv.writer(f).writerows([[f"{vstage(s, a.chunk, P, v_shape)}{name[a.kind]}{a.mb}" for a in o]
                             for s, o in enumerate(orders_)])


def orders_of(impl: str, P: int, M: int, V: int, consecutive: int = 0) -> list[list[Action]]:
  """The per-stage orders of `pipeline.impl`: a named schedule's (`orders`), or a user's table's ticks read off in
  tick order (a tick's F, then B, then W)."""
  if ":" not in impl:
    return orders(impl, P, M, V, consecutive)
  ticks = load_table(impl, P, M, V)
  return [[a for row in ticks for a in sorted(row[s], key=lambda a: SLOT[a.kind])] for s in range(P)]


def table_of(impl: str, csv_table: str, P: int, M: int, V: int, consecutive: int = 0):
  """The ticks a pipeline runs on P stages: its CSV file (`pipeline.table`, read_csv) or its schedule
  (`pipeline.impl`, load_table; interleaved in groups of `consecutive`); checked."""
  if not csv_table:
    return load_table(impl, P, M, V, consecutive)
  try:
    orders_, *_, v_shape = read_csv(csv_table)
    ticks = table(orders_, V, v_shape)
    check(ticks, M, V)
  except ConfigError as e:
    raise ConfigError(str(e) if str(e).startswith("pipeline.table=") else f"pipeline.table={csv_table}: {e}") from None
  return ticks


def depth_order(n_layers: int, P: int, V: int, v_shape: bool = False) -> list[int]:
  """The stored layer index (0 .. n_layers-1, as `params` holds them) that runs at each depth on a pipeline of P
  stages with V chunks each: the identity for V = 1; Megatron's interleaved assignment for V > 1, or the V's
  (stage s: depths s and 2P - 1 - s; see Pipeline)."""
  k = n_layers // (P * V)
  return [s * V * k + c * k + j for v in range(P * V) for s, c in [_where(v, P, v_shape)] for j in range(k)]
