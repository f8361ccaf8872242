"""Nothing written is lost: a run directory, a sweep directory and a checkpoint directory each belong to one run
(or one lineage of resumed runs). The five ways results used to be lost, each checked with checksums of the
earlier run's files before and after: a requeued finished run (it says so and touches nothing), a second run
into a finished run's directory, a second sweep into a sweep directory, a fresh run into another run's
checkpoint.dir (each refused in one line, exit 2, before anything is written) and a full run directory (one line
naming it and the step; the earlier files stay whole). Then the requeue loop: the same resume command, killed
at random points, ends with the uninterrupted run's losses and says when it is done.

The earlier run is test_checkpoint's `ref` (4x2 mesh, 6 steps, checkpoints 2, 4, 6), copied per test."""
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from test_checkpoint import RUN, metrics, ref, run  # noqa: F401  (ref: the shared uninterrupted run)

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
CMD = [*RUN, "checkpoint.every=2"]          # the command that made `ref`
SLOW = ("import sys, time, shardlab.data as D, shardlab.run as R; b = D.MarkovData.batch; "
        "D.MarkovData.batch = lambda self, i: (time.sleep({s}), b(self, i))[1]; R.cli()")


def sums(d: Path) -> dict:
  """{path under d: sha256} of every file under d: 'untouched' means this does not change."""
  return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(d.rglob("*")) if p.is_file()}


def cli(*args, slow=None):
  cmd = ["-c", SLOW.format(s=slow)] if slow else ["-m", "shardlab"]
  return subprocess.run([sys.executable, *cmd, *CMD, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                        timeout=300)


def one_error_line(r) -> str:
  """Exit 2, no traceback, and stderr exactly one `shardlab: error:` line."""
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-3000:]
  assert lines[0].startswith("shardlab: error: "), lines
  return lines[0]


@pytest.fixture
def finished(ref, tmp_path):
  """A copy of the finished reference run's directory (summary.json, metrics.jsonl, checkpoints 2, 4, 6)."""
  out = tmp_path / "run"
  shutil.copytree(ref[0], out)
  return out


def test_requeued_finished_run_says_so_and_touches_nothing(finished):
  """Loss 1: `checkpoint.resume=true` again on a finished run (a requeued job): one line on stdout, exit 0,
  every file as it was, nothing new (not even Hydra's .hydra/)."""
  before = sums(finished)
  r = cli("checkpoint.resume=true", f"hydra.run.dir={finished}")
  assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert r.stdout.splitlines() == [f"shardlab: {finished}: already finished: train.steps=6 reached (checkpoint 6 in "
                                   f"{finished / 'checkpoints'}); summary.json kept as it was; raise train.steps to "
                                   "continue"], r.stdout
  assert not [l for l in r.stderr.splitlines() if l.startswith("shardlab")], r.stderr
  assert sums(finished) == before and not (finished / ".hydra").exists()


@pytest.mark.parametrize("kill", ["after_the_final_save", "during_the_final_save"])
def test_requeue_after_a_kill_at_the_final_save_ends_like_the_uninterrupted_run(ref, finished, kill):
  """Loss 1, killed (-9) at the final save: after it (checkpoint 6 complete, no summary.json yet) the requeued
  run restores 6, runs no step and writes the summary; during it (checkpoint 6 still orbax's temporary
  directory) it resumes from 4. Either way: the uninterrupted run's losses, checkpoints 2 and 4 untouched."""
  from shardlab.outputs import final_line
  (finished / "summary.json").unlink()
  if kill == "during_the_final_save":
    (finished / "checkpoints" / "6").rename(finished / "checkpoints" / "6.orbax-checkpoint-tmp-1700000000000000")
  before = {k: v for k, v in sums(finished).items() if k.startswith(("checkpoints/2/", "checkpoints/4/"))}
  s = run(finished, "checkpoint.every=2", "checkpoint.resume=true")
  assert s["status"] == "ok" and s["losses"] == ref[1]["losses"]
  assert s["checkpoint"]["resumed_from"] == (6 if kill == "after_the_final_save" else 4)
  assert json.loads((finished / "summary.json").read_text())["losses"] == ref[1]["losses"]
  assert [m["loss"] for m in metrics(finished)] == ref[1]["losses"]
  assert final_line(finished, s).startswith(f"shardlab: {finished}: ok, final loss {ref[1]['final_loss']:.4f} after "
                                            "6 steps, step time ")
  assert {k: v for k, v in sums(finished).items() if k in before} == before


