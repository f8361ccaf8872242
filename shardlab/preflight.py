"""Everything checked before a run compiles or writes, each failure one line (ConfigError: exit 2):

  1. the settings' ranges and the process settings (validate.py), before JAX starts;
  2. the run directory: named, not a file, creatable, not a sweep's directory; on resume the checkpoint's JSON
     record: saved with the same model, precision, batch, seed and data settings (unless
     checkpoint.allow_changed=true), and not past train.steps; the profile window inside the run;
  3. the processes (joined within distributed.timeout_s), the devices against the mesh, and the memory the
     model needs per device (analytic, `memory_model.breakdown`) against what each local device has;
  4. process 0's run directory holding no other run's results (a resume without a checkpoint only as a requeue
     of the same settings), the checkpoint directory no other run's checkpoints unless resuming, and none
     claimed by another run dir (`<checkpoint.dir>/.owner`: a checkpoint directory belongs to one run; process
     0's verdict for every process); a resumed run that is already
     finished (its final checkpoint saved and summary.json written): `Finished`, which the CLI reports in one
     line, exit 0, touching nothing;
  5. the checkpoint directory: a probe file written and read back by every process; with several processes,
     a nonce written by process 0 must be read back by all (the same shared directory);
  6. the run directory lock (`<run dir>/.lock`, flock, held by process 0 for the run): a second run into the
     same directory is refused instead of interleaving metrics.jsonl; then an external checkpoint.dir is claimed
     for this run dir (`claim_checkpoint_dir`).

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
from shardlab.errors import ConfigError

_LOCKS: dict[str, list] = {}     # run dir -> [the open, flock'ed .lock file, pid written into it]
_SHARED_OK: set[str] = set()     # checkpoint dirs already found shared by every process


OPTIMIZER = ("lr", "warmup_steps", "b1", "b2", "adam_eps", "weight_decay", "grad_clip")   # train.*: AdamW's


def record_settings(cfg: Config) -> dict:
  """The settings a checkpoint must be resumed with (saved in its JSON record): what changes the function trained
  (the model, its name aside, and the precision it computes in), the batch, the seed and the data (a batch is a
  pure function of these and the step), and the optimizer's settings (a resume with another learning rate would
  continue another training, and summary.json's config would name it for the steps before too). Not
  train.steps (a run may be continued further), the mesh, the layout or the schedule: they place the same
  function (an interleaved pipeline's placement of layers included: checkpoints hold the model's order of
  layers). A record saved before a setting was added here does not compare it."""
  import dataclasses
  out = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items() if k != "name"}
  out.update({f"precision.{k}": v for k, v in dataclasses.asdict(cfg.precision).items() if k != "name"})
  out.update({"train.batch_size": cfg.train.batch_size, "train.seed": cfg.train.seed})
  out.update({f"train.{k}": getattr(cfg.train, k) for k in OPTIMIZER})
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
  check_profile(cfg)
  check_vocab(cfg)
  D.check_cluster_env(cfg.distributed)
  set_cpu_devices(cfg.cpu_devices)                # this process's devices (each process brings its own)
  D.initialize(cfg.distributed)                   # jax.distributed, when this is one of several processes
  import jax
  from shardlab import target as TG
  target = cfg.compile_for == "target"
  if target:                                      # the target's compiler installed, its topology valid
    TG.check(cfg.hardware, cfg.mesh.n_devices)
  # every XLA option known to the compiler that takes it (a trivial compile)
  TG.check_flags(cfg.xla.flags, cfg.hardware if target else None, cfg.mesh.n_devices)
  # The mesh against every process's devices (a dry run compiled for a target needs none of them).
  validate(cfg, None if cfg.compile_for == "target" and cfg.dry_run else len(jax.devices()))
  if target:                                      # the options the parts ask of the target's compiler, the same way
    from shardlab.composition import resolve
    asked = resolve(cfg).compiler_options(cfg.hardware.target_platform)
    if asked:
      TG.check_flags(asked, cfg.hardware, cfg.mesh.n_devices)
  # Process 0's run dir holds the run's results: its verdict, for every process (no peer left waiting for it).
  refusal = ""
  if D.is_main():
    try:
      check_run_dir_unused(cfg, out_dir)
      check_checkpoint_owner(cfg, out_dir)
    except ConfigError as e:
      refusal = str(e)
  refusal = D.gather_strings("shardlab_run_dir_unused", refusal)[0]
  if refusal:
    raise ConfigError(refusal)
  check_resume(cfg, out_dir)                      # the checkpoint's settings, once it is known to be this run's
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
    claim_checkpoint_dir(cfg, out_dir)


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
  """A run directory belongs to one run (or one lineage of resumed runs), and is no sweep directory. A fresh run
  into a directory that holds another run's results (summary.json, metrics.jsonl) is refused before anything is
  overwritten; so is a resumed one with no checkpoint to continue from, unless it is the same run requeued
  (check_requeue). With a checkpoint, check_resume compares the checkpoint's record instead."""
  check_not_sweep_dir(out_dir)
  p = Path(out_dir)
  held = [n for n in ("summary.json", "metrics.jsonl") if (p / n).is_file()]
  if not held:
    return
  s = _summary(p)
  what = (f"summary.json: status {s.get('status')}, {len(s.get('losses') or [])} steps" if s is not None else
          " and ".join(held))
  cont = resume_settings(cfg, out_dir, s)
  if not cfg.checkpoint.resume:
    raise ConfigError(f"hydra.run.dir={out_dir}: holds another run ({what}); a new run would overwrite it: choose a "
                      "new hydra.run.dir" + (f", or continue that run with {cont}" if cont else ""))
  if cont == "checkpoint.resume=true":
    return                                        # its checkpoint's record is compared by check_resume
  check_requeue(cfg, out_dir, s, what, cont)


