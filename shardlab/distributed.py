"""Several processes, one mesh. `jax.distributed` starts before anything else touches JAX, from the config
(`distributed.coordinator=HOST:PORT distributed.num_processes=P distributed.process_id=I`) or from the cluster
(srun or mpirun with several tasks: JAX reads SLURM_* / OMPI_* itself). Afterwards `jax.devices()` lists every
process's devices, the mesh spans them all, and each process computes (and feeds) only its own shards: the
batch is a jit of (seed, step) with the batch sharding, so each process generates exactly its addressable rows.

On CPU the processes exchange collectives through gloo (`jax_cpu_collectives_implementation`); each process
brings `cpu_devices` fake devices of its own.

Nothing waits forever: joining is bounded by `distributed.timeout_s` (a timer names what did not answer), every
barrier here goes through the coordination service with that timeout, and a watchdog thread asks the service
which processes are alive: a process that vanished without saying goodbye (killed, crashed, hung past
`distributed.heartbeat_timeout_s`) stops the others with one line naming it. JAX's recoverable mode is on so that
the service reports a lost process instead of aborting every survivor in C++, and the service runs in a child
process of process 0 so that it outlives a killed process 0 long enough to report it too.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading

import jax
import numpy as np

from shardlab import jax_private
from shardlab.config import DistributedConfig
from shardlab.errors import ConfigError

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
OMPI_VARS = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
_state = {"timeout_s": 120.0, "heartbeat_s": 20, "stop": threading.Event(), "watching": False, "keys": 0}


def cluster_tasks() -> int:
  """Tasks that srun (SLURM_STEP_NUM_TASKS) or mpirun (OMPI_COMM_WORLD_SIZE) started for this job step."""
  v = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("OMPI_COMM_WORLD_SIZE") or "1"
  return int(v) if v.strip().isdigit() else 1


def check_cluster_env(d: DistributedConfig) -> None:
  """With `distributed.auto`, a task count from srun/mpirun needs the rest of that launcher's environment: a
  partial one (copied into a shell, or a stale variable) is a ConfigError, not JAX's ValueError."""
  if d.coordinator is not None or not d.auto:
    return
  for count_var, needed in (("SLURM_STEP_NUM_TASKS", SLURM_VARS), ("OMPI_COMM_WORLD_SIZE", OMPI_VARS)):
    v = os.environ.get(count_var)
    if v is None:
      continue
    if not v.strip().isdigit():
      raise ConfigError(f"distributed.auto=true: {count_var}={v!r} is not a task count; unset it, or set "
                        "distributed.auto=false to run one process")
    missing = [x for x in needed if x not in os.environ]
    if int(v) > 1 and missing:
      raise ConfigError(f"distributed.auto=true: {count_var}={v} says this is one of {v} tasks, but "
                        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set (a partial "
                        f"{count_var.split('_')[0]} environment); launch the tasks with "
                        f"{'srun' if count_var.startswith('SLURM') else 'mpirun'}, or set distributed.auto=false")
    return


def _say(msg: str) -> None:
  print(f"shardlab: error: {msg}", file=sys.stderr, flush=True)


def _reachable(address: str) -> bool:
  host, _, port = address.rpartition(":")
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
    return True
  except (OSError, ValueError):
    return False


def _coordinator(d: DistributedConfig) -> str:
  return f"distributed.coordinator={d.coordinator}" if d.coordinator else "the cluster's coordinator"


def _join_timed_out(d: DistributedConfig, n: int | None, me: int | None) -> None:
  """The join did not finish within distributed.timeout_s: say which side is missing and exit (JAX would wait
  for its own timeout and then abort in C++)."""
  where = _coordinator(d)
  if me not in (None, 0) and d.coordinator and not _reachable(d.coordinator):
    why = f"nothing answers at {where} (is process 0 running there, and the port right?)"
  else:
    why = (f"not every one of the {n or '?'} processes joined {where}; start each process_id in 0..{(n or 2) - 1} "
           "with the same coordinator")
  _say(f"distributed.timeout_s={d.timeout_s:g}: process {me if me is not None else '?'} waited {d.timeout_s:g} s "
       f"for the others: {why}, or raise distributed.timeout_s")
  os._exit(1)


def initialize(d: DistributedConfig) -> None:
  """Join the other processes; must run before JAX's backend starts. A single process: nothing to do."""
  if d.coordinator is None and not (d.auto and cluster_tasks() > 1):
    return
  if jax.distributed.is_initialized():  # a second run in the same process
    return
  _state.update(timeout_s=float(d.timeout_s), heartbeat_s=int(d.heartbeat_timeout_s),
                coordinator=_coordinator(d))
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on CPU
  try:   # a lost process is reported to the others (the watchdog names it) instead of aborting them in C++
    jax.config.update("jax_enable_recoverability", True)
  except AttributeError:
    pass
  me = d.process_id if d.coordinator else None
  timer = threading.Timer(d.timeout_s, _join_timed_out, (d, d.num_processes if d.coordinator else cluster_tasks(), me))
  timer.daemon = True
  timer.start()
  kw = dict(initialization_timeout=int(d.timeout_s) + 60, heartbeat_timeout_seconds=int(d.heartbeat_timeout_s))
  # Private API, no public way: JAX starts the coordination service inside process 0 and offers no option to
  # host it elsewhere. Hosted there, a killed process 0 takes the service along, and every survivor's client
  # aborts in C++ within a second (its error callback cannot be replaced from Python). So process 0 starts
  # the same service in a small child process of its own (`_serve`), which outlives it long enough for the
  # survivors to see process 0 missing and name it.
  jd = jax_private.distributed_module()
  start_service = jd._jax.get_distributed_runtime_service
  jd._jax.get_distributed_runtime_service = _ServiceProcess
  try:
    if d.coordinator is None:
      jax.distributed.initialize(**kw)  # coordinator, process count and id from the cluster's environment
    else:
      jax.distributed.initialize(d.coordinator, d.num_processes, d.process_id, **kw)
  finally:
    jd._jax.get_distributed_runtime_service = start_service
    timer.cancel()
  _start_watchdog()


_SERVE = """
import os, sys, time
from jaxlib import _jax
address, n, heartbeat, shutdown, recoverable = sys.argv[1], *map(int, sys.argv[2:])
try:
  service = _jax.get_distributed_runtime_service(address, n, heartbeat_timeout=heartbeat,
                                                 shutdown_timeout=shutdown, recoverable=bool(recoverable))
except Exception as e:
  print("error", " ".join(str(e).split())[:300], flush=True)
  os._exit(1)
print("ready", flush=True)
if sys.stdin.readline().strip() != "bye":   # process 0 vanished: let the others see that it is gone, then stop
  time.sleep(heartbeat + 10)
os._exit(0)
"""


class _ServiceProcess:
  """JAX's coordination service (the arguments of `_jax.get_distributed_runtime_service`), hosted by a child
  process that process 0 started (see `initialize`): it stops when process 0 shuts down, or, when process 0
  vanished (killed, crashed), heartbeat_timeout + 10 s later, once the others had the time to notice."""

  def __init__(self, address: str, num_nodes: int, heartbeat_timeout: int | None = None,
               shutdown_timeout: int | None = None, recoverable: bool | None = None, **_):
    import subprocess
    from shardlab.errors import RunError
    args = [address, num_nodes, heartbeat_timeout or 100, shutdown_timeout or 300, int(bool(recoverable))]
    self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, *map(str, args)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 start_new_session=True)   # a SIGINT to the run's process group is process 0's
    said = self.proc.stdout.readline().split(None, 1)
    if said[:1] != ["ready"]:
      self.proc.kill()
      raise RunError(f"{_state['coordinator']}: process 0 could not start the coordination service at {address} "
                     f"({said[1].strip() if len(said) > 1 else 'its process ended'}); is that port taken (by "
                     "another run, or one that ended less than distributed.heartbeat_timeout_s + 10 s ago)?")

  def shutdown(self) -> None:
    try:
      self.proc.stdin.write("bye\n")
      self.proc.stdin.close()
      self.proc.wait(timeout=10)
    except Exception:  # noqa: BLE001  (gone already, or stuck: it ends on its own)
      pass


