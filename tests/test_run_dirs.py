"""Run and sweep directories keep what they hold: a later command that is refused or fails rewrites none of an
earlier run's files (checksums of every file before and after), in one line, exit 2 for a refusal.

  1. a resume into a run without checkpoints: refused unless it is the same run requeued (killed before its first
     checkpoint: every setting the same, run control aside); a finished one, refused (nothing to continue); a fresh
     run's refusal advises checkpoint.resume=true only where there is a checkpoint to continue;
  2. a failed resume keeps the summary.json (its losses), metrics.jsonl and .hydra/ it found;
  3. a resumed sweep whose jobs are finished rewrites nothing (not .hydra/, not multirun.yaml), with either
     launcher; one whose jobs are refused exits 1 and keeps them; another sweep into its directory is refused,
     resumed or not;
  4. a single run into a sweep directory, and a sweep into a single run's directory: refused.

The earlier runs are tiny real CLI runs (2 steps), made once per module and copied per test."""
import json
import shutil
import subprocess
import sys

import pytest

from joints import ENV, ROOT, checksums, one_line, shardlab

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md

PLAIN = ["train.steps=2", "checkpoint.enabled=false"]       # a run without checkpoints
SWEEP = ["train.steps=2", "train.lr=1e-3,2e-3"]             # a sweep of two jobs (checkpoints on)
PIPE = ["train.steps=2", "mesh.pipeline=2", "mesh.fsdp=4", "mesh.tensor=1", "model.n_layers=2", "pipeline=gpipe"]


def _made(r):
  assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
  """A finished run of PLAIN, as the CLI leaves it (summary.json, metrics.jsonl, .hydra/, no checkpoints)."""
  d = tmp_path_factory.mktemp("plain") / "run"
  _made(shardlab(f"hydra.run.dir={d}", *PLAIN))
  return d


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
  """A finished sweep of SWEEP, launched without checkpoint.resume (so a resume that rewrote a job's
  .hydra/overrides.yaml or multirun.yaml would change their bytes)."""
  d = tmp_path_factory.mktemp("sweep") / "sweep"
  _made(shardlab("-m", f"hydra.sweep.dir={d}", *SWEEP))
  return d


def _copy(src, dst):
  shutil.copytree(src, dst, symlinks=True)
  return dst


def _interrupted(run, keep: int):
  """summary.json as a SIGTERM after step `keep` leaves it (status interrupted, the losses so far)."""
  s = json.loads((run / "summary.json").read_text())
  s.update(status="interrupted", losses=s["losses"][:keep], error=f"Interrupted: stopped by SIGTERM after step {keep}")
  s.pop("final_loss", None)
  (run / "summary.json").write_text(json.dumps(s))


def _refused(before, d, r, *expected) -> str:
  """Exit 2, one line without a traceback containing each of `expected`, and every file under d as it was."""
  assert r.returncode == 2, r.stderr[-3000:]
  line = one_line(r.stderr)
  assert all(e in line for e in expected), line
  assert checksums(d) == before
  return line


# 1. Resume into a run without checkpoints.

def test_resume_with_another_setting_into_a_run_without_checkpoints_is_refused(plain, tmp_path):
  """The reported loss: checkpoint.resume=true and another train.lr replaced metrics.jsonl, summary.json and
  .hydra/ (train.lr is no checkpoint setting, and there was no checkpoint to compare anyway)."""
  run = _copy(plain, tmp_path / "run")
  before = checksums(run)
  r = shardlab(f"hydra.run.dir={run}", *PLAIN, "checkpoint.resume=true", "train.lr=1e-3")
  _refused(before, run, r, f"hydra.run.dir={run}: holds a run with other settings (train.lr=0.001 (that run: 0.02))",
           "no checkpoint to resume", "choose a new hydra.run.dir")


def test_resume_of_a_finished_run_without_checkpoints_is_refused(plain, tmp_path):
  """Its own settings, but finished and nothing saved to continue from: starting over would only replace it."""
  run = _copy(plain, tmp_path / "run")
  before = checksums(run)
  r = shardlab(f"hydra.run.dir={run}", *PLAIN, "checkpoint.resume=true")
  _refused(before, run, r, f"hydra.run.dir={run}: holds a finished run (summary.json: status ok, 2 steps) and no "
                           "checkpoint to continue from", "nothing to resume")


