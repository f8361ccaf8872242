"""Every use of JAX's private API (`jax._src`), in one place, for the JAX version it was written for.

Written for jax 0.10.2:
- dead-code elimination of a jaxpr (`partial_eval.dce_jaxpr`), which has no public equivalent. The ledger
  counts only collectives whose results are used (XLA removes the others), and the memory breakdown counts only
  the residuals a layer's backward reads;
- the distributed runtime's module and its global state (shardlab/distributed.py: the coordination service
  hosted in a child process, and the key-value client for barriers and heartbeats);
- the persistent compilation cache's write (`compilation_cache.put_executable_and_time`), wrapped so that some
  executables are not stored (shardlab.mesh.guard_persistent_cache).
Another JAX version: check these still exist and behave the same (tests/test_ledger.py, tests/test_target.py's
memory tests and tests/test_distributed.py fail if they do not), then add it to TESTED.
"""
from __future__ import annotations

import warnings

import jax
from jax._src.interpreters import partial_eval as _pe

TESTED = ("0.10.2",)
if jax.__version__ not in TESTED:
  warnings.warn(f"shardlab.jax_private was written for jax {', '.join(TESTED)}; this is jax {jax.__version__}: "
                "the ledger's dead-code elimination and the residual reader use private API", stacklevel=2)


def dce(jaxpr):
  """The jaxpr with dead equations removed, recursively (jit, scan, shard_map, remat, custom calls)."""
  return _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def distributed_module():
  """jax._src.distributed (its `_jax` runtime bindings and `global_state`)."""
  from jax._src import distributed
  return distributed


def dce_used_inputs(jaxpr) -> list[bool]:
  """Per input of `jaxpr`: whether any of its outputs depends on it."""
  return _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[1]


def skip_cache_writes(refuse) -> None:
  """JAX's persistent compilation cache stores no executable that `refuse(platform, hlo_text)` refuses (its
  backend's platform, "cpu", "gpu"..., and its optimized HLO text)
  (they are compiled afresh by every process that needs them); the others are stored as before. Idempotent."""
  from jax._src import compilation_cache as cc
  put = cc.put_executable_and_time
  if getattr(put, "refuse", None) is not None:
    put.refuse = refuse
    return

  def guarded(cache_key, module_name, executable, backend, compile_time):
    if guarded.refuse(backend.platform, "\n".join(m.to_string() for m in executable.hlo_modules())):
      return
    put(cache_key, module_name, executable, backend, compile_time)
  guarded.refuse = refuse
  cc.put_executable_and_time = guarded


def cache_write_refuser():
  """The `refuse` skip_cache_writes installed, or None."""
  from jax._src import compilation_cache as cc
  return getattr(cc.put_executable_and_time, "refuse", None)