def _client():
  return jax_private.distributed_module().global_state.client


def _key(name: str) -> str:
  """A key unique to this call site's n-th use (every process makes the same calls in the same order)."""
  _state["keys"] += 1
  return f"shardlab/{name}/{_state['keys']}"


def _say_leaving() -> None:
  _state["stop"].set()
  try:
    _client().key_value_set(f"shardlab/left/{jax.process_index()}", "1", allow_overwrite=True)
  except Exception:
    pass


def _leaving() -> None:
  """atexit: tell the others this process leaves on purpose (an error or the end), so none reports it lost.
  In recoverable mode JAX's exit barrier no longer holds process 0 back, yet its exit stops the coordination
  service (in its child, `_ServiceProcess`) every other process polls: so the others disconnect first, and
  process 0 waits (at most timeout_s) for that."""
  import time
  if _client() is None:
    return
  _say_leaving()
  # The watchdog may be inside a coordination-service call, which runs without the GIL: left running, it would
  # return into an interpreter that is finalizing, be ended there by a forced unwind through C++, and abort the
  # process ("terminate called ... FATAL: exception not rethrown", exit -6) after a run that succeeded.
  watchdog = _state.get("watchdog")
  if watchdog is not None and watchdog is not threading.current_thread():
    watchdog.join(min(_state["timeout_s"], 30.0))
  n, me = jax.process_count(), jax.process_index()
  if me != 0:
    try:
      jax.distributed.shutdown()
    except Exception:
      pass
    return
  end = time.monotonic() + _state["timeout_s"]
  while time.monotonic() < end:
    try:
      if set(_client().get_live_nodes(list(range(n)))) <= {0}:
        return
    except Exception:
      return
    time.sleep(0.2)


