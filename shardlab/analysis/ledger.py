"""The communication ledger: every collective one step performs, forward and backward, by kind, mesh axis and
dtype, with executions and bytes per device per step. Read twice, independently:

  from_program(closed_jaxpr)  the traced program: walks nested jaxprs (jit, shard_map, scan x `length`, remat,
                              custom_vjp/jvp calls), after dead-code elimination, so only what executes counts
  from_hlo(colls)             the compiled program (hlo.collectives: while loops x known_trip_count)

Bytes follow the bandwidth-optimal cost of each kind (NCCL tests doc/PERFORMANCE.md; V = the full gathered or
reduced array, n = devices on the axis): AllGather and ReduceScatter move V (n-1)/n per device, AllReduce
2 V (n-1)/n, a ppermute its whole operand. A ring of n-1 ppermutes of V/n blocks therefore moves (n-1)/n V:
the bytes of the all-gather it replaces (tests/test_ledger.py checks the ring presets against allgather TP).

Why the traced program needs dead-code elimination: the explicit schedule's layer stack is a custom_vjp whose
backward calls `jax.vjp(gather, ..)` only for the transpose; that vjp's forward all-gather is dead, and XLA
drops it. The custom_vjp's primal body never appears in a differentiated program (AD runs fwd and bwd instead).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from shardlab import jax_private
from shardlab.analysis import hlo

# jaxpr primitive -> HLO opcode (the ledger speaks HLO's names on both sides). `pvary`/`pcast` move nothing.
PRIMITIVES = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "psum": "all-reduce",
              "psum_invariant": "all-reduce", "pmax": "all-reduce", "pmin": "all-reduce",
              "ppermute": "collective-permute", "all_to_all": "all-to-all", "ragged_all_to_all": "ragged-all-to-all"}
HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64", "int32": "s32",
             "int64": "s64", "int8": "s8", "uint8": "u8", "uint32": "u32", "bool": "pred"}


@dataclass
class Row:
  """One collective of the program (one jaxpr equation or one HLO instruction) and how often it runs."""
  kind: str          # HLO opcode: all-gather | reduce-scatter | all-reduce | collective-permute | all-to-all
  axis: str          # mesh axis, or axes joined by '+'
  dtype: str         # HLO dtype name (f32, bf16, ..)
  scope: str         # innermost collectives.scope name (hlo.scope_of), 'other' if unplanned
  backward: bool     # runs in the backward pass ('transpose(' in its name stack)
  group_size: int    # devices on the axis
  arrays: int        # arrays carried (XLA's combiners merge several into one instruction)
  count: int         # executions per step
  bytes_full: int    # V: the whole gathered / reduced array, per execution
  bytes_moved: int   # bytes each device sends per execution (bandwidth-optimal, see module doc)

  @property
  def total_bytes(self) -> int:
    return self.bytes_moved * self.count


# ---- from the traced program ----


def _dce(jaxpr):
  """The jaxpr with dead equations removed (shardlab.jax_private: private JAX API, in one place); without it the
  count would include dead collectives."""
  return jax_private.dce(jaxpr)


def _nbytes(aval) -> int:
  return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def from_program(closed_jaxpr, axis_order=None, platform: str = "cpu") -> list[Row]:
  """Every collective equation of a traced step (`jax.make_jaxpr(step)(*args)`), with its trip count.
  Collectives over axes of size 1 move nothing and are dropped (XLA removes them too). Axes are named in the
  order of the mesh the shard_map runs over (or `axis_order`). `platform`: what the program is lowered for (cpu,
  cuda, tpu): of a jax.lax.platform_dependent choice only that platform's branch is walked (only it is lowered)."""
  from jax.extend.core import jaxprs_in_params
  rows = []

  def walk(jaxpr, times, sizes, path):
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      where = path + "/" + str(eqn.source_info.name_stack)
      if name == "shard_map":
        sizes = dict(eqn.params["mesh"].shape)
      if name in PRIMITIVES:
        rows.append(_row(eqn, name, times, sizes, where, axis_order or tuple(sizes)))
      inner = [j for j in jaxprs_in_params(eqn.params)]
      if name == "while" and any(_has_collective(j) for j in inner):
        raise ValueError(f"{name} at {where}: collectives under it have no static count")
      if name == "cond" and eqn.params.get("branches_platforms"):     # platform_dependent: one branch lowered
        lists = eqn.params["branches_platforms"]
        hit = [i for i, ps in enumerate(lists) if ps is not None and platform in ps] or [lists.index(None)]
        walk(eqn.params["branches"][hit[0]].jaxpr, times, sizes, where)
        continue
      if name == "cond" and any(_has_collective(j) for j in inner):   # a declared pipeline slot
        n = hlo.branch_times(times, where, f"cond at {where}")
        for sub in inner:
          walk(sub, n, sizes, where)
        continue
      for sub in inner:
        walk(sub, times * (eqn.params["length"] if name == "scan" else 1), sizes, where)

  walk(_dce(closed_jaxpr.jaxpr), 1, {}, "")
  return [r for r in rows if r.group_size > 1]


