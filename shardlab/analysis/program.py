"""One compiled step, parsed once: the program object every analysis reads.

`Program.of(compiled, mesh)` parses the optimized HLO text a single time into its computations, the number of
times each runs (while loops x known_trip_count), its collectives (kind, mesh axis, bytes, count; an async
`-start`/`-done` pair is one collective) and, for programs the compiler scheduled (GPU: `is_scheduled=true`), the
order in which each computation issues its instructions. The ledger, the audit, the overlap report, the FLOPs,
the cost model and the timeline all read this object, whichever compiler made it: XLA:CPU for the local fake
devices, or the real GPU / TPU compiler for a target (shardlab/target.py).
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from shardlab.analysis import hlo
from shardlab.analysis.hlo import flops_fn  # noqa: F401  (re-exported: calibrated.py reads it here)

# Instructions that launch no kernel themselves (bookkeeping, or a loop, call or conditional, whose work is in the
# computations they run: Program.issued); anything else between a collective's start and done is work.
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "copy-start", "copy-done", "while", "call", "conditional"}


NESTED = ("while", "call", "conditional")    # in FREE: their work is their computations'
RING_STEP = re.compile(r"ring_(fwd|bwd)_step(\d+)")   # the scope of a ring attention step (schedules/context.py)


@dataclass
class AsyncPair:
  """One async collective of a scheduled program and what the compiler scheduled between its start and done."""
  coll: hlo.Collective
  computation: str
  start: int               # positions in the computation's instruction order
  done: int
  gemms: int               # matmul kernels issued between start and done
  kernels: int             # every kernel (matmuls included) issued between them
  flops: float             # matmul FLOPs between them
  in_loop: bool            # the computation is a while body (the layer loop)
  wraps: bool              # done comes before start: the pair spans the loop's back edge (a pipelined collective)
  is_sync: bool            # the compiler marked it synchronous (nothing to hide it behind)


class Program:
  """A compiled program's HLO, parsed once (module doc)."""

  def __init__(self, text: str, device_ids, axis_names: tuple, platform: str = "cpu", compiled=None,
               buffers: str | None = None):
    self.text, self.platform, self.compiled, self.buffers = text, platform, compiled, buffers
    self.device_ids, self.axis_names = device_ids, tuple(axis_names)
    self.comps, self.entry = hlo.parse(text)
    self.mult = hlo.multiplicities(self.comps, self.entry)
    self.collectives = hlo.collectives_in(self.comps, self.mult, device_ids, self.axis_names)
    self.scheduled = bool(re.search(r"^HloModule [^\n]*is_scheduled=true", text, re.M))
    self.loop_bodies = {b for instrs in self.comps.values() for i in instrs if i.opcode == "while"
                        for b in re.findall(r"body=%?([\w.\-]+)", i.attrs)}
    self._flops, self._issued, self._shape_of = flops_fn(self.comps), {}, {}
    self._chained, self._roles = None, {}

  @classmethod
  def of(cls, compiled, mesh, buffers: str | None = None) -> "Program":
    """`buffers`: the compiler's buffer assignment of the program (target.compile_reading_buffers), if read."""
    platform = next(iter(mesh.devices.flat)).platform
    return cls(compiled.as_text(), mesh.device_ids, tuple(mesh.axis_names), platform, compiled, buffers)

  # ---- what the compiler reports ----

  def memory(self) -> dict:
    """compiled.memory_analysis() per device; peak = arguments + outputs + temporaries - donated aliases; with
    the compiler's buffer assignment, `allocated` too (memory())."""
    return memory(self.compiled, self.buffers)

  def flops(self) -> tuple[float, str]:
    """FLOPs per device per step and where the figure comes from: the compiler's cost analysis where it gives one
    (XLA:CPU, TPU), else the matmuls counted from the HLO (GPU compiles report none)."""
    cost = self.compiled.cost_analysis() if self.compiled is not None else None
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    if cost and cost.get("flops"):
      return float(cost["flops"]), "cost_analysis"
    return self.matmul_flops(), "hlo_matmuls"

  def matmul_flops(self) -> float:
    """Matmul FLOPs per device per step, every loop iteration counted."""
    f = flops_fn(self.comps)
    fused = {c for instrs in self.comps.values() for i in instrs if i.opcode in ("fusion", "custom-call")
             for c in hlo.called(i)}   # counted through the instruction that calls them
    return sum(f(i, {x.name: x.shape for x in instrs}) * self.mult.get(c, 0)
               for c, instrs in self.comps.items() if c not in fused for i in instrs
               if i.opcode not in ("while", "call"))

  # ---- the collectives ----

  def audit(self) -> dict:
    return audit(self.collectives)

  def chained(self) -> dict:
    """{chain: its collective} of libtpu's async collective fusions (hlo.async_fusion): the collective the
    program's list holds for each chain (hlo.collectives_in counts one copy of each)."""
    if self._chained is None:
      self._chained = {}
      for c in self.collectives:
        ins = next((i for i in self.comps.get(c.computation, []) if i.name == c.name), None)
        key = hlo.chain_key(ins) if ins is not None else None
        if key:
          self._chained[key] = c
    return self._chained

  def async_role(self, comp: str, ins) -> tuple[str, tuple] | None:
    """hlo.async_fusion of `ins` (in computation `comp`) where its chain's collective is known, else None;
    looked up once per instruction, and only in a program that has such chains."""
    if ins.opcode != "fusion" or not self.chained():
      return None
    if (comp, ins.name) not in self._roles:
      found = hlo.async_fusion(ins, self.comps)
      self._roles[(comp, ins.name)] = found if found and found[1] in self._chained else None
    return self._roles[(comp, ins.name)]

  def async_pairs(self) -> list[AsyncPair]:
    """Every async collective with what its computation issues between start and done (scheduled programs): a
    `-start` .. `-done` pair, or libtpu's async collective fusion from its start fusion to its done fusion."""
    by_name = {(c.computation, c.name): c for c in self.collectives}
    chained = self.chained()
    out = []
    for comp, instrs in self.comps.items():
      if not self.mult.get(comp):
        continue
      pos = {i.name: k for k, i in enumerate(instrs)}
      roles = {k: r for k, r in enumerate(self.async_role(comp, i) for i in instrs) if r}
      starts = {r[1]: k for k, r in roles.items() if r[0] == "start"}
      for k, ins in enumerate(instrs):
        if k in roles:
          role = roles[k]
          if role[0] != "done" or role[1] not in starts:
            continue
          s = starts[role[1]]
          by_name.setdefault((comp, instrs[s].name), chained[role[1]])
        elif not ins.opcode.endswith("-done") or not ins.operands or (comp, ins.operands[0]) not in by_name:
          continue
        else:
          s = pos[ins.operands[0]]
        between = instrs[s + 1:k] if s < k else instrs[s + 1:] + instrs[:k]
        work = [w for w in (self.issued(i, comp) for i in between) if w[1]]
        start = instrs[s]
        out.append(AsyncPair(by_name[(comp, start.name)], comp, s, k, sum(fl > 0 for fl, _ in work), len(work),
                             sum(fl for fl, _ in work), comp in self.loop_bodies, s > k,
                             '"is_sync":true' in start.attrs))
    return out

  def issued(self, ins, comp: str) -> tuple[float, int]:
    """(matmul FLOPs, kernels) one execution of `ins` issues: a kernel its own, a loop its body's times its trip
    count, a call its computation's, a conditional its largest branch's (its count is declared, not known
    here); bookkeeping and a collective's start or done nothing. A loop, call or conditional counts as one unit
    of work between a collective's start and done when anything in it runs."""
    if ins.opcode.endswith(("-start", "-done")) or ins.opcode in FREE and ins.opcode not in NESTED:
      return 0.0, 0
    if ins.opcode not in NESTED:
      return self._flops(ins, self._shapes(comp)), 1
    key = (comp, ins.name)
    if key not in self._issued:
      self._issued[key] = (0.0, 0)                                 # a guard against a computation calling itself
      if ins.opcode == "while":
        bodies, times = re.findall(r"body=%?([\w.\-]+)", ins.attrs), hlo.trip_count(ins, comp, self.comps)
      else:
        bodies, times = (hlo.branches(ins) if ins.opcode == "conditional"
                         else re.findall(r"to_apply=%?([\w.\-]+)", ins.attrs)), 1
      per = [(sum(fl for fl, _ in w), sum(n for _, n in w))
             for w in ([self.issued(i, b) for i in self.comps.get(b, [])] for b in bodies)]
      fl, n = (max(per, default=(0.0, 0)) if ins.opcode == "conditional"
               else (sum(x[0] for x in per), sum(x[1] for x in per)))
      self._issued[key] = (fl * times, n * times)
    return self._issued[key]

  def _shapes(self, comp: str) -> dict:
    if comp not in self._shape_of:
      self._shape_of[comp] = {i.name: i.shape for i in self.comps.get(comp, [])}
    return self._shape_of[comp]

  def overlap(self) -> dict:
    """summary.json's `overlap`: per collective kind and mesh axis, `count` (executions per step) and `overlapped`
    (those with at least one kernel scheduled between start and done), `with_matmul` (a matmul among them),
    `matmuls_between` (per execution, mean), and `not_realized`: collectives the dependency graph lets overlap
    a matmul (hlo.overlap_structure) that the scheduler left with no matmul between start and done."""
    if self.platform == "cpu" or not self.scheduled:
      why = ("XLA:CPU runs collectives synchronously: no start/done pairs" if self.platform == "cpu" else
             f"the {self.platform} program's HLO shows its collectives synchronous (its backend schedules them)")
      return {"available": False, "why": why}
    pairs = self.async_pairs()
    could = {(r.computation, r.collective) for r in hlo.overlap_rows(self.comps) if r.independent_matmuls}
    table: dict = {}
    missed = defaultdict(int)
    for p in pairs:
      c = p.coll
      row = table.setdefault(c.kind, {}).setdefault(c.axis, {"count": 0, "overlapped": 0, "with_matmul": 0,
                                                             "matmuls_between": 0.0})
      row["count"] += c.count
      row["overlapped"] += c.count if p.kernels else 0
      row["with_matmul"] += c.count if p.gemms else 0
      row["matmuls_between"] += c.count * p.gemms
      if (p.computation, c.name) in could and not p.gemms:
        missed[f"{c.kind} {c.axis} ({c.scope})"] += c.count
    for axes in table.values():
      for row in axes.values():
        row["matmuls_between"] = row["matmuls_between"] / row["count"] if row["count"] else 0.0
    out = {"available": True, "by_kind": table, "not_realized": dict(missed),
           "pairs": [{"name": p.coll.name, "kind": p.coll.kind, "axis": p.coll.axis, "scope": p.coll.scope,
                      "count": p.coll.count, "in_loop": p.in_loop, "matmuls_between": p.gemms,
                      "kernels_between": p.kernels, "wraps_loop": p.wraps, "is_sync": p.is_sync}
                     for p in pairs]}
    ring = self.ring_steps(pairs)
    if ring:
      out["ring_steps"] = ring
    return out

  def ring_steps(self, pairs: list[AsyncPair]) -> list[dict]:
    """Per shift of ring attention (schedules/context.py: Ring, each step under the scope ring_fwd_stepS or
    ring_bwd_stepS): the ring steps of the same pass whose attention (matmuls) the compiler scheduled between
    the shift's start and done, and whether that includes the step the shift can hide behind, the step that
    issues it: a K/V shift carries the block the next step reads, a backward step's shift also the dK/dV of the
    block held before (one collective, `cp_ring_kv_grad`; the last step's alone), which its next holder adds after
    its own compute. The last shift takes the dK/dV home after the last step: no ring step follows it, any kernel
    can hide it. A shift not hidden names the collectives the compiler kept in flight across that step's attention
    instead (`in_flight_instead`: under XLA's GPU default of one collective in flight, the one that took the slot)."""
    shifts = {"cp_ring": "K/V", "cp_ring_kv_grad": "K/V + dK/dV", "cp_ring_grad": "dK/dV", "cp_ring_home": "dK/dV home"}
    rows = []
    for p in pairs:
      found = RING_STEP.findall(p.coll.op_name) if p.coll.scope in shifts else []
      if not found:
        continue
      pas, step = found[-1]
      instrs = self.comps[p.computation]
      between = instrs[p.start + 1:p.done] if not p.wraps else instrs[p.start + 1:] + instrs[:p.done]
      steps = set()
      for i in between:
        got = RING_STEP.findall(i.op_name)
        if got and got[-1][0] == pas and self.issued(i, p.computation)[0]:
          steps.add(int(got[-1][1]))
      home = p.coll.scope == "cp_ring_home"
      behind = None if home else int(step)
      row = {"pass": "forward" if pas == "fwd" else "backward", "step": int(step),
             "shift": shifts[p.coll.scope], "name": p.coll.name, "count": p.coll.count,
             "steps_between": sorted(steps), "can_hide_behind": behind,
             "hidden": p.kernels > 0 if home else behind in steps, "kernels_between": p.kernels}
      if not row["hidden"] and not home:
        row["in_flight_instead"] = self._in_flight_across(pairs, p, pas, behind)
      rows.append(row)
    return rows

  def _in_flight_across(self, pairs: list[AsyncPair], shift: AsyncPair, pas: str, step: int) -> list[dict]:
    """The async collectives of `shift`'s computation (other than it) in flight while ring step `step` of pass
    `pas` issues its work: started before one of that step's kernels and done after it."""
    instrs = self.comps[shift.computation]
    at = [k for k, i in enumerate(instrs) if (got := RING_STEP.findall(i.op_name)) and got[-1] == (pas, str(step))
          and self.issued(i, shift.computation)[0]]
    out = []
    for q in pairs:
      if q is shift or q.computation != shift.computation or not at:
        continue
      covers = (lambda k: k > q.start or k < q.done) if q.wraps else (lambda k: q.start < k < q.done)
      if any(covers(k) for k in at):
        out.append({"name": q.coll.name, "kind": q.coll.kind, "axis": q.coll.axis, "scope": q.coll.scope,
                    "bytes": q.coll.bytes_full})
    return out