def test_fresh_run_into_a_run_without_checkpoints_is_not_told_to_resume(plain, tmp_path):
  """The refusal used to advise checkpoint.resume=true, which led straight into the loss above."""
  run = _copy(plain, tmp_path / "run")
  before = checksums(run)
  line = _refused(before, run, shardlab(f"hydra.run.dir={run}", *PLAIN, "train.lr=1e-3"),
                  "holds another run (summary.json: status ok, 2 steps); a new run would overwrite it")
  assert line.endswith("choose a new hydra.run.dir") and "checkpoint.resume" not in line, line


@pytest.mark.slow
def test_requeue_of_a_run_killed_before_its_first_checkpoint_runs_again(plain, tmp_path):
  """The same run requeued (summary.json interrupted after step 1, nothing saved): it starts over and finishes;
  run control (checkpoint.*, progress) may differ. Its .hydra/ is then this launch's."""
  run = _copy(plain, tmp_path / "run")
  _interrupted(run, 1)
  r = shardlab(f"hydra.run.dir={run}", "train.steps=2", "checkpoint.resume=true")
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.loads((run / "summary.json").read_text())
  assert s["status"] == "ok" and len(s["losses"]) == 2
  assert "checkpoint.resume=true" in (run / ".hydra" / "overrides.yaml").read_text()


def _compose_cfg(*overrides):
  from conftest import compose
  from shardlab.config import to_config
  return to_config(compose(*overrides))


@pytest.mark.parametrize("setup, overrides, expected", [
    ("interrupted", ["checkpoint.resume=true", "progress=false", "checkpoint.every=1", "tensorboard=false"], None),
    ("interrupted", ["checkpoint.resume=true", "train.lr=1e-3"], "train.lr=0.001 (that run: 0.02)"),
    ("interrupted", ["checkpoint.resume=true", "train.steps=4"], "train.steps=4 (that run: 2)"),
    ("interrupted", ["checkpoint.resume=true", "mesh=1x8"], "mesh.fsdp=1 (that run: 4)"),
    ("killed", ["checkpoint.resume=true"], None),                     # no summary.json: .hydra/config.yaml says
    ("killed", ["checkpoint.resume=true", "train.seed=3"], "train.seed=3 (that run: 0)"),
    ("unrecorded", ["checkpoint.resume=true"], "recorded no settings"),
    ("finished", ["checkpoint.resume=true"], "holds a finished run"),
    ("finished", ["checkpoint.resume=false"], "holds another run"),
])
def test_which_resumes_without_a_checkpoint_pass(plain, tmp_path, setup, overrides, expected):
  """check_run_dir_unused on its own (no process): a requeue passes only with the run's own settings."""
  from shardlab import preflight
  from shardlab.mesh import ConfigError
  run = _copy(plain, tmp_path / "run")
  if setup == "interrupted":
    _interrupted(run, 1)
  elif setup in ("killed", "unrecorded"):     # a kill -9 before the summary: metrics.jsonl and .hydra/ only
    (run / "summary.json").unlink()
    if setup == "unrecorded":
      shutil.rmtree(run / ".hydra")
  cfg = _compose_cfg(*PLAIN, *overrides)
  if expected is None:
    preflight.check_run_dir_unused(cfg, run)
  else:
    with pytest.raises(ConfigError) as e:
      preflight.check_run_dir_unused(cfg, run)
    assert expected in str(e.value), str(e.value)


# 2. A failed resume keeps what it found.

def test_record_failure_keeps_any_summary_it_finds(tmp_path):
  """An interrupted run's summary (its losses) stays; only a directory without one gets the error record."""
  from shardlab.outputs import record_failure
  kept = tmp_path / "kept"
  kept.mkdir()
  (kept / "summary.json").write_text(json.dumps({"status": "interrupted", "losses": [5.5] * 13}))
  before = checksums(kept)
  record_failure(kept, RuntimeError("boom"))
  assert checksums(kept) == before
  record_failure(tmp_path / "new", RuntimeError("boom"))
  assert json.loads((tmp_path / "new" / "summary.json").read_text())["error"] == "RuntimeError: boom"


FAIL_COMPILE = ("import shardlab.trainer as T, shardlab.run as R\n"
                "def boom(*a, **k): raise RuntimeError('injected: the resumed step does not compile')\n"
                "T.compile_and_analyze = boom; R.cli()")


def test_failed_resume_keeps_the_interrupted_runs_files(sweep, tmp_path):
  """A resume that passes its checks and fails before training (here an error injected into compiling) used to
  replace the interrupted run's summary.json with a 3-key error; every file stays (but .lock, which names the
  process holding the run dir)."""
  run = _copy(sweep / "0_baseline_4x2_tiny", tmp_path / "run")
  _interrupted(run, 2)
  before = {k: v for k, v in checksums(run).items() if k != ".lock"}
  r = _python_c(FAIL_COMPILE, f"hydra.run.dir={run}", "train.steps=4", "train.lr=1e-3", "checkpoint.resume=true")
  assert r.returncode == 1 and "injected: the resumed step does not compile" in r.stderr, r.stderr[-3000:]
  assert {k: v for k, v in checksums(run).items() if k != ".lock"} == before