def _row(eqn, name, times, sizes, where, axis_order) -> Row:
  axes = eqn.params.get("axis_name", eqn.params.get("axes"))
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  axes = tuple(a for a in axis_order if a in axes) + tuple(a for a in axes if a not in axis_order)
  n = int(np.prod([sizes.get(a, 1) for a in axes]))
  groups = eqn.params.get("axis_index_groups")
  if groups:   # within groups of the axis (collectives.Group: USP's): the devices of one group
    n = len(groups[0])
  if n > 1:   # axes of size 1 take no part (the compiled program names the group by the others)
    axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
  kind = PRIMITIVES[name]
  # a ragged all-to-all's bytes are data-dependent: counted at the most it can send (its whole input operand)
  invars = eqn.invars[:1] if kind == "ragged-all-to-all" else eqn.invars
  operand = sum(_nbytes(v.aval) for v in invars)
  full = operand * n if kind == "all-gather" else operand
  dtype = HLO_DTYPE.get(str(eqn.invars[0].aval.dtype), str(eqn.invars[0].aval.dtype))
  return Row(kind, "+".join(axes), dtype, hlo.scope_of(where), "transpose(" in where, n, len(invars), times,
             full, hlo.moved_bytes(kind, full, n))


def _has_collective(jaxpr) -> bool:
  from jax.extend.core import jaxprs_in_params
  return any(e.primitive.name in PRIMITIVES or any(_has_collective(j) for j in jaxprs_in_params(e.params))
             for e in jaxpr.eqns)


# ---- from the compiled program ----


def from_hlo(colls: list[hlo.Collective]) -> list[Row]:
  """hlo.collectives(...) as ledger rows (a combined collective carrying several dtypes: a row per dtype)."""
  return [Row(c.kind, c.axis, dtype, c.scope, "transpose(" in c.op_name, c.group_size, arrays, c.count,
              full, hlo.moved_bytes(c.kind, full, c.group_size))
          for c in colls if c.group_size > 1 for dtype, full, arrays in c.by_dtype()]


# ---- views ----


def totals(rows: list[Row], by=("kind", "axis")) -> dict:
  """{(field values..): {"count", "arrays", "bytes"}} summed over rows: executions, arrays carried (executions
  x arrays) and bytes sent per device per step."""
  out = defaultdict(lambda: {"count": 0, "arrays": 0, "bytes": 0})
  for r in rows:
    t = out[tuple(getattr(r, f) for f in by)]
    t["count"] += r.count
    t["arrays"] += r.count * r.arrays
    t["bytes"] += r.total_bytes
  return dict(out)


def nested(rows: list[Row]) -> dict:
  """{kind: {axis: {dtype: {"count", "arrays", "bytes", "forward_bytes", "backward_bytes"}}}}, JSON-ready."""
  out: dict = {}
  for r in rows:
    t = out.setdefault(r.kind, {}).setdefault(r.axis, {}).setdefault(
        r.dtype, {"count": 0, "arrays": 0, "bytes": 0, "forward_bytes": 0, "backward_bytes": 0})
    t["count"] += r.count
    t["arrays"] += r.count * r.arrays
    t["bytes"] += r.total_bytes
    t["backward_bytes" if r.backward else "forward_bytes"] += r.total_bytes
  return out


