"""Checkpoints with orbax, and stopping cleanly on SIGTERM/SIGINT.

A checkpoint is the whole training state (params, optimizer state and step; every leaf lives on the mesh, the
scalars replicated) plus a small JSON record: the step, the losses so far, the mesh it was saved on, and a
checksum per leaf. The data position needs no saving: a batch is a pure function of (seed, step).

Restoring reads the newest checkpoint straight into the target shardings of the current mesh (`T.state_specs`
on the new mesh), so a run resumes on any mesh shape or device count; orbax reads each device's slice. Orbax
writes a checkpoint into a temporary directory and renames it when complete, so a save cut short never looks
complete. A checkpoint that fails to read, or whose bits differ from its checksums, is moved aside (renamed
`<step>.unreadable`) with a one-line warning (which step, why), and the one before it is used.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging as absl_logging
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlab import distributed as D
from shardlab.config import CheckpointConfig
from shardlab.errors import ConfigError
from shardlab.errors import RunError

# orbax reports every save at INFO through absl (absl's own logger: records name their caller, see the filter)
absl_logging.get_absl_logger().setLevel(logging.WARNING)


class _NoOrbaxTracebacks(logging.Filter):
  """Orbax logs a failed read or save as ERROR with a traceback (one per thread); shardlab reports each such
  failure itself in one line (a RunError, or a checkpoint set aside), so those records are dropped."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def _from_checkpoint_io(u) -> bool:
  """An unraisable exception (sys.unraisablehook's argument) raised by orbax's or tensorstore's own code: a
  coroutine of theirs, or a traceback through their files."""
  if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
    return True
  code = getattr(u.object, "cr_code", None) or getattr(u.object, "gi_code", None)
  files = [code.co_filename] if code is not None else []
  tb = u.exc_traceback
  while tb is not None:
    files.append(tb.tb_frame.f_code.co_filename)
    tb = tb.tb_next
  return any(f"{os.sep}orbax{os.sep}" in f or f"{os.sep}tensorstore{os.sep}" in f for f in files)


def _no_closed_loop_reports(hook):
  """sys.unraisablehook without orbax's and tensorstore's late reports: when one read of a damaged checkpoint
  fails, orbax ends the restore and closes its event loop while the other reads are still in flight; each of
  those then fails to post its result to the closed loop ('Event loop is closed'), or its coroutine is dropped
  with its own error ('Exception ignored in: <coroutine object _read_array_index_and_device_put>', with the
  array's whole TensorStore spec), which Python printed as a traceback each: 190 to 22,000 lines for one
  damaged checkpoint. shardlab reports that checkpoint itself, in one line."""
  def unraisable(u):
    if not _from_checkpoint_io(u):
      hook(u)
  unraisable.shardlab = True
  return unraisable


def _why_unreadable(e: BaseException) -> str:
  """A failed read in a few words: tensorstore's message is a chain ('Error opening ...: Error reading ...:
  Error decoding ...') followed by its JSON spec; the last two links say which file and what was wrong. Orbax
  may wrap it ('Encountered error while reading array index ... See full TensorStore details: <its spec>'):
  the innermost cause is tensorstore's."""
  while e.__cause__ is not None:
    e = e.__cause__
  msg = (str(e).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0].split(" See full TensorStore")[0]
  msg = " ".join(msg.split())
  links = msg.split(": Error ")
  if len(links) > 3:
    msg = f"{links[0]}: ... Error " + ": Error ".join(links[-2:])
  return f"{type(e).__name__}: {msg}"[:300]


def _say(msg: str) -> None:
  if D.is_main():
    print(f"shardlab: {msg}", file=sys.stderr)


def _bit_sum(x):
  uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  return jnp.sum(jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32), dtype=jnp.uint32)  # wraps around


@functools.lru_cache(maxsize=None)
def _checksum_fn(mesh):
  return jax.jit(lambda leaves: jnp.stack([_bit_sum(x) for x in leaves]), out_shardings=NamedSharding(mesh, P()))


def shapes(state) -> list[list[int]]:
  return [list(x.shape) for x in jax.tree.leaves(state)]


def checksums(state) -> list[int]:
  """Per leaf, the wrapping uint32 sum of its bits: exact, so the same for any sharding of the same values.
  It catches truncated, zeroed or missing data; it is not a cryptographic hash."""
  leaves = jax.tree.leaves(state)
  return [int(v) for v in np.asarray(_checksum_fn(leaves[0].sharding.mesh)(leaves))]


