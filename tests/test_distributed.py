"""Several processes, one mesh: 2 local processes with 4 fake CPU devices each (jax.distributed, gloo) train
like 1 process with 8; only process 0 writes the run's files; both write their checkpoint shards."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, free_port
from test_checkpoint import RUN, ref, run  # noqa: F401  (ref: the 1-process, 8-device run, shared)

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md


def test_two_processes_train_like_one(tmp_path, request):
  port, ck = free_port(), tmp_path / "ck"
  logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
  procs = [subprocess.Popen([sys.executable, "-m", "shardlab", *RUN, "cpu_devices=4", "checkpoint.every=2",
                             f"checkpoint.dir={ck}", f"hydra.run.dir={tmp_path / f'p{i}'}",
                             f"distributed.coordinator=localhost:{port}", "distributed.num_processes=2",
                             f"distributed.process_id={i}"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=logs[i])
           for i in range(2)]
  _, ref_s = request.getfixturevalue("ref")   # made (if need be) while the two processes start
  for i, p in enumerate(procs):
    p.wait(timeout=600)
    logs[i].close()
    assert p.returncode == 0, (tmp_path / f"p{i}.log").read_text()[-3000:]
  s = json.loads((tmp_path / "p0" / "summary.json").read_text())
  assert s["status"] == "ok" and s["devices"] == 8 and s["mesh"] == {"fsdp": 4, "tensor": 2}
  np.testing.assert_allclose(s["losses"], ref_s["losses"], rtol=1e-6)
  assert not (tmp_path / "p1" / "summary.json").exists() and not (tmp_path / "p1" / "metrics.jsonl").exists()
  assert sorted(os.listdir(ck)) == [".owner", "2", "4", "6"]        # claimed by process 0's run dir
  assert json.loads((ck / ".owner").read_text())["run_dir"] == str((tmp_path / "p0").resolve())


