"""Sweeps as researchers run them: a multirun's summary has one correct row per job, a failed job is a row
with its error, jobs with different device counts each get a process (submitit_local launcher), the report
turns the sweep into markdown and figures; and the same seed gives the same per-step losses on every mesh
(4x2, 1x8, 8x1) and on one device."""
import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md


def _sweep(out, *overrides, returncode=0):
  r = subprocess.run([sys.executable, "-m", "shardlab", "-m", "progress=false", "train.steps=2",
                      f"hydra.sweep.dir={out}", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == returncode, r.stderr[-3000:]   # 1: some job failed (after the summary was written)
  if returncode == 0:                                   # the last line says where the results went
    assert f"shardlab: sweep {out}: " in r.stdout and "jobs ok; " in r.stdout and "summary.md" in r.stdout, r.stdout[-2000:]
  with open(out / "summary.csv") as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    row["args"] = dict(o.split("=", 1) for o in row["overrides"].split())
    if row["status"] == "ok":
      row["losses"] = json.loads((out / row["job"] / "summary.json").read_text())["losses"]
  return rows


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
  out = tmp_path_factory.mktemp("grid")
  return out, _sweep(out, "schedule=baseline,collective_matmul", "mesh=4x2,1x8", "profile.enabled=true",
                     "profile.start_step=1", "profile.steps=1")


def test_sweep_summary_has_a_row_per_job(grid):
  out, rows = grid
  assert [(r["args"]["schedule"], r["args"]["mesh"]) for r in rows] == [
      (s, m) for s in ("baseline", "collective_matmul") for m in ("4x2", "1x8")]
  assert all(r["status"] == "ok" for r in rows)
  for r in rows:
    np.testing.assert_allclose(r["losses"], rows[0]["losses"], rtol=1e-5, err_msg=r["job"])
    assert float(r["final_loss"]) == r["losses"][-1]
    fsdp, tensor = map(int, r["args"]["mesh"].split("x"))
    assert (int(r["bytes_fsdp"] or 0) > 0) == (fsdp > 1) and (int(r["bytes_tensor"] or 0) > 0) == (tensor > 1)
    assert int(r["memory_peak_bytes"]) > 0
  assert (out / "summary.md").read_text().count("| ok |") == 4
  assert all(list((out / r["job"] / "profile").rglob("*.xplane.pb")) for r in rows)   # profile.enabled


def test_report_draws_the_sweep(grid):
  out, _ = grid
  r = subprocess.run([sys.executable, "-m", "shardlab.report", str(out)], cwd=ROOT, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  report = (out / "report.md").read_text()
  for fig in ("step_time.png", "bytes.png", "memory.png"):
    assert (out / fig).stat().st_size > 10_000 and f"]({fig})" in report
  assert report.count("\n| ") >= 5   # header + 4 runs
  timelines = sorted(p.name for p in out.glob("timeline_*.png"))      # every run's, none left out
  assert len(timelines) == 4 and all(f"]({t})" in report for t in timelines), timelines


def test_failed_jobs_are_rows_and_device_counts_differ_per_process(grid, tmp_path):
  """submitit_local runs each job in its own process: 1 and 8 fake devices in one sweep. The jobs whose mesh
  does not match their device count fail with their one-line error; the sweep goes on, reports them, and exits
  with status 1."""
  rows = _sweep(tmp_path, "hydra/launcher=submitit_local", "mesh=8x1,1x1", "cpu_devices=8,1", returncode=1)
  by = {(r["args"]["mesh"], r["args"]["cpu_devices"]): r for r in rows}
  assert len(by) == 4
  for mesh, n in (("8x1", "8"), ("1x1", "1")):
    r = by[(mesh, n)]
    assert r["status"] == "ok", r["error"]
    np.testing.assert_allclose(r["losses"], grid[1][0]["losses"], rtol=1e-5, err_msg=f"{mesh} on {n} devices")
  for mesh, n in (("8x1", "1"), ("1x1", "8")):
    r = by[(mesh, n)]
    assert r["status"] == "error" and "ConfigError: mesh.fsdp=" in r["error"], r


def test_sweep_columns_add_a_bytes_column_for_every_axis_present():
  """bytes_data, bytes_fsdp and bytes_tensor always (their names unchanged); another declared axis's column
  when a job has it, in the registry's order."""
  from shardlab.sweep import COLUMNS, columns
  assert columns([{"job": "0"}]) == COLUMNS
  got = columns([{"job": "0", "bytes_pipeline": 1, "bytes_context": 2}])
  axes = [c for c in got if c.startswith("bytes_")]
  assert axes == ["bytes_pipeline", "bytes_data", "bytes_fsdp", "bytes_context", "bytes_tensor"]
