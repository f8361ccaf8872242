"""Comparisons: trees leaf by leaf, a shard_map'd function against a plain one on every mesh (every device's
output and the gradients)."""
from __future__ import annotations

import inspect
import itertools
import math

import numpy as np

from shardlab.testing.arrays import block, coords, fmt, origin, owner, slices
from shardlab.testing.meshes import mesh_id, meshes_for


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
  for mesh in meshes_for(meshes):
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
        glob = tuple(s.start + l for s, l in zip(slices(spec, shape, c, mesh), i[k:]))
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
    total[slices(spec, ref.shape, c, mesh)] += ct[idx]
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
