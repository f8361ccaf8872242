"""Everything checked before a run compiles or writes, each failure one line (ConfigError: exit 2):

  1. the settings' ranges and the process settings (validate.py), before JAX starts;
  2. the run directory: named, not a file, creatable; on resume the checkpoint's JSON record: saved with the
     same model, batch, seed and data settings (unless checkpoint.allow_changed=true), and not past
     train.steps; the profile window inside the run;
  3. the processes (joined within distributed.timeout_s), the devices against the mesh, and the memory the
     model needs per device (analytic, `memory_model.breakdown`) against what each local device has;
  4. process 0's run directory holding no other run's results, and the checkpoint directory no other run's
     checkpoints, unless resuming (process 0's verdict for every process); a resumed run that is already
     finished (its final checkpoint saved and summary.json written): `Finished`, which the CLI reports in one
     line, exit 0, touching nothing;
  5. the checkpoint directory: a probe file written and read back by every process; with several processes,
     a nonce written by process 0 must be read back by all (the same shared directory);
  6. the run directory lock (`<run dir>/.lock`, flock, held by process 0 for the run): a second run into the
     same directory is refused instead of interleaving metrics.jsonl.

The CLI runs `check` from a Hydra callback (`run.Preflight.on_run_start`) before Hydra creates the run directory
or writes `.hydra/`, and `run.train` runs it again (cheap, idempotent) for runs that do not come through Hydra.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
from pathlib import Path

from shardlab.config import Config
from shardlab.mesh import ConfigError

_LOCKS: dict[str, list] = {}     # run dir -> [the open, flock'ed .lock file, pid written into it]
_SHARED_OK: set[str] = set()     # checkpoint dirs already found shared by every process


def record_settings(cfg: Config) -> dict:
  """The settings a checkpoint must be resumed with (saved in its JSON record): the model (its name aside),
  the batch, the seed and the data; a batch is a pure function of these and the step."""
  import dataclasses
  out = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items() if k != "name"}
  out.update({"train.batch_size": cfg.train.batch_size, "train.seed": cfg.train.seed})
  out.update({f"data.{k}": v for k, v in dataclasses.asdict(cfg.data).items()})
  return out


def checkpoint_dir(cfg: Config, out_dir) -> Path:
  return Path(cfg.checkpoint.dir or Path(out_dir) / "checkpoints").absolute()


def _ckpt_setting(cfg: Config, d: Path) -> str:
  return f"checkpoint.dir={cfg.checkpoint.dir}" if cfg.checkpoint.dir else f"checkpoint.dir=null (<run dir>/checkpoints = {d})"


class Finished(Exception):
  """`checkpoint.resume=true` on a run that already reached train.steps: nothing to do, nothing to write (a
  requeued job whose run finished). `summary`: the finished run's summary.json (process 0; {} elsewhere)."""

  def __init__(self, msg: str, summary: dict):
    super().__init__(msg)
    self.summary = summary


def check(cfg: Config, out_dir, *, lock: bool = True) -> None:
  """All of the above, in that order; raises ConfigError (or RunError for a fault between processes, Finished
  for a resumed run with nothing left to do)."""
  from shardlab import distributed as D
  from shardlab.mesh import set_cpu_devices
  from shardlab.validate import validate, validate_launch
  validate_launch(cfg)                            # ranges, checkpoint and process settings, before JAX starts
  check_run_dir(out_dir)
  check_resume(cfg, out_dir)
  check_profile(cfg)
  check_vocab(cfg)
  D.check_cluster_env(cfg.distributed)
  set_cpu_devices(cfg.cpu_devices)                # this process's devices (each process brings its own)
  D.initialize(cfg.distributed)                   # jax.distributed, when this is one of several processes
  import jax
  from shardlab import target as TG
  TG.check_flags(cfg.xla.flags)                   # every XLA option known to this XLA (a trivial compile)
  if cfg.compile_for == "target":                 # the target's compiler installed, its topology valid
    TG.check(cfg.hardware, cfg.mesh.n_devices)
  # The mesh against every process's devices (a dry run compiled for a target needs none of them).
  validate(cfg, None if cfg.compile_for == "target" and cfg.dry_run else len(jax.devices()))
  # Process 0's run dir holds the run's results: its verdict, for every process (no peer left waiting for it).
  refusal = ""
  if D.is_main():
    try:
      check_run_dir_unused(cfg, out_dir)
    except ConfigError as e:
      refusal = str(e)
  refusal = D.gather_strings("shardlab_run_dir_unused", refusal)[0]
  if refusal:
    raise ConfigError(refusal)
  check_checkpoints_unused(cfg, out_dir)          # the same shared directory for every process
  check_finished(cfg, out_dir)
  main = lock and jax.process_index() == 0
  if main:
    lock_run_dir(out_dir, create=False)           # an existing lock held by another run: refuse before probing
  if not cfg.dry_run:
    check_memory(cfg)
    if cfg.checkpoint.enabled:
      check_checkpoint_dir(cfg, out_dir)
  if main:
    lock_run_dir(out_dir)


