"""Pipeline schedules as tables: what each pipeline stage runs, in which order, and when.

P stages (devices on the `pipeline` axis), M microbatches, V chunks per stage (interleaved: device s holds model
stages s, s + P, ..., s + (V-1) P, Megatron's assignment; chunk c of device s is virtual stage c P + s). An action
is the forward (F), the backward (B: input gradient, and the weight gradient unless split off) or the split-off
weight gradient (W, zero-bubble) of one microbatch on one chunk. A schedule is, per stage, the order of its
actions (`orders`, torch.distributed.pipelining's `pipeline_order`); `table` places them on ticks, one action per
stage per tick, each as soon as its inputs exist (an activation or cotangent sent at tick t is there at t+1):
the static table one executor runs, the cost model replays with measured times (`replay`), and `draw` pictures.

  gpipe        every forward, then every backward (GPipe, Huang et al. 2019): M microbatches of activations
  1f1b         P - 1 - s forwards to warm up, then one forward one backward, then the rest of the backwards
               (PipeDream-flush, Narayanan et al. 2021): at most P - s microbatches in flight on stage s
  interleaved  1f1b over V chunks per stage, microbatches in groups of P (Megatron-LM's interleaved schedule,
               Narayanan et al. 2021): bubble (P-1)/(V M + P-1) for V times the point-to-point messages
  zb_h1        1f1b with each backward split into B (input gradient: on the critical path) and W (weight
               gradient: deferred into what would be bubble), holding no more microbatches than 1f1b (ZB-H1, Qi
               et al. 2023, arXiv:2401.10241)

Closed forms with uniform per-microbatch stage times and free links: gpipe and 1f1b leave a bubble of
(P-1)/(M+P-1) of the step, interleaved (P-1)/(V M+P-1); zb_h1 about a third of 1f1b's when T_F = T_B = T_W.
tests/test_pipeline_tables.py checks `replay` against each.

`check` rejects a table that reads an activation before it was sent, misses or repeats an action, or never runs a
backward; `table` rejects orders that deadlock. Each is one ConfigError line naming the stage, tick and action.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardlab.mesh import ConfigError

KINDS = ("F", "B", "W")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")


@dataclass(frozen=True, order=True)
class Action:
  kind: str        # F | B | W
  mb: int          # microbatch
  chunk: int = 0   # which of the stage's V chunks (virtual stage chunk * P + stage)

  def __str__(self) -> str:
    return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def vstage(stage: int, chunk: int, P: int) -> int:
  """The model stage (0 .. V P - 1, in the order layers run) of chunk `chunk` on pipeline stage `stage`."""
  return chunk * P + stage


def _where(v: int, P: int) -> tuple[int, int]:
  """Virtual stage v -> (pipeline stage, chunk)."""
  return v % P, v // P


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


def orders(name: str, P: int, M: int, V: int = 1) -> list[list[Action]]:
  """Per stage, its actions in the order it runs them, for a named schedule."""
  check_shape(name, P, M, V)
  out = []
  for s in range(P):
    if name == "gpipe":
      out.append([Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)])
    elif name in ("1f1b", "zb_h1"):
      warmup = min(P - 1 - s, M)
      order = _one_f_one_b([Action("F", m) for m in range(M)], [Action("B", m) for m in range(M)], warmup)
      if name == "zb_h1":   # each B's weight gradient W: placed by `table` into the ticks B leaves idle
        order = [a for x in order for a in ((x, Action("W", x.mb)) if x.kind == "B" else (x,))]
      out.append(order)
    else:                   # interleaved: microbatches in groups of P, chunks in turn (Megatron-LM)
      fwd = [Action("F", g * P + i, c) for g in range(M // P) for c in range(V) for i in range(P)]
      bwd = [Action("B", g * P + i, c) for g in range(M // P) for c in reversed(range(V)) for i in range(P)]
      warmup = min((P - 1 - s) * 2 + (V - 1) * P, len(fwd))
      out.append(_one_f_one_b(fwd, bwd, warmup))
  return out


def check_shape(name: str, P: int, M: int, V: int) -> None:
  """The settings a named schedule can run with; one line otherwise."""
  if name not in SCHEDULES:
    raise ConfigError(f"pipeline={name}: unknown; choose one of {', '.join(SCHEDULES)}")
  if P < 1 or M < 1 or V < 1:
    raise ConfigError(f"pipeline: stages {P}, microbatches {M}, virtual stages {V}: each must be >= 1")
  if name != "interleaved" and V != 1:
    raise ConfigError(f"pipeline.virtual_stages={V}: only pipeline=interleaved runs several chunks per stage")
  if name == "interleaved" and M % P:
    raise ConfigError(f"pipeline.microbatches={M} is not a multiple of mesh.pipeline={P} (interleaved runs "
                      f"microbatches in groups of P); choose microbatches a multiple of {P}")


# ------------------------------------------------------------------------------------------ dependencies, ticks

def _needs(a: Action, stage: int, P: int, V: int, split: bool) -> list[tuple[int, Action]]:
  """(stage, action) pairs that must be done (and sent) before `a` runs on `stage`."""
  v, last = vstage(stage, a.chunk, P), V * P - 1
  if a.kind == "F":
    if v == 0:
      return []
    s, c = _where(v - 1, P)
    return [(s, Action("F", a.mb, c))]
  if a.kind == "B":
    need = [(stage, Action("F", a.mb, a.chunk))]
    if v < last:
      s, c = _where(v + 1, P)
      need.append((s, Action("B", a.mb, c)))
    return need
  return [(stage, Action("B", a.mb, a.chunk))]   # W after its own B


def table(orders_: list[list[Action]], V: int = 1) -> list[list[Action | None]]:
  """The static table [tick][stage] of per-stage orders: each stage runs its next action at the first tick its
  inputs are there (one from another stage: sent the tick it was made, there the tick after). A W (split
  weight gradient) may be run later than listed: it fills the first tick where the stage's next action must
  wait. Orders that can never finish deadlock: one line naming the stuck stages."""
  P = len(orders_)
  split = any(a.kind == "W" for o in orders_ for a in o)
  done: dict[tuple[int, Action], int] = {}
  pending = [list(o) for o in orders_]
  deferred: list[list[Action]] = [[] for _ in range(P)]
  # A split table keeps no more weight gradients waiting than the forwards its order runs before its first
  # backward (P - s for 1f1b's order): each waiting W holds its microbatch's layer inputs and output gradients.
  cap = [next((i for i, a in enumerate(a for a in o if a.kind != "W") if a.kind == "B"), len(o)) for o in orders_]
  ticks, t = [], 0
  limit = 4 * sum(len(o) for o in orders_) + 4
  while any(pending) or any(deferred):
    row: list[Action | None] = [None] * P
    for s in range(P):
      ready = lambda a: all(n in done and done[n] < t for n in _needs(a, s, P, V, split))
      while pending[s] and pending[s][0].kind == "W":     # W's wait in the stage's deferred queue
        deferred[s].append(pending[s].pop(0))
      over = len(deferred[s]) > cap[s]
      if pending[s] and ready(pending[s][0]) and not (over and ready(deferred[s][0])):
        row[s] = pending[s].pop(0)
      elif deferred[s] and ready(deferred[s][0]):
        row[s] = deferred[s].pop(0)
    for s, a in enumerate(row):
      if a is not None:
        done[(s, a)] = t
    if all(a is None for a in row):
      stuck = "; ".join(f"stage {s} waits to run {(pending[s] or deferred[s])[0]}" for s in range(P)
                        if pending[s] or deferred[s])
      raise ConfigError(f"pipeline table deadlocks at tick {t}: {stuck}")
    ticks.append(row)
    t += 1
    if t > limit:
      raise ConfigError("pipeline table does not finish")
  return ticks


def check(ticks: list[list[Action | None]], M: int, V: int = 1) -> None:
  """A table [tick][stage] runs: every stage runs F and B (and W, if any B is split) of every microbatch and
  chunk exactly once, and nothing before its inputs were sent (one tick for a transfer). One line otherwise."""
  P = len(ticks[0]) if ticks else 0
  split = any(a is not None and a.kind == "W" for row in ticks for a in row)
  when: dict[tuple[int, Action], int] = {}
  for t, row in enumerate(ticks):
    for s, a in enumerate(row):
      if a is None:
        continue
      if (s, a) in when:
        raise ConfigError(f"pipeline table: stage {s} runs {a} twice (ticks {when[(s, a)]} and {t})")
      when[(s, a)] = t
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
  for (s, a), t in sorted(when.items(), key=lambda x: x[1]):
    for n in _needs(a, s, P, V, split):
      if n not in when or when[n] >= t:
        src = "never" if n not in when else f"at tick {when[n]}"
        raise ConfigError(f"pipeline table: stage {s} runs {a} at tick {t}, but its input {n[1]} from stage "
                          f"{n[0]} is made {src}: it reads an activation before it was sent")


def build(name: str, P: int, M: int, V: int = 1) -> list[list[Action | None]]:
  """The checked table of a named schedule."""
  ticks = table(orders(name, P, M, V), V)
  check(ticks, M, V)
  return ticks


def in_flight(ticks, until: str = "B") -> list[int]:
  """Per stage, the most microbatch-chunks whose activations it holds at once, from each F until its B (the
  residuals the backward reads): M for gpipe, at most P - s for 1f1b and zb_h1 on stage s. until="W": until the
  weight gradient of a split table (the layer inputs and output gradients a waiting W still holds)."""
  P = len(ticks[0])
  out = []
  for s in range(P):
    live = peak = 0
    for row in ticks:
      a = row[s]
      if a is None:
        continue
      live += 1 if a.kind == "F" else -1 if a.kind == until else 0
      peak = max(peak, live)
    out.append(peak)
  return out


# ------------------------------------------------------------------------------------------------ the replay

@dataclass(frozen=True)
class Slot:
  stage: int
  action: Action
  start: float
  end: float


def replay(ticks, t_f: float, t_b: float, t_w: float = 0.0, t_comm: float = 0.0) -> dict:
  """Times of the table on real links: each stage runs its actions in the table's order, each as soon as the
  stage is free and its inputs have arrived (t_comm after the producing action ends, across stages). Times are
  per microbatch and per chunk (an interleaved chunk holds 1/V of a stage's layers: pass its own times): F takes
  t_f, B t_b (plus t_w unless the table splits W off), W t_w.
  Returns {"slots", "step_s", "busy_s" (per stage), "bubble": idle fraction of the step, averaged over stages}."""
  P = len(ticks[0])
  split = any(a is not None and a.kind == "W" for row in ticks for a in row)
  V = 1 + max(a.chunk for row in ticks for a in row if a is not None)
  dur = {"F": t_f, "B": t_b if split else t_b + t_w, "W": t_w}
  end: dict[tuple[int, Action], float] = {}
  free = [0.0] * P
  slots = []
  for row in ticks:
    for s, a in enumerate(row):
      if a is None:
        continue
      ready = max([end[n] + (t_comm if n[0] != s else 0.0) for n in _needs(a, s, P, V, split)], default=0.0)
      start = max(free[s], ready)
      free[s] = end[(s, a)] = start + dur[a.kind]
      slots.append(Slot(s, a, start, free[s]))
  step = max(free)
  busy = [sum(x.end - x.start for x in slots if x.stage == s) for s in range(P)]
  return {"slots": slots, "step_s": step, "busy_s": busy, "bubble": 1 - sum(busy) / (P * step) if step else 0.0}


def closed_form_bubble(name: str, P: int, M: int, V: int = 1) -> float:
  """(P-1)/(M+P-1) for gpipe and 1f1b, (P-1)/(V M+P-1) for interleaved; zb_h1: 1f1b's (an upper bound)."""
  return (P - 1) / ((V if name == "interleaved" else 1) * M + P - 1)


# ------------------------------------------------------------------------------------------------- the picture

COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}


