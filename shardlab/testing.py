"""A kit for testing sharded code on fake CPU devices: shardlab's own tests use it, and so can yours.

With shardlab installed, its pytest plugin (shardlab/pytest_plugin.py) sets the fake CPU devices before JAX
starts and gives every test a `mesh` fixture; nothing else is needed in a test file.

Devices and meshes
  set_devices(n)                  n fake CPU devices, before JAX starts (the plugin calls it)
  mesh_shapes(n, rank=2)          every fsdp x tensor factorization of n (rank=3: data x fsdp x tensor)
  mesh_of(fsdp, tensor)           a cached mesh over the first fsdp*tensor devices (Auto axes);
  mesh_of(data, fsdp, tensor)     the same with an HSDP `data` axis in front (none when data is 1);
  mesh_of({axis: size})           any declared axes (shardlab/axes.py), e.g. {"pipeline": 2, "fsdp": 4}
Rank-coded inputs
  rank_coded(shape)               an array whose every value says where it came from (index i -> value i)
  where(x, shape)                 decode a rank-coded value back to its index in the original array
  origin(x, shape, spec, mesh)    ... and the device (and local index) that held it under `spec`
  assert_rank_coded_equal(..)     exact equality; a mismatch says which element (and shard) arrived instead
Comparisons
  per_device(fn, mesh, in_specs)  shard_map(fn) whose output out[f, t, ...] is device (f, t)'s local value
  assert_trees_close(a, b)        per-leaf comparison naming the leaf path and the first mismatching index
  assert_matches_reference(..)    a shard_map'd function against a plain one on every mesh: every device's
                                  output, and the gradients, optionally against finite differences too
  assert_collectives(..)          the compiled program's collectives (kind, mesh axis, bytes) against the
                                  expected ones, and no collective the compiler added on its own
  assert_schedule_matches_baseline(..)  a schedule's loss, gradients and bytes against `baseline` (or
                                  `against=` another schedule), tiny model; optional overlap claims
  assert_overlap(..)              collectives that can run behind matmuls (the compiled dependency graph)
The tiny model
  tiny_config, tiny_batch, reference_loss_and_grads, compile_schedule (cached; tests/conftest.py uses them)
  placed_batch(tokens, mesh)      tokens[B, L+1] -> data.Batch (inputs, targets, positions) placed on the mesh
  abstract_batch(B, L, mesh)      the same as ShapeDtypeStructs (for .lower)
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
import os

import numpy as np

DEFAULT_DEVICES = 8
# XLA:CPU compiles tests' programs with LLVM's optimizations off and with its elemental IR emitters instead of its
# MLIR fusion emitters. XLA's HLO passes still run; with the elemental emitters XLA:CPU expands each scatter into a
# loop of its own (tests/test_target.py's trip-count test compiles its CPU side with the default emitters).
# tests/test_equivalence.py on 2 workers: 150 CPU-seconds with both flags, 372 with the first alone (2026-11-26).
# The emitter flag is XLA:CPU's: the HLO and schedule of a GPU or TPU compile do not change.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


# ------------------------------------------------------------------------------------------- devices, meshes

def set_devices(n: int = DEFAULT_DEVICES, fast_compile: bool = True) -> None:
  """Ask for `n` fake CPU devices (through shardlab.mesh.set_cpu_devices, the one place that sets them).
  Must run before the first JAX operation; asking again for the same count later is harmless.
  `fast_compile` sets XLA_FLAGS to FAST_COMPILE unless it is already set: tests check numbers and bytes, not
  speed."""
  if fast_compile:
    os.environ.setdefault("XLA_FLAGS", FAST_COMPILE)
  from shardlab.mesh import set_cpu_devices
  set_cpu_devices(n)
  import jax   # the audit reads op_names: a cached program must carry its own (see shardlab.trainer.build)
  jax.config.update("jax_compilation_cache_include_metadata_in_key", True)


def configured_devices() -> int | None:
  """The fake CPU device count asked for so far (by set_devices or anyone else), if any."""
  import jax
  n = jax.config.jax_num_cpu_devices
  return n if n > 0 else None


def devices(n: int | None = None) -> list:
  """The first n devices the kit builds meshes on: the default backend's, or the fake CPU ones when the
  default backend has fewer (a machine with one GPU still runs the tests on 8 CPU devices)."""
  import jax
  n = n or device_count()
  devs = jax.devices()
  if len(devs) < n:
    devs = jax.devices("cpu")
  if len(devs) < n:
    raise ValueError(f"{n} devices needed, {len(devs)} present: run pytest with --shardlab-devices={n}")
  return devs[:n]


def device_count() -> int:
  """How many devices the kit's meshes span by default: the fake CPU count if one was set."""
  import jax
  return configured_devices() or len(jax.devices())


