"""Replay a compiled step on modeled streams: its dependency graph from the optimized HLO, list-scheduled onto a
compute stream and communication links. Durations come from costmodel.py; this module knows only the graph.

The graph. Every HLO instruction is a task that depends on its operands. Matmuls (a `dot`, or a fusion that
contains one) run on the compute stream; collectives on the links; everything else (elementwise fusions,
slicing, bookkeeping) takes no time. A while loop is unrolled by its known_trip_count, and each iteration
starts when the previous one has finished entirely: that is how XLA runs a loop (an async collective started
in an iteration is done by its end), so FSDP prefetch shows only where the program carries the next layer's
gathered weights in the loop state. A conditional is refused (no static count), as in hlo.multiplicities.

The replay (list scheduling). A task starts when its operands are ready and every resource it needs is free;
among ready tasks the one with the longest path to the end of the step goes first (the critical path, what a
latency-hiding scheduler favours). Replayed on one shared resource the same graph gives the serial time.
"""
from __future__ import annotations

import heapq
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from shardlab.analysis import hlo
from shardlab.axes import CONTEXT, DATA, FSDP, PIPELINE, TENSOR


@dataclass
class Task:
  kind: str                       # "compute" | "comm" | "" (no time)
  deps: list = field(default_factory=list)
  label: str = ""
  flops: float = 0.0              # compute: matmul FLOPs per device
  coll: hlo.Collective | None = None
  direction: str = ""             # collective-permute: "+" or "-" along its axis
  backward: bool = False
  iteration: tuple = ()           # the loop iteration it runs in, outermost first (() outside loops)


def _direction(pairs, device_ids: np.ndarray, axis_names: tuple, axis: str) -> str:
  """'+' if a collective-permute sends each device to the next along `axis`, '-' if to the previous."""
  if "+" in axis or axis not in axis_names:
    return "+"
  ids = np.asarray(device_ids)
  a = axis_names.index(axis)
  pos = {int(d): idx[a] for idx, d in np.ndenumerate(ids)}
  n = ids.shape[a]
  s, t = pairs[0]
  return "-" if n > 2 and (pos[t] - pos[s]) % n == n - 1 else "+"


def build(prog, entry: str | None = None) -> list[Task]:
  """The step's dependency graph, while loops unrolled; tasks are in a topological order (deps first).
  `prog`: an analysis.program.Program (the compiled program, parsed once); `entry`: one computation of it (a
  pipeline slot's branch) instead of the whole step."""
  comps, device_ids, axis_names = prog.comps, prog.device_ids, prog.axis_names
  entry = entry or prog.entry
  colls = {(c.computation, c.name): c for c in prog.collectives}
  flops = hlo.flops_fn(comps)
  tasks: list[Task] = []

  def add(t: Task) -> int:
    tasks.append(t)
    return len(tasks) - 1

  seen: dict = {}

  def emit(comp: str, args: list, it: tuple = ()) -> int:
    local, shapes = {}, {i.name: i.shape for i in comps[comp]}
    for ins in comps[comp]:
      deps = [local[o] for o in ins.operands if o in local] or (list(args) if ins.opcode == "parameter" else [])
      op, bwd = ins.opcode, "transpose(" in ins.op_name
      if op == "while":
        trips = hlo.trip_count(ins, comp, comps)
        body = re.search(r"body=%?([\w.\-]+)", ins.attrs).group(1)
        for k in range(trips):
          deps = [emit(body, deps, it + (k,))]
        i = add(Task("", deps))
      elif op.removesuffix("-start") in hlo.COLLECTIVES and (comp, ins.name) in colls:   # (not over 1 device)
        c = colls[(comp, ins.name)]
        d = ""
        if c.kind == "collective-permute":
          pairs = re.findall(r"\{(\d+),(\d+)\}", ins.attrs.split("source_target_pairs=")[1])
          pairs = [(int(a), int(b)) for a, b in pairs]
          d = _direction(pairs, device_ids, axis_names, c.axis)
        i = add(Task("comm", deps, f"{c.kind} {c.axis} ({c.scope})", coll=c, direction=d, backward=bwd, iteration=it))
      elif op == "conditional":              # a pipeline slot: its branch, as often as declared (hlo.spread)
        i = add(Task("", deps))
        for c in hlo.spread(ins, seen):
          i = emit(c, [i], it)
      elif op == "call":
        i = emit(re.search(r"to_apply=%?([\w.\-]+)", ins.attrs).group(1), deps, it)
      elif (f := flops(ins, shapes)) > 0:
        i = add(Task("compute", deps, _short(ins.op_name) or ins.name, flops=f, backward=bwd, iteration=it))
      else:
        i = add(Task("", deps))
      local[ins.name] = i
    return add(Task("", list(local.values())))   # the computation is done when all of it is (a loop barrier)

  emit(entry, [])
  return tasks