def draw(result: dict, path, title: str = "", unit: str = "s") -> None:
  """pipeline.png: one row per stage over time, each action a box labelled with its microbatch (and chunk),
  forward blue, backward green, weight gradient orange; what is left white is the bubble."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch
  slots, step = result["slots"], result["step_s"]
  P = 1 + max(x.stage for x in slots)
  fig, ax = plt.subplots(figsize=(min(18, 3 + 0.35 * len(slots) / max(P, 1)), 0.6 * P + 1.6))
  for x in slots:
    ax.barh(x.stage, x.end - x.start, left=x.start, height=0.8, color=COLORS[x.action.kind], edgecolor="white",
            alpha=0.55 + 0.45 * (1 - x.action.chunk / max(1, 1 + max(y.action.chunk for y in slots))))
    ax.text((x.start + x.end) / 2, x.stage, f"{x.action.mb}" + (f".{x.action.chunk}" if x.action.chunk else ""),
            ha="center", va="center", fontsize=7, color="white")
  ax.set_yticks(range(P), [f"stage {s}" for s in range(P)])
  ax.invert_yaxis()
  ax.set_xlim(0, step)
  ax.set_xlabel(f"time (prediction, {unit})")
  ax.legend(handles=[Patch(color=c, label=k) for k, c in
                     (("forward", COLORS["F"]), ("backward", COLORS["B"]), ("weight gradient", COLORS["W"]))
                     if k[0].upper() in {x.action.kind for x in slots}],
            loc="upper center", bbox_to_anchor=(0.5, -0.25 if P < 4 else -0.12), ncol=3, frameon=False)
  ax.set_title(f"{title}bubble {result['bubble']:.1%} of the step (idle: white)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