def test_resumed_finished_run_continues_to_more_steps(ref, finished):
  """A finished run with a larger train.steps and checkpoint.resume=true continues from its final checkpoint."""
  before = {k: v for k, v in sums(finished).items() if k.startswith(("checkpoints/4/", "checkpoints/6/"))}
  s = run(finished, "train.steps=8", "checkpoint.every=2", "checkpoint.resume=true")
  assert s["checkpoint"]["resumed_from"] == 6 and s["checkpoint"]["saved"] == [8]
  assert len(s["losses"]) == 8 and s["losses"][:6] == ref[1]["losses"]
  assert [m["step"] for m in metrics(finished)] == list(range(8))
  assert {k: v for k, v in sums(finished).items() if k in before} == before


def test_second_run_into_a_finished_runs_directory_is_refused(finished):
  """Loss 2: another seed into the finished run's hydra.run.dir: one line, exit 2, every file as it was (the
  check runs before Hydra writes .hydra/)."""
  from shardlab.mesh import ConfigError
  before = sums(finished)
  line = one_error_line(cli("train.seed=1", f"hydra.run.dir={finished}"))
  assert line == (f"shardlab: error: hydra.run.dir={finished}: holds another run (summary.json: status ok, 6 steps); a "
                  "new run would overwrite it: choose a new hydra.run.dir, or continue that run with "
                  "checkpoint.resume=true")
  with pytest.raises(ConfigError, match="holds another run"):   # the library entry point too
    run(finished, "train.seed=1")
  assert sums(finished) == before and not (finished / ".hydra").exists()


def test_resumed_run_of_other_settings_without_checkpoints_is_refused(finished):
  """checkpoint.resume=true into a run directory whose run left no checkpoint (here: moved away) and other
  settings (another seed): it would start over on top of that run, so it is refused; nothing changes."""
  from shardlab.mesh import ConfigError
  shutil.rmtree(finished / "checkpoints")
  before = sums(finished)
  with pytest.raises(ConfigError, match=r"holds a run with other settings \(train.seed=1 \(that run: 0\)\)"):
    run(finished, "train.seed=1", "checkpoint.resume=true")
  assert sums(finished) == before