def check_run_dir(out_dir, setting: str = "hydra.run.dir") -> None:
  """The run directory is named (an empty name is the current directory: the run's files would land among the
  user's), is a directory, or can be made one: the topmost missing directory is made and removed again, since
  write permission says nothing on /proc or as root."""
  if not str(out_dir).strip():
    raise ConfigError(f"{setting}={str(out_dir)!r}: empty, so the run's files would go into the current "
                      f"directory; name a directory, e.g. {setting}=outputs/run1")
  p = Path(out_dir).absolute()
  if p.exists() and not p.is_dir():
    raise ConfigError(f"{setting}={out_dir}: is a file, not a directory; choose another {setting}")
  parent = p
  while not parent.exists():
    parent = parent.parent
  if not parent.is_dir():
    raise ConfigError(f"{setting}={out_dir}: {parent} is a file, so the run directory cannot be made there")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ConfigError(f"{setting}={out_dir}: {parent} is not writable; choose another {setting}")
  if parent != p:
    top = p
    while top.parent != parent:
      top = top.parent
    try:
      top.mkdir()
    except FileExistsError:                       # made meanwhile (another process of this run)
      return
    except OSError as e:
      raise ConfigError(f"{setting}={out_dir}: cannot make it in {parent} ({e.strerror or e}); choose a "
                        f"writable {setting}") from None
    try:
      top.rmdir()
    except OSError:                               # another process of this run has filled it meanwhile
      pass


def _summary(out_dir) -> dict | None:
  """The run directory's summary.json, or None (none, or unreadable)."""
  try:
    s = json.loads((Path(out_dir) / "summary.json").read_text())
  except (OSError, ValueError):
    return None
  return s if isinstance(s, dict) else None


def check_run_dir_unused(cfg: Config, out_dir) -> None:
  """A run directory belongs to one run (or one lineage of resumed runs): a fresh run into a directory that
  holds another run's results (summary.json, metrics.jsonl) is refused before anything is overwritten. A
  resumed one whose checkpoint.dir has no checkpoint record to compare (check_resume) is compared with the
  settings in the directory's summary.json instead: a run of other settings would start over on top of it."""
  p = Path(out_dir)
  if cfg.checkpoint.resume:
    s = _summary(p)
    conf = s.get("config") if s is not None else None
    if not isinstance(conf, dict) or _latest_record(checkpoint_dir(cfg, out_dir)) is not None:
      return
    def get(key):
      v = conf
      for part in key.split("."):
        v = v.get(part) if isinstance(v, dict) else None
      return v
    now = record_settings(cfg)
    diff = [f"{k}={now[k]} (that run: {get(k)})" for k in now if get(k) is not None and get(k) != now[k]]
    if diff and not cfg.checkpoint.allow_changed:
      raise ConfigError(f"hydra.run.dir={out_dir}: holds a run with other settings ({', '.join(diff)}) and no "
                        "checkpoint to resume; a resumed run would start over on top of it: choose a new "
                        "hydra.run.dir, or set checkpoint.allow_changed=true to replace it")
    return
  held = [n for n in ("summary.json", "metrics.jsonl") if (p / n).is_file()]
  if not held:
    return
  s = _summary(p)
  what = (f"summary.json: status {s.get('status')}, {len(s.get('losses') or [])} steps" if s is not None else
          " and ".join(held))
  raise ConfigError(f"hydra.run.dir={out_dir}: holds another run ({what}); a new run would overwrite it: choose a "
                    "new hydra.run.dir, or continue that run with checkpoint.resume=true")


def _checkpoint_steps(d: Path) -> list[str]:
  """Names of the checkpoints (complete or being written) in `d`, without starting JAX."""
  if not d.is_dir():
    return []
  names = [p.name for p in d.iterdir() if p.is_dir() and (p.name.isdigit() or ".orbax-checkpoint-tmp" in p.name)]
  return sorted(names, key=lambda n: (int(n.split(".")[0]) if n.split(".")[0].isdigit() else -1, n))