# Settings that say how a run is launched, watched and saved, not what it computes: a requeued run or sweep may
# change them (checkpoint.resume is the one a requeue adds).
RUN_CONTROL = ("checkpoint", "progress", "tensorboard", "figures", "profile", "distributed", "cpu_devices")


def is_run_control(key: str) -> bool:
  """Whether `key` (dotted, e.g. checkpoint.resume) is one of RUN_CONTROL or under one."""
  key = key.lstrip("+~")
  return any(key == k or key.startswith(k + ".") for k in RUN_CONTROL)


def resume_settings(cfg: Config, out_dir, s: dict | None) -> str:
  """What continues the run in `out_dir` from its newest checkpoint: 'checkpoint.resume=true' when this command's
  checkpoint.dir holds one, plus checkpoint.dir=D when that run saved into a checkpoint.dir of its own choosing
  (named_checkpoint_dir) that does; '' when there is no checkpoint to continue (a run with
  checkpoint.enabled=false, or killed before its first save)."""
  if _latest_record(checkpoint_dir(cfg, out_dir)) is not None:
    return "checkpoint.resume=true"
  d = named_checkpoint_dir(s)
  return f"checkpoint.resume=true checkpoint.dir={d}" if d is not None and _latest_record(d) is not None else ""


def has_checkpoint(run_dir) -> bool:
  """Whether the run in `run_dir` left a checkpoint to continue: in <run dir>/checkpoints, or in the
  checkpoint.dir it named."""
  return any(d is not None and _latest_record(d) is not None
             for d in (Path(run_dir) / "checkpoints", named_checkpoint_dir(_summary(run_dir))))


def named_checkpoint_dir(s: dict | None) -> Path | None:
  """Where a run saved its checkpoints (summary.json's checkpoint.dir) when its checkpoint.dir setting named a
  directory; None for the default <run dir>/checkpoints, which moves with the run dir (a copied run's summary
  names the original's)."""
  s = s if isinstance(s, dict) else {}
  conf, saved = s.get("config"), s.get("checkpoint")
  named = ((conf.get("checkpoint") or {}).get("dir") if isinstance(conf, dict) else None)
  d = saved.get("dir") if isinstance(saved, dict) else None
  return Path(d) if named and isinstance(d, str) and d else None


