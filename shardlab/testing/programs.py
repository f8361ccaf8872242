"""The compiled program's collectives and overlap, checked: kind, mesh axis and bytes against what a test
expects, nothing the compiler added on its own, collectives that can run behind matmuls."""
from __future__ import annotations


import numpy as np

from shardlab.testing.meshes import mesh_id


def compiled_program(fn, args):
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
  colls = hlo.collectives(compiled_program(fn, args).as_text(), mesh.device_ids, tuple(mesh.axis_names))
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
    article = "an" if u["kind"][:1] in "aeiou" else "a"
    errors.append(f"the compiler added {article} {u['kind']} over {u['axis']} (of a {u['bytes']}-byte array, "
                  f"{u['name']}; the ledger counts the bytes each device sends) that "
                  f"no collective in the code placed (only shardlab.collectives places planned ones): most often a "
                  f"value typed varying over {u['axis']} where the math makes it invariant (JAX sums it: mark it "
                  f"with collectives.psum or keep it invariant; docs/testing.md), or in_specs that disagree with "
                  f"the arguments' layout (a reshard)")
  if errors:
    raise AssertionError((label or f"mesh {mesh_id(mesh)}: ") + "; ".join(errors) + f". Ledger: {format_ledger(ledger)}")
  return ledger


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
  rows = [r for r in hlo.overlap_rows(hlo.parse(compiled_program(fn, args).as_text())[0])
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
