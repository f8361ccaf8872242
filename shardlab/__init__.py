"""shardlab: hand-placed collectives for FSDP x TP training on JAX, and the tools to compare them."""

# Python's cyclic garbage collector, run less often in a process that traces programs: tracing allocates hundreds of
# thousands of short-lived objects, and at CPython's default thresholds (700, 10, 10) a 2-step run of the tiny model
# (`python -m shardlab train.steps=2`) collected 584 times, 0.27-0.34 s of its 4.2-4.6 s; at these, 37 times,
# 0.07-0.10 s (2-core VM, 2026-11-28). A test worker's equivalence tests: 3.3 s of 80 s in the collector, then 0.5 s.
# Nothing is left uncollected: reference counting frees what is not in a cycle, and the collector still runs.
GC_THRESHOLDS = (10_000, 20, 20)


def fewer_gc_passes() -> None:
  """gc.set_threshold(*GC_THRESHOLDS), unless this process set thresholds of its own (not CPython's defaults).
  The CLI's first line; shardlab.mesh.set_cpu_devices, which every process that runs or tests a step calls before
  JAX starts, calls it too. Importing shardlab as a library leaves the collector alone."""
  import gc
  if gc.get_threshold() == (700, 10, 10):
    gc.set_threshold(*GC_THRESHOLDS)
