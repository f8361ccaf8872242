"""A layer's backward cut in two, for zero-bubble pipelines (Qi et al. 2023, arXiv:2401.10241): B computes the
input gradient and hands W what W needs; W computes the weight gradient from it and the layer's residuals. No
matmul runs twice: no second backward chain, no recomputed forward matmul.

JAX's vjp gives one backward function for both gradients. `split` traces it once into a flat jaxpr (calls to
jitted functions and remat blocks inlined, so that their equations can land on either side), keeps for B every
equation the input gradient depends on, and gives W the rest of what the weight gradient depends on. What W reads
of B's equations (each weight matmul's output gradient and, under remat, the recomputed activations) is B's extra
output: the values a waiting W holds (`Split.boundary_avals`). A matmul's weight gradient x^T dy thus runs once,
in W, from the x and dy that B left. Two refinements keep what W holds small (_shrink, _pull): recomputation
only a weight gradient reads runs in B where its result is smaller than what it reads, and W re-runs a cheap
producer (no matmul) of a large value instead of holding it, e.g. the all-gather of a sequence-parallel shard.
Public JAX only (jax.extend): the jaxprs are cut, not rewritten.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util as SI

from shardlab import collectives as C

INLINED = ("jit", "pjit", "remat2", "checkpoint", "closed_call", "core_call")   # call-like: their bodies inlined


def _read(env, v):
  return v.val if isinstance(v, jcore.Literal) else env[v]


def _bind(eqn, vals):
  """eqn's primitive on vals. A body traced with some inputs invariant (a remat block's, a vjp closure's) may
  be run with them varying over more mesh axes (read back from a buffer that varies over them): an equation
  whose inputs then disagree gets them all varying over the union (no communication, as JAX's own numpy
  functions do), and a pvary of an axis already varying is the identity. (The mismatch is recognised by the
  message jax 0.10.2 raises for it; tests/test_pipeline.py's zero-bubble cases under remat fail if that changes.)"""
  params = eqn.primitive.get_bind_params(eqn.params)
  if eqn.primitive.name == "pvary":
    axes = tuple(a for a in params["axes"] if a not in C.varying_axes(vals[0]))
    return [vals[0]] if not axes else [eqn.primitive.bind(vals[0], axes=axes)]
  try:
    outs = eqn.primitive.bind(*vals, **params)
  except ValueError as e:
    if "varying manual axes" not in str(e):
      raise
    union = frozenset().union(*(C.varying_axes(v) for v in vals if hasattr(v, "shape")))
    outs = eqn.primitive.bind(*(C.pvary(v, tuple(union)) if hasattr(v, "shape") else v
                                for v in vals), **params)
  return outs if eqn.primitive.multiple_results else [outs]


def _eval(jaxpr, consts, args, names=None, inline: bool = False):
  """Evaluate `jaxpr` by binding its equations (_bind), with inline a call-like one by evaluating its body the
  same way (so that tracing this gives a jaxpr without them). Each equation keeps its name scopes (the audit
  reads a collective's)."""
  names = SI.current_name_stack() if names is None else names
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    vals = [_read(env, v) for v in eqn.invars]
    body = eqn.params.get("jaxpr") if inline and eqn.primitive.name in INLINED else None
    stack = names + eqn.source_info.name_stack
    if body is not None:
      inner, inner_consts = (body.jaxpr, body.consts) if isinstance(body, jcore.ClosedJaxpr) else (body, ())
      outs = _eval(inner, inner_consts, vals, stack, inline=True)
    else:
      with SI.user_context(eqn.source_info.traceback, name_stack=stack), eqn.ctx.manager:
        outs = _bind(eqn, vals)
    env.update(zip(eqn.outvars, outs))
  return [_read(env, v) for v in jaxpr.outvars]


def _needs(eqns, outvars) -> set[int]:
  """Indices of the equations `outvars` depend on."""
  made = {v: i for i, e in enumerate(eqns) for v in e.outvars}
  want = [v for v in outvars if not isinstance(v, jcore.Literal)]
  seen: set[int] = set()
  while want:
    i = made.get(want.pop())
    if i is None or i in seen:
      continue
    seen.add(i)
    want.extend(v for v in eqns[i].invars if not isinstance(v, jcore.Literal))
  return seen


@dataclass(frozen=True)
class Split:
  """The two halves of one backward over flat inputs `args`: b(*args) -> (input gradients, boundary) and
  w(read, boundary) -> weight gradients, `read` the inputs W reads (`w_reads`: per input, whether it does).
  `boundary_avals`: what B hands W beyond those inputs."""
  b_jaxpr: object
  w_jaxpr: object
  boundary_avals: tuple
  w_reads: tuple

  def b(self, *args):
    outs = _eval(self.b_jaxpr.jaxpr, self.b_jaxpr.consts, args)
    n = len(outs) - len(self.boundary_avals)
    return list(outs[:n]), list(outs[n:])

  def w(self, read, boundary):
    return list(_eval(self.w_jaxpr.jaxpr, self.w_jaxpr.consts, [*read, *boundary]))


def _nbytes(v) -> int:
  return v.aval.size * v.aval.dtype.itemsize


def _shrink(eqns, b_eqns: set, w_eqns: set, dw_out, inputs: set, held: set) -> None:
  """Move recomputation from W to B (in place) where that makes what B hands W smaller: an equation that does not
  depend on the output gradient (`held`: a forward value remat recomputes, never weight-gradient work), whose
  inputs B has, and whose outputs W still reads are fewer bytes than the inputs only it read of what W holds.
  E.g. under remat the attention output that only the output projection's weight gradient reads is recomputed
  in B from the probabilities B made, instead of handing W the probabilities (L x L per head). Nothing runs
  twice: B and W still share the backward's equations."""
  on_ct = set(held)                   # values that depend on the output gradient
  for e in eqns:
    if any(v in on_ct for v in e.invars if not isinstance(v, jcore.Literal)):
      on_ct.update(e.outvars)
  avail = {v for i in b_eqns for v in eqns[i].outvars}
  wanted = {v for v in dw_out if not isinstance(v, jcore.Literal)}
  changed = True
  while changed:
    changed = False
    readers: dict = {}
    for i in w_eqns:
      for v in eqns[i].invars:
        if not isinstance(v, jcore.Literal):
          readers.setdefault(v, set()).add(i)
    for i in sorted(w_eqns):
      e = eqns[i]
      ins = [v for v in e.invars if not isinstance(v, jcore.Literal)]
      if any(v in on_ct for v in e.outvars) or any(v not in avail and v not in inputs for v in ins):
        continue
      gain = sum(_nbytes(v) for v in set(ins) if (v in avail or v in held) and readers.get(v) == {i}
                 and v not in wanted)
      cost = sum(_nbytes(v) for v in e.outvars if (readers.get(v, set()) - {i}) or v in wanted)
      if cost < gain:
        w_eqns.discard(i)
        b_eqns.add(i)
        avail.update(e.outvars)
        changed = True
        break


def _pull(eqns, b_eqns: set, w_eqns: set, dw_out, inputs: set, weights: set) -> set:
  """Equations of B that W runs again instead of being handed their result, where what they read is fewer
  bytes than what they make, none is a matmul and none reads a weight W does not read already (W would gather
  it): the all-gather of a sequence-parallel activation or output gradient (W re-gathers the shard it holds).
  Returns their indices (they stay in B)."""
  made = {v: i for i, e in enumerate(eqns) for v in e.outvars}
  pulled: set = set()
  while True:
    runs = w_eqns | pulled
    w_made = {v for i in runs for v in eqns[i].outvars}
    read = {v for i in runs for v in eqns[i].invars if not isinstance(v, jcore.Literal)}
    read |= {v for v in dw_out if not isinstance(v, jcore.Literal)}
    boundary = {v for v in read if v not in w_made and v not in inputs}
    best = None
    for v in sorted(boundary, key=lambda v: (-_nbytes(v), made[v])):
      e = eqns[made[v]]
      if e.primitive.name == "dot_general" or any(type(x).__name__ != "NamedAxisEffect" for x in e.effects):
        continue       # (a collective's only effect names its mesh axis)
      ins = {u for u in e.invars if not isinstance(u, jcore.Literal)}
      if any(u in weights and u not in read for u in ins):
        continue
      new = {u for u in ins if u not in inputs and u not in boundary and u not in w_made}
      if sum(map(_nbytes, new)) < sum(_nbytes(u) for u in e.outvars if u in boundary):
        best = made[v]
        break
    if best is None:
      return pulled
    pulled.add(best)


def split(fn, args, n_input: int, held: int = 0, weights=()) -> Split:
  """Cut the backward `fn(*args)` (flat arrays in, flat arrays out; its first `n_input` outputs the input
  gradients, the rest the weight gradients; args may be jax.ShapeDtypeStructs) into B and W. The last `held` args
  are ones a waiting W would have to hold (a layer's output gradient), the others are kept anyway (residuals)
  or, those at the indices `weights`, gathered where read."""
  closed = jax.make_jaxpr(fn)(*args)
  flat = jax.make_jaxpr(lambda *a: _eval(closed.jaxpr, closed.consts, a, inline=True))(*args)
  jx = flat.jaxpr
  dx_out, dw_out = jx.outvars[:n_input], jx.outvars[n_input:]
  b_eqns = _needs(jx.eqns, dx_out)
  w_eqns = _needs(jx.eqns, dw_out) - b_eqns
  inputs = {*jx.invars, *jx.constvars}
  _shrink(jx.eqns, b_eqns, w_eqns, dw_out, inputs, set(jx.invars[len(jx.invars) - held:]) if held else set())
  w_eqns |= _pull(jx.eqns, b_eqns, w_eqns, dw_out, inputs, {jx.invars[i] for i in weights})   # run in both
  made_by_w = {v for i in w_eqns for v in jx.eqns[i].outvars}
  made_by_b = {v for i in b_eqns for v in jx.eqns[i].outvars} - made_by_w
  w_list = [e for i, e in enumerate(jx.eqns) if i in w_eqns]
  read = [v for e in w_list for v in e.invars if not isinstance(v, jcore.Literal)]
  read += [v for v in dw_out if not isinstance(v, jcore.Literal)]
  boundary = list(dict.fromkeys(v for v in read if v in made_by_b))
  w_reads = tuple(v in set(read) for v in jx.invars)
  info = lambda what, n_in, n_out: jcore.DebugInfo(f"zero-bubble {what}", jx.debug_info.func_src_info,
                                                   (None,) * n_in, (None,) * n_out)
  w_in = [v for v, r in zip(jx.invars, w_reads) if r] + boundary
  b_jaxpr = jcore.Jaxpr(jx.constvars, jx.invars, [*dx_out, *boundary],
                        [e for i, e in enumerate(jx.eqns) if i in b_eqns],
                        debug_info=info("B", len(jx.invars), len(dx_out) + len(boundary)))
  w_jaxpr = jcore.Jaxpr(jx.constvars, w_in, dw_out, w_list, debug_info=info("W", len(w_in), len(dw_out)))
  return Split(jcore.ClosedJaxpr(b_jaxpr, flat.consts), jcore.ClosedJaxpr(w_jaxpr, flat.consts),
               tuple(v.aval for v in boundary), w_reads)