def _short(op_name: str) -> str:
  """The last two components of an op_name: 'jit(f)/../jvp(bld,dtf->bltf)/dot_general' -> 'jvp(..)/dot_general'."""
  return "/".join(op_name.split("/")[-2:])


@dataclass
class Replay:
  start: list
  finish: list
  makespan: float
  behind: list          # the task that last held the resource a task waited for (-1: none)


def replay(tasks: list[Task], duration: list[float], resources: list[tuple]) -> Replay:
  """List-schedule the graph: a task starts when its deps have finished and all its `resources` are free;
  ready tasks go critical-path first. Tasks with no resources and no duration finish when they are ready."""
  n = len(tasks)
  succ = [[] for _ in range(n)]
  waiting = [0] * n
  for i, t in enumerate(tasks):
    for d in set(t.deps):
      succ[d].append(i)
    waiting[i] = len(set(t.deps))
  level = [0.0] * n                                 # longest path from the task's start to the end of the step
  for i in range(n - 1, -1, -1):
    level[i] = duration[i] + max((level[s] for s in succ[i]), default=0.0)
  start, finish, ready, behind = [0.0] * n, [0.0] * n, [0.0] * n, [-1] * n
  queues: dict = defaultdict(list)
  free: dict = defaultdict(float)
  holder: dict = {}
  running: list = []

  def release(first: int, t: float):
    stack = [first]
    while stack:
      i = stack.pop()
      for s in succ[i]:
        ready[s] = max(ready[s], t)
        waiting[s] -= 1
        if waiting[s] == 0:
          if resources[s]:
            heapq.heappush(queues[resources[s]], (-level[s], s))
          else:                                      # no time: done as soon as it is ready
            start[s] = finish[s] = ready[s]
            stack.append(s)

  roots = [i for i in range(n) if waiting[i] == 0]
  for i in roots:
    if resources[i]:
      heapq.heappush(queues[resources[i]], (-level[i], i))
  for i in roots:
    if not resources[i]:
      release(i, 0.0)
  t = 0.0
  while True:
    dispatched = True
    while dispatched:
      dispatched = False
      for key in sorted((k for k in queues if queues[k]), key=lambda k: queues[k][0]):
        if queues[key] and all(free[r] <= t for r in key):
          _, i = heapq.heappop(queues[key])
          start[i], finish[i] = t, t + duration[i]
          behind[i] = holder.get(max(key, key=lambda r: free[r]), -1)
          for r in key:
            free[r], holder[r] = finish[i], i
          heapq.heappush(running, (finish[i], i))
          dispatched = True
    if not running:
      break
    t, i = heapq.heappop(running)
    release(i, t)
  assert not any(waiting), "the replay stalled: the graph has a cycle"
  return Replay(start, finish, max(finish, default=0.0), behind)


def critical_path(tasks: list[Task], r: Replay) -> list[int]:
  """The timed tasks on the chain that sets the makespan, last first: from the task that finishes last, step to
  whatever made each task start when it did (the operand that finished last, or the task it waited behind on a
  busy stream). Their durations add up to the makespan."""
  eps = 1e-12 * max(r.makespan, 1e-30)
  cur = max(range(len(tasks)), key=lambda i: r.finish[i], default=-1)
  path = []
  while cur >= 0:
    if tasks[cur].kind:
      path.append(cur)
    dep = max(tasks[cur].deps, key=lambda d: r.finish[d], default=-1)
    if dep >= 0 and r.finish[dep] >= r.start[cur] - eps:
      cur = dep
    elif r.behind[cur] >= 0 and r.finish[r.behind[cur]] >= r.start[cur] - eps:
      cur = r.behind[cur]
    else:
      break
  return path


# ---- intervals ----


def union(intervals) -> list[tuple]:
  """Merge [(a, b)] into disjoint sorted intervals."""
  out = []
  for a, b in sorted(intervals):
    if b <= a:
      continue
    if out and a <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], b))
    else:
      out.append((a, b))
  return out


def overlap(a: list[tuple], b: list[tuple]) -> float:
  """Total length of the intersection of two unions of disjoint sorted intervals."""
  i = j = 0
  total = 0.0
  while i < len(a) and j < len(b):
    total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return total


def length(intervals: list[tuple]) -> float:
  return sum(b - a for a, b in intervals)


# ---- outputs: Chrome / Perfetto trace events and a Gantt chart ----

COLORS = {"compute fwd": "#4c72b0", "compute bwd": "#8172b3", "fsdp all-gather": "#dd8452",
          "fsdp reduce-scatter": "#c44e52", FSDP: "#da8bc3", TENSOR: "#55a868", CONTEXT: "#64b5cd",
          PIPELINE: "#ccb974", DATA: "#8c8c8c", "other comm": "#937860",
          "loop, folded": "#e3e3e3"}   # a loop's iterations replayed at once, each as the one before (calibrated.py)