def _python_c(code, *args):
  """`python -c CODE progress=false figures=false ARGS` (CODE ends in shardlab.run.cli()) as a real process."""
  return subprocess.run([sys.executable, "-c", code, "progress=false", "figures=false", *args], cwd=ROOT, env=ENV,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_failed_resume_of_a_pipeline_run_keeps_its_summary(tmp_path):
  """The reported loss: an interrupted pipeline run resumed with schedule=gspmd (which cannot run pipeline
  stages), as a single run and as a sweep's job: each fails, and the interrupted run's summary.json (its losses),
  metrics.jsonl and .hydra/ stay as they were (the sweep's job used to get a 3-key error summary)."""
  sw = tmp_path / "sweep"
  job = sw / "job"
  _made(shardlab(f"hydra.run.dir={job}", *PIPE))
  _interrupted(job, 1)
  before = checksums(job)
  r = shardlab(f"hydra.run.dir={job}", *PIPE, "checkpoint.resume=true", "schedule=gspmd")
  assert r.returncode in (1, 2) and "schedule=gspmd" in r.stderr, r.stderr[-3000:]
  assert {k: v for k, v in checksums(job).items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}
  r = shardlab("-m", f"hydra.sweep.dir={sw}", "hydra.sweep.subdir=job", *PIPE, "checkpoint.resume=true",
               "schedule=gspmd")
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert "schedule=gspmd" in r.stderr and "1 of 1 sweep jobs failed" in r.stderr, r.stderr[-3000:]
  assert {k: v for k, v in checksums(job).items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}


# 3. A resumed sweep.

def _stats(d):
  """{path: (sha256, mtime)} of every file under d: rewritten with the same bytes shows too."""
  sums = checksums(d)
  return {k: (v, (d / k).stat().st_mtime_ns) for k, v in sums.items()}


def _sweep_copy(sweep, dst):
  """A copy of the sweep as if made there: its summary.md names its own directory."""
  from shardlab.sweep import write
  write(_copy(sweep, dst))
  return dst


def test_resumed_finished_sweep_rewrites_nothing(sweep, tmp_path):
  """The same sweep again with checkpoint.resume=true: each job says it is finished, and no file of the sweep
  directory is rewritten (Hydra used to rewrite each job's .hydra/ and multirun.yaml, even with the same bytes)."""
  sw = _sweep_copy(sweep, tmp_path / "sweep")
  before = _stats(sw)
  r = shardlab("-m", f"hydra.sweep.dir={sw}", *SWEEP, "checkpoint.resume=true")
  assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert r.stdout.count("already finished") == 2, r.stdout
  assert _stats(sw) == before


@pytest.mark.slow
def test_resumed_finished_sweep_through_the_process_launcher_rewrites_nothing(sweep, tmp_path):
  """The same with hydra/launcher=submitit_local (a process per job, as for sweeps over device counts): only
  submitit's own logs (.submitit/) are new."""
  sw = _sweep_copy(sweep, tmp_path / "sweep")
  before = _stats(sw)
  r = shardlab("-m", f"hydra.sweep.dir={sw}", *SWEEP, "checkpoint.resume=true", "hydra/launcher=submitit_local")
  assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert {k: v for k, v in _stats(sw).items() if not k.startswith(".submitit")} == before


def test_resumed_sweep_whose_jobs_are_refused_fails_and_keeps_them(sweep, tmp_path):
  """Each finished job without its checkpoints (removed here) is refused on resume: the sweep exits 1, though every
  row still says ok (the jobs' files, summary.csv and summary.md as they were)."""
  sw = _sweep_copy(sweep, tmp_path / "sweep")
  for job in ("0_baseline_4x2_tiny", "1_baseline_4x2_tiny"):
    shutil.rmtree(sw / job / "checkpoints")
  before = checksums(sw)
  r = shardlab("-m", f"hydra.sweep.dir={sw}", *SWEEP, "checkpoint.resume=true")
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert r.stderr.count("holds a finished run (summary.json: status ok, 2 steps) and no checkpoint") == 3
  assert "shardlab: error: 2 of 2 sweep jobs failed" in r.stderr, r.stderr[-3000:]
  assert checksums(sw) == before


@pytest.mark.parametrize("change, expected", [
    (["train.lr=1e-3,3e-3"], "sweeps train.lr=1e-3,3e-3 (that sweep: train.lr=1e-3,2e-3)"),
    (["train.lr=2e-3,1e-3"], "sweeps train.lr=2e-3,1e-3 (that sweep: train.lr=1e-3,2e-3)"),
    (["train.lr=1e-3,2e-3", "train.seed=3"], "train.seed=3 (that sweep: unset)"),
])
def test_another_sweep_into_a_sweep_directory_is_refused_even_resumed(sweep, tmp_path, change, expected):
  """Other values, another order of them (which numbers the jobs) or another setting: not the same sweep."""
  sw = _copy(sweep, tmp_path / "sweep")
  before = checksums(sw)
  r = shardlab("-m", f"hydra.sweep.dir={sw}", "train.steps=2", *change, "checkpoint.resume=true")
  _refused(before, sw, r, f"hydra.sweep.dir={sw}: holds another sweep (multirun.yaml: {expected})")


def test_a_sweep_refused_for_a_typo_does_not_hold_its_directory(tmp_path):
  """Hydra saves multirun.yaml before it composes the jobs, so a sweep value with a typo is refused after the
  record is written: that record of a launch that ran no job does not hold the directory against the corrected
  command (it used to be refused as another sweep, told to rerun the command with the typo). A launch that queued
  jobs (submitit's .submitit) or ran some still does."""
  from shardlab.errors import ConfigError
  from shardlab.sweep import check_sweep_dir
  sw = tmp_path / "sweep"
  r = shardlab("-m", f"hydra.sweep.dir={sw}", "train.steps=2", "schedule=baseline,fsdp_prefetc")
  assert r.returncode == 2 and "Could not find 'schedule/fsdp_prefetc'" in one_line(r.stderr), r.stderr[-2000:]
  assert sorted(p.name for p in sw.iterdir()) == ["multirun.yaml"]
  queued = tmp_path / "queued"
  shutil.copytree(sw, queued)
  (queued / ".submitit").mkdir()
  fixed = ["train.steps=2", "schedule=baseline,fsdp_prefetch"]
  check_sweep_dir(sw, False, fixed)
  assert not (sw / "multirun.yaml").exists()               # the corrected sweep writes its own
  with pytest.raises(ConfigError, match="holds another sweep"):
    check_sweep_dir(queued, False, fixed)


# 4. Run and sweep directories are not each other's.

def test_single_run_into_a_sweep_directory_is_refused(sweep, tmp_path):
  """It used to run, and the report of the directory then said "1 of 1 runs ok", the sweep's jobs hidden."""
  sw = _copy(sweep, tmp_path / "sweep")
  before = checksums(sw)
  r = shardlab(f"hydra.run.dir={sw}", "train.steps=2")
  _refused(before, sw, r, f"hydra.run.dir={sw}: holds a sweep (multirun.yaml, 2 jobs: 0_baseline_4x2_tiny, "
                          "1_baseline_4x2_tiny)", f"hydra.run.dir={sw / '0_baseline_4x2_tiny'}")


@pytest.mark.parametrize("resume", ["false", "true"])
def test_sweep_into_a_single_runs_directory_is_refused(plain, tmp_path, resume):
  run = _copy(plain, tmp_path / "run")
  before = checksums(run)
  r = shardlab("-m", f"hydra.sweep.dir={run}", *SWEEP, f"checkpoint.resume={resume}")
  _refused(before, run, r, f"hydra.sweep.dir={run}: holds a single run (summary.json and metrics.jsonl and .hydra)")


def test_a_resume_drops_the_rows_it_runs_again_only_when_it_writes_its_first(tmp_path):
  """metrics.jsonl of a run resumed from step 2: a failure before its first new row leaves the file it found
  whole (it used to be cut back to the checkpoint's step at once); the first new row drops the rows after the
  checkpoint and follows the kept ones."""
  import json as J
  from shardlab import outputs as O
  rows = "".join(J.dumps({"step": i, "loss": 5.0 - i}) + "\n" for i in range(5))
  (tmp_path / "metrics.jsonl").write_text(rows)
  with O.open_metrics(tmp_path, 2, True):
    pass                                          # the resumed run failed before its first step
  assert (tmp_path / "metrics.jsonl").read_text() == rows
  with O.open_metrics(tmp_path, 2, True) as f:
    f.write(J.dumps({"step": 2, "loss": 9.0}) + "\n")
  assert [J.loads(l)["loss"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [5.0, 4.0, 9.0]
