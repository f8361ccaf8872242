"""Read a compiled program's optimized HLO text: its collectives (kind, mesh axis, bytes, how many times loops
run them) and its dependency graph (which collective could overlap which matmul).

XLA:CPU runs collectives synchronously, but the optimized HLO is the same dataflow a GPU's latency-hiding
scheduler works from: a collective with no path to or from a matmul can run behind it.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all", "ragged-all-to-all")
# The audit's one rule: a collective placed through shardlab.collectives runs under a named scope
# `shardlab.<name>` (collectives.scope), whatever the name; any other collective is unplanned (UNPLANNED).
SCOPE_PREFIX = "shardlab."   # = collectives.SCOPE_PREFIX (tests/test_hlo.py checks; this module imports no JAX)
UNPLANNED = "other"
_TAG = re.compile(re.escape(SCOPE_PREFIX) + r"(\w+)")


def scope_of(op_name: str) -> str:
  """The innermost collective scope in an op_name path ('.../transpose(jvp(shardlab.ring_shift))/..' ->
  'ring_shift'), or UNPLANNED when no shardlab.collectives call placed it."""
  found = _TAG.findall(op_name)
  return found[-1] if found else UNPLANNED


def planned(op_name: str) -> bool:
  """Placed through shardlab.collectives (under any name)."""
  return scope_of(op_name) != UNPLANNED


@dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  operands: list
  attrs: str

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.attrs)
    return m.group(1) if m else ""


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string, tuples summed: 'f32[8,64]{1,0}' -> 2048."""
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]", shape):
    size = DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return total


_PARENS = re.compile(r"[()]")


def _matching(s: str, start: int) -> int:
  """Index of the parenthesis closing the one at s[start]."""
  depth = 0
  for m in _PARENS.finditer(s, start):
    depth += 1 if m.group() == "(" else -1
    if depth == 0:
      return m.start()
  raise ValueError("unbalanced parentheses in HLO")