def test_second_sweep_into_a_sweep_directory_is_refused(ref, tmp_path):
  """Loss 3: a sweep directory as Hydra and shardlab leave it (two jobs, each with .hydra/, and the summary):
  a new one-job sweep into it is refused before any job starts; nothing changes."""
  from shardlab import sweep
  sw = tmp_path / "sweep"
  for i, seed in enumerate((0, 1)):
    job = sw / f"{i}_baseline_4x2_tiny"
    shutil.copytree(ref[0], job)
    (job / ".hydra").mkdir()
    (job / ".hydra" / "overrides.yaml").write_text(f"- train.seed={seed}\n")
  sweep.write(sw)
  before = sums(sw)
  r = subprocess.run([sys.executable, "-m", "shardlab", "-m", *CMD, "train.seed=5", f"hydra.sweep.dir={sw}"],
                     cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
  assert one_error_line(r) == (f"shardlab: error: hydra.sweep.dir={sw}: holds another sweep (2 jobs: "
                               "0_baseline_4x2_tiny, 1_baseline_4x2_tiny); a new sweep would overwrite its jobs: "
                               "choose a new hydra.sweep.dir, or continue that sweep with checkpoint.resume=true")
  assert sums(sw) == before


def test_sweep_directory_that_cannot_be_made_is_one_line(tmp_path):
  """hydra.sweep.dir under /proc used to end in Hydra's FileNotFoundError traceback (exit 0!)."""
  r = subprocess.run([sys.executable, "-m", "shardlab", "-m", *CMD, "hydra.sweep.dir=/proc/shardlab_sweep"],
                     cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
  assert one_error_line(r) == ("shardlab: error: hydra.sweep.dir=/proc/shardlab_sweep: cannot make it in /proc (No "
                               "such file or directory); choose a writable hydra.sweep.dir")


def test_fresh_run_into_another_runs_checkpoint_dir_is_refused(finished, tmp_path):
  """Loss 4: a fresh run (no resume) with checkpoint.dir naming another run's checkpoints: refused, one line;
  the checkpoints as they were, the new run directory never made."""
  ck, new = finished / "checkpoints", tmp_path / "new"
  before = sums(ck)
  line = one_error_line(cli(f"checkpoint.dir={ck}", f"hydra.run.dir={new}"))
  assert line.startswith(f"shardlab: error: checkpoint.dir={ck}: holds checkpoints of another run (2, 4, 6); "), line
  assert "checkpoint.resume=true" in line
  assert sums(ck) == before and not new.exists()


FILL_AT = ("import os, sys, shardlab.data as D, shardlab.run as R; b = D.MarkovData.batch; out = sys.argv[-1].split('=', 1)[1]\n"
           "def fill():\n"
           "  with open(os.path.join(out, 'filler'), 'wb', buffering=0) as f:\n"
           "    for n in (1 << 16, 1 << 12, 1):\n"
           "      try:\n"
           "        while True:\n"
           "          f.write(bytes(n))\n"
           "      except OSError:\n"
           "        pass\n"
           "D.MarkovData.batch = lambda self, i: (i == {step} and fill(), b(self, i))[1]; R.cli()")
REPORT = ("import hashlib, json, pathlib, sys; d = pathlib.Path(sys.argv[1]); json.dump({str(p.relative_to(d)): "
          "hashlib.sha256(p.read_bytes()).hexdigest() for p in d.rglob('*') if p.is_file() and p.name != 'filler'} | "
          "{'metrics.jsonl:text': (d / 'metrics.jsonl').read_text()}, open(sys.argv[2], 'w'))")


def test_full_run_directory_is_one_line_and_keeps_the_earlier_files(ref, tmp_path):
  """Loss 5: a run directory on a 4 MiB filesystem (tmpfs, in a mount namespace of the process's own) that
  fills up before the last step of a resumed run: one line naming hydra.run.dir, the file and the step, exit 1;
  the earlier summary.json (of the interrupted run) and metrics rows stay whole, nothing truncated; the final
  checkpoint (in a checkpoint.dir elsewhere) is saved, so a resume with space left finishes the run."""
  if os.geteuid() != 0:
    pytest.skip("needs root for a small tmpfs in a mount namespace")
  earlier, ck, small = tmp_path / "earlier", tmp_path / "ck", tmp_path / "small"
  shutil.copytree(ref[0], earlier, ignore=shutil.ignore_patterns("checkpoints"))
  shutil.copytree(ref[0] / "checkpoints" / "2", ck / "2")
  shutil.copytree(ref[0] / "checkpoints" / "4", ck / "4")
  s = json.loads((earlier / "summary.json").read_text())   # as SIGTERM after step 4 leaves it
  s.update(status="interrupted", losses=s["losses"][:4], error="Interrupted: stopped by SIGTERM after step 4")
  del s["final_loss"]
  (earlier / "summary.json").write_text(json.dumps(s))
  (earlier / "metrics.jsonl").write_text("".join(l + "\n" for l in (earlier / "metrics.jsonl").read_text().splitlines()[:4]))
  before, ck_before = sums(earlier), sums(ck)
  small.mkdir()
  out = small / "run"
  (tmp_path / "report.py").write_text(REPORT)      # the files as the process left them, read in its namespace
  script = (f'mount -t tmpfs -o size=4m tmpfs "$0" || exit 99; cp -a {earlier} {out}; "$@"; rc=$?; '
            f'{sys.executable} {tmp_path / "report.py"} {out} {tmp_path / "after.json"}; exit $rc')
  r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                      str(small), sys.executable, "-c", FILL_AT.replace("{step}", "5"), *CMD, "checkpoint.resume=true",
                      f"checkpoint.dir={ck}", f"hydra.run.dir={out}"],
                     cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
  if r.returncode == 99:
    pytest.skip(f"no tmpfs mount possible here: {r.stderr.strip()[:200]}")
  assert r.returncode == 1 and "Traceback" not in r.stderr and "Logging error" not in r.stderr, r.stderr[-3000:]
  lines = [l for l in r.stderr.splitlines() if l.startswith("shardlab")]
  assert lines == [f"shardlab: resuming from checkpoint 4 in {ck}",
                   f"shardlab: error: hydra.run.dir={out}: cannot write summary.json after step 6 (No space left on "
                   f"device); its earlier files are kept whole; checkpoint 6 in {ck} is saved: free space, then "
                   "continue with checkpoint.resume=true"], r.stderr[-3000:]
  after = json.loads((tmp_path / "after.json").read_text())
  assert after["summary.json"] == before["summary.json"]          # the interrupted run's, whole
  rows = after.pop("metrics.jsonl:text").splitlines()
  assert [json.loads(l)["step"] for l in rows] == list(range(6))   # whole lines only
  assert rows[:4] == (earlier / "metrics.jsonl").read_text().splitlines()
  assert {k: v for k, v in sums(ck).items() if k in ck_before} == ck_before and (ck / "6").is_dir()
  (earlier / "metrics.jsonl").write_text("\n".join(rows) + "\n")   # space again: the same command finishes it
  s = run(earlier, "checkpoint.every=2", "checkpoint.resume=true", f"checkpoint.dir={ck}")
  assert s["status"] == "ok" and s["losses"] == ref[1]["losses"] and s["checkpoint"]["resumed_from"] == 6


def test_run_directory_too_small_for_the_analysis_is_one_line(tmp_path):
  """A run directory (64 KiB tmpfs) too small for the analysis's timeline files: one line naming it and the
  point (before training), exit 1, and no half-written file or staging directory left in it."""
  if os.geteuid() != 0:
    pytest.skip("needs root for a small tmpfs in a mount namespace")
  small = tmp_path / "small"
  small.mkdir()
  out = small / "run"
  script = (f'mount -t tmpfs -o size=64k tmpfs "$0" || exit 99; "$@"; rc=$?; ls -A {out} > {tmp_path / "ls"}; '
            'exit $rc')
  r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(small), sys.executable,
                      "-m", "shardlab", *(a for a in CMD if a != "figures=false"), f"hydra.run.dir={out}"], cwd=ROOT,
                     env=ENV, capture_output=True,
                     text=True, timeout=300)
  if r.returncode == 99:
    pytest.skip(f"no tmpfs mount possible here: {r.stderr.strip()[:200]}")
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert [l for l in r.stderr.splitlines() if l.strip()] == [
      f"shardlab: error: hydra.run.dir={out}: cannot write the analysis (timeline.json, timeline.png) before training "
      "(No space left on device); its earlier files are kept whole; free space or choose another hydra.run.dir"]
  left = (tmp_path / "ls").read_text().split()
  assert not [n for n in left if n.startswith(".analysis") or n.startswith("timeline")], left


