"""A pipeline table replayed on real links, and its picture (pipeline.png): the timing model of a table
(shardlab/pipeline_tables.py), read by the planner (closed forms' check, pipeline layouts) and by a run's pipeline
prediction (pipeline_cost.py: the compiled slots' times). Every time here is a prediction."""
from __future__ import annotations

from dataclasses import dataclass

from shardlab.pipeline_tables import Action, needs, v_shaped, vstage

@dataclass(frozen=True)
class Slot:
  stage: int
  action: Action
  start: float
  end: float


def replay(ticks, t_f: float, t_b: float, t_w: float = 0.0, t_comm: float = 0.0, sync: bool = True,
           t_head: float = 0.0, layers: list[float] | None = None) -> dict:
  """Times of the table on real links. Times are per microbatch and chunk (an interleaved chunk holds 1/V of a
  stage's layers: pass its own times): F takes t_f (t_f + t_head on the last virtual stage, which runs the head
  in its F slot), B t_b (plus t_w unless the table splits W off), W t_w. `layers`: per virtual stage, in model
  order, the layers it holds as a fraction of a chunk's (None: 1 each; an uneven split such as Llama 3's, one layer
  fewer on the first and the last stage): its F, B and W times scale with it, the head's not.

  sync=True: as the executor (`Pipeline`) runs it: each tick, a stage runs its slots back to back, then sends
  its forward output and its input gradient (t_comm, both ways at once); it starts the next tick when it and the
  stages it receives from (s-1 and s+1; around the ring with looped chunks) have ended this one: ticks
  synchronised between neighbours by the sends. sync=False: each action as soon as its stage is free and its inputs arrived
  (t_comm after the producing action, across stages), an asynchronous runtime's ideal.
  Returns {"slots", "step_s", "busy_s" (per stage), "bubble": idle fraction of the step, averaged over stages}."""
  P = len(ticks[0])
  split = any(a.kind == "W" for row in ticks for cell in row for a in cell)
  V, v_shape = 1 + max(a.chunk for row in ticks for cell in row for a in cell), v_shaped(ticks)
  dur = {"F": t_f, "B": t_b if split else t_b + t_w, "W": t_w}
  last = V * P - 1
  if layers is not None and len(layers) != V * P:
    raise ValueError(f"layers: {len(layers)} figures for {V * P} virtual stages")

  def took(a, s):
    v = vstage(s, a.chunk, P, v_shape)
    return dur[a.kind] * (1.0 if layers is None else layers[v]) + (t_head if a.kind == "F" and v == last else 0.0)
  slots = []
  if sync:
    near = [sorted({s, (s - 1) % P, (s + 1) % P} if V > 1 and not v_shape else
                   {max(s - 1, 0), s, min(s + 1, P - 1)}) for s in range(P)]
    ended = [0.0] * P            # when each stage's previous tick ended (its sends arrived)
    for row in ticks:
      begin = [max(ended[n] for n in near[s]) for s in range(P)]
      for s, cell in enumerate(row):
        at = begin[s]
        for a in cell:
          slots.append(Slot(s, a, at, at + took(a, s)))
          at += took(a, s)
        ended[s] = at + t_comm
    step = max(ended) - t_comm
  else:
    end: dict[tuple[int, Action], float] = {}
    free = [0.0] * P
    for row in ticks:
      for s, cell in enumerate(row):
        for a in cell:
          ready = max([end[n] + (t_comm if n[0] != s else 0.0) for n in needs(a, s, P, V, v_shape)], default=0.0)
          start = max(free[s], ready)
          free[s] = end[(s, a)] = start + took(a, s)
          slots.append(Slot(s, a, start, free[s]))
    step = max(free)
  busy = [sum(x.end - x.start for x in slots if x.stage == s) for s in range(P)]
  return {"slots": slots, "step_s": step, "busy_s": busy, "bubble": 1 - sum(busy) / (P * step) if step else 0.0}


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
  k, shown = 1.0, unit                    # seconds drawn in the unit that reads: s, ms or us
  if unit == "s":
    k, shown = next((f, u) for f, u in ((1.0, "s"), (1e3, "ms"), (1e6, "us")) if step * f >= 1 or u == "us")
  P = 1 + max(x.stage for x in slots)
  chunks = max(x.action.chunk for x in slots) > 0
  fig, ax = plt.subplots(figsize=(max(11, min(18, 3 + 0.35 * len(slots) / max(P, 1))), 0.6 * P + 1.6))
  for x in slots:
    ax.barh(x.stage, (x.end - x.start) * k, left=x.start * k, height=0.8, color=COLORS[x.action.kind],
            edgecolor="white", alpha=0.55 + 0.45 * (1 - x.action.chunk / max(1, 1 + max(y.action.chunk for y in slots))))
    ax.text((x.start + x.end) / 2 * k, x.stage, f"{x.action.mb}" + (f".{x.action.chunk}" if chunks else ""),
            ha="center", va="center", fontsize=7, color="white")
  ax.set_yticks(range(P), [f"stage {s}" for s in range(P)])
  ax.invert_yaxis()
  ax.set_xlim(0, step * k)
  ax.set_xlabel(f"time (prediction, {shown})")
  handles = [Patch(color=c, label=n) for n, c in
             (("forward", COLORS["F"]), ("backward", COLORS["B"]), ("weight gradient", COLORS["W"]))
             if n[0].upper() in {x.action.kind for x in slots}]
  handles.append(Patch(color="none", label="label: microbatch" + (".chunk (lighter: later chunk)" if chunks else "")))
  ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25 if P < 4 else -0.12),
            ncol=len(handles), frameon=False)
  length = f"step {step * k:.4g} {shown}, " if unit == "s" else ""
  ax.set_title(f"{title}{length}bubble {result['bubble']:.1%} of the step (idle: white)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