def check_checkpoints_unused(cfg: Config, out_dir) -> None:
  """A fresh run into a checkpoint.dir holding other checkpoints would interleave with them (a step already
  there is not saved again; checkpoint.keep deletes the oldest, whoever wrote them): refused."""
  c = cfg.checkpoint
  if c.resume or not c.enabled or cfg.dry_run:
    return
  d = checkpoint_dir(cfg, out_dir)
  steps = _checkpoint_steps(d)
  if steps:
    raise ConfigError(f"{_ckpt_setting(cfg, d)}: holds checkpoints of another run ({', '.join(steps[:6])}"
                      f"{', ...' if len(steps) > 6 else ''}); a fresh run would mix with them and delete them: "
                      "continue them with checkpoint.resume=true, or choose an empty checkpoint.dir")


def check_vocab(cfg: Config) -> None:
  """More successors per token than the vocabulary has: both settings named, and the fix (validate's own
  message names only data.branching, though model.vocab_size is as likely the one changed)."""
  b, v = cfg.data.branching, cfg.model.vocab_size
  if isinstance(b, int) and isinstance(v, int) and v >= 1 and b > v:
    raise ConfigError(f"data.branching={b} is more than model.vocab_size={v} (each token's successors are drawn "
                      f"from the vocabulary); choose data.branching <= {v} or model.vocab_size >= {b}")


def check_profile(cfg: Config) -> None:
  """A profile window that starts after the last step would silently profile nothing."""
  p = cfg.profile
  if p.enabled and not cfg.dry_run and p.start_step >= cfg.train.steps:
    raise ConfigError(f"profile.start_step={p.start_step}: the run has only train.steps={cfg.train.steps} steps "
                      f"(0..{cfg.train.steps - 1}), so nothing would be profiled; choose profile.start_step <= "
                      f"{cfg.train.steps - 1} or more train.steps")


def check_finished(cfg: Config, out_dir) -> None:
  """`checkpoint.resume=true` on a run whose final checkpoint (step == train.steps) is saved and whose
  summary.json (process 0's) says ok with train.steps losses: raise Finished, agreed by every process. With the
  final checkpoint but no such summary (killed after the final save), the run goes on: it restores that
  checkpoint, runs no step and writes the summary."""
  from shardlab import distributed as D
  if cfg.dry_run or not cfg.checkpoint.resume:
    return
  d = checkpoint_dir(cfg, out_dir)
  meta = _latest_record(d) if cfg.checkpoint.enabled else None
  s = _summary(out_dir) if D.is_main() else None
  done = (meta is not None and meta["step"] == cfg.train.steps and s is not None and s.get("status") == "ok"
          and len(s.get("losses") or []) == cfg.train.steps)
  if D.over_processes(int(done), max):
    raise Finished(f"{out_dir}: already finished: train.steps={cfg.train.steps} reached (checkpoint "
                   f"{cfg.train.steps} in {d}); summary.json kept as it was; raise train.steps to continue",
                   s or {})


def _latest_record(d: Path) -> dict | None:
  """The JSON record of the newest checkpoint in `d` whose record reads (the one a resume starts from), read
  straight from orbax's layout (<step>/meta/metadata) without starting JAX."""
  if not d.is_dir():
    return None
  steps = sorted((int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()), reverse=True)
  for step in steps:
    try:
      meta = json.loads((d / str(step) / "meta" / "metadata").read_text())
    except (OSError, ValueError):
      continue
    if isinstance(meta, dict) and "step" in meta:
      return meta
  return None


def check_resume(cfg: Config, out_dir) -> None:
  """On resume: refuse a checkpoint saved with other model/batch/seed/data settings, or past train.steps."""
  if cfg.dry_run or not cfg.checkpoint.resume:
    return
  d = checkpoint_dir(cfg, out_dir)
  meta = _latest_record(d)
  if meta is None:
    return
  if meta["step"] > cfg.train.steps:
    raise ConfigError(f"train.steps={cfg.train.steps}: the checkpoint in {d} is already at step {meta['step']}; "
                      "raise train.steps to continue it")
  saved, now = meta.get("settings") or {}, record_settings(cfg)
  diff = [f"{k}={now[k]} (checkpoint: {saved[k]})" for k in now if k in saved and saved[k] != now[k]]
  if diff and not cfg.checkpoint.allow_changed:
    raise ConfigError(f"{_ckpt_setting(cfg, d)}: checkpoint {meta['step']} was saved with other settings: "
                      f"{', '.join(diff)}; resume with its settings, use another checkpoint.dir, or set "
                      "checkpoint.allow_changed=true to continue anyway")


