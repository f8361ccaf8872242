"""What the reliability tests share: a checksum of every file under a directory (what "nothing already written is
lost" compares before and after a command), the CLI run in this process or as a real process, and the one line a
refused command must end with."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def checksums(d) -> dict[str, str] | None:
  """{relative path: sha256 of its bytes} for every file under `d` (None if `d` does not exist); directories are
  listed too (as 'dir'), so a directory made by a refused command shows."""
  d = Path(d)
  if not d.exists():
    return None
  out = {}
  for p in sorted(d.rglob("*")):
    rel = str(p.relative_to(d))
    if p.is_dir():
      out[rel] = "dir"
    elif p.is_file():
      out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
  return out


def one_line(err: str, prefix: str = "shardlab: error: ") -> str:
  """The stderr of a refused command: no traceback, exactly one line of shardlab's (JAX's C++ start-up notes aside),
  starting with `prefix`; that line."""
  assert "Traceback" not in err, err[-3000:]
  ours = [l for l in err.splitlines() if l.startswith("shardlab")]
  assert len(ours) == 1 and ours[0].startswith(prefix), err[-3000:]
  return ours[0]


def shardlab(*args, module: str = "shardlab", timeout: float = 300, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
  """`python -m MODULE progress=false figures=false ARGS` as a real process: its CompletedProcess (stdout, stderr
  as text). No figures: these runs are about their files, lines and exit codes, and matplotlib costs seconds."""
  args = [str(a) for a in args]
  flags = [a for a in args if a.startswith("-")]            # Hydra's flags (-m) before the overrides
  extra = ["progress=false", "figures=false"] if module == "shardlab" else []
  return subprocess.run([sys.executable, "-m", module, *flags, *extra, *(a for a in args if a not in flags)], cwd=cwd,
                        env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)