@pytest.mark.slow
def test_requeue_loop_ends_like_the_uninterrupted_run(ref, tmp_path):
  """The same `checkpoint.resume=true` command, as a requeued job runs it: the first two runs killed (-9) at
  random points (while starting, mid-step, mid-save, at the final save, or after the end), then run again until
  one says it is already finished. The losses are the uninterrupted run's, the last run's output is that one
  line, and it touched nothing."""
  seed = random.randrange(1 << 30)
  rng, out = random.Random(seed), tmp_path / "run"
  args = [sys.executable, "-c", SLOW.format(s=0.2), *CMD, "checkpoint.resume=true", f"hydra.run.dir={out}"]
  kills = []
  for _ in range(2):
    p = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rows, delay = rng.randrange(0, 7), rng.uniform(0, 0.4)    # after `rows` metrics rows (6: at/after the end)
    deadline = time.monotonic() + 240
    while p.poll() is None and time.monotonic() < deadline:
      if rows == 0 or ((out / "metrics.jsonl").exists() and len(metrics(out)) >= rows):
        break
      time.sleep(0.02)
    time.sleep(delay)
    p.kill()
    _, err = p.communicate(timeout=60)
    kills.append((rows, round(delay, 2), p.returncode))
    assert "Traceback" not in err, (seed, kills, err[-3000:])
  for i in range(3):
    before = sums(out) if out.exists() else {}
    p = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, (seed, kills, p.stderr[-3000:])
    if "already finished" in p.stdout:
      assert p.stdout.splitlines() == [f"shardlab: {out}: already finished: train.steps=6 reached (checkpoint 6 in "
                                       f"{out / 'checkpoints'}); summary.json kept as it was; raise train.steps to "
                                       "continue"], (seed, kills, p.stdout)
      assert sums(out) == before, (seed, kills)
      break
  else:
    raise AssertionError(f"never said it was finished (seed {seed}, kills {kills})")
  s = json.loads((out / "summary.json").read_text())
  assert s["status"] == "ok" and s["losses"] == ref[1]["losses"], (seed, kills)
  assert [m["loss"] for m in metrics(out)] == ref[1]["losses"], (seed, kills)


def test_a_refused_job_keeps_a_finished_runs_summary(tmp_path):
  """A resumed sweep's job refused for changed settings records its error without replacing the summary.json of
  the run that finished there (its losses and analysis stay); a job with no finished run gets the error."""
  import json
  from shardlab.mesh import ConfigError
  from shardlab.outputs import record_failure
  done = tmp_path / "0_baseline_4x2_tiny"
  done.mkdir()
  (done / "summary.json").write_text(json.dumps({"status": "ok", "losses": [5.5, 5.4]}))
  before = (done / "summary.json").read_bytes()
  record_failure(done, ConfigError("train.seed=1: differs from the checkpoint's"))
  assert (done / "summary.json").read_bytes() == before
  fresh = tmp_path / "1_baseline_4x2_tiny"
  record_failure(fresh, ConfigError("train.seed=1: differs from the checkpoint's"))
  assert json.loads((fresh / "summary.json").read_text())["status"] == "error"