def check_requeue(cfg: Config, out_dir, s: dict | None, what: str, cont: str = "") -> None:
  """`checkpoint.resume=true` into a run directory with results but no checkpoint: the run starts over from step 0
  and replaces them, which is right only for the same run requeued after it was killed before its first
  checkpoint. So every setting (run control aside) must be the one that run recorded, its checkpoints must not
  be elsewhere (`cont`: resume_settings naming the checkpoint.dir in its summary.json), and it must not have
  finished (nothing to continue; starting over would only replace its results)."""
  then = earlier_config(out_dir, s)
  if then is None:
    raise ConfigError(f"hydra.run.dir={out_dir}: holds a run ({what}) that recorded no settings (no config in "
                      "summary.json or .hydra/config.yaml) and no checkpoint to resume; a resumed run would start "
                      "over on top of it: choose a new hydra.run.dir")
  diff, finished = changed_settings(cfg, then), s is not None and s.get("status") == "ok"
  if diff:
    more = f", and {len(diff) - 4} more" if len(diff) > 4 else ""
    raise ConfigError(f"hydra.run.dir={out_dir}: holds a run with other settings ({', '.join(diff[:4])}{more}) and "
                      "no checkpoint to resume; a resumed run would start over on top of it: choose a new "
                      "hydra.run.dir" + (f", or continue it from its checkpoints with {cont}" if cont else
                                         "" if finished else ", or requeue that run with its own settings"))
  if cont:
    raise ConfigError(f"hydra.run.dir={out_dir}: holds a run ({what}) whose checkpoints are not in this command's "
                      f"checkpoint.dir ({checkpoint_dir(cfg, out_dir)}); a resumed run would start over on top of it: "
                      f"continue it with {cont}")
  if finished:
    raise ConfigError(f"hydra.run.dir={out_dir}: holds a finished run ({what}) and no checkpoint to continue from "
                      f"(none in {checkpoint_dir(cfg, out_dir)}); nothing to resume: choose a new hydra.run.dir "
                      "(with checkpoint.enabled=true to be able to continue it later)")


def earlier_config(out_dir, s: dict | None) -> dict | None:
  """The resolved settings of the run in `out_dir`: its summary.json's config, else its .hydra/config.yaml (a run
  killed before it wrote a summary, or whose summary is a bare error record); None if neither reads."""
  conf = (s or {}).get("config")
  if isinstance(conf, dict):
    return conf
  try:
    import yaml
    conf = yaml.safe_load((Path(out_dir) / ".hydra" / "config.yaml").read_text())
  except Exception:  # noqa: BLE001  (missing or unreadable: no settings known)
    return None
  return conf if isinstance(conf, dict) else None


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def changed_settings(cfg: Config, then: dict) -> list[str]:
  """Each setting of `cfg` that differs from `then` (a run's resolved config, as summary.json holds it), run
  control aside, as 'key=now (that run: then)'. A key `then` lacks (a setting added since) is not compared."""
  import dataclasses
  now = _flat(json.loads(json.dumps(dataclasses.asdict(cfg), default=str)))
  old = _flat(json.loads(json.dumps(then, default=str)))
  show = lambda v: "null" if v is None else v  # noqa: E731
  return [f"{k}={show(v)} (that run: {show(old[k])})" for k, v in now.items()
          if k in old and old[k] != v and not is_run_control(k)]


def run_files(d) -> list[str]:
  """A single run's files at the top of directory `d` (what a sweep directory never holds there)."""
  return [n for n in ("summary.json", "metrics.jsonl", ".hydra") if (Path(d) / n).exists()]


def sweep_jobs(d) -> list[str]:
  """The subdirectories of `d` that are runs (a sweep's jobs): each holds .hydra/ or summary.json."""
  d = Path(d)
  if not d.is_dir():
    return []
  return sorted(p.name for p in d.iterdir()
                if p.is_dir() and ((p / ".hydra").is_dir() or (p / "summary.json").is_file()))


def check_not_sweep_dir(out_dir) -> None:
  """A single run's files at the top of a sweep directory (multirun.yaml, or job directories) would hide the
  sweep's jobs from shardlab.report, which reads a directory with a summary.json as one run: refused."""
  p = Path(out_dir)
  jobs = sweep_jobs(p)
  if not jobs and not (p / "multirun.yaml").is_file():
    return
  what = ", ".join((["multirun.yaml"] if (p / "multirun.yaml").is_file() else [])
                   + ([f"{len(jobs)} jobs: {', '.join(jobs[:3])}{', ...' if len(jobs) > 3 else ''}"] if jobs else []))
  raise ConfigError(f"hydra.run.dir={out_dir}: holds a sweep ({what}); a single run's files beside its jobs would "
                    "hide them from its report: choose a new hydra.run.dir"
                    + (f", or resume one job with hydra.run.dir={p / jobs[0]}" if jobs else ""))


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