def _missing() -> tuple[list[int], list[int]]:
  """(lost, left): processes the coordination service no longer sees, split by whether they said they were
  leaving (an error or the end of their run) or vanished (killed, crashed, hung)."""
  c, n = _client(), jax.process_count()
  try:
    live = set(c.get_live_nodes(list(range(n))))
  except Exception:  # the service itself is gone: process 0 hosted it
    return ([0], []) if jax.process_index() != 0 else ([], [])
  lost, left = [], []
  for p in sorted(set(range(n)) - live):
    try:
      said = c.key_value_try_get(f"shardlab/left/{p}")
    except Exception:
      said = None
    (left if said else lost).append(p)
  return lost, left


def _lost() -> list[int]:
  return _missing()[0]


_reporting = threading.Lock()


def _report_lost(lost: list[int]) -> None:
  if not _reporting.acquire(blocking=False):   # the watchdog and the main thread may both notice: one line
    threading.Event().wait()                    # the other reporter exits the process
  n = jax.process_count()
  who = ", ".join(f"process {p}" + (" (the coordinator)" if p == 0 else "") for p in lost)
  _say(f"lost {who} of {n}: killed, crashed or silent for distributed.heartbeat_timeout_s={_state['heartbeat_s']} "
       "s; stopping this one too (resume from the last checkpoint with checkpoint.resume=true)")
  _say_leaving()
  os._exit(1)


def _start_watchdog() -> None:
  if _state["watching"] or jax.process_count() == 1:
    return
  _state["watching"] = True
  atexit.register(_leaving)        # registered after JAX's own exit hooks, so it runs before them

  def watch():
    while not _state["stop"].wait(1.0):
      lost = _lost()
      if lost and not _state["stop"].is_set():
        _report_lost(lost)
  _state["watchdog"] = threading.Thread(target=watch, name="shardlab-watchdog", daemon=True)
  _state["watchdog"].start()


def wait_for_lost_peer(seconds: float | None = None) -> None:
  """After a failed step (a collective broke): if a peer is gone, report it and exit; else return after
  `seconds` (default: the heartbeat timeout, the longest the service takes to notice a hung peer)."""
  if jax.process_count() == 1 or not _state["watching"]:
    return
  import time
  end = time.monotonic() + (_state["heartbeat_s"] + 3 if seconds is None else seconds)
  while time.monotonic() < end:
    lost, left = _missing()
    if lost:
      _report_lost(lost)
    if left:
      from shardlab.errors import RunError
      raise RunError(f"process {', '.join(map(str, left))} of {jax.process_count()} stopped on its own error (see "
                     "its output); this process cannot go on without it")
    time.sleep(0.5)


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
  """Wait until every process gets here (device collective; use `barrier` where a bound matters)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def barrier(name: str, what: str) -> None:
  """Wait for every process at most distributed.timeout_s; a RunError names `what` they were doing."""
  if jax.process_count() == 1:
    return
  from shardlab.errors import RunError
  try:
    _client().wait_at_barrier(_key(name), int(_state["timeout_s"] * 1000))
  except Exception as e:
    raise RunError(f"distributed.timeout_s={_state['timeout_s']:g}: not every process reached '{what}' within "
                   f"{_state['timeout_s']:g} s ({str(e).strip().splitlines()[0][:160]})") from None


def gather_strings(name: str, value: str) -> list[str]:
  """Every process's `value`, in process order, through the coordination service (bounded by timeout_s)."""
  if jax.process_count() == 1:
    return [value]
  key = _key(name)
  _client().key_value_set(f"{key}/{jax.process_index()}", value)
  barrier(name + "_gathered", name)
  got = dict(_client().key_value_dir_get(f"{key}/"))
  return [got.get(f"{key}/{p}", "") for p in range(jax.process_count())]
