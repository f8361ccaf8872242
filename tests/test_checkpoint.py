"""Checkpoints: a resumed run continues exactly where the uninterrupted one went (same mesh), or with the same
losses on another mesh; SIGTERM saves before exiting; a damaged latest checkpoint falls back to the one before;
a non-finite loss keeps the last good checkpoint. Runs are in-process (8 fake CPU devices) unless a process is
the point (SIGTERM)."""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, compose

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md

# steps <= 6: the same learning rates as any longer prefix of them. fsdp_prefetch: a step whose collectives all sit
# in one computation, so the persistent compilation cache serves it to every process these tests start (the
# default schedule's are in its layer loops too, a program mesh.guard_persistent_cache keeps out of that cache).
RUN = ["train.steps=6", "progress=false", "figures=false", "schedule=fsdp_prefetch"]


def run(out, *overrides):
  from shardlab.config import to_config
  from shardlab.run import train
  return train(to_config(compose(*RUN, *overrides)), out)


def metrics(out):
  return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def ref(tmp_path_factory):
  """The uninterrupted run (4x2 mesh, 6 steps, checkpoints after steps 2, 4 and 6): (run dir, summary).
  Made once per session; pytest-xdist workers share it through a lock in their common temporary directory."""
  root = tmp_path_factory.getbasetemp()
  root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
  out = root / "checkpoint_ref"
  with open(root / "checkpoint_ref.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (out / "summary.json").exists():
      run(out, "checkpoint.every=2")
  return out, json.loads((out / "summary.json").read_text())


def copy_checkpoints(ref_dir, dst, steps):
  for s in steps:
    shutil.copytree(ref_dir / "checkpoints" / str(s), dst / str(s))
  return dst


def test_reference_run_saves_every_2_steps_and_at_the_end(ref):
  out, s = ref
  assert s["status"] == "ok" and s["checkpoint"]["saved"] == [2, 4, 6] and s["checkpoint"]["resumed_from"] is None
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4", "6"]


def test_sigterm_saves_and_the_resumed_run_ends_like_the_uninterrupted_one(tmp_path, request):
  """A real process, slowed to 0.5 s a step so that SIGTERM lands mid-run: it finishes the step, saves, exits
  with 128+15. Resuming in the same run dir gives the uninterrupted run's losses exactly, step by step."""
  out = tmp_path / "run"
  slow = ("import sys, time, shardlab.data as D, shardlab.run as R; b = D.MarkovData.batch; "
          "D.MarkovData.batch = lambda self, i: (time.sleep(0.5), b(self, i))[1]; R.cli()")
  p = subprocess.Popen([sys.executable, "-c", slow, *RUN, f"hydra.run.dir={out}"], cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  ref_out, ref_s = request.getfixturevalue("ref")   # made (if need be) while the process compiles
  deadline = time.time() + 300
  while p.poll() is None and time.time() < deadline:
    if (out / "metrics.jsonl").exists() and len(metrics(out)) >= 2:
      break
    time.sleep(0.05)
  p.send_signal(signal.SIGTERM)
  _, err = p.communicate(timeout=300)
  assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
  s = json.loads((out / "summary.json").read_text())
  saved = s["checkpoint"]["saved"]
  assert s["status"] == "interrupted" and len(saved) == 1 and 2 <= saved[0] < 6, s
  assert f"shardlab: stopped by SIGTERM after step {saved[0]}" in err
  assert s["losses"] == ref_s["losses"][:saved[0]]               # two runs of one config: identical metrics

  r = run(out, "checkpoint.resume=true")                         # the default checkpoint dir, in the run dir
  assert r["checkpoint"]["resumed_from"] == saved[0] and r["checkpoint"]["saved"] == [6]
  assert r["losses"] == ref_s["losses"] and r["final_loss"] == ref_s["final_loss"]
  assert [m["loss"] for m in metrics(out)] == ref_s["losses"] and [m["step"] for m in metrics(out)] == list(range(6))


def test_damaged_checkpoints_fall_back_with_one_line_each(ref, tmp_path):
  """Checkpoint 6 with its array data zeroed, checkpoint 4 with every array data file cut in half: a real
  process (tensorstore's late callbacks used to print ~190 lines of event-loop tracebacks for the zeroed one,
  and orbax's dropped read coroutines 6,000-22,000 lines of 'Exception ignored in: <coroutine ...>' with each
  array's TensorStore spec for the cut one) says one line per checkpoint it sets aside, which step and why
  (tensorstore's own error, not orbax's wrapper with the spec), resumes from 2 and runs exactly like the
  uninterrupted run (the same mesh)."""
  ref_out, ref_s = ref
  ck = copy_checkpoints(ref_out, tmp_path / "ck", [2, 4, 6])
  for p in (ck / "6" / "state").rglob("d/*"):
    p.write_bytes(bytes(p.stat().st_size))
  cut = [p for p in (ck / "4" / "state").glob("ocdbt.process_*/d/*") if p.is_file()]
  assert cut
  for data in cut:
    os.truncate(data, data.stat().st_size // 2)
  out = tmp_path / "run"
  r = subprocess.run([sys.executable, "-m", "shardlab", *RUN, "checkpoint.every=2", "checkpoint.resume=true",
                      f"checkpoint.dir={ck}", f"hydra.run.dir={out}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert [l.split(" is unusable (")[0] for l in lines] == [
      f"shardlab: warning: checkpoint 6 in {ck}", f"shardlab: warning: checkpoint 4 in {ck}",
      f"shardlab: resuming from checkpoint 2 in {ck}"], r.stderr
  assert "DATA_LOSS" in lines[0] and "tensorstore_spec" not in lines[0] and len(lines[0]) < 500
  assert "TensorStore details" not in lines[1] and "OCDBT" in lines[1] and len(lines[1]) < 500
  s = json.loads((out / "summary.json").read_text())
  assert s["checkpoint"]["resumed_from"] == 2 and s["checkpoint"]["saved"] == [4, 6]
  assert s["losses"] == ref_s["losses"]
  assert sorted(p.name for p in ck.iterdir()) == [".owner", "2", "4", "4.unreadable", "6", "6.unreadable"]
  assert json.loads((ck / ".owner").read_text())["run_dir"] == str(out.resolve())   # claimed by the run resuming it


@pytest.mark.parametrize("mesh", ["2x4", "1x8", "2x2x2"])
def test_resume_onto_another_mesh_reshards(ref, tmp_path, mesh):
  """The 4x2 checkpoint restored with the 2x4 / 1x8 / HSDP 2x2x2 shardings (every leaf, optimizer state
  included; on 2x2x2 replicated over data): the
  following losses match the uninterrupted 4x2 run to float32 rounding of a different reduction order."""
  ref_out, ref_s = ref
  ck = copy_checkpoints(ref_out, tmp_path / "ck", [2])
  s = run(tmp_path / "run", f"mesh={mesh}", "checkpoint.resume=true", f"checkpoint.dir={ck}")
  assert s["checkpoint"]["resumed_from"] == 2 and s["losses"][:2] == ref_s["losses"][:2]
  np.testing.assert_allclose(s["losses"][2:], ref_s["losses"][2:], rtol=2e-6)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  with pytest.raises(FloatingPointError, match=r"non-finite loss nan .* at step 1; last good checkpoint: checkpoint 1"):
    run(tmp_path, "train.lr=1e10", "checkpoint.every=1")   # step 0's update blows the weights up
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["status"] == "error" and s["error"].startswith("FloatingPointError") and len(s["losses"]) == 2
  assert s["losses"][1] is None                                  # strict JSON: null, not a bare NaN token
  def no_nan(token):
    raise AssertionError(f"non-strict JSON token {token}")
  rows = [json.loads(l, parse_constant=no_nan) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert rows[1]["loss"] is None
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]   # nothing from the bad state




def test_orbax_and_tensorstore_late_reports_are_dropped():
  """The unraisable-exception hook a Checkpointer installs: a read coroutine of orbax's dropped with its error
  (what a damaged checkpoint's in-flight reads print, thousands of lines, depending on timing) and tensorstore's
  'Event loop is closed' are not printed; any other unraisable exception still is."""
  from types import SimpleNamespace
  from orbax.checkpoint._src.serialization import serialization
  from shardlab.checkpoint import _no_closed_loop_reports
  seen = []
  hook = _no_closed_loop_reports(seen.append)
  coro = serialization._read_array_index_and_device_put(None, None, None, global_shape=None, new_shard_shape=None,
                                                        dtype=None, byte_limiter=None, strict=None, dll=None,
                                                        memory_kind=None)
  try:
    orbax_read = SimpleNamespace(exc_type=Exception, exc_value=Exception("Encountered error while reading array "
                                 "index"), exc_traceback=None, err_msg=None, object=coro)
    closed = SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError("Event loop is closed"),
                             exc_traceback=None, err_msg=None, object=None)
    other = SimpleNamespace(exc_type=ValueError, exc_value=ValueError("mine"), exc_traceback=None, err_msg=None,
                            object=len)
    for u in (orbax_read, closed, other):
      hook(u)
  finally:
    coro.close()
  assert seen == [other]


def test_a_failed_background_save_names_its_own_step(tmp_path):
  """A save that fails in the background surfaces at a later check or at the next save: the line names the step
  whose save failed (it named the next one, 80 for a failed 60) and the newest complete checkpoint."""
  from shardlab.checkpoint import Checkpointer
  from shardlab.config import CheckpointConfig
  ck = Checkpointer(CheckpointConfig(), tmp_path / "ck", (4, 2))
  try:
    ck.pending = 60
    err = str(ck._failed(OSError(28, "No space left on device")))
  finally:
    ck.close()
  assert err.startswith(f"checkpoint.dir={tmp_path / 'ck'}: saving checkpoint 60 failed (OSError: [Errno 28] No "
                        "space left on device); last complete checkpoint: none"), err