OWNER = ".owner"   # in a checkpoint.dir outside the run dir: the run dir whose checkpoints it holds


def _external_checkpoint_dir(cfg: Config, out_dir) -> Path | None:
  """checkpoint.dir when it lies outside the run dir (one inside belongs to that run by where it is, and goes
  with it when the run dir is copied or moved), else None. None too without checkpoints or in a dry run."""
  c = cfg.checkpoint
  if not c.enabled or cfg.dry_run or not c.dir:
    return None
  d, run = checkpoint_dir(cfg, out_dir).resolve(), Path(out_dir).absolute().resolve()
  return None if d == run or run in d.parents else d


def _owner(d: Path) -> str | None:
  try:
    return json.loads((d / OWNER).read_text()).get("run_dir")
  except (OSError, ValueError, AttributeError):
    return None


def check_checkpoint_owner(cfg: Config, out_dir) -> None:
  """A checkpoint.dir belongs to one run: a run (fresh or resumed) into a checkpoint.dir that another run dir
  claimed (`claim_checkpoint_dir`) would mix its checkpoints with that run's, or resume that run's state under its
  own name (two runs, or a sweep's jobs, sharing one checkpoint.dir): refused while that run dir exists and holds
  checkpoints there or is running. A run dir copied elsewhere and resumed after the original is gone takes the
  checkpoints over."""
  d = _external_checkpoint_dir(cfg, out_dir)
  owner = _owner(d) if d is not None else None
  run = str(Path(out_dir).absolute().resolve())
  if owner is None or owner == run or not Path(owner).is_dir() or not (_checkpoint_steps(d) or _running(owner)):
    return    # void: the owner's run dir is gone (moved, or deleted), or it saved nothing and is not running
  raise ConfigError(f"checkpoint.dir={cfg.checkpoint.dir}: belongs to the run in {owner} (its checkpoints, or a run "
                    f"writing there now), not to hydra.run.dir={out_dir}; give each run (each job of a sweep) its own "
                    f"checkpoint.dir, e.g. checkpoint.dir=null (<run dir>/checkpoints), or continue that run with "
                    f"hydra.run.dir={owner}")


def _running(run_dir: str) -> bool:
  """Whether a run holds `<run_dir>/.lock` now (lock_run_dir); tested with a lock of our own, released at once."""
  try:
    f = open(Path(run_dir) / ".lock")
  except OSError:
    return False
  with f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      return str(Path(run_dir).absolute()) not in _LOCKS   # held by this process: the run being checked
    except OSError:
      return False
    fcntl.flock(f, fcntl.LOCK_UN)
  return False


def claim_checkpoint_dir(cfg: Config, out_dir) -> None:
  """Write `<checkpoint.dir>/.owner` naming this run dir (created exclusively: of two runs starting at once, one
  claims it and the other is refused in one line). A checkpoint.dir of checkpoints from before owners were
  recorded is claimed by the run that resumes it."""
  d = _external_checkpoint_dir(cfg, out_dir)
  if d is None:
    return
  run = str(Path(out_dir).absolute().resolve())
  d.mkdir(parents=True, exist_ok=True)
  if _owner(d) not in (None, run):               # a void claim (check_checkpoint_owner let it pass): replaced
    (d / OWNER).unlink(missing_ok=True)
  try:
    fd = os.open(d / OWNER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  except FileExistsError:
    check_checkpoint_owner(cfg, out_dir)          # claimed meanwhile by another run: refused
    return
  except OSError as e:
    raise ConfigError(f"checkpoint.dir={cfg.checkpoint.dir}: cannot write there ({e.strerror or e}); choose a "
                      "writable directory") from None
  with os.fdopen(fd, "w") as f:
    json.dump({"run_dir": run, "pid": os.getpid(), "host": socket.gethostname()}, f)


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
  from shardlab.composition import resolve
  b = breakdown(resolve(cfg))
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