def parse(text: str) -> tuple[dict, str]:
  """HLO module text -> ({computation: [Instr]}, entry computation name)."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      cur = head.group(2)
      comps[cur] = []
      if head.group(1):
        entry = cur
      continue
    if cur is None or " = " not in line or line.startswith("}"):
      continue
    lhs, rhs = line.strip().removeprefix("ROOT ").split(" = ", 1)
    if rhs.startswith("("):
      end = _matching(rhs, 0)
      shape, rest = rhs[: end + 1], rhs[end + 1:].lstrip()
    else:
      shape, _, rest = rhs.partition(" ")
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
      continue
    close = _matching(rest, m.end() - 1)
    inside = rest[m.end(): close]
    operands = [inside] if m.group(1) == "constant" else re.findall(r"%([\w.\-]+)", inside)   # a constant: its literal
    comps[cur].append(Instr(lhs.lstrip("%"), shape, m.group(1), operands, rest[close + 1:]))
  return comps, entry


RUNS = re.compile(r"(?:pipeline|flash)_(\w+?)_runs_(\d+)_of_(\d+)")


def declared_runs(op_name: str):
  """(slot, n, of) of the innermost pipeline slot scope in an op_name or name stack (pipeline_tables.py: runs), or
  of a Pallas kernel's block-skipping branch when interpreted (flash_kernel.py: flash_visit_runs_n_of_m): the
  conditional there runs its branch n times in `of` executions of its context; None if it declares none."""
  found = RUNS.findall(op_name)
  return (found[-1][0], int(found[-1][1]), int(found[-1][2])) if found else None


def branch_times(times: int, op_name: str, what: str) -> int:
  """How often a conditional's branch runs, `times` being how often the conditional does: its declared count
  (declared_runs); one line if it declares none (a conditional's count is not in the program)."""
  got = declared_runs(op_name)
  if got is None:
    raise ValueError(f"{what}: collectives under a branch have no static count")
  _, n, of = got
  if (times * n) % of:
    raise ValueError(f"{what}: declared to run {n} of {of} times, which is no whole count of its {times} runs")
  return times * n // of


def called(ins) -> list[str]:
  """The computations an instruction calls by `calls=` (a fusion's body, a custom call's)."""
  return re.findall(r"calls=%?([\w.\-]+)", ins.attrs)


def branches(ins) -> list[str]:
  """The branch computations of a conditional: `branch_computations={...}` (an index predicate, XLA:CPU) or
  `true_computation=..., false_computation=...` (a boolean one, as the GPU compiler rewrites a two-way cond)."""
  b = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
  if b:
    return re.findall(r"%?([\w.\-]+)", b.group(1))
  return re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", ins.attrs)


def spread(ins, seen: dict) -> list[str]:
  """The branch computations of conditional `ins` to replay at this execution of it (a walk of the program,
  execution by execution): all of them (the declared branch and the empty one) on n of every `of` executions
  (declared_runs), spread evenly; none on the others. `seen` counts executions per conditional."""
  got = declared_runs(ins.op_name)
  if got is None:
    raise ValueError(f"conditional {ins.name}: no static schedule to replay")
  _, n, of = got
  k = seen[ins.name] = seen.get(ins.name, 0) + 1
  if k * n // of == (k - 1) * n // of:
    return []
  return branches(ins)


def multiplicities(comps: dict, entry: str) -> dict:
  """How many times each computation runs per program execution (while bodies x known_trip_count)."""
  mult = defaultdict(int)

  def visit(comp, times):
    mult[comp] += times
    for ins in comps.get(comp, []):
      if ins.opcode == "while":
        trips = trip_count(ins, comp, comps)
        body = re.search(r"body=%?([\w.\-]+)", ins.attrs).group(1)
        visit(body, times * trips)
      else:
        for c in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", ins.attrs):
          visit(c, times)
        if ins.opcode == "conditional":   # each branch as often as the declared branch runs; the other is empty
          n = branch_times(times, ins.op_name, f"conditional {ins.name}")
          for c in branches(ins):
            visit(c, n)
  visit(entry, 1)
  return dict(mult)


def _constant(name: str, instrs: list) -> int | None:
  """The integer a scalar instruction holds: a constant, through copies (TPU programs copy loop counters)."""
  ins = next((i for i in instrs if i.name == name), None)
  while ins is not None and ins.opcode in ("copy", "copy-done", "bitcast") and ins.operands:
    ins = next((i for i in instrs if i.name == ins.operands[0]), None)
  if ins is None or ins.opcode != "constant":
    return None
  return int(ins.operands[0]) if ins.operands and re.fullmatch(r"-?\d+", ins.operands[0]) else None


def trip_count(ins: Instr, comp: str, comps: dict) -> int:
  """How many times while loop `ins` (in computation `comp`) runs: the compiler's known_trip_count, or (TPU
  programs carry none) read off its condition (_trip_count_from_condition)."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
  return int(m.group(1)) if m else _trip_count_from_condition(ins, comp, comps)


def _trip_count_from_condition(ins: Instr, comp: str, comps: dict) -> int:
  """A while loop's trip count when the compiler did not annotate it (TPU programs carry no known_trip_count),
  from the form every jax.lax.scan lowers to: the condition's root is `i < N` (a compare, direction=LT, of tuple
  element k of the loop state with a constant), element k starts from a constant in the loop's initial tuple, and
  the body's root tuple sets it to `i + c` for a constant c (c > 1 when the compiler unrolled the body). Anything
  else raises: a guessed count would make every byte and FLOP of the loop wrong."""
  fail = ValueError(f"while loop {ins.name} has no known trip count, and its condition is not `i < N`")
  cond = comps.get(re.search(r"condition=%?([\w.\-]+)", ins.attrs).group(1), [])
  body = comps.get(re.search(r"body=%?([\w.\-]+)", ins.attrs).group(1), [])
  root = cond[-1] if cond else None                 # HLO text lists a computation's ROOT last
  if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
    raise fail
  gte = next((i for i in cond if i.name == root.operands[0] and i.opcode == "get-tuple-element"), None)
  limit = _constant(root.operands[1], cond)
  init = next((i for i in comps[comp] if i.name == ins.operands[0]), None) if ins.operands else None
  if gte is None or limit is None or init is None or init.opcode != "tuple" or not body or body[-1].opcode != "tuple":
    raise fail
  k = int(re.search(r"index=(\d+)", gte.attrs).group(1))
  start = _constant(init.operands[k], comps[comp])
  step = _increment(body[-1].operands[k], k, body)
  if start is None or not step:
    raise fail
  return max(0, -(-(limit - start) // step))


def _increment(name: str, k: int, body: list) -> int | None:
  """c when the loop body's new element k is `element k + c` (an add of its get-tuple-element and a constant)."""
  by_name = {i.name: i for i in body}
  ins = by_name.get(name)
  while ins is not None and ins.opcode in ("copy", "bitcast") and ins.operands:
    ins = by_name.get(ins.operands[0])
  if ins is None or ins.opcode != "add" or len(ins.operands) != 2:
    return None
  for a, b in (ins.operands, ins.operands[::-1]):
    g = by_name.get(a)
    while g is not None and g.opcode in ("copy", "bitcast") and g.operands:   # libtpu copies the counter first
      g = by_name.get(g.operands[0])
    if g is not None and g.opcode == "get-tuple-element" and re.search(rf"index={k}\b", g.attrs):
      return _constant(b, body)
  return None