def reorder_layers(state, order: list[int] | None, to_model: bool):
  """`state` (parameters and optimizer state) with every stacked-layer leaf (under a `layers` key, leading dim
  len(order)) reordered: stored -> the model's order (`to_model`), or back. `order[d]`: the stored row that runs at
  depth d (an interleaved pipeline's placement, schedules/pipeline.py: Pipeline.layer_order). Shardings kept. One
  program for all the leaves (a program per leaf took 0.55 s of a pipeline run's resume: 66 of them)."""
  if order is None:
    return state
  perm = np.asarray(order) if to_model else np.argsort(order)
  n = len(order)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  rows = [i for i, (path, a) in enumerate(flat)
          if any(getattr(k, "key", None) == "layers" for k in path) and getattr(a, "ndim", 0) and a.shape[0] == n]
  if not rows:
    return state
  moved = _take_rows(tuple(int(i) for i in perm), tuple(flat[i][1].sharding for i in rows))([flat[i][1] for i in rows])
  leaves = [a for _, a in flat]
  for i, a in zip(rows, moved):
    leaves[i] = a
  return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.lru_cache(maxsize=None)
def _take_rows(perm: tuple, shardings: tuple):
  return jax.jit(lambda xs: [x[np.asarray(perm)] for x in xs], out_shardings=list(shardings))


