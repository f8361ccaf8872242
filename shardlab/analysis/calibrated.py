"""The calibrated cost model: the target compiler's own scheduled order, replayed at achieved rates.

A GPU program compiled for a target is scheduled (`is_scheduled=true`): each computation lists its instructions in
the order the device issues them, async collectives as `-start` ... `-done` pairs placed by XLA's latency-hiding
scheduler. The replay walks that order (while bodies x trip count) with one compute stream and one collective
stream (NCCL runs collectives one after another on its own stream):

  kernel      GEMM (a dot fusion or cuBLAS call): FLOPs / (R q), R the achieved rate of a large GEMM of its
              operands' dtype (HardwareConfig.gemm_rate: measured by shardlab.calibrate, else C gemm_efficiency),
              q the wave-quantization of its output tiles over the device's compute units, or its bytes at HBM
              rate if that is longer;
              fused attention (cuDNN's; shardlab's Pallas kernel, flash_kernel.py, at the FLOPs its name
              states): FLOPs / (C attention_efficiency), causal blocks skipped; shardlab's kernel at
              flash_kernel_efficiency where the preset has one (HardwareConfig.attention_rate);
              any other kernel: bytes accessed / (hbm_bandwidth hbm_efficiency); each + kernel_launch_s
  -start      the collective starts when the compute stream issues it and the collective stream is free, and
              takes collective_latency_s + bytes / (W link_efficiency r(bytes)), r(S) = S / (S + link_half_bytes)
              the ramp of bus bandwidth with message size (NCCL reaches its plateau only for large messages;
              links.collective_seconds, the formula every cost model uses)
  -done       the compute stream waits until that collective has finished
  synchronous collective (no pair)   the compute stream waits for it whole

libtpu writes its collectives synchronous unless its async collective fusion is on (MaxText's TPU recipes turn it
on: conf/xla/maxtext_v5p.yaml). Then one collective is split over fusions that hold copies of it under one
chain_id (hlo.async_fusion): its start fusion is replayed as `-start`, its done fusion as `-done`, and the compute
fusions it continues in as the kernels they are (their bytes without the collective's buffers they carry).

A loop is walked until two iterations in a row change the state alike (its steady state); the rest are then
added at once, each as the one before (`loop, folded` in the timeline): a 70B step replays in a fraction of a
second instead of a minute, to the same figure. Loops that run pipeline slots (conditionals) are walked whole.

Bytes accessed of a kernel are read from its fused computation: a parameter read only through dynamic-slices
(directly, or after a layout change, conversion or transpose of the same elements) counts the slices, an in-place
dynamic-update-slice counts the update (a layer's slice of a stacked buffer, not the stack). Every constant is in
the hardware preset with its source (conf/hardware/). The same replay at peak rates (HardwareConfig.peak) is the
ceiling it is compared with. MODEL PREDICTIONS, not measurements.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from shardlab.analysis import hlo
from shardlab.analysis.program import FREE, flops_fn
from shardlab.analysis.hlo import dims
from shardlab.analysis.links import collective_seconds


@dataclass
class Replayed:
  t_total_s: float
  t_compute_s: float           # the compute stream busy (kernels)
  t_gemm_s: float              # matmuls and fused attention kernels
  t_other_kernels_s: float
  t_comm_s: dict               # per mesh axis: collective time on the collective stream
  t_exposed_comm_s: float      # the compute stream waiting for a collective
  kernels: int
  events: list                 # timeline events (the format of timeline.events)
  t_attention_s: float = 0.0   # of t_gemm_s, the fused attention kernels (cuDNN's, shardlab's Pallas ones)


def gemm_seconds(flops: float, out_dims: list, nbytes: float, hw, dtype: str = "") -> float:
  """A matmul kernel: compute at the shape's achieved rate (operands of `dtype`), or its bytes at HBM rate,
  whichever is longer."""
  q = 1.0
  if hw.compute_units and len(out_dims) >= 2:
    m, n = out_dims[-2], out_dims[-1]
    tiles = math.ceil(m / hw.gemm_tile) * math.ceil(n / (2 * hw.gemm_tile)) * math.prod(out_dims[:-2])
    q = tiles / (math.ceil(tiles / hw.compute_units) * hw.compute_units)
  return max(flops / (hw.gemm_rate(dtype) * q), nbytes / (hw.hbm_bandwidth * hw.hbm_efficiency))


# HLO element types -> the dtype names shardlab.calibrate measures GEMMs under (numpy's)
_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "f8e4m3fn": "float8_e4m3fn",
           "f8e5m2": "float8_e5m2", "s8": "int8"}
_WIDTH = {"f8e4m3fn": 1, "f8e5m2": 1, "s8": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8}


def operand_dtype(ins: hlo.Instr, shapes: dict, comps: dict | None = None) -> str:
  """The dtype a GEMM kernel multiplies in, numpy's name ("" when none is known): the narrowest floating dtype
  among the operands of rank 2 or more of the dot it runs (a bf16 matmul that accumulates into f32 is a bf16
  GEMM). In a fusion, its dot's operands: a convert fused before the dot does not change the dtype the dot
  multiplies in (XLA:CPU runs a bf16 matmul as converts to f32, then an f32 dot: an f32 GEMM)."""
  called = hlo.called(ins) if comps is not None and ins.opcode == "fusion" else []
  body = comps.get(called[0], []) if called else []
  dots = [i for i in body if i.opcode == "dot" or hlo.is_gemm_call(i)]
  if dots:
    inner = {i.name: i.shape for i in body}
    return _narrowest([inner.get(o, "") for d in dots for o in d.operands])
  return _narrowest([shapes.get(o, "") for o in ins.operands])


def _narrowest(shapes: list[str]) -> str:
  best = ""
  for shape in shapes:
    m = re.match(r"(\w+)\[([^\]]*)\]", shape)
    if m and m.group(1) in _WIDTH and m.group(2).count(",") >= 1:
      if not best or _WIDTH[m.group(1)] < _WIDTH[best]:
        best = m.group(1)
  return _DTYPES.get(best, "")


def kernel_bytes(ins: hlo.Instr, shapes: dict, comps: dict) -> float:
  """Bytes a kernel reads and writes (module doc)."""
  called = hlo.called(ins)
  out = hlo.shape_bytes(ins.shape)
  if ins.opcode != "fusion" or not called or called[0] not in comps:
    return out + sum(hlo.shape_bytes(shapes.get(o, "")) for o in ins.operands)
  body = comps[called[0]]
  users: dict = {}
  for i in body:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  inner = {i.name: i.shape for i in body}
  params = [i for i in body if i.opcode == "parameter"]
  total = 0.0
  for p in params:
    us = users.get(p.name, [])
    if us and all(u.opcode == "dynamic-update-slice" and u.operands[0] == p.name for u in us):
      total += 0.0                                  # updated in place: only the update is touched
    else:
      total += hlo.shape_bytes(p.shape) * _read_fraction(p, users, comps)
  root = body[-1] if body else None
  roots = [root] if root is not None and root.opcode != "tuple" else [
      next((i for i in body if i.name == o), None) for o in (root.operands if root is not None else [])]
  for r in roots:
    if r is not None and r.opcode == "dynamic-update-slice":
      out -= hlo.shape_bytes(r.shape) - hlo.shape_bytes(inner.get(r.operands[1], ""))
  return total + max(out, 0)


# Ops that map the elements of their operand one to one (a layout change, a conversion, a permutation): a slice
# taken after them reads only the elements it takes of the operand. A nested fusion is one of them when its own
# computation holds nothing else.
_ONE_TO_ONE = frozenset({"bitcast", "copy", "convert", "transpose", "reshape"})


def _one_to_one(ins: hlo.Instr, n: int, comps: dict) -> bool:
  """`ins` maps the n elements of its operand one to one onto its own (one array, n elements)."""
  if ins.shape.startswith("(") or math.prod(dims(ins.shape)) != n:
    return False
  if ins.opcode == "fusion":
    called = hlo.called(ins)
    body = comps.get(called[0], []) if called else []
    return bool(body) and all(i.opcode in _ONE_TO_ONE or i.opcode == "parameter" for i in body)
  return ins.opcode in _ONE_TO_ONE


def _read_fraction(value: hlo.Instr, users: dict, comps: dict) -> float:
  """The fraction of `value` (a fused computation's parameter, or an op on it) that the kernel reads: the
  elements its dynamic-slices take where every use of it ends in one, directly or through one-to-one ops
  (_ONE_TO_ONE; a kernel computes only the elements it writes: libtpu's programs change a stacked mask's layout in
  a nested fusion, then take one block of it); 1.0 where any use reads it whole. Slices that overlap are summed
  (an upper bound), capped at the whole."""
  n = math.prod(dims(value.shape))
  us = users.get(value.name, [])
  if not us or n == 0:
    return 1.0
  fraction = 0.0
  for u in us:
    if u.opcode == "dynamic-slice" and u.operands[0] == value.name:
      fraction += math.prod(dims(u.shape)) / n
    elif _one_to_one(u, n, comps):
      fraction += _read_fraction(u, users, comps)
    else:
      return 1.0
  return min(fraction, 1.0)


def replay(prog, hw, ici_axes: dict | None = None, scale: dict | None = None, entry: str | None = None) -> Replayed:
  """Walk the scheduled program (module doc). `scale`: {(kind, axis, scope): factor} on collective bytes. `entry`:
  one computation of it (a pipeline slot's branch) instead of the whole step."""
  ici_axes, scale = ici_axes or {}, scale or {}
  comps, f = prog.comps, flops_fn(prog.comps)
  colls = {(c.computation, c.name): c for c in prog.collectives}
  chained = prog.chained()    # libtpu's async collective fusions: chain -> its collective
  st = {"t": 0.0, "link": 0.0, "gemm": 0.0, "other": 0.0, "attention": 0.0, "exposed": 0.0, "kernels": 0}
  comm: dict = {}
  events: list = []
  finish: dict = {}

  def coll_time(c):
    return collective_seconds(c.kind, c.bytes_moved * scale.get((c.kind, c.axis, c.scope), 1.0), c.group_size,
                              c.axis, hw, ici_axes)

  seen: dict = {}
  wrote: list = []       # every name `finish` was set for, in order (what an iteration left in flight)
  slots: dict = {}       # computation -> whether it holds a pipeline slot (memo of _has_slot)

  def loop(body: str, trips: int, it: tuple):
    """The loop's iterations, until two in a row change the state by the same amounts (the steady state of a
    layer loop: the same kernels and collectives, the same waits); the rest are then added at once, each as the
    one before (`fold`). A loop that runs a pipeline slot is never folded (its ticks differ by design)."""
    prev = None
    foldable = not _has_slot(body, comps, slots)
    for k in range(trips):
      before, mark = _state(st, comm), len(wrote)
      run(body, it + (k,))
      delta = _minus(_state(st, comm), before)
      if foldable and prev is not None and k + 1 < trips and _same(delta, prev) and \
          (abs(delta["link"] - delta["t"]) <= 1e-9 * abs(delta["t"]) or delta["link"] == 0.0):
        n = trips - k - 1
        start = st["t"]
        for key, d in delta.items():
          if key.startswith("comm "):
            comm[key[5:]] = comm.get(key[5:], 0.0) + n * d
          else:
            st[key] += n * d
        for name in set(wrote[mark:]):          # what this iteration left in flight, n iterations later
          finish[name] += n * delta["t"]
        events.append({"name": f"{n} more iterations of {body}, each as the one before ({delta['t'] * 1e6:.4g} us)",
                       "cat": "loop, folded", "row": "compute", "start": start, "dur": n * delta["t"],
                       "args": {"iterations": n, "seconds_each": delta["t"], "iteration": list(it)}})
        return
      prev = delta

  def send(c, key, it: tuple):
    """Collective `c` on its axis's link from now (after the one before it there); `key` finishes with it."""
    d = coll_time(c)
    s = max(st["t"], st["link"])
    st["link"] = finish[key] = s + d
    wrote.append(key)
    comm[c.axis] = comm.get(c.axis, 0.0) + d
    events.append(_event(f"{c.kind} {c.axis} ({c.scope})", "comm", f"comm {c.axis}", s, d, it,
                         {"kind": c.kind, "axis": c.axis, "bytes_moved": c.bytes_moved, "scope": c.scope,
                          "hlo": c.name}, c))

  def run(comp: str, it: tuple):
    instrs = comps[comp]
    shapes = {i.name: i.shape for i in instrs}
    for ins in instrs:
      op = ins.opcode
      if op in ("while", "call", "conditional"):
        if op == "while":
          trips = hlo.trip_count(ins, comp, comps)
          loop(re.search(r"body=%?([\w.\-]+)", ins.attrs).group(1), trips, it)
        elif op == "call":
          run(re.search(r"to_apply=%?([\w.\-]+)", ins.attrs).group(1), it)
        else:                                 # a pipeline slot: its branch, as often as declared (hlo.spread)
          for c in hlo.spread(ins, seen):
            run(c, it)
        continue
      role = prog.async_role(comp, ins)           # libtpu's async collective fusion: start, continuation, done
      if role and role[0] == "start":             # libtpu's async collective fusion: the transfer begins
        send(chained[role[1]], role[1], it)
      elif role and role[0] == "done":            # ... and its result is needed
        if role[1] in finish:
          _wait(st, finish[role[1]])
      elif (comp, ins.name) in colls:              # a collective: async start, or synchronous
        send(colls[(comp, ins.name)], ins.name, it)
        if not op.endswith("-start"):
          _wait(st, finish[ins.name])
      elif op.endswith("-done"):
        if ins.operands and ins.operands[0] in finish:
          _wait(st, finish[ins.operands[0]])
      elif op in FREE or op.endswith("-start"):
        continue
      else:
        fl = f(ins, shapes)
        nbytes = kernel_bytes(ins, shapes, comps) - (_carried_bytes(ins, comps) if role else 0.0)
        if hlo.is_attention_call(ins):             # a fused flash-attention kernel: its own achieved rate
          d = max(fl / hw.attention_rate(hlo.stated_flops(ins) is not None),
                  nbytes / (hw.hbm_bandwidth * hw.hbm_efficiency))
          st["attention"] += d + hw.kernel_launch_s
        else:
          d = (gemm_seconds(fl, dims(ins.shape), nbytes, hw, operand_dtype(ins, shapes, comps)) if fl > 0 else
               nbytes / (hw.hbm_bandwidth * hw.hbm_efficiency))
        d += hw.kernel_launch_s
        st["gemm" if fl > 0 else "other"] += d
        st["kernels"] += 1
        if fl > 0 or d > 2e-6:                      # small elementwise kernels: counted, not drawn
          events.append(_event(_short(ins.op_name) or ins.name, "compute", "compute", st["t"], d, it,
                               {"flops": fl, "bytes": nbytes}, None, "transpose(" in ins.op_name))
        st["t"] += d

  run(entry or prog.entry, ())
  total = max(st["t"], st["link"])
  return Replayed(total, st["gemm"] + st["other"], st["gemm"], st["other"], comm, st["exposed"], st["kernels"],
                  events, st["attention"])


def _carried_bytes(ins: hlo.Instr, comps: dict) -> float:
  """Of a continuation of libtpu's async collective fusion (a compute kernel the transfer runs beside), the bytes
  kernel_bytes counts that are the collective's own buffers, not the kernel's: the parameters only the collective
  or the output tuple take, and the outputs that are a parameter or the collective passed on."""
  body = comps.get(hlo.called(ins)[0], [])
  users: dict = {}
  for i in body:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  root = body[-1]
  carried = {i.name for i in body if i.opcode in hlo.COLLECTIVES}
  out = 0.0
  for i in body:
    if i.opcode == "parameter" and users.get(i.name) and all(
        u.opcode in hlo.COLLECTIVES or u is root for u in users[i.name]):
      out += hlo.shape_bytes(i.shape)
      carried.add(i.name)
  if root.opcode == "tuple":
    inner = {i.name: i.shape for i in body}
    out += sum(hlo.shape_bytes(inner[o]) for o in root.operands if o in carried)
  return out


def _has_slot(comp: str, comps: dict, memo: dict) -> bool:
  """Whether computation `comp`, or a loop or call in it, holds a conditional (a pipeline slot)."""
  if comp not in memo:
    memo[comp] = False
    for ins in comps.get(comp, []):
      inner = re.findall(r"(?:body|to_apply)=%?([\w.\-]+)", ins.attrs) if ins.opcode in ("while", "call") else []
      if ins.opcode == "conditional" or any(_has_slot(c, comps, memo) for c in inner):
        memo[comp] = True
        break
  return memo[comp]


def _state(st: dict, comm: dict) -> dict:
  return {**{k: v for k, v in st.items()}, **{f"comm {a}": v for a, v in comm.items()}}


def _minus(a: dict, b: dict) -> dict:
  return {k: v - b.get(k, 0) for k, v in a.items()}


def _same(a: dict, b: dict) -> bool:
  """Two iterations' state changes equal (to float rounding)."""
  return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-9 * max(abs(a[k]), abs(b[k]), 1e-15) for k in a)


def _wait(st: dict, until: float) -> None:
  if until > st["t"]:
    st["exposed"] += until - st["t"]
    st["t"] = until


def _short(op_name: str) -> str:
  return "/".join(op_name.split("/")[-2:])


def _event(name, kind, row, start, dur, it, args, coll=None, backward=False) -> dict:
  from shardlab.analysis.timeline import Task, category
  cat = category(Task(kind, coll=coll, backward=backward))
  return {"name": name, "cat": cat, "row": row, "start": start, "dur": dur, "args": {**args, "iteration": list(it)}}
