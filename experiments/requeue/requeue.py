"""A requeue loop, as a cluster's scheduler runs one: the same `checkpoint.resume=true` command, killed (-9) at
random points (while starting, mid-step, mid-save, at the final save, after the end), then run again until it says
it is finished. Two commands: a pipeline run (2 stages x fsdp 2 x tensor 2, 1f1b, 4 microbatches) and a sweep of
two jobs (train.lr=1e-3,2e-3). A trial passes when every run's losses are the uninterrupted run's, bit for bit (the
same mesh), and the last command touched nothing.

  python experiments/requeue/requeue.py --trials 5 --out experiments/requeue/results.json   # ~20 min on 2 cores

experiments/requeue/README.md has the measured results."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
STEPS = 6
COMMON = ["progress=false", "tensorboard=false", f"train.steps={STEPS}", "checkpoint.every=2"]
KINDS = {
    "pipeline": ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2", "model.n_layers=4", "pipeline=1f1b",
                 "pipeline.microbatches=4"],
    "sweep": ["-m", "train.lr=1e-3,2e-3"],
}
# Each step sleeps `s` seconds first, so that a kill lands at a random point of a run, not only in its start-up.
SLOW = ("import sys, time, shardlab.data as D, shardlab.run as R; b = D.MarkovData.batch; "
        "D.MarkovData.batch = lambda self, i: (time.sleep({s}), b(self, i))[1]; R.cli()")


def _args(kind: str, where: Path, resume: bool, slow: float | None = 0.2) -> list[str]:
  flags = [a for a in KINDS[kind] if a.startswith("-")]
  over = [a for a in KINDS[kind] if not a.startswith("-")]
  head = [sys.executable, "-c", SLOW.format(s=slow)] if slow else [sys.executable, "-m", "shardlab"]
  dir_key = "hydra.sweep.dir" if flags else "hydra.run.dir"
  return [*head, *flags, *COMMON, *over, *(["checkpoint.resume=true"] if resume else []), f"{dir_key}={where}"]


def _runs(kind: str, where: Path) -> list[Path]:
  """The run dirs a command writes: the run dir, or the sweep's job dirs (in job order)."""
  if kind != "sweep":
    return [where]
  return sorted((p for p in where.iterdir() if p.is_dir() and (p / ".hydra").is_dir()),
                key=lambda p: int(p.name.split("_")[0])) if where.is_dir() else []


def _rows(kind: str, where: Path) -> int:
  """metrics.jsonl rows written so far, over every run of the command."""
  n = 0
  for run in _runs(kind, where):
    try:
      n += sum(1 for _ in (run / "metrics.jsonl").open())
    except OSError:
      pass
  return n


def _sums(d: Path) -> dict:
  return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(d.rglob("*")) if p.is_file()} if d.exists() else {}


def losses(kind: str, where: Path) -> list[list[float]]:
  return [json.loads((r / "summary.json").read_text()).get("losses") for r in _runs(kind, where)]


def uninterrupted(kind: str, where: Path) -> list[list[float]]:
  r = subprocess.run(_args(kind, where, resume=False, slow=None), cwd=ROOT, env=ENV, capture_output=True, text=True,
                     timeout=600)
  if r.returncode != 0:
    raise RuntimeError(f"the uninterrupted {kind} run failed: {r.stderr[-2000:]}")
  return losses(kind, where)


def trial(kind: str, seed: int, where: Path, reference: list[list[float]], kills: int = 2) -> dict:
  """`kills` runs of the resume command killed at random points, then the same command until it says it is done
  (at most 4 more). {"ok", "kills": [(rows, delay, exit code)], "reruns", "why"}."""
  rng = random.Random(seed)
  total = STEPS * len(reference)
  args = _args(kind, where, resume=True)
  out = {"kind": kind, "seed": seed, "kills": [], "reruns": 0, "ok": False, "why": ""}
  for _ in range(kills):
    p = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rows, delay = rng.randrange(0, total + 1), rng.uniform(0, 0.4)   # after `rows` metrics rows
    deadline = time.monotonic() + 300
    while p.poll() is None and time.monotonic() < deadline and rows and _rows(kind, where) < rows:
      time.sleep(0.02)
    time.sleep(delay)
    p.kill()
    _, err = p.communicate(timeout=60)
    out["kills"].append((rows, round(delay, 2), p.returncode))
    if "Traceback" in err:
      out["why"] = f"a traceback after a kill: {err[-1500:]}"
      return out
  for _ in range(4):
    before = _sums(where)
    p = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    out["reruns"] += 1
    if p.returncode != 0 or "Traceback" in p.stderr:
      out["why"] = f"rerun {out['reruns']} exit {p.returncode}: {p.stderr[-1500:]}"
      return out
    done = [l for l in p.stdout.splitlines() if "already finished" in l]
    if len(done) == len(reference):              # every run (every job) says it is finished
      if _sums(where) != before:
        out["why"] = "the command that found everything finished changed files"
        return out
      break
  else:
    out["why"] = "never said it was finished"
    return out
  got = losses(kind, where)
  out["ok"] = got == reference
  out["why"] = "" if out["ok"] else f"losses {got} != uninterrupted {reference}"
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", type=Path, default=None)
  ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
  a = ap.parse_args()
  results = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "machine": f"{os.cpu_count()} cores, {sys.platform}", "trials": []}
  with tempfile.TemporaryDirectory() as tmp:
    for kind in a.kinds:
      ref = uninterrupted(kind, Path(tmp) / f"{kind}-uninterrupted")
      for i in range(a.trials):
        r = trial(kind, a.seed * 1000 + i, Path(tmp) / f"{kind}-{i}", ref)
        print(json.dumps(r), flush=True)
        results["trials"].append(r)
  for kind in a.kinds:
    rs = [r for r in results["trials"] if r["kind"] == kind]
    print(f"{kind}: {sum(r['ok'] for r in rs)} of {len(rs)} ended with the uninterrupted losses")
  if a.out:
    a.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
  main()