# What a target compiler may do to a placed collective, in the order the reconciliation tries them (a pair of
# program and compiled (kind, dtype) on one mesh axis; elements of the whole array V are conserved):
#   as placed                     same kind and dtype (executions may drop: `combined` below)
#   dtype narrowed / widened      same kind, another dtype: XLA moved the convert across the collective (the H100
#                                 and TPU compilers gather f32 weights as bf16 when only their bf16 copy is read;
#                                 XLA:CPU has no bf16 collectives and widens them to f32)
#   reduce-scatter as all-reduce  libtpu reduces small or awkwardly shaped arrays whole and slices its shard
#                                 afterwards: 2 V (n-1)/n moved for the V (n-1)/n placed (any dtype change beside)
#   all-gather as all-reduce      libtpu gathers small arrays (norm scales) as an all-reduce of the zero-padded
#                                 whole: 2 V (n-1)/n moved for V (n-1)/n
# and, for what no pair explains on an axis whose compiled collectives are all explained:
#   reduce-scatter padded ...     libtpu's padded all-reduce-scatter and the collective-permute that realigns its
#                                 rows (reconcile: each bounded by one shard)
#   duplicated                    a compiled collective of a kind and dtype placed on the axis, moving whole
#                                 copies of one placed array, at most as many as that array was placed: the
#                                 compiler ran a placed collective again rather than keep its result (libtpu, the
#                                 ring's positions beside a Mosaic kernel)
#   hoisted                       a placed collective in a loop on an operand the loop does not change, run fewer
#                                 times than placed (XLA's loop-invariant code motion, or CSE across layers)
#   all-reduce on fewer elements  XLA's AllReduceReassociate sums the operands of all-reduces whose results are
#                                 added, then reduces once, where the axis runs an all-reduce of the dtype (the
#                                 grad norm's partial sums, when a size-1 axis makes
#                                 their groups equal); libtpu reduces a tensor-replicated gradient over `tensor`
#                                 after its reduce-scatter over `fsdp`, on the shard (the leftover may show on a
#                                 reduce-scatter or all-gather of the dtype that paired "as all-reduce")
REWRITES = (("as placed", lambda pk, pd, ck, cd: pk == ck and pd == cd),
            ("dtype", lambda pk, pd, ck, cd: pk == ck and pd != cd),
            ("reduce-scatter as all-reduce", lambda pk, pd, ck, cd: pk == "reduce-scatter" and ck == "all-reduce"),
            ("all-gather as all-reduce", lambda pk, pd, ck, cd: pk == "all-gather" and ck == "all-reduce"))


def _pools(rows: list[Row]) -> dict:
  """{axis: {(kind, dtype): {"elements", "bytes", "count", "arrays"}}}: elements of the whole arrays V over
  every execution (what a rewrite conserves), bytes sent per device."""
  out: dict = {}
  for r in rows:
    p = out.setdefault(r.axis, {}).setdefault((r.kind, r.dtype), {"elements": 0, "bytes": 0, "count": 0, "arrays": 0})
    p["elements"] += r.count * r.bytes_full // hlo.DTYPE_BYTES.get(r.dtype, 4)
    p["bytes"] += r.total_bytes
    p["count"] += r.count
    p["arrays"] += r.count * r.arrays
  return out


@dataclass
class Reconciled:
  rewrites: list[dict]     # JSON-ready: {"rewrite", "axis", "elements", "program": {..}, "compiled": {..}}
  differences: list[str]   # human-readable; [] when every byte is explained
  unexplained: set         # the mesh axes the differences are on