class Checkpointer:
  """One run's checkpoints in `directory`. Every process calls every method (each writes and reads its own
  shards; process 0 writes the JSON record)."""

  def __init__(self, c: CheckpointConfig, directory, mesh_shape: tuple[int, ...], settings: dict | None = None,
               layer_order: list[int] | None = None):
    self.c, self.dir, self.mesh_shape = c, Path(directory).absolute(), list(mesh_shape)
    self.settings = settings or {}   # model/batch/seed/data settings, compared on resume (preflight.check_resume)
    self.layer_order = layer_order   # the run's stored layer for each depth (None: the model's order); see save
    if not any(isinstance(f, _NoOrbaxTracebacks) for f in logging.getLogger("absl").filters):
      logging.getLogger("absl").addFilter(_NoOrbaxTracebacks())
    if not getattr(sys.unraisablehook, "shardlab", False):
      sys.unraisablehook = _no_closed_loop_reports(sys.unraisablehook)
    import orbax.checkpoint as ocp   # here: a run that stops at its settings does not import it (0.4 s)
    self.mngr = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=c.keep,
                                      create=c.enabled), item_names=("state", "meta"))
    self.latest: int | None = None   # the newest good checkpoint: restored or saved by this run
    self.saved: list[int] = []
    self.pending: int | None = None  # the step of the save last handed to orbax (maybe still being written)

  def save(self, step: int, state, losses: list[float]) -> None:
    """Save the state after `step` steps (unless saving is off, or that step is already saved)."""
    if not self.c.enabled or (self.latest is not None and step <= self.latest):
      return
    self.wait()   # the save before this one, finished (orbax would wait anyway): its failure names its own step
    state = reorder_layers(state, self.layer_order, to_model=True)   # saved in the model's order of layers
    meta = {"step": step, "losses": list(losses), "mesh": self.mesh_shape, "shapes": shapes(state),
            "checksums": checksums(state), "settings": self.settings, "layer_order": "model"}
    import orbax.checkpoint as ocp
    try:
      self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    except StoppedAtOnce:                         # a second signal: not a failed save (fit names what is on disk)
      self.pending = step
      raise
    except Exception as e:
      raise self._failed(e, step) from None
    self.saved.append(step)
    self.latest = self.pending = step

  def restore(self, abstract_state):
    """(state placed with `abstract_state`'s shardings, losses so far) from the newest intact checkpoint;
    (None, []) when the directory holds none."""
    import orbax.checkpoint as ocp
    stale = sorted(self.dir.glob("*.orbax-checkpoint-tmp*"))
    for p in stale:   # this run owns the directory (preflight): no other run is writing it
      _say(f"warning: removing {p}: a save that did not finish")
      if D.is_main():
        shutil.rmtree(p, ignore_errors=True)    # (orbax would warn again when it saves that step)
    if stale:
      D.sync("shardlab_stale_saves_removed")
      self.mngr.reload()
    for step in sorted(self.mngr.all_steps(), reverse=True):
      state = meta = err = None
      try:
        meta = self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        if meta["shapes"] != shapes(abstract_state):  # intact, but not this model: leave it alone
          raise ConfigError(f"checkpoint.dir={self.dir}: checkpoint {step} holds another model's state (other "
                            "shapes); resume with the model.* settings it was saved with, or another checkpoint.dir")
        state = self.mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))).state
      except ConfigError:
        raise
      except Exception as e:  # unreadable: truncated, zeroed or missing files
        err = _why_unreadable(e)
      if D.over_processes(err is None, min) and checksums(state) == meta["checksums"]:
        _say(f"resuming from checkpoint {step} in {self.dir}")
        self.latest = step
        if meta.get("layer_order") == "model":   # (a checkpoint from before: the order it was trained in)
          state = reorder_layers(state, self.layer_order, to_model=False)
        return state, meta["losses"]
      self._set_aside(step, err or "its data differs from the checksums saved with it")
    _say(f"no checkpoint in {self.dir}; starting from step 0")
    return None, []

  def _set_aside(self, step: int, why: str) -> None:
    bad = self.dir / f"{step}.unreadable"
    _say(f"warning: checkpoint {step} in {self.dir} is unusable ({why}); moved it to {bad.name}, "
         "using the one before")
    if D.is_main():
      shutil.rmtree(bad, ignore_errors=True)
      (self.dir / str(step)).rename(bad)
    D.sync(f"shardlab_set_aside_{step}")
    self.mngr.reload()

  def _failed(self, e: Exception, step: int | None = None) -> RunError:
    """The one line for a failed save: `step`'s, or (None) the save in flight, which orbax finishes in the
    background; the newest checkpoint complete on disk."""
    try:
      self.mngr.reload()
      done = max(self.mngr.all_steps(), default=None)
    except Exception:
      done = None
    why = " ".join((str(e).strip().splitlines() or [type(e).__name__])[0].split())
    why = why if len(why) <= 400 else why[:397] + "..."
    step = step if step is not None else self.pending
    what = f"saving checkpoint {step} failed" if step is not None else "a checkpoint save failed in the background"
    return RunError(f"checkpoint.dir={self.dir}: {what} ({type(e).__name__}: {why}); last complete checkpoint: "
                    f"{done if done is not None else 'none'}; check that the directory is writable and has space")

  def check(self) -> None:
    """Raise (RunError) if a background save has failed; cheap, called every step."""
    try:
      self.mngr.check_for_errors()
    except StoppedAtOnce:
      raise
    except Exception as e:
      raise self._failed(e) from None

  def wait(self) -> None:
    """Wait for the save in flight; a failed one raises RunError naming checkpoint.dir."""
    try:
      self.mngr.wait_until_finished()
    except StoppedAtOnce:
      raise
    except Exception as e:
      raise self._failed(e) from None

  def newest_complete(self) -> int | None:
    """The newest checkpoint complete on disk (orbax renames a save into place only when it is whole)."""
    try:
      self.mngr.reload()
      return max(self.mngr.all_steps(), default=None)
    except Exception:  # noqa: BLE001  (an unreadable directory: nothing to name)
      return None

  def close(self, timeout_s: float = 120.0) -> None:
    """Wait (at most `timeout_s`) for a save still being written, then release orbax. Errors were raised by
    `wait`/`check` already, so here they are only reported, never raised: this runs on error paths too."""
    if getattr(self, "_closed", False):
      return
    self._closed = True
    err: list[Exception] = []

    def run():
      try:
        self.mngr.close()
      except Exception as e:  # noqa: BLE001
        err.append(e)
    t = threading.Thread(target=run, name="shardlab-checkpoint-close", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
      _say(f"warning: checkpoint.dir={self.dir}: a save still not finished after {timeout_s:g} s; not waiting longer")


class Interrupted(Exception):
  """SIGTERM or SIGINT arrived; the state after `step` steps was saved (if saving is on) and the run stopped.
  `step` None: it arrived while compiling, before any step of this run."""

  def __init__(self, signum: int, step: int | None, ckpt: Checkpointer | None):
    self.signum = signum
    name = signal.Signals(signum).name
    if step is None:
      super().__init__(f"stopped by {name} while compiling, before this run's first step: nothing saved by this "
                       "run; run it again with checkpoint.resume=true")
      return
    where = (f"saved checkpoint {step} in {ckpt.dir}; continue with checkpoint.resume=true "
             f"checkpoint.dir={ckpt.dir}" if ckpt.c.enabled else "nothing saved (checkpoint.enabled=false)")
    super().__init__(f"stopped by {name} after step {step}: {where}")


class StoppedAtOnce(Exception):
  """A second SIGTERM/SIGINT: stop now, without the save at the step boundary (the last one saved stays)."""

  def __init__(self, signum: int):
    self.signum = signum
    super().__init__(f"stopped at once by a second {signal.Signals(signum).name}: not saved at this step; resume "
                     "from the last saved checkpoint with checkpoint.resume=true")

  def name_checkpoint(self, step: int | None, directory) -> None:
    """Say which checkpoint is complete on disk (the run waited for the save in flight, if any)."""
    name = signal.Signals(self.signum).name
    what = (f"checkpoint {step} in {directory} is complete; continue from it with checkpoint.resume=true"
            if step is not None else "no checkpoint is complete; a rerun starts from step 0")
    self.args = (f"stopped at once by a second {name}: {what}",)


class StopOnSignal:
  """Inside `with`: SIGTERM and SIGINT ask the step loop to stop at the next step boundary, after saving,
  instead of killing the process mid-step or mid-save. A second signal interrupts at once."""

  def __enter__(self):
    self.signum, self._old = 0, {}
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
      self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
    return self

  def _handle(self, signum, frame):
    if self.signum:
      raise StoppedAtOnce(signum)   # the run's error path writes summary.json; no KeyboardInterrupt traceback
    self.signum = signum

  def requested(self) -> int:
    """The signal to stop for, agreed by every process (any process that got one stops them all); 0: go on."""
    return D.over_processes(self.signum, max)

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)