def memory(compiled, buffers: str | None = None) -> dict:
  """compiled.memory_analysis() per device; peak = arguments + outputs + temporaries - donated aliases. With
  `buffers` (the compiler's buffer assignment, target.compile_reading_buffers), `allocated`: the device memory
  that assignment holds, by kind (hlo.allocations), the runtime's own figure where memory_analysis() differs."""
  m = compiled.memory_analysis()
  out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias",
                                                             "generated_code")}
  out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  if buffers:
    out["allocated"] = hlo.allocations(buffers)
  return out


def audit(colls) -> dict:
  """Collectives in the compiled program that no shardlab collective placed: every collective the code
  places runs under a named scope (collectives.py), so one without is compiler-inserted resharding."""
  unplanned = [{"kind": c.kind, "axis": c.axis, "bytes": c.bytes_full, "name": c.name, "computation": c.computation}
               for c in colls if c.scope == "other"]
  return {"unplanned": unplanned, "collectives": len(colls)}


def analyze(compiled, mesh, prog: Program | None = None) -> dict:
  """summary.json's `comm`, `audit`, `memory`, `flops_per_device` (and `flops_source`) and `overlap`."""
  prog = prog or Program.of(compiled, mesh)
  fl, src = prog.flops()
  return {"comm": hlo.ledger(prog.collectives), "audit": prog.audit(), "memory": prog.memory(),
          "flops_per_device": fl, "flops_source": src, "overlap": prog.overlap()}