def _groups(ins: Instr) -> list[list[int]] | None:
  """The device groups of a collective (positions in the program's device assignment), in any of the three forms
  XLA prints: explicit lists, an iota (`[G,S]<=[dims]T(perm)`) or a mesh with the axes that form the groups
  (`mesh['a'=4,'b'=2] {'b'}`). None where it names none (`{}` or no attribute: every device, one group)."""
  m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", ins.attrs)
  if m:
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  if "replica_groups=mesh[" in ins.attrs:
    return mesh_groups(ins.attrs.split("replica_groups=", 1)[1])
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", ins.attrs)
  if m:
    g, s = int(m.group(1)), int(m.group(2))
    dims = [int(d) for d in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(p) for p in m.group(4).split(",")])
    return ids.reshape(g, s).tolist()
  return None


MESH_GROUPS = re.compile(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}")


def mesh_groups(text: str) -> list[list[int]]:
  """Device groups from XLA's mesh form of replica groups (xla/hlo/ir/mesh_and_axis.cc, MeshAxesReplicaGroupList):
  `mesh['x'=4,'y'=2][, device_ids=(..)] {'y'}`: the devices (in iota order unless device_ids lists them) laid out
  on named axes; devices that differ only along the braced axes form a group. A braced `'x':(p)k` is a sub-axis:
  the k-sized factor of x after a major factor p (x = p * k * rest, major to minor). The H100 compiler, libtpu and
  XLA:CPU's partitioner give the collectives they place themselves (gspmd) in this form."""
  m = MESH_GROUPS.match(text)
  axes = dict((n.strip().strip("'\""), int(k)) for n, k in re.findall(r"([^,=]+)=(\d+)", m.group(1))) if m else {}
  refs = [re.fullmatch(r"\s*['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?\s*", r)
          for r in m.group(3).split(",") if r.strip()] if m else []
  if not axes or any(r is None or r.group(1) not in axes for r in refs):
    raise ValueError(f"replica groups {text[:80]!r}: not a form shardlab reads")
  names, sizes = tuple(axes), tuple(axes.values())
  # Each axis cut into factors at every sub-axis boundary named (major-to-minor products).
  cuts = {a: {1, k} for a, k in zip(names, sizes)}
  for r in refs:
    if r.group(2):
      cuts[r.group(1)] |= {int(r.group(2)), int(r.group(2)) * int(r.group(3))}
  factors = []                       # (axis, major product before it, size), major to minor over the whole mesh
  for a in names:
    b = sorted(cuts[a])
    factors += [(a, lo, hi // lo) for lo, hi in zip(b, b[1:])]
  n = math.prod(sizes)
  ids = _device_order(m.group(2)) if m.group(2) else np.arange(n)
  ids = ids.reshape([f[2] for f in factors] or [1])
  grouped = []
  for r in refs:
    a, pre, k = r.group(1), int(r.group(2) or 1), int(r.group(3) or 0)
    grouped += [i for i, f in enumerate(factors) if f[0] == a and (not k or pre <= f[1] < pre * k)]
  other = [i for i in range(len(factors)) if i not in grouped]
  size = math.prod(factors[i][2] for i in grouped)
  return ids.transpose(other + grouped).reshape(-1, size).tolist()


def _device_order(text: str) -> np.ndarray:
  """A mesh's device_ids: a list of ids, or an iota reshaped and transposed (`[4,2]T(1,0)`), flattened."""
  iota = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
  if not iota:
    return np.array([int(d) for d in re.findall(r"\d+", text)])
  dims = [int(d) for d in iota.group(1).split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  return (ids.transpose([int(p) for p in iota.group(2).split(",")]) if iota.group(2) else ids).ravel()


def axis_of(groups_or_pairs, device_ids: np.ndarray, axis_names: tuple) -> str:
  """The mesh axis (or axes, joined by '+') whose device groups contain every group/pair given. HLO numbers
  devices by their position in the program's device assignment (the mesh, flattened), not by device id."""
  ids = np.arange(np.size(device_ids)).reshape(np.shape(device_ids))
  candidates = []
  for k in range(1, len(axis_names) + 1):
    for axes in itertools.combinations(range(len(axis_names)), k):
      other = [a for a in range(ids.ndim) if a not in axes]
      grouped = ids.transpose(other + list(axes)).reshape(-1, math.prod(ids.shape[a] for a in axes))
      member = {int(d): i for i, g in enumerate(grouped) for d in g}
      if all(len({member[int(d)] for d in g}) == 1 for g in groups_or_pairs):
        candidates.append("+".join(axis_names[a] for a in axes))
  return candidates[0] if candidates else "?"


@dataclass
class Collective:
  kind: str
  axis: str
  dtype: str
  group_size: int
  bytes_full: int       # the whole gathered / reduced array (all-gather: result; others: operand)
  bytes_moved: int      # bytes each device sends per execution (bandwidth-optimal algorithm)
  count: int            # executions per program run
  scope: str
  computation: str
  name: str
  arrays: int = 1       # arrays it carries (more than 1 when XLA combined several collectives into one)
  op_name: str = ""     # the jax op_name path ('transpose(' in it: a backward-pass collective)
  parts: tuple = ()     # ((dtype, bytes_full, arrays), ..) when a combined collective carries several dtypes

  @property
  def total_bytes(self) -> int:
    return self.bytes_moved * self.count

  def by_dtype(self) -> list[tuple[str, int, int]]:
    """[(dtype, bytes_full, arrays)]: one entry, or one per dtype of a combined collective's arrays."""
    return list(self.parts) or [(self.dtype, self.bytes_full, self.arrays)]


def moved_bytes(kind: str, full: int, n: int) -> int:
  """Per-device bytes of a bandwidth-optimal collective over n devices (NCCL tests, doc/PERFORMANCE.md). A
  collective-permute counts its operand for every device of its groups: the bytes of a device that sends, the
  busiest; where its pairs are no cycle (a pipeline's sends between 2 stages, the first and the last stage's
  missing sends) some devices send nothing and the mean per device is less."""
  if kind == "all-reduce":
    return 2 * full * (n - 1) // n
  if kind == "collective-permute":
    return full if n > 1 else 0
  return full * (n - 1) // n


def mesh_ids(mesh_or_ids, axis_names=None) -> tuple:
  """(device_ids, axis_names) from a Mesh, or from device ids and the mesh's axis names (read from the mesh,
  never guessed from the array's rank)."""
  if hasattr(mesh_or_ids, "axis_names"):
    return mesh_or_ids.device_ids, tuple(mesh_or_ids.axis_names)
  if axis_names is None or len(axis_names) != np.ndim(mesh_or_ids):
    raise ValueError(f"device ids of rank {np.ndim(mesh_or_ids)} need the mesh's {np.ndim(mesh_or_ids)} axis "
                     f"names (got {axis_names!r}); pass the mesh")
  return mesh_or_ids, tuple(axis_names)


def collectives(text: str, device_ids, axis_names=None) -> list[Collective]:
  """Every collective in the compiled program, with its mesh axis, bytes and execution count. `device_ids`: the
  mesh (or its device ids, with its axis_names)."""
  comps, entry = parse(text)
  return collectives_in(comps, multiplicities(comps, entry), device_ids, axis_names)


def collectives_in(comps: dict, mult: dict, device_ids, axis_names=None) -> list[Collective]:
  """`collectives` of an already parsed program. An async pair (`all-gather-start` .. `all-gather-done`, as GPU
  programs have) is one collective: its start. `device_ids`: the mesh, or its device ids with its axis_names."""
  device_ids, axis_names = mesh_ids(device_ids, axis_names)
  out, chains = [], set()
  for comp, instrs in comps.items():
    shapes = {i.name: i.shape for i in instrs}
    for ins in instrs:
      kind = ins.opcode.removesuffix("-start")
      if kind not in COLLECTIVES or mult.get(comp, 0) == 0:
        continue
      # libtpu's async collective fusion splits one collective over a start fusion and its continuations, each
      # holding a copy of the instruction marked with the same chain_id: one collective, counted once
      key = chain_key(ins)
      if key:
        if key in chains:
          continue
        chains.add(key)
      if kind == "collective-permute":
        groups = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", ins.attrs.split("source_target_pairs=")[1])]
        n = _ring_size(groups, device_ids, axis_names)
      else:
        groups = _groups(ins) or [list(range(np.asarray(device_ids).size))]
        n = len(groups[0])
      if n == 1:   # over one device (an axis of size 1): a copy that moves nothing, and no axis to name
        continue
      # XLA's combiners merge several arrays into one tuple-shaped collective: sum over every operand.
      # (a ragged all-to-all's bytes are data-dependent: counted at the most it can send, its input operand)
      operands = ins.operands[:1] if kind == "ragged-all-to-all" else ins.operands
      operand_bytes = sum(shape_bytes(shapes.get(o, "")) for o in operands)
      full = shape_bytes(ins.shape) if kind == "all-gather" else operand_bytes
      if kind == "all-gather" and ins.opcode.endswith("-start"):   # async (GPU): the result tuple holds the operand
        full = operand_bytes * n
      # a reduction's dtype is its operand's: libtpu folds a convert into an all-reduce (bf16 operand, f32 result)
      typed = shapes.get(ins.operands[0], ins.shape) if kind != "all-gather" and ins.operands else ins.shape
      dtype = re.search(r"([a-z]+\d*(?:e\d+m\d+\w*)?)\[", typed).group(1)
      scope = scope_of(ins.op_name)
      out.append(Collective(kind, axis_of(groups, device_ids, axis_names), dtype, n, full,
                            moved_bytes(kind, full, n), mult[comp], scope, comp, ins.name, len(operands),
                            ins.op_name, _parts([shapes.get(o, "") for o in operands], full)))
  return out


def chain_key(ins: Instr) -> tuple | None:
  """The chain of one libtpu async collective fusion that `ins` (a collective) is a copy in, None when it is in
  none: its chain_id, its array (dtype and dims, whatever the layout) and its groups, which its copies share."""
  chain = re.search(r'chain_id="(\d+)"', ins.attrs)
  return (chain.group(1), re.sub(r"\{[^}]*\}", "", ins.shape), str(_groups(ins))) if chain else None


def async_fusion(ins: Instr, comps: dict) -> tuple[str, tuple] | None:
  """(role, chain_key) of a fusion in libtpu's async collective fusion (its flags
  `xla_tpu_enable_async_collective_fusion*`, conf/xla/maxtext_v5p.yaml), None for any other instruction. libtpu
  splits such a collective over three kinds of fusion, each holding a copy of the collective with the same
  chain_id: the start (its root a custom call `AsyncCollectiveStart`: the transfer begins), continuations (compute
  kernels the transfer runs beside) and the done (root `AsyncCollectiveDone`: the result is needed)."""
  if ins.opcode != "fusion":
    return None
  body = comps.get(next(iter(called(ins)), ""), [])
  key = next((chain_key(i) for i in body if i.opcode in COLLECTIVES and chain_key(i)), None)
  if key is None:
    return None
  root = body[-1]
  role = ("start" if 'custom_call_target="AsyncCollectiveStart"' in root.attrs else
          "done" if 'custom_call_target="AsyncCollectiveDone"' in root.attrs else "continuation")
  return role, key


def _parts(operands: list[str], full: int) -> tuple:
  """A combined collective's arrays by dtype, ((dtype, bytes_full, arrays), ..), its `full` bytes split in
  proportion to the operands' bytes; () when they share one dtype (the GPU combiner joins a bf16 weight's
  gather and an f32 one's)."""
  split: dict = {}
  for shape in operands:
    for dtype, d in re.findall(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]", shape):
      b, k = split.get(dtype, (0, 0))
      split[dtype] = (b + shape_bytes(f"{dtype}[{d}]"), k + 1)     # this array's bytes, not the whole tuple's
  total = sum(b for b, _ in split.values())
  if len(split) < 2 or not total:
    return ()
  return tuple((d, full * b // total, k) for d, (b, k) in sorted(split.items()))


def _ring_size(pairs, device_ids, axis_names) -> int:
  """How many devices a collective-permute's pairs pass along: the length of its cycles when the pairs close
  into cycles all of one length (rings within groups of an axis: USP's), else the size of the mesh axis they run
  along (a pipeline's sends, or a compiler's reshuffle with fixed points)."""
  nxt = dict((a, b) for a, b in pairs)
  if pairs and set(nxt.values()) == set(nxt):        # a permutation of its devices: cycles
    lengths = set()
    for first in nxt:
      n, d = 1, nxt[first]
      while d != first:
        d, n = nxt[d], n + 1
      lengths.add(n)
    if len(lengths) == 1:      # every device on a cycle of the same length: rings of that size
      return lengths.pop()
  ids = np.asarray(device_ids)
  axis = axis_of(pairs, ids, axis_names)
  return math.prod(ids.shape[axis_names.index(a)] for a in axis.split("+")) if axis != "?" else 0


_HEAD = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s[^\n]*\{[ \t]*$", re.M)
_COLLECTIVE_OP = re.compile(r" (?:%s)(?:-start)?\(" % "|".join(COLLECTIVES))   # an opcode, after its shape


def collective_computations(text: str) -> list[str]:
  """The computations of an HLO module that hold a collective (a loop body, a branch, the entry...), in order:
  what parse() would find, read by a scan of the text (mesh.guard_persistent_cache asks it of every program a
  run writes to the compilation cache, so it is kept cheap)."""
  heads = list(_HEAD.finditer(text))
  ends = [h.start() for h in heads[1:]] + [len(text)]
  return [h.group(1) for h, end in zip(heads, ends) if _COLLECTIVE_OP.search(text, h.end(), end)]


def allocations(buffer_assignment: str) -> dict:
  """The device-memory (memory space 0: HBM) bytes of a compiler's buffer assignment (XLA's
  BufferAssignment::ToString, the dump's `*-buffer-assignment.txt`), by kind: `parameter` (the arguments,
  donated outputs among them), `temp` (the temporaries and undonated outputs; TPU: one preallocated block),
  `other` (constants, thread-local) and `total`. Other memory spaces (TPU VMEM, SMEM) are left out."""
  out = {"parameter": 0, "temp": 0, "other": 0}
  for m in re.finditer(r"^allocation \d+: size (\d+)(.*?):$", buffer_assignment, re.M):
    attrs = m.group(2)
    color = re.search(r"\bcolor (\d+)", attrs)
    if color and int(color.group(1)) != 0:
      continue
    kind = ("parameter" if re.search(r"\bparameter \d+", attrs) else
            "other" if re.search(r"\b(constant|thread-local)\b", attrs) else "temp")
    out[kind] += int(m.group(1))
  out["total"] = sum(out.values())
  return out


def ledger(colls: list[Collective]) -> dict:
  """{kind: {axis: {"count": executions per step, "bytes": bytes sent per device per step}}}."""
  out: dict = {}
  for c in colls:
    row = out.setdefault(c.kind, {}).setdefault(c.axis, {"count": 0, "bytes": 0})
    row["count"] += c.count
    row["bytes"] += c.total_bytes
  return out


# ---- dependency structure ----


def _compute_comps(comps: dict) -> set:
  """Computations that contain a matmul, directly or through what they call."""
  memo = {}

  def has_dot(c):
    if c not in memo:
      memo[c] = False
      memo[c] = any(_is_dot(i) or any(has_dot(x) for x in called(i))
                    for i in comps.get(c, []))
    return memo[c]
  return {c for c in comps if has_dot(c)}


def _is_dot(ins: Instr) -> bool:
  return ins.opcode in ("dot", "convolution") or is_gemm_call(ins)


def is_gemm_call(ins: Instr) -> bool:
  """A library matmul: cuBLAS / cuBLASLt custom calls on GPU (`__cublas$gemm`, `__cublas$lt$matmul`)."""
  return ins.opcode == "custom-call" and bool(re.search(r'custom_call_target="[^"]*(gemm|matmul)', ins.attrs, re.I))


def is_attention_call(ins: Instr) -> bool:
  """A fused (flash) attention kernel, forward or backward: cuDNN's (`__cudnn$fmhaSoftmax`, `...Backward`) or
  shardlab's Pallas kernel (flash_kernel.py: a custom call named `shardlab_flash_<kind>_<FLOPs>f`)."""
  return ins.opcode == "custom-call" and ("__cudnn$fmha" in ins.attrs or stated_flops(ins) is not None)


STATED = re.compile(r"shardlab_flash_\w+?_(\d+)f/")


def stated_flops(ins: Instr) -> float | None:
  """The FLOPs a shardlab Pallas kernel states in its name (flash_kernel.py: the matmuls of the block pairs it
  visits; a Triton custom call carries no cost of its own), None for any other instruction."""
  if ins.opcode != "custom-call":
    return None
  m = STATED.search(ins.op_name)
  return float(m.group(1)) if m else None


@dataclass
class OverlapRow:
  computation: str
  collective: str
  kind: str
  scope: str
  independent_matmuls: int   # matmuls in the same computation with no path to or from the collective
  matmuls: int
  in_loop: bool              # the computation is a while-loop body (the layer loop)


def overlap_structure(text: str) -> list[OverlapRow]:
  """For every collective: how many matmuls of its computation it could run behind (no data dependency
  either way). A prefetched gather should be independent of all of its layer's matmuls; a ring step's
  ppermute of at least the matmul of its step."""
  return overlap_rows(parse(text)[0])


def overlap_rows(comps: dict) -> list[OverlapRow]:
  """`overlap_structure` of a parsed program."""
  dot_comps = _compute_comps(comps)
  bodies = {b for instrs in comps.values() for i in instrs if i.opcode == "while"
            for b in re.findall(r"body=%?([\w.\-]+)", i.attrs)}
  rows = []
  for comp, instrs in comps.items():
    colls = [i for i in instrs if i.opcode.removesuffix("-start") in COLLECTIVES and not i.opcode.endswith("-done")]
    if not colls:
      continue
    is_mm = {i.name for i in instrs if _is_dot(i) or any(
        c in dot_comps for c in called(i))}
    if not is_mm:
      continue
    # HLO text lists instructions after their operands: one pass builds every ancestor set (as bitsets).
    bit = {i.name: 1 << k for k, i in enumerate(instrs)}
    anc = {}
    for i in instrs:
      a = 0
      for p in i.operands:
        if p in bit:
          a |= bit[p] | anc[p]
      anc[i.name] = a
    for c in colls:
      independent = sum(1 for d in is_mm if not anc[c.name] & bit[d] and not anc[d] & bit[c.name])
      rows.append(OverlapRow(comp, c.name, c.opcode.removesuffix("-start"), scope_of(c.op_name), independent,
                             len(is_mm), comp in bodies))
  return rows


# ---- matmul FLOPs of an instruction (the cost model, the timeline and the program read them) ----


def dims(shape: str) -> list[int]:
  """'f32[8,32,64]{2,1,0}' -> [8, 32, 64] (the first array of a tuple)."""
  m = re.search(r"\[([\d,]*)\]", shape)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def dot_flops(ins: Instr, shapes: dict) -> float:
  """2 x (result elements) x (contracted elements): each output is a dot product of that length."""
  lhs = dims(shapes.get(ins.operands[0], "")) if ins.operands else []
  m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
  contracted = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 1
  return 2.0 * math.prod(dims(ins.shape)) * contracted


def conv_flops(ins: Instr, shapes: dict) -> float:
  """A convolution's multiply-adds x 2. libtpu writes every matmul as one (dim_labels: lhs b/f/spatial, rhs
  i/o/spatial, output b/f/spatial): a batch dim of the dot becomes a spatial dim whose window, padding and
  reversal let each output position meet one input position. So per spatial dim d, V_d = the (output position,
  window tap) pairs that land on a real (not padded, not dilated-in) input element; FLOPs = 2 x (output batch x
  output features) x (the rhs's input features: contracted per group) x prod V_d (XLA's HloCostAnalysis counts
  the valid taps alike)."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
  if not labels or len(ins.operands) < 2:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  lhs, rhs, out = dims(shapes.get(ins.operands[0], "")), dims(shapes.get(ins.operands[1], "")), dims(ins.shape)
  if not (lhs and rhs and out):
    return 0.0
  spatial = [c for c in out_l if c.isdigit()]
  window = re.search(r"window=\{([^}]*)\}", ins.attrs)
  field = lambda name, n, default: (
      [int(v) for v in re.search(rf"\b{name}=([\dx_]+)", window.group(1)).group(1).replace("_", "x").split("x")]
      if window and re.search(rf"\b{name}=", window.group(1)) else [default] * n)
  n = len(spatial)
  size, stride = field("size", n, 1), field("stride", n, 1)
  pad = field("pad", 2 * n, 0)
  lhs_dil, rhs_dil = field("lhs_dilate", n, 1), field("rhs_dilate", n, 1)
  taps = 1
  for d, c in enumerate(spatial):
    n_in, n_out = lhs[lhs_l.index(c)], out[out_l.index(c)]
    o = np.arange(n_out)[:, None]
    i = o * stride[d] + np.arange(size[d])[None, :] * rhs_dil[d] - pad[2 * d]
    taps *= int(np.count_nonzero((i >= 0) & (i % lhs_dil[d] == 0) & (i // lhs_dil[d] < n_in)))
  return 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * taps


def gemm_call_flops(ins: Instr, shapes: dict) -> float:
  """A cuBLAS custom call: its backend_config holds the dot's dimension numbers; the result is the tuple's first
  array (a workspace follows)."""
  lhs = dims(shapes.get(ins.operands[0], "")) if ins.operands else []
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
  contracted = math.prod(lhs[int(d)] for d in re.findall(r"\d+", m.group(1))) if m and lhs else 1
  return 2.0 * math.prod(dims(ins.shape)) * contracted


def attention_call_flops(ins: Instr) -> float:
  """A fused attention call: shardlab's Pallas kernel states its FLOPs (stated_flops); cuDNN's: 4 B H Lq Lk K for the forward's two matmuls (scores, then probabilities x
  values), 2.5 times that for the backward's five (FlashAttention-2's count, arXiv:2307.08691), half of it under a
  causal mask (the masked blocks are skipped). B H Lq Lk: the backend config's intermediate_tensor_shape; K: the
  output's last dimension."""
  stated = stated_flops(ins)
  if stated is not None:
    return stated
  m = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*"dimensions":\s*\[([^\]]*)\]', ins.attrs)
  if not m:
    return 0.0
  bhqk = [int(d) for d in re.findall(r"\d+", m.group(1))]
  k = dims(ins.shape)[-1]
  f = 4.0 * math.prod(bhqk) * k * (2.5 if "Backward" in ins.attrs else 1.0)
  return f / 2 if re.search(r'"mask_type":\s*"[A-Z_]*CAUSAL', ins.attrs) else f


def flops_fn(comps: dict):
  """flops(instruction, computation) -> matmul FLOPs it performs (dots, inside fusions too)."""
  memo = {}

  def of_comp(c):
    if c not in memo:
      memo[c] = 0.0
      shapes = {i.name: i.shape for i in comps.get(c, [])}
      memo[c] = sum(of_ins(i, shapes) for i in comps.get(c, []))
    return memo[c]

  def of_ins(ins, shapes):
    if ins.opcode == "dot":
      return dot_flops(ins, shapes)
    if ins.opcode == "convolution":
      return conv_flops(ins, shapes)
    if is_gemm_call(ins):
      return gemm_call_flops(ins, shapes)
    if is_attention_call(ins):
      return attention_call_flops(ins)
    if ins.opcode in ("fusion", "custom-call"):
      return sum(of_comp(c) for c in called(ins))
    return 0.0
  return of_ins