def category(t: Task) -> str:
  """The colour class of a task in the chart: compute (forward or backward), FSDP's gathers and reductions, and
  every other collective by the mesh axis it runs over (whatever schedule or TP class placed it; a collective
  over several axes is "other comm")."""
  if t.kind == "compute":
    return "compute bwd" if t.backward else "compute fwd"
  c = t.coll
  if c.axis == FSDP and c.kind in ("all-gather", "reduce-scatter"):
    return f"fsdp {c.kind}"
  return c.axis if c.axis in COLORS else "other comm"


def events(tasks: list[Task], r: Replay, duration: list[float], rows: list[str]) -> list[dict]:
  """One event per timed task: name, category, row (stream), start and duration in seconds, details."""
  out = []
  for i, t in enumerate(tasks):
    if not t.kind:
      continue
    args = {"flops": t.flops} if t.kind == "compute" else {
        "kind": t.coll.kind, "axis": t.coll.axis, "bytes_moved": t.coll.bytes_moved, "group_size": t.coll.group_size,
        "scope": t.coll.scope, "hlo": t.coll.name}
    args["iteration"] = list(t.iteration)
    out.append({"name": t.label, "cat": category(t), "row": rows[i], "start": r.start[i], "dur": duration[i],
                "args": args})
  return out


def chrome_trace(evs: list[dict], metadata: dict | None = None) -> dict:
  """Trace-event JSON (chrome://tracing, ui.perfetto.dev): one thread per stream, times in microseconds."""
  rows = sorted({e["row"] for e in evs}, key=lambda s: (s != "compute", s))
  tid = {row: k for k, row in enumerate(rows)}
  out = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[row], "args": {"name": row}} for row in rows]
  out += [{"name": e["name"], "cat": e["cat"], "ph": "X", "pid": 0, "tid": tid[e["row"]], "ts": e["start"] * 1e6,
           "dur": e["dur"] * 1e6, "args": e["args"]} for e in evs]
  return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": metadata or {}}


def plot(evs: list[dict], path, title: str, zoom: tuple[float, float] = (0.15, 0.19)) -> None:
  """A Gantt chart of the replay: the whole step, and a zoom on a window of it (fractions of the step)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch

  rows = sorted({e["row"] for e in evs}, key=lambda s: (s != "compute", s))
  end = max((e["start"] + e["dur"] for e in evs), default=1.0)
  scale, unit = (1e3, "ms") if end >= 1e-3 else (1e6, "us")
  folded = [e for e in evs if e["cat"] == "loop, folded"]
  window, what = (zoom[0] * end, zoom[1] * end), f"zoom: {zoom[0]:.0%}-{zoom[1]:.0%} of the step"
  if folded:     # the zoom on the last two iterations replayed before the longest fold (the fold is one band)
    f = max(folded, key=lambda e: e["dur"])
    window = (max(0.0, f["start"] - 2 * f["args"]["seconds_each"]), f["start"])
    what = "zoom: the last two iterations replayed before a loop's fold (grey: iterations added at once, each as these)"
  fig, axes = plt.subplots(2, 1, figsize=(15, 2.2 + 1.1 * len(rows)), constrained_layout=True)
  for e in folded:
    if e["dur"] > 0.08 * end:
      axes[0].text((e["start"] + e["dur"] / 2) * scale, rows.index(e["row"]), f"{e['args']['iterations']} more "
                   f"iterations, folded", ha="center", va="center", fontsize=8, color="#555555")
  for ax, (lo, hi) in zip(axes, [(0.0, end), window]):
    for y, row in enumerate(rows):
      for cat, color in COLORS.items():
        bars = [(e["start"] * scale, max(e["dur"] * scale, 1e-9)) for e in evs
                if e["row"] == row and e["cat"] == cat and e["start"] + e["dur"] >= lo and e["start"] <= hi]
        if bars:
          ax.broken_barh(bars, (y - 0.38, 0.76), facecolors=color, edgecolor=color if ax is axes[0] else "white",
                         linewidth=0.2)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(lo * scale, hi * scale)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", alpha=0.3)
  fig.suptitle(title, fontsize=10, x=0.01, ha="left")        # its own line: the legend sits below it
  axes[1].set_title(what, fontsize=9, loc="left")
  handles = [Patch(color=c, label=k) for k, c in COLORS.items() if k in {e["cat"] for e in evs}]
  axes[0].legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=len(handles) or 1,
                 frameon=False)
  fig.savefig(path, dpi=110)
  plt.close(fig)