def reconcile(program: list[Row], compiled: list[Row]) -> Reconciled:
  """The rewrites and differences between the traced program's ledger and the compiled one. Per mesh axis, every
  element the program placed is paired with an element the compiled program moves, by the first rule of
  REWRITES that pairs their (kind, dtype); each pairing other than "as placed" is a rewrite with the program's
  and the compiled bytes. Fewer executions than placed, bytes paired, is the compiler's combiner (several arrays
  in one instruction): a `combined` rewrite. `differences` (human-readable, [] when every byte is explained):
  elements left unpaired on either side, and an axis whose compiled program runs more collectives than placed."""
  P, C = _pools(program), _pools(compiled)
  rewrites, bad, axes = [], [], set()
  for axis in sorted(set(P) | set(C)):
    before = len(bad)
    p = {k: dict(v, left=v["elements"]) for k, v in P.get(axis, {}).items()}
    c = {k: dict(v, left=v["elements"]) for k, v in C.get(axis, {}).items()}
    for name, pairs in REWRITES:
      for (pk, pd), a in sorted(p.items()):
        for (ck, cd), b in sorted(c.items()):
          m = min(a["left"], b["left"])
          if m <= 0 or not pairs(pk, pd, ck, cd):
            continue
          a["left"] -= m
          b["left"] -= m
          if name == "as placed":
            continue
          what = name
          if pd != cd:
            change = "narrowed" if hlo.DTYPE_BYTES.get(cd, 4) < hlo.DTYPE_BYTES.get(pd, 4) else "widened"
            what = f"dtype {change}" if name == "dtype" else f"{name}, dtype {change}"
          rewrites.append({"rewrite": what, "axis": axis, "elements": m,
                           "program": {"kind": pk, "dtype": pd, "bytes": a["bytes"] * m // a["elements"]},
                           "compiled": {"kind": ck, "dtype": cd, "bytes": b["bytes"] * m // b["elements"]}})
    # libtpu's SingleInputAllReduceScatterFusion: a reduce-scatter whose rows do not split into its tiles runs as
    # an all-reduce of the rows padded to n equal shards and sliced, then a collective-permute moves the rows each
    # shard holds beyond the placed split to where it puts them: the padding and the moved rows, each at most one
    # shard of what was reduced as an all-reduce on this axis
    n = max((r.group_size for r in compiled if r.axis == axis), default=1)
    shard = sum(r["elements"] for r in rewrites if r["axis"] == axis
                and r["rewrite"].startswith("reduce-scatter as all-reduce")) // max(n, 1)
    pad = {k: b for k, b in c.items() if b["left"] and k[0] in ("all-reduce", "collective-permute")}
    within = all(sum(b["left"] for k, b in pad.items() if k[0] == kind) <= shard
                 for kind in ("all-reduce", "collective-permute"))
    if shard and pad and within and not any(b["left"] for k, b in c.items() if k not in pad):
      for (ck, cd), b in sorted(pad.items()):
        rewrites.append({"rewrite": "reduce-scatter padded to equal shards" if ck == "all-reduce" else
                         "reduce-scatter's rows realigned", "axis": axis, "elements": b["left"],
                         "program": {"kind": "reduce-scatter", "dtype": cd, "bytes": 0},
                         "compiled": {"kind": ck, "dtype": cd, "bytes": b["bytes"] * b["left"] // b["elements"]}})
        b["left"] = 0
        if ck == "collective-permute":
          b["extra_runs"] = b["count"]
    runs_of = {}                   # per (kind, dtype): {a placed collective's whole-array elements: its runs}
    for r in program:
      if r.axis == axis:
        e = r.bytes_full // hlo.DTYPE_BYTES.get(r.dtype, 4)
        of = runs_of.setdefault((r.kind, r.dtype), {})
        of[e] = of.get(e, 0) + r.count
    for key, b in sorted(c.items()):
      # a placed collective the compiler runs again (rematerialized, or in two branches): what is left is whole
      # runs of one placed array, at most as many again as it was placed (not any multiple of any size: a
      # scalar's would pass every leftover)
      one = [e for e, n in runs_of.get(key, {}).items() if e and b["left"] % e == 0 and b["left"] // e <= n]
      if b["left"] and one and not any(a["left"] for a in p.values()):
        rewrites.append({"rewrite": "duplicated", "axis": axis, "elements": b["left"],
                         "program": {"kind": key[0], "dtype": key[1], "bytes": 0},
                         "compiled": {"kind": key[0], "dtype": key[1], "bytes": b["bytes"] * b["left"] // b["elements"]}})
        b["extra_runs"] = b.get("extra_runs", 0) + b["left"] // max(one)
        b["left"] = 0
    if not any(b["left"] for b in c.values()):
      # a collective placed in a loop (the layer scan) on an operand the loop does not change, which the compiler
      # runs fewer times (hoisted out of the loop, or one run shared by several: the context strategies' token
      # positions, the same in every layer): at most all but one run of each such placed collective
      for key, a in sorted(p.items()):
        looped = [r for r in program if r.axis == axis and (r.kind, r.dtype) == key and r.count > 1]
        spare = sum((r.count - 1) * (r.bytes_full // hlo.DTYPE_BYTES.get(r.dtype, 4)) for r in looped)
        if a["left"] and key in c and key[0] != "all-reduce" and a["left"] <= spare:   # (all-reduces: below)
          rewrites.append({"rewrite": "hoisted", "axis": axis, "elements": a["left"],
                           "program": {"kind": key[0], "dtype": key[1], "bytes": a["bytes"] * a["left"] // a["elements"]},
                           "compiled": {"kind": key[0], "dtype": key[1], "bytes": 0}})
          a["left"] = 0
      # (the greedy pairing may have given a reassociated all-reduce's compiled elements to a placed reduce-scatter
      # or all-gather of its dtype, "as all-reduce": the leftover then shows there, at most the placed all-reduces'
      # elements)
      # (only where the compiled program runs an all-reduce of that dtype on the axis: one it does not run at all
      # was dropped, not reassociated)
      ar = lambda d: p.get(("all-reduce", d), {}).get("elements", 0)
      for (pk, pd), a in sorted(p.items()):
        if a["left"] and ("all-reduce", pd) in c and (
            pk == "all-reduce" or (pk in ("reduce-scatter", "all-gather") and a["left"] <= ar(pd))):
          rewrites.append({"rewrite": "all-reduce on fewer elements", "axis": axis, "elements": a["left"],
                           "program": {"kind": pk, "dtype": pd, "bytes": a["bytes"] * a["left"] // a["elements"]},
                           "compiled": {"kind": pk, "dtype": pd, "bytes": 0}})
          a["left"] = 0
    for side, pool, other in (("program", p, "the compiled program does not move"),
                              ("compiled", c, "the program did not place")):
      for (kind, dtype), v in sorted(pool.items()):
        if v["left"]:
          bad.append(f"{kind}/{axis}/{dtype}: {v['bytes'] * v['left'] // v['elements']} bytes ({v['left']} elements) "
                     f"{'placed that' if side == 'program' else 'moved that'} {other}")
    placed = sum(v["count"] for v in p.values())
    runs = sum(v["count"] - v.get("extra_runs", 0) for v in c.values())
    if runs > placed:
      bad.append(f"{axis}: the compiled program runs {runs} collectives per step, the program places {placed}")
    elif runs < placed:
      rewrites.append({"rewrite": "combined", "axis": axis, "program": {"executions": placed},
                       "compiled": {"executions": runs,
                                    "arrays": sum(v["arrays"] for v in c.values())}})
    if len(bad) > before:
      axes.add(axis)
  return Reconciled(rewrites, bad, axes)


def compare(program: list[Row], compiled: list[Row]) -> list[str]:
  """The differences of `reconcile`: [] when every byte the compiled program moves is one the program placed,
  as placed or through a named compiler rewrite."""
  return reconcile(program, compiled).differences


def per_axis(program: list[Row], compiled: list[Row]) -> dict:
  """{axis: {"placed_bytes", "compiled_bytes"}}: bytes sent per device per step, as the program placed them
  and as the compiled program moves them (after the compiler's rewrites)."""
  out: dict = {}
  for side, rows in (("placed_bytes", program), ("compiled_bytes", compiled)):
    for r in rows:
      out.setdefault(r.axis, {"placed_bytes": 0, "compiled_bytes": 0})[side] += r.total_bytes
  return dict(sorted(out.items()))


def dtype_scale(program: list[Row], compiled: list[Row]) -> dict:
  """{(kind, axis, scope): program bytes / compiled bytes} where the compiled program moves more. XLA:CPU has no
  bf16 collectives: its float normalization widens them to f32, so a dry run's HLO moves twice the bytes a GPU or
  TPU would for a bf16 program. The cost model scales such collectives back to the program's bytes."""
  key = ("kind", "axis", "scope")
  a, b = totals(program, key), totals(compiled, key)
  return {k: a[k]["bytes"] / b[k]["bytes"] for k in a if k in b and 0 < a[k]["bytes"] < b[k]["bytes"]}


def markdown(rows: list[Row]) -> str:
  """A table: kind, axis, dtype, executions, arrays, bytes forward and backward (per device per step)."""
  big = max((r.total_bytes for r in rows), default=0) >= 1e7
  scale, unit = (1e6, "MB") if big else (1e3, "KB")
  lines = [f"| kind | axis | dtype | executions | arrays | {unit} fwd | {unit} bwd |",
           "|---|---|---|---:|---:|---:|---:|"]
  for kind, axes in sorted(nested(rows).items()):
    for axis, dts in sorted(axes.items()):
      for dt, t in sorted(dts.items()):
        lines.append(f"| {kind} | {axis} | {dt} | {t['count']} | {t['arrays']} | {t['forward_bytes'] / scale:.1f} | "
                     f"{t['backward_bytes'] / scale:.1f} |")
  return "\n".join(lines)
