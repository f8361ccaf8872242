"""Several processes, one mesh. `jax.distributed` starts before anything else touches JAX, from the config
(`distributed.coordinator=HOST:PORT distributed.num_processes=P distributed.process_id=I`) or from the cluster
(srun or mpirun with several tasks: JAX reads SLURM_* / OMPI_* itself). Afterwards `jax.devices()` lists every
process's devices, the mesh spans them all, and each process computes (and feeds) only its own shards: the
batch is a jit of (seed, step) with the batch sharding, so each process generates exactly its addressable rows.

On CPU the processes exchange collectives through gloo (`jax_cpu_collectives_implementation`); each process
brings `cpu_devices` fake devices of its own.
"""
from __future__ import annotations

import os

import jax
import numpy as np

from shardlab.config import DistributedConfig


def cluster_tasks() -> int:
  """Tasks that srun (SLURM_STEP_NUM_TASKS) or mpirun (OMPI_COMM_WORLD_SIZE) started for this job step."""
  return int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)


def initialize(d: DistributedConfig) -> None:
  """Join the other processes; must run before JAX's backend starts. A single process: nothing to do."""
  if d.coordinator is None and not (d.auto and cluster_tasks() > 1):
    return
  if jax.distributed.is_initialized():  # a second run in the same process
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on CPU
  if d.coordinator is None:
    jax.distributed.initialize()  # coordinator, process count and id from the cluster's environment
  else:
    jax.distributed.initialize(d.coordinator, d.num_processes, d.process_id)


def is_main() -> bool:
  """Process 0 writes the run's files (metrics.jsonl, summary.json); every process writes its checkpoint shards."""
  return jax.process_index() == 0


def over_processes(x: int, op=max) -> int:
  """`op` of one int from every process, the same answer on all of them (one process: `x`). Decisions that
  change what runs next (stop on a signal, which checkpoint to restore) go through here so no process diverges."""
  if jax.process_count() == 1:
    return x
  from jax.experimental import multihost_utils
  return int(op(multihost_utils.process_allgather(np.int32(x))))


def sync(name: str) -> None:
  """Wait until every process gets here."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