def device_memory() -> tuple[float | None, str]:
  """(bytes one local device can hold, how that was found). CPU: the host's available memory (MemAvailable)
  shared by this process's fake devices; accelerators: the runtime's bytes_limit. (None, ..) if unknown."""
  import jax
  devs = jax.local_devices()
  if devs[0].platform == "cpu":
    avail = None
    try:
      for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
          avail = int(line.split()[1]) * 1024
    except OSError:
      pass
    if avail is None and hasattr(os, "sysconf"):
      try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
      except (ValueError, OSError):
        return None, "unknown"
    return avail / len(devs), (f"the host has {avail / 2**30:.1f} GiB available for {len(devs)} CPU devices "
                               f"({avail / len(devs) / 2**30:.2f} GiB each)")
  stats = devs[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return (float(limit), f"each {devs[0].device_kind} has {limit / 2**30:.1f} GiB") if limit else (None, "unknown")


def check_memory(cfg: Config) -> None:
  """Refuse a run whose analytic memory per device exceeds what a local device has (it would fail with
  RESOURCE_EXHAUSTED after compiling, or swap the host)."""
  from shardlab.analysis.memory_model import breakdown
  b = breakdown(cfg)
  have, where = device_memory()
  if have is None or b["total"] <= have:
    return
  parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in b.items() if k != "total" and v)
  raise ConfigError(f"model={cfg.model.name} on mesh {cfg.mesh.label} needs "
                    f"{b['total'] / 2**30:.2f} GiB per device (analytic: {parts} GiB), but {where}; use "
                    "dry_run=true to compile and analyze without allocating, or a smaller model or train.batch_size")


def check_checkpoint_dir(cfg: Config, out_dir) -> None:
  """Every process can write `checkpoint.dir` (a probe file, read back) and, with several processes, they all
  see the same directory (process 0's nonce file read by every process after a barrier)."""
  import jax
  from shardlab import distributed as D
  d = checkpoint_dir(cfg, out_dir)
  name = _ckpt_setting(cfg, d)
  if d.exists() and not d.is_dir():
    raise ConfigError(f"{name}: is a file, not a directory; choose a directory for the checkpoints")
  made = d
  while not made.parent.exists() and made.parent != made:
    made = made.parent                              # the topmost directory this probe creates
  made = None if d.exists() else made
  probe = d / f".probe-{socket.gethostname()}-{os.getpid()}"
  try:
    d.mkdir(parents=True, exist_ok=True)
    probe.write_text("shardlab")
    ok = probe.read_text() == "shardlab"
    probe.unlink()
    if not ok:
      raise OSError("the probe file read back different bytes")
  except OSError as e:
    if made is not None and made.is_dir():        # leave nothing behind: remove what the probe created
      import shutil
      shutil.rmtree(made, ignore_errors=True)
    raise ConfigError(f"{name}: cannot write there ({e.strerror or e}); choose a writable directory") from None
  if jax.process_count() == 1 or str(d) in _SHARED_OK:
    return
  nonce = D.gather_strings("ckpt_nonce", secrets.token_hex(8) if D.is_main() else "")[0]
  marker = d / f".shared-{nonce}"
  if D.is_main():
    marker.write_text(nonce)
  D.barrier("ckpt_marker_written", f"checking that {name} is shared")
  try:
    seen = marker.read_text() == nonce
  except OSError:
    seen = False
  seen_by = D.gather_strings("ckpt_seen", "1" if seen else "0")
  if D.is_main():
    marker.unlink(missing_ok=True)
  blind = [str(p) for p, s in enumerate(seen_by) if s != "1"]
  if blind:
    raise ConfigError(f"{name}: not one shared directory: process {', '.join(blind)} of {len(seen_by)} does not see "
                      f"the file process 0 wrote there; with several processes (or hosts) every process must save "
                      "into the same directory: set checkpoint.dir to a path on a filesystem all of them see")
  _SHARED_OK.add(str(d))


def lock_run_dir(out_dir, create: bool = True) -> None:
  """flock `<run dir>/.lock` for the rest of this process (or until `unlock_run_dir`): a second run into the
  same directory is a ConfigError naming the holder. `create=False`: only test an existing lock file (writes
  nothing). A filesystem without locks: no lock, no error."""
  p = Path(out_dir).absolute()
  held = _LOCKS.get(str(p))
  if held is not None and (held[1] or not create):
    return
  if held is None:
    if not create and not (p / ".lock").is_file():
      return
    p.mkdir(parents=True, exist_ok=True)
    f = open(p / ".lock", "a+")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      f.seek(0)
      holder = f.read().strip() or "another process"
      f.close()
      raise ConfigError(f"hydra.run.dir={out_dir}: another run ({holder}) is writing this directory; wait for it "
                        "to finish or choose another hydra.run.dir") from None
    except OSError:
      f.close()
      return
    held = _LOCKS[str(p)] = [f, False]
  if create:
    f = held[0]
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    held[1] = True


def unlock_run_dir(out_dir) -> None:
  held = _LOCKS.pop(str(Path(out_dir).absolute()), None)
  if held is not None:
    held[0].close()
