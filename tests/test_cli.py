"""`python -m shardlab` end to end, in a subprocess: the README's main job. (Equal losses on every mesh and on
one device: tests/test_sweep.py.)"""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md

SUMMARY_KEYS = {"status", "losses", "final_loss", "mesh", "devices", "schedule", "compile_time_s",
                "step_time_s_median", "jax_version", "config"}
METRIC_KEYS = {"step", "loss", "grad_norm", "step_time_s", "tokens_per_s"}


def launch(out, *overrides, cwd=ROOT, figures=False):
  return subprocess.Popen([sys.executable, "-m", "shardlab", "progress=false", f"figures={str(figures).lower()}",
                           f"hydra.run.dir={out}", *overrides],
                          cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, out):
  stdout, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  s = json.loads((out / "summary.json").read_text())
  assert stdout.splitlines()[-1] == (f"shardlab: {out}: ok, final loss {s['final_loss']:.4f} after "
                                     f"{len(s['losses'])} steps, step time {s['step_time_s_median'] * 1e3:.1f} ms "
                                     f"(median)"), stdout[-500:]
  # The run's numbers before that line: named prediction, memory and fit, measured beside predicted.
  from shardlab.run import numbers
  n = len(numbers(s))
  assert stdout.splitlines()[-1 - n:-1] == numbers(s), stdout[-1000:]
  # run.log keeps what the run printed: its numbers and its last line
  assert (out / "run.log").read_text().splitlines()[-1 - n:] == stdout.splitlines()[-1 - n:]
  return s


def test_a_run_ends_with_its_numbers(default_run):
  """The lines before the last: the prediction named (peak-rate over the local XLA:CPU program), memory per
  device and the fit against the preset's HBM, predicted step time, MFU and exposed communication; a training
  run adds the measured median beside the prediction; a dry run (no steps) does not."""
  from shardlab.run import numbers
  s = default_run[1]
  p = s["prediction"]
  assert p["model"].startswith("peak-rate")                          # summary.json names its model
  lines = numbers(s)
  assert lines[0] == "shardlab: prediction for h100 (peak-rate model over the cpu program):"
  assert lines[1].startswith("  memory per device") and "fits" in lines[1] and "80 GB" in lines[1]
  assert f"{100 * p['mfu']:.3g}%" in lines[2] and "predicted" in lines[2] and "exposed communication" in lines[2]
  assert lines[3].startswith("  measured") and "median, 8 x cpu" in lines[3]
  # measured on CPU, predicted for an H100: no error between them (it used to print "prediction -100%")
  assert "(measured on cpu, predicted for h100: no error to compute)" in lines[3] and "%" not in lines[3]
  on_gpu = {**s, "platform": "gpu", "config": {**s["config"], "hardware": {**s["config"]["hardware"],
                                                                           "target_platform": "cuda"}}}
  error = p["t_overlapped_s"] / s["step_time_s_median"] - 1
  assert f"(prediction {error:+.1%} of the measurement)" in numbers(on_gpu)[3]
  measured_here = {**s, "config": {**s["config"], "hardware": {**s["config"]["hardware"], "target_platform": "",
                                                                 "measured_on": "cpu"}}}   # a calibrated preset
  assert f"(prediction {error:+.1%} of the measurement)" in numbers(measured_here)[3]
  dry = numbers({k: v for k, v in s.items() if k not in ("step_time_s_median", "losses", "final_loss")})
  assert dry[:3] == lines[:3] and dry[3:] == lines[4:]
  # what the analysis found comes after: here the compiler's combined collectives, a note (nothing unplanned)
  assert [l.split(":")[1].strip() for l in lines[4:]] == ["note"] * len(s["ledger"]["rewrites"] and [1])


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
  """The README's main job: the default config (tiny model, 8 fake CPU devices, 4x2 mesh, 30 steps)."""
  out = tmp_path_factory.mktemp("default")
  return out, finish(launch(out, figures=True), out)


def test_default_run_writes_the_contract(default_run):
  out, s = default_run
  assert SUMMARY_KEYS <= s.keys() and s["status"] == "ok"
  assert s["mesh"] == {"fsdp": 4, "tensor": 2} and s["devices"] == 8 and s["schedule"] == "baseline"
  rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(30)) and all(METRIC_KEYS <= r.keys() for r in rows)
  assert [r["loss"] for r in rows] == s["losses"] and s["final_loss"] == s["losses"][-1]
  assert s["config"]["schedule"]["name"] == "baseline" and s["config"]["train"]["steps"] == 30
  assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG" and (out / "timeline.json").is_file()
  events = list((out / "tensorboard").glob("events.out.tfevents.*"))
  assert len(events) == 1 and events[0].stat().st_size > 1000   # 30 steps x 4 scalars


def test_loss_falls_over_30_steps(default_run):
  """data.py's claim: the default run learns the chain, from log(vocab) most of the way to log(branching)."""
  losses = default_run[1]["losses"]
  assert losses[0] == pytest.approx(np.log(256), rel=0.01)   # an untrained model is uniform over the vocab
  assert losses[-1] < 2.2, losses                            # floor: log(4) = 1.39


def test_user_schedule_from_its_own_file_trains_like_baseline(default_run, tmp_path):
  """examples/user_schedule.py, outside the package, by `impl: module:Class` and `tp: module:Class`: the same
  losses as the default run's first steps (warmup: the same learning rates) and nothing unplanned."""
  s = finish(launch(tmp_path, "schedule.impl=user_schedule:ExplicitReduce", "schedule.tp=user_schedule:NamedAllGatherTP",
                    "train.steps=3", "tensorboard=false", cwd=ROOT / "examples"), tmp_path)
  np.testing.assert_allclose(s["losses"], default_run[1]["losses"][:3], rtol=1e-6)
  assert s["audit"]["unplanned"] == [] and s["audit"]["collectives"] > 0


def test_hsdp_mesh_trains_like_the_2d_run(default_run, tmp_path):
  """mesh=2x2x2 from the command line (HSDP: weights replicated over data): the default run's losses, the
  `data` axis in summary.json's mesh, ledger (the gradient all-reduce over data) and prediction, nothing
  unplanned, and the sweep row's bytes_data."""
  from shardlab.sweep import job_row
  s = finish(launch(tmp_path, "mesh=2x2x2", "train.steps=3", "tensorboard=false"), tmp_path)
  np.testing.assert_allclose(s["losses"], default_run[1]["losses"][:3], rtol=1e-5)
  assert s["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2} and s["audit"]["unplanned"] == []
  assert (tmp_path / "timeline.json").is_file() and not (tmp_path / "timeline.png").exists()   # figures=false
  assert s["comm"]["all-reduce"]["data"]["bytes"] > 0 and s["prediction"]["t_comm_s"]["data"] > 0
  (tmp_path / ".hydra").mkdir(exist_ok=True)
  assert job_row(tmp_path)["bytes_data"] == sum(
      r["bytes"] for rows in s["comm"].values() for a, r in rows.items() if "data" in a.split("+"))