def mesh_shapes(n: int = 8, rank: int = 2, axes=None) -> list:
  """Every factorization of n into `rank` axes: (fsdp, tensor), or (data, fsdp, tensor) with rank=3. `axes`
  (declared axis names, outer to inner): every {axis: size} over those axes instead."""
  if axes is not None:
    if len(axes) == 1:
      return [{axes[0]: n}]
    return [{axes[0]: d, **rest} for d in range(1, n + 1) if n % d == 0
            for rest in mesh_shapes(n // d, axes=tuple(axes[1:]))]
  if rank not in (2, 3):
    raise ValueError(f"rank={rank}: meshes have 2 (fsdp x tensor) or 3 (data x fsdp x tensor) axes; "
                     f"name others with axes=(...)")
  return [tuple(s.values()) for s in mesh_shapes(n, axes=_classic()[3 - rank:])]


def _classic() -> tuple[str, ...]:
  from shardlab.axes import CLASSIC
  return CLASSIC


def mesh_id(shape) -> str:
  """(2, 4) or a mesh -> '2x4', (2, 2, 2) -> '2x2x2' (test ids and messages); a mesh or {axis: size} with other
  axes -> 'p2xf2xt2' (axes.label)."""
  from shardlab.axes import label, shape_of
  if hasattr(shape, "axis_names"):
    shape = dict(zip(shape.axis_names, shape.devices.shape))
  if isinstance(shape, dict):
    return label(shape_of(shape))
  return "x".join(str(s) for s in tuple(shape))


def parse_mesh_shape(shape) -> tuple[int, ...]:
  """'2x4', (2, 4) -> (2, 4); '2x2x2' -> (2, 2, 2) (data x fsdp x tensor). A named shape ({axis: size}, or a
  label such as 'p2xf2xt2') -> a tuple of (axis, size) pairs, outer to inner."""
  from shardlab.axes import parse_label, shape_of
  if isinstance(shape, dict):
    return tuple(shape_of(shape).items())
  if isinstance(shape, tuple) and shape and all(isinstance(s, tuple) for s in shape):
    return tuple(shape_of(dict(shape)).items())
  if isinstance(shape, str):
    if not all(p.isdigit() for p in shape.lower().split("x")):
      return tuple(parse_label(shape).items())
    shape = shape.lower().split("x")
  out = tuple(int(s) for s in shape)
  if len(out) not in (2, 3) or min(out) < 1:
    raise ValueError(f"mesh shape {shape!r}: expected 'FxT' (fsdp, tensor) or 'DxFxT' (data, fsdp, tensor), "
                     f"or a label naming its axes ('p2xf2xt2')")
  return out


def named_shape(shape) -> dict[str, int]:
  """Any shape parse_mesh_shape takes -> {axis: size} of the mesh it makes, outer to inner."""
  from shardlab.axes import CLASSIC, shape_of
  got = parse_mesh_shape(shape)
  if got and isinstance(got[0], tuple):
    return dict(got)
  return shape_of(dict(zip(CLASSIC[3 - len(got):], got)))


def mesh_of(*shape):
  """The `fsdp x tensor` (or `data x fsdp x tensor`) mesh (shardlab.mesh.make_mesh: Auto axes, so check_grads
  works; a data axis of 1 is no axis). Also mesh_of({axis: size}) or mesh_of('p2xf2xt2') for any axes. Cached."""
  if len(shape) == 1 and not isinstance(shape[0], int):
    shape = shape[0]
  return _mesh_of(tuple(named_shape(shape).items()))


@functools.lru_cache(maxsize=None)
def _mesh_of(items: tuple):
  from shardlab.mesh import make_mesh
  named = dict(items)
  return make_mesh(named, devices=devices(math.prod(named.values())))


def _meshes(meshes) -> list:
  """None (every shape of the device count), a mesh, a shape, or a list of either -> [Mesh]."""
  if meshes is None:
    meshes = mesh_shapes(device_count())
  elif hasattr(meshes, "axis_names") or isinstance(meshes, str) or (
      isinstance(meshes, tuple) and all(isinstance(s, int) for s in meshes)):
    meshes = [meshes]
  return [m if hasattr(m, "axis_names") else mesh_of(_hashable(m)) for m in meshes]


def _hashable(shape):
  return tuple(named_shape(shape).items())


# --------------------------------------------------------------------------------- rank-coded arrays, blocks

def rank_coded(shape, dtype=np.float32, offset: int = 0) -> np.ndarray:
  """Values 0, 1, 2, ... in row-major order: any element that lands in the wrong place is identifiable
  (exact in float32 up to 2**24 elements)."""
  size = int(np.prod(shape))
  assert size + offset < 2**24, "rank-coded arrays must stay exact in float32"
  return (np.arange(size, dtype=np.float64) + offset).astype(dtype).reshape(shape)


def where(value, shape) -> tuple[int, ...]:
  """The index a rank-coded value came from."""
  return tuple(int(i) for i in np.unravel_index(int(round(float(value))), shape))


def _entries(spec, ndim: int) -> list[tuple[str, ...]]:
  """A PartitionSpec as, per dim, the tuple of mesh axes it is split over (major to minor)."""
  spec = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
  return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def coords(mesh) -> list[dict]:
  """Every device's coordinates, as {axis: index}, in the mesh's row-major order."""
  return [dict(zip(mesh.axis_names, c)) for c in np.ndindex(*mesh.devices.shape)]


def fmt(coord: dict) -> str:
  return "(" + ", ".join(f"{a}={i}" for a, i in coord.items()) + ")"


def _slices(spec, shape, coord: dict, mesh) -> tuple:
  """The slices of a global array of `shape` that device `coord` holds under `spec`."""
  out = []
  for d, axes in enumerate(_entries(spec, len(shape))):
    n = math.prod(mesh.shape[a] for a in axes)
    if shape[d] % n:
      raise ValueError(f"dim {d} of shape {tuple(shape)} does not split over {'x'.join(axes)} ({n} devices)")
    k, i = shape[d] // n, 0
    for a in axes:
      i = i * mesh.shape[a] + coord[a]
    out.append(slice(i * k, (i + 1) * k))
  return tuple(out)


def block(x, spec, coord: dict, mesh) -> np.ndarray:
  """numpy: the block of global `x` that device `coord` holds under `spec`."""
  x = np.asarray(x)
  return x[_slices(spec, x.shape, coord, mesh)]


def owner(index, spec, shape, mesh) -> dict:
  """The device coordinates whose block under `spec` holds global `index` ('*': any, replicated)."""
  own = {a: "*" for a in mesh.axis_names}
  for d, axes in enumerate(_entries(spec, len(shape))):
    if axes:
      k = shape[d] // math.prod(mesh.shape[a] for a in axes)
      own.update(zip(axes, np.unravel_index(index[d] // k, [mesh.shape[a] for a in axes])))
  return {a: int(i) if i != "*" else i for a, i in own.items()}


def origin(value, shape, spec=None, mesh=None, name: str = "the input") -> str:
  """Where a rank-coded value came from: 'element (3, 1) of x (device (fsdp=1, tensor=*))'."""
  try:
    index = where(value, shape)
  except ValueError:
    return f"{float(value)!r}, not an element of {name}"
  text = f"element {index} of {name}"
  return text + (f" (device {fmt(owner(index, spec, shape, mesh))})" if mesh is not None else "")


def assert_rank_coded_equal(got, want, shape, spec=None, mesh=None, label: str = "") -> None:
  """Exact equality of rank-coded values; a mismatch says which element of the input (and, given its spec
  and mesh, which device's shard) arrived instead of the expected one."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
  bad = np.argwhere(got != want)
  if len(bad):
    i = tuple(int(k) for k in bad[0])
    raise AssertionError(f"{label}: {len(bad)} of {got.size} values wrong; at {i} got "
                         f"{origin(got[i], shape, spec, mesh)}, expected {origin(want[i], shape, spec, mesh)}")


# ---------------------------------------------------------------------------------------------- comparisons

def assert_trees_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6, label: str = "") -> None:
  """Every leaf of `actual` equals `expected` within tolerance; `atol` is relative to the leaf's scale
  (max |expected|), so that tiny and large parameters are held to the same standard."""
  import jax
  flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
  flat_e = jax.tree.leaves(expected)
  assert len(flat_a) == len(flat_e), f"{label}: {len(flat_a)} leaves vs {len(flat_e)}"
  for (path, a), e in zip(flat_a, flat_e):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    name = jax.tree_util.keystr(path)
    assert a.shape == e.shape, f"{label}{name}: shape {a.shape} != {e.shape}"
    scale = max(float(np.max(np.abs(e))) if e.size else 0.0, 1e-30)
    bad = np.abs(a - e) > atol * scale + rtol * np.abs(e)
    if bad.any():
      idx = tuple(int(i) for i in np.argwhere(bad)[0])
      err = float(np.max(np.abs(a - e)) / scale)
      raise AssertionError(f"{label}{name}: {int(bad.sum())} of {a.size} values differ; first at {idx}: "
                           f"{a[idx]!r} != {e[idx]!r}; max error {err:.2e} of the leaf's scale")


def _factor_hint(got, want, bad, mesh) -> str:
  """' every differing value is 0.25x the reference (1/4 = 1/size of tensor)' when the error is a factor."""
  g, w = got[bad], want[bad]
  nz = w != 0
  if not nz.any() or (g[nz] == 0).all():
    return ""
  r = g[nz] / w[nz]
  if not np.allclose(r, r[0], rtol=1e-4):
    return ""
  r = float(r[0])
  hint = f"; every differing value is {r:.4g}x the reference"
  sizes = {"x".join(c): math.prod(mesh.shape[a] for a in c) for k in (1, 2)
           for c in itertools.combinations(mesh.axis_names, k)}
  for axes, n in sizes.items():
    if n > 1 and (abs(r - n) < 1e-3 * n or abs(r * n - 1) < 1e-3):
      hint += f" ({'' if r > 1 else '1/'}{n} = {'' if r > 1 else '1/'}size of {axes}): a lost or extra factor"
      break
  return hint


def _compare(got, want, label, rtol, atol, mesh, locate=lambda i: f"at {i}", describe=None) -> None:
  """One array against its expected value, with a message naming the first mismatch."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-30)
  bad = ~(np.abs(got - want) <= atol * scale + rtol * np.abs(want))   # NaN counts as bad
  if bad.any():
    i = tuple(int(k) for k in np.argwhere(bad)[0])
    what = describe(got[i], want[i]) if describe else f"got {float(got[i])!r}, expected {float(want[i])!r}"
    raise AssertionError(f"{label}: {int(bad.sum())} of {got.size} values differ; first {locate(i)}: {what}"
                         f"{_factor_hint(got, want, bad, mesh)}")


def per_device(fn, mesh, in_specs):
  """shard_map(fn) whose every output leaf gets leading mesh dims: out[f, t, ...] is device (f, t)'s local
  value. Every device's copy is checked, including copies out_specs would call replicated."""
  import jax
  from jax.sharding import PartitionSpec as P
  lead = (None,) * len(mesh.axis_names)
  body = lambda *xs: jax.tree.map(lambda y: y[lead], fn(*xs))
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(*mesh.axis_names))


def _is_spec(x) -> bool:
  from jax.sharding import PartitionSpec
  return isinstance(x, PartitionSpec)


def _shape_hint(got, want) -> str:
  """Which dims of a local block are too large or too small ('dim 0: 4x too large, dim 1: 4x too small')."""
  if len(got) != len(want):
    return ""
  parts = [f"dim {d}: {g / w:g}x too large" if g > w else f"dim {d}: {w / g:g}x too small"
           for d, (g, w) in enumerate(zip(got, want)) if g != w and g and w]
  return ("; " + ", ".join(parts) + ": a gather or scatter on the wrong dimension?") if parts else ""


def assert_matches_reference(fn, reference, args, in_specs, out_specs, meshes=None, grads: bool = True,
                             numerical: bool = False, source: int | None = None, rtol: float = 1e-5,
                             atol: float = 1e-5, label: str = "") -> None:
  """`jax.shard_map(fn, in_specs, out_specs)` computes `reference(*args)` on every mesh, on every device.

  fn          the per-device function (runs inside shard_map); reference: the plain function of the global
              arrays. `args` are global arrays (use `rank_coded` ones).
  meshes      None (every fsdp x tensor shape of the device count), a mesh or shape, or a list of them.
  out_specs   the layout fn promises: each device's local output must equal its block of the reference's
              output under it (all copies of replicated outputs are checked).
  grads       also compare the VJP of every float argument, with a different cotangent on every device
              (the reference gets their sum, scattered to where each device's block lives).
  numerical   also `jax.test_util.check_grads` the sharded function (finite differences; float32 needs
              small-valued inputs).
  source      fn only moves elements of args[source] (a gather, a ring, a permute): name, on a mismatch,
              which element and which device's shard arrived instead of the expected one.
  """
  import jax
  args = tuple(np.asarray(a) for a in args)
  in_specs = (in_specs,) if _is_spec(in_specs) else tuple(in_specs)
  names = _arg_names(reference, len(args))
  refs, treedef = jax.tree.flatten(jax.jit(reference)(*args))
  refs = [np.asarray(r) for r in refs]
  specs = jax.tree.leaves(out_specs, is_leaf=_is_spec)
  specs = specs * len(refs) if len(specs) == 1 else specs
  assert len(specs) == len(refs), f"{len(specs)} out_specs for {len(refs)} outputs of the reference"
  floats = [i for i, a in enumerate(args) if np.issubdtype(a.dtype, np.floating)]
  wrt = floats if grads else []
  if wrt and not all(np.issubdtype(r.dtype, np.floating) for r in refs):
    raise ValueError("grads=True needs float outputs; pass grads=False")
  for mesh in _meshes(meshes):
    at = f"{label}mesh {mesh_id(mesh)}"
    stacked, k = per_device(fn, mesh, in_specs), len(mesh.axis_names)
    outs = jax.tree.leaves(jax.eval_shape(stacked, *args))
    assert len(outs) == len(refs), f"{at}: fn returns {len(outs)} outputs, the reference {len(refs)}"
    want = [_expected_blocks(r, spec, mesh, o.shape[k:], f"{at}, output {j}")
            for j, (o, r, spec) in enumerate(zip(outs, refs, specs))]
    cts = [_cotangent(o.shape, o.dtype) for o in outs] if wrt else []

    def run(args, cts):
      if not wrt:
        return stacked(*args), ()
      out, vjp = jax.vjp(_of(stacked, args, wrt), *[args[i] for i in wrt])
      return out, vjp(jax.tree.unflatten(jax.tree.structure(out), cts))
    got, dargs = jax.jit(run)(args, cts)

    for j, (g, w, spec) in enumerate(zip(jax.tree.leaves(got), want, specs)):
      def locate(i, spec=spec, shape=refs[j].shape):
        c = dict(zip(mesh.axis_names, i[:k]))
        glob = tuple(s.start + l for s, l in zip(_slices(spec, shape, c, mesh), i[k:]))
        return f"on device {fmt(c)}, local index {i[k:]} (global {glob})"
      describe = None
      if source is not None:
        src = lambda v: origin(v, args[source].shape, in_specs[source], mesh, names[source])
        describe = lambda g_, w_: f"got {src(g_)}, expected {src(w_)}"
      _compare(g, w, f"{at}, output {j}", rtol, atol, mesh, locate, describe)
    if numerical:
      from jax.test_util import check_grads
      try:
        check_grads(jax.jit(_of(stacked, args, floats)), [args[i] for i in floats], order=1, modes=("rev",),
                    eps=1e-2, atol=1e-2, rtol=1e-2)
      except AssertionError as e:
        raise AssertionError(f"{at}: AD gradients differ from finite differences: {e}") from None
    if not wrt:
      continue
    ref_cts = [_reference_cotangent(ct, spec, mesh, r) for ct, r, spec in zip(cts, refs, specs)]
    ref_grads = jax.jit(lambda args, cts: jax.vjp(_of(reference, args, wrt), *[args[i] for i in wrt])[1](
        jax.tree.unflatten(treedef, cts)))(args, ref_cts)
    for i, g, w in zip(wrt, dargs, ref_grads):
      locate = lambda idx, i=i: f"at {idx} (device {fmt(owner(idx, in_specs[i], args[i].shape, mesh))})"
      _compare(g, w, f"{at}, gradient of argument {i} ({names[i]})", rtol, atol, mesh, locate)


def _cotangent(shape, dtype) -> np.ndarray:
  """1, 2, 3, ... (mod a prime): a different, exactly summable cotangent on every device."""
  return (np.arange(int(np.prod(shape))) % 65521 + 1).astype(dtype).reshape(shape)


def _expected_blocks(ref, spec, mesh, local_shape, at: str) -> np.ndarray:
  """The reference output as every device should hold it under `spec`: [*mesh shape, *block]."""
  cs = coords(mesh)
  bshape = block(ref, spec, cs[0], mesh).shape
  if tuple(local_shape) != bshape:
    raise AssertionError(f"{at}: each device's block has shape {tuple(local_shape)}, but out_specs {spec} "
                         f"of the reference's {ref.shape} gives {bshape}{_shape_hint(local_shape, bshape)}")
  return np.stack([block(ref, spec, c, mesh) for c in cs]).reshape(*mesh.devices.shape, *bshape)


def _reference_cotangent(ct, spec, mesh, ref) -> np.ndarray:
  """Every device's cotangent added where its block lives in the global output (the copies of a
  replicated output sum): what the reference's VJP must be given."""
  total = np.zeros(ref.shape, np.float64)
  for c, idx in zip(coords(mesh), np.ndindex(*mesh.devices.shape)):
    total[_slices(spec, ref.shape, c, mesh)] += ct[idx]
  return total.astype(ref.dtype)


def _of(f, args, wrt):
  """f as a function of args[i] for i in wrt only, the other arguments fixed."""
  def g(*d):
    full = list(args)
    for i, v in zip(wrt, d):
      full[i] = v
    return f(*full)
  return g


def _arg_names(fn, n: int) -> list[str]:
  try:
    params = [p.name for p in inspect.signature(fn).parameters.values()]
  except (TypeError, ValueError):
    params = []
  return [params[i] if i < len(params) else f"arg{i}" for i in range(n)]


# ---------------------------------------------------------------------------------------------- collectives

def _compiled(fn, args):
  import jax
  if hasattr(fn, "as_text") and hasattr(fn, "memory_analysis"):   # already a jax.stages.Compiled
    return fn
  return (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args).compile()


def collectives_of(fn, args=(), mesh=None):
  """(hlo.collectives, unplanned) of `fn` compiled for `args` (or of an already compiled function).

  unplanned: summary.json's audit (analysis.program.audit), the one rule: every collective not placed through
  shardlab.collectives (under any name), e.g. the compiler's own resharding at a shard_map boundary whose
  in_specs disagree with how the arguments are laid out, or a bare `jax.lax` collective."""
  from shardlab.analysis import hlo, program
  if mesh is None:
    raise TypeError("collectives_of / assert_collectives need mesh=: the mesh the function runs on")
  colls = hlo.collectives(_compiled(fn, args).as_text(), mesh.device_ids, tuple(mesh.axis_names))
  return colls, program.audit(colls)["unplanned"]


def _row(value) -> dict:
  return {"bytes": value} if isinstance(value, (int, np.integer)) else dict(value)


def format_ledger(ledger: dict) -> str:
  rows = [f"{kind} over {axis}: {r['bytes']} bytes in {r['count']}" for kind, axes in sorted(ledger.items())
          for axis, r in sorted(axes.items())]
  return "; ".join(rows) or "no collectives"


def assert_collectives(fn, args=(), expected: dict | None = None, mesh=None, exact: bool = True,
                       label: str = "") -> dict:
  """The collectives `fn(*args)` performs, read from the compiled HLO, are the expected ones; returns the
  ledger ({kind: {axis: {"count", "bytes"}}}, bytes each device sends per call, loops unrolled).

  expected    {kind: {axis: bytes or {"bytes": b, "count": c}}}, kinds as HLO names them ('all-gather',
              'reduce-scatter', 'all-reduce', 'collective-permute', 'all-to-all'), axis 'fsdp', 'tensor'
              or 'fsdp+tensor'. A missing row means none; a row with 0 bytes is the same as a missing one.
  exact       also fail on collectives `expected` does not list (otherwise only listed rows are checked).
  Always fails on a collective not placed through shardlab.collectives (see collectives_of).
  """
  from shardlab.analysis import hlo
  colls, unplanned = collectives_of(fn, args, mesh)
  ledger = hlo.ledger(colls)
  errors = []
  want = {(k, a): _row(v) for k, axes in (expected or {}).items() for a, v in axes.items()}
  have = {(k, a): r for k, axes in ledger.items() for a, r in axes.items()}
  for key in sorted(set(want) | (set(have) if exact and expected is not None else set())):
    w, h = want.get(key), have.get(key, {"bytes": 0, "count": 0})
    kind, axis = key
    if w is None:
      if h["bytes"] or h["count"]:
        errors.append(f"unexpected {kind} over {axis}: {h['bytes']} bytes in {h['count']} collectives")
      continue
    if "bytes" in w and h["bytes"] != w["bytes"]:
      ratio = f" ({h['bytes'] / w['bytes']:.3g}x)" if w["bytes"] else ""
      errors.append(f"{kind} over {axis} moves {h['bytes']} bytes per device in {h['count']} collectives, "
                    f"expected {w['bytes']}{ratio}")
    if "count" in w and h["count"] != w["count"]:
      errors.append(f"{kind} over {axis} runs {h['count']} times, expected {w['count']}")
  for u in unplanned:
    errors.append(f"the compiler added a {u['kind']} over {u['axis']} ({u['bytes']} bytes, {u['name']}) that "
                  f"no collective in the code placed (only shardlab.collectives places planned ones): "
                  f"resharding, e.g. in_specs that disagree with the arguments' layout")
  if errors:
    raise AssertionError((label or f"mesh {mesh_id(mesh)}: ") + "; ".join(errors) + f". Ledger: {format_ledger(ledger)}")
  return ledger


# ---------------------------------------------------------------------------------- schedules, tiny model

def tiny_config(model: dict | None = None, **schedule):
  """The tiny model used by the tests: 4 layers, so that prefetch depth 2 still runs a loop of 2 trips.
  `model`: ModelConfig fields to change (e.g. {"n_kv_heads": 2, "attention": "blockwise"})."""
  from shardlab.config import Config, ModelConfig, ScheduleConfig, TrainConfig
  return Config(model=ModelConfig(**{"n_layers": 4, **(model or {})}), schedule=ScheduleConfig(**schedule),
                train=TrainConfig(steps=3))


@functools.lru_cache(maxsize=None)
def tiny_batch():
  """One batch of tokens[B, L+1] for the tiny model."""
  from shardlab.data import markov_batch
  cfg = tiny_config()
  return markov_batch(0, 0, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size, cfg.data.branching)


def placed_batch(tokens_BL1, mesh, layout=None, order=None):
  """tokens[B, L+1] -> data.Batch (inputs, targets, positions), each field placed by the layout's data spec on
  `mesh` (default layout: layout.Layout()), the tokens of each sequence in `order` (a schedule's data_order)."""
  import jax
  from jax.sharding import NamedSharding
  from shardlab.data import split
  from shardlab.layout import Layout
  from shardlab.train import batch_specs
  specs = batch_specs(layout or Layout(), mesh)
  return jax.device_put(split(tokens_BL1, order), type(specs)(*(NamedSharding(mesh, s) for s in specs)))


def abstract_batch(batch_size: int, seq_len: int, mesh, layout=None):
  """A data.Batch of ShapeDtypeStructs (int32 inputs, targets [batch_size, seq_len], positions [seq_len]) placed
  like placed_batch (for .lower)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from shardlab.data import Batch
  from shardlab.layout import Layout
  from shardlab.train import batch_specs
  shapes = ((batch_size, seq_len), (batch_size, seq_len), (seq_len,))
  return Batch(*(jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, s))
                 for shape, s in zip(shapes, batch_specs(layout or Layout(), mesh))))


def reference_loss_and_grads(model: dict | None = None, depth_order=None):
  """Loss and gradients of the unsharded reference on the tiny model (`model`: fields changed) and
  `tiny_batch()`; cached. The reference has one attention (plain): model.attention and its block are ignored.
  depth_order: the stored layer that runs at each depth (an interleaved pipeline's, pipeline.depth_order); the
  gradients come back in stored order."""
  model = {k: v for k, v in (model or {}).items() if k not in ("attention", "attention_block")}
  return _reference_loss_and_grads(tuple(sorted(model.items())), None if depth_order is None else tuple(depth_order))


@functools.lru_cache(maxsize=None)
def _reference_loss_and_grads(model_items: tuple, depth_order=None):
  import jax
  import numpy as np
  from shardlab import params as PM, reference as R
  cfg = tiny_config(dict(model_items))
  p = PM.init(jax.random.key(0), PM.declare(cfg.model), cfg.model)
  b = tiny_batch()
  order = np.arange(cfg.model.n_layers) if depth_order is None else np.asarray(depth_order)

  def loss(p):   # the layers run in depth order: stored layer order[d] at depth d
    return R.loss({**p, "layers": jax.tree.map(lambda a: a[order], p["layers"])}, b[:, :-1], b[:, 1:], cfg)
  with jax.numpy_dtype_promotion("strict"):
    return jax.jit(jax.value_and_grad(loss))(p)


def _schedule_key(schedule, knobs) -> tuple:
  """(implementation class or None, the ScheduleConfig's fields as a hashable tuple, name aside)."""
  import dataclasses
  from shardlab.config import ScheduleConfig
  cls = schedule if isinstance(schedule, type) else None
  if isinstance(schedule, ScheduleConfig):
    knobs = {**dataclasses.asdict(schedule), **knobs}
  elif isinstance(schedule, dict):
    knobs = {**schedule, **knobs}
  elif schedule is not None and cls is None:
    raise TypeError(f"schedule: a ScheduleConfig, a dict of knobs or a schedule class, not {schedule!r}")
  cfg = dataclasses.asdict(ScheduleConfig(**knobs))
  return cls, tuple(sorted((k, v) for k, v in cfg.items() if k != "name"))


def compile_schedule(schedule=None, mesh_shape=(2, 4), model: dict | None = None, layout: dict | None = None,
                     context: str | None = None, load_balance: bool = False, pipeline: dict | None = None, **knobs):
  """(compiled grad fn, (loss, grads)) of a schedule on the tiny model and `tiny_batch()`; cached.

  schedule: a ScheduleConfig, a dict of knobs, or a schedule class (constructed as cls(ScheduleConfig(
  **knobs), model, compute_dtype, layout), like the registered ones); knobs override. model: ModelConfig fields
  to change (tiny_config). mesh_shape: any shape mesh_of takes. layout: sharding rules {logical: [axes]} (None:
  the default layout). context: the context-parallel strategy (context.impl; None: all_gather); load_balance:
  context.load_balance (the data in zigzag order). pipeline: PipelineConfig fields ({"impl": "1f1b",
  "microbatches": 4}; None: no pipeline); compare with `reference_loss_and_grads(model, pipeline=..)`, which runs
  the layers in the pipeline's depth order."""
  items = tuple(named_shape(mesh_shape).items())     # data 1 is no axis: the 2D mesh (one compile)
  rules = None if layout is None else tuple((k, tuple(v) if isinstance(v, (list, tuple)) else v)
                                            for k, v in layout.items())
  return _compile_schedule(items, *_schedule_key(schedule, knobs), tuple(sorted((model or {}).items())), rules,
                           context, load_balance, tuple(sorted((pipeline or {}).items())))


@functools.lru_cache(maxsize=None)
def _compile_schedule(mesh_items, cls, items, model_items=(), rules=None, context=None, load_balance=False,
                      pipe_items=()):
  import jax
  import jax.numpy as jnp
  from shardlab import params as PM, schedules, train as T
  cfg = tiny_config(dict(model_items), **dict(items))
  mesh = mesh_of(mesh_items)
  layout, decls, params = _tiny_model(mesh_items, model_items, rules)
  from shardlab.config import ContextConfig
  cp = None if context is None and not load_balance else ContextConfig(
      name=(context or "all_gather").rpartition(":")[2], impl=context or "all_gather", load_balance=load_balance)
  from shardlab.config import PipelineConfig
  pipe = PipelineConfig(**{"name": dict(pipe_items).get("impl", "none"), **dict(pipe_items)}) if pipe_items else None
  sched = (cls(cfg.schedule, cfg.model, jnp.float32, layout, *([cp] if cp else [])) if cls
           else schedules.build(cfg.schedule, cfg.model, jnp.float32, layout, cp, pipe))
  micro = getattr(sched, "microbatches_on", lambda shape: cfg.schedule.microbatches)(dict(mesh_items))
  PM.check_divisible(cfg.model, layout, dict(mesh_items), cfg.train.batch_size, micro,
                     seq_parallel=sched.ops.seq_sharded, seq_halves=sched.ops.bidirectional)
  b = placed_batch(tiny_batch(), mesh, layout, sched.data_order(dict(mesh_items)))
  with jax.numpy_dtype_promotion("strict"):
    compiled = T.make_grad_fn(cfg, sched, decls, mesh).lower(params, b).compile()
  return compiled, jax.block_until_ready(compiled(params, b))


@functools.lru_cache(maxsize=None)
def _tiny_model(mesh_items, model_items=(), rules=None):
  """(layout, parameter declarations, parameters (seed 0) placed by the layout) of the tiny model on the mesh:
  made once per mesh, model and layout (jax arrays are immutable; every compiled step of the kit takes them)."""
  from shardlab import params as PM
  from shardlab.axes import TENSOR
  from shardlab.layout import Layout
  cfg, mesh = tiny_config(dict(model_items)), mesh_of(mesh_items)
  layout = Layout() if rules is None else Layout.of(dict(rules))
  layout.check(mesh.axis_names)
  decls = PM.declare(cfg.model, dict(mesh_items)[TENSOR], layout, mesh.axis_names)
  return layout, decls, PM.init_sharded(0, decls, cfg.model, mesh)


def _check_claims(ledger, base, comm, label) -> None:
  """`ledger` moves no more bytes than `comm` claims relative to `base` (see assert_schedule_matches_baseline)."""
  rows = lambda l: {f"{k} {a}": r["bytes"] for k, axes in l.items() for a, r in axes.items()}
  from shardlab.analysis.hlo import COLLECTIVES
  have, was = rows(ledger), rows(base)
  claims = {key: 1.0 for key in [*have, *was, "total"]} if comm == "baseline" else dict(comm)
  for key in claims:
    if key != "total" and (len(key.split()) != 2 or key.split()[0] not in COLLECTIVES):
      raise ValueError(f"comm claim {key!r}: expected 'total' or '<kind> <axis>' with a kind of "
                       f"{', '.join(COLLECTIVES)} (e.g. 'all-gather fsdp')")
  errors = []
  for key, factor in sorted(claims.items()):
    got = sum(have.values()) if key == "total" else have.get(key, 0)
    base_bytes = sum(was.values()) if key == "total" else was.get(key, 0)
    if got > factor * base_bytes:
      what = "in all" if key == "total" else "as " + key.replace(" ", " over ", 1)
      errors.append(f"moves {got} bytes per device per step {what}, more than it claims: {factor:g}x the "
                    f"baseline's {base_bytes}")
  if errors:
    raise AssertionError(f"{label}: " + "; ".join(errors) + f". Ledger: {format_ledger(ledger)}. "
                         f"Baseline: {format_ledger(base)}")


def _schedule_name(cls, items) -> str:
  defaults = dict(_schedule_key(None, {})[1])
  return cls.__name__ if cls else ", ".join(f"{k}={v}" for k, v in items if v != defaults[k]) or "baseline"


def assert_schedule_matches_baseline(schedule=None, mesh_shapes=((2, 4),), comm=None, reference: bool = False,
                                     rtol: float = 2e-5, atol: float = 2e-5, against=None, overlap=None,
                                     **knobs) -> dict:
  """A schedule trains the tiny model exactly as `baseline` does (loss and every gradient) on each mesh, and
  moves no more bytes than it claims; returns {mesh id: {"ledger", "baseline"}}.

  schedule    a ScheduleConfig, a dict of knobs, or a schedule class (see compile_schedule); knobs override.
  against     the schedule to compare with instead of `baseline` (same forms as `schedule`, None: baseline);
              `comm` claims are then relative to it, and the result's "baseline" is its ledger.
  comm        the byte claim, checked on the compiled programs' ledgers: None (no claim); "baseline" (no
              row and no total above the baseline's); or {"all-gather fsdp": 0.5, "total": 1.0, ...}: each
              named row (kind and axis) or the total at most that many times the baseline's bytes.
  overlap     a claim on what the schedule hides, checked on the compiled program (see assert_overlap): a dict
              of its arguments ({"kind": "reduce-scatter", "scope": "fsdp_all_gather", "behind": "all"}), or a
              list of them.
  reference   also compare with the unsharded reference (the baseline already is, in tests/).
  Every schedule is also audited: no collective that shardlab.collectives did not place (the one rule).
  """
  cls, items = _schedule_key(schedule, knobs)
  other_cls, other_items = _schedule_key(against, {})
  name, other = _schedule_name(cls, items), _schedule_name(other_cls, other_items)
  out = {}
  for shape in mesh_shapes:
    shape = tuple(named_shape(shape).items())
    label = f"{name} on {mesh_id(dict(shape))}"
    compiled, (loss, grads) = _compile_schedule(shape, cls, items)
    base_compiled, (base_loss, base_grads) = _compile_schedule(shape, other_cls, other_items)
    assert_trees_close(loss, base_loss, rtol=1e-6, atol=0, label=f"{label}, loss vs {other}")
    assert_trees_close(grads, base_grads, rtol=rtol, atol=atol, label=f"{label}, gradient vs {other} ")
    if reference:
      ref_loss, ref_grads = reference_loss_and_grads()
      assert_trees_close(grads, ref_grads, rtol=rtol, atol=atol, label=f"{label}, gradient vs reference ")
    ledger = assert_collectives(compiled, mesh=mesh_of(shape), label=f"{label}: ")
    base = assert_collectives(base_compiled, mesh=mesh_of(shape), label=f"{other} on {mesh_id(dict(shape))}: ")
    if comm is not None:
      _check_claims(ledger, base, comm, label)
    for claim in ([overlap] if isinstance(overlap, dict) else overlap or []):
      assert_overlap(compiled, label=f"{label}: ", **claim)
    out[mesh_id(dict(shape))] = {"ledger": ledger, "baseline": base}
  return out


def assert_overlap(fn, args=(), kind: str | None = None, scope: str | None = None, behind="any",
                   in_loop: bool = True, label: str = "") -> list:
  """Every matching collective of the compiled program could run behind matmuls: none of `behind` ("any": at
  least one, "all": every one) of its computation's matmuls has a data path to or from it (hlo.overlap_rows:
  the dependency structure a GPU's latency-hiding scheduler works from). Returns the matching rows.

  kind        HLO kind ('reduce-scatter', ...); scope: the collectives.scope name ('fsdp_all_gather' also
              names the reduce-scatter that is its transpose); in_loop: only collectives in a loop body (the
              layer loop), where overlap is decided. Fails if nothing matches."""
  from shardlab.analysis import hlo
  if behind not in ("any", "all"):
    raise ValueError(f"behind={behind!r}: 'any' or 'all'")
  rows = [r for r in hlo.overlap_rows(hlo.parse(_compiled(fn, args).as_text())[0])
          if (kind is None or r.kind == kind) and (scope is None or r.scope == scope) and (r.in_loop or not in_loop)]
  what = " ".join(x for x in (kind, f"({scope})" if scope else None) if x) or "collective"
  if not rows:
    raise AssertionError(f"{label}no {what} {'in a loop body ' if in_loop else ''}of the compiled program")
  need = (lambda r: r.independent_matmuls == r.matmuls) if behind == "all" else (lambda r: r.independent_matmuls > 0)
  bad = [r for r in rows if not need(r)]
  if bad:
    r = bad[0]
    raise AssertionError(f"{label}{len(bad)} of {len(rows)} {what} cannot run behind {behind} matmuls of their "
                         f"computation: e.g. {r.collective} in {r.computation} is independent of "
                         f"{r.independent_matmuls} of {r.matmuls}")
  return rows
