"""Every `python -m shardlab...` command in README.md and docs/ is in COMMANDS below, and the ones cheap enough run
here as written: the planner's (pure Python, in-process) and the target dry runs (a subprocess each; skipped
without the extra that compiles for that target), the latter checked against the numbers docs/targets.md quotes.
Training runs and sweeps are listed with the test that runs the same entry point at test size."""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# command (as written, continuations joined, comment dropped) -> how this test treats it
COVERED = "trains or sweeps for minutes: tests/test_cli.py, test_sweep.py, test_checkpoint.py run these entry points"
COMMANDS = {
    # README.md
    "python -m shardlab": COVERED,
    "python -m shardlab mesh=2x4 schedule=collective_matmul train.steps=50": COVERED,
    "python -m shardlab mesh.fsdp=8 mesh.tensor=1 schedule=fsdp_prefetch schedule.remat=full": COVERED,
    "python -m shardlab mesh=2x2x2": COVERED,
    "python -m shardlab model=tiny_moe mesh.expert=2 mesh.fsdp=2 mesh.tensor=2 expert=all_gather": COVERED,
    "python -m shardlab mesh.context=2 mesh.fsdp=2": COVERED,
    "python -m shardlab mesh.context=4 mesh.fsdp=1 context=ulysses": COVERED,
    "python -m shardlab mesh.context=8 mesh.fsdp=1 mesh.tensor=1 context=ring context.load_balance=true": COVERED,
    "python -m shardlab mesh.context=8 mesh.fsdp=1 mesh.tensor=1 context=usp context.ulysses=2": COVERED,
    "python -m shardlab -m schedule=baseline,fsdp_prefetch,keep_gathered mesh=4x2,2x4": COVERED,
    "python -m shardlab mesh.pipeline=4 mesh.fsdp=2 mesh.tensor=1 model.n_layers=8 pipeline=1f1b "
    "pipeline.microbatches=8": COVERED,
    "python -m shardlab -m mesh.pipeline=4 mesh.fsdp=2 mesh.tensor=1 model.n_layers=8 pipeline.microbatches=8 "
    "pipeline=gpipe,1f1b,eager_1f1b,interleaved,zb_h1 dry_run=true": "pipeline sweep",
    "python -m shardlab.plan model=llama3_70b hardware=h100 devices=64 precision=bf16 "
    "train.global_batch_tokens=4194304": "plan",
    "python -m shardlab.plan model=llama3_8b model.seq_len=32768 train.batch_size=1 mesh.fsdp=8 mesh.tensor=1 "
    "precision=bf16 model.attention=dot_product hardware=h100 context_search=true": "plan",
    "python -m shardlab -m schedule=baseline,fsdp_prefetch,collective_matmul,gspmd mesh=4x2,2x4": COVERED,
    "python -m shardlab.report multirun/DATE/TIME": "needs that sweep's directory: tests/test_sweep.py",
    # docs/planning.md
    "python -m shardlab.plan model=llama3_70b hardware=h100 devices=64 precision=bf16 "
    "train.global_batch_tokens=4194304 rows=8": "plan",
    "python -m shardlab.plan model=llama2_13b hardware=tpu_v5p mesh.fsdp=1024 mesh.tensor=4 mesh.fsdp_ici_axes=2 "
    "train.global_batch_tokens=3000000 precision=bf16 schedule.gather_dtype=compute schedule.remat=full": "plan",
    "python -m shardlab.plan model=llama2_13b model.seq_len=32768 hardware=tpu_v5p devices=4096 "
    "train.global_batch_tokens=3000000 train.mfu=0.4 precision=bf16 schedule.gather_dtype=compute "
    "schedule.remat=full plot=curve.png": "plan",
    # docs/targets.md
    "python -m shardlab dry_run=true compile_for=target hardware=h100 schedule=fsdp_prefetch": "target",
    "python -m shardlab dry_run=true compile_for=target hardware=h100 mesh.fsdp=32 mesh.tensor=2 "
    "train.batch_size=32": "target",
    "python -m shardlab dry_run=true compile_for=target hardware=tpu_v5p mesh.fsdp=16 mesh.tensor=4 "
    "train.batch_size=32": "target",
    "python -m shardlab dry_run=true compile_for=target hardware=h100 model=llama2_7b mesh=8x1 precision=bf16 "
    "train.batch_size=32 model.attention=dot_product schedule=fsdp_prefetch "
    "schedule.remat=save_matmuls_attn_out xla=maxtext_a3": "target",
    # docs/analysis.md
    "python -m shardlab dry_run=true compile_for=target hardware=h100 model=llama3_8b model.seq_len=2048 "
    "precision=bf16 train.batch_size=4 schedule=fsdp_prefetch mesh=4x2": "target",
    # docs/failure_handling.md, docs/schedules.md
    "python -m shardlab hydra.run.dir=outputs/r1 train.steps=200 checkpoint.every=50": COVERED,
    "python -m shardlab hydra.run.dir=outputs/r1 train.steps=200 checkpoint.every=50 checkpoint.resume=true": COVERED,
    "python -m shardlab mesh=1x8 train.steps=300 checkpoint.resume=true checkpoint.dir=outputs/r1/checkpoints": COVERED,
    "python -m shardlab schedule.impl=user_schedule:ExplicitReduce schedule.tp=user_schedule:NamedAllGatherTP": COVERED,
    # docs/pipeline.md
    "python -m shardlab.pipeline export schedule=zb_h1 stages=4 microbatches=8 out=zb_h1.csv": "pipeline tool",
    "python -m shardlab.pipeline show table=zb_h1.csv": "pipeline tool",
    "python -m shardlab pipeline.table=zb_h1.csv mesh.pipeline=4 mesh.fsdp=2 mesh.tensor=1 model.n_layers=8":
    "trains a CSV table: tests/test_pipeline.py trains one in-process, test_fuzz.py checks the settings; the "
    "table itself comes from the export above (test_the_pipeline_tool_runs_as_written)",
    # docs/experts.md
    "python -m shardlab.plan model=mixtral_8x7b hardware=h100_multinode devices=64 precision=bf16 "
    "train.batch_size=128 expert_search=true": "plan",
    # docs/calibrate.md
    "python -m shardlab.calibrate out=my_machine.yaml": "measures for a minute: tests/test_calibrate.py runs it "
    "with grid=quick (in-process and as a command)",
    "python -m shardlab.calibrate out=h200_measured.yaml": "a GPU's calibration: experiments/calibrate/device.sh",
    "python -m shardlab hardware.file=my_machine.yaml cpu_devices=1 mesh=1x1 model.d_model=512 model.n_layers=4":
    "needs a calibrated file: tests/test_calibrate.py reads one with hardware.file",
}
SLURM = "python -m shardlab -m hydra/launcher=slurm"   # needs a SLURM cluster: listed by its prefix


def doc_commands() -> dict[str, str]:
  """{command: file} of every `python -m shardlab...` command in a ```bash block (a line, or a part of one between
  `&&`), continuations joined, comments dropped."""
  out = {}
  for path in DOCS:
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
      for line in (part for l in block.replace("\\\n", " ").splitlines() for part in l.split("&&")):
        words = shlex.split(line, comments=True)
        if words[:3] == ["python", "-m", "shardlab"] or words[:2] == ["python", "-m"] and \
            words[2].startswith("shardlab."):
          out[" ".join(words)] = path.name
  return out


def test_every_documented_command_is_listed():
  found = doc_commands()
  missing = [f"{f}: {c}" for c, f in found.items() if c not in COMMANDS and not c.startswith(SLURM)]
  assert not missing, "add these to COMMANDS (and run them if cheap):\n" + "\n".join(missing)
  gone = [c for c in COMMANDS if c not in found]
  assert not gone, "no longer in the docs:\n" + "\n".join(gone)


@pytest.mark.parametrize("command", [c for c, k in COMMANDS.items() if k == "plan"])
def test_planner_commands_run_as_written(command, tmp_path, monkeypatch, capsys):
  from shardlab.plan import main
  monkeypatch.chdir(tmp_path)
  assert main(shlex.split(command)[3:]) == 0, capsys.readouterr().err
  out = capsys.readouterr().out
  assert "prediction" in out and "Warning" not in out


# What docs/targets.md quotes of the MaxText Llama2-7B dry run: predicted step time, compiled peak per device.
MAXTEXT = {"step_s": 1.335, "peak_gb": 69.5}


@pytest.mark.parametrize("command", [c for c, k in COMMANDS.items() if k == "target"])
def test_target_dry_runs_run_as_written(command, tmp_path):
  tpu = "hardware=tpu" in command
  if importlib.util.find_spec("libtpu" if tpu else "jax_cuda12_plugin") is None:
    pytest.skip(f"needs the {'tpu' if tpu else 'cuda12'} extra: pip install 'shardlab[{'tpu' if tpu else 'cuda12'}]'")
  r = subprocess.run([sys.executable, *shlex.split(command)[1:], "progress=false", "figures=false",
                      f"hydra.run.dir={tmp_path}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  lines = r.stdout.splitlines()
  assert lines[-1].endswith("ok (dry run: compiled and analyzed, no step run)")
  s = json.loads((tmp_path / "summary.json").read_text())
  from shardlab.run import numbers
  head = lines[-1 - len(numbers(s))]
  assert head.startswith("shardlab: prediction for ") and "calibrated model" in head
  assert s["memory"]["fits"] and s["prediction"]["model"].startswith("calibrated")
  assert s["overlap"]["available"]                   # TPU programs too (docs/targets.md)
  assert s["ledger"]["differences"] == [] and s["audit"]["unplanned"] == []   # every byte explained
  if "model=llama3_8b" in command:                   # docs/analysis.md's table of rewrites
    narrowed = [r for r in s["ledger"]["rewrites"] if r["rewrite"] == "dtype narrowed"]
    assert [(r["program"]["bytes"], r["compiled"]["bytes"]) for r in narrowed] == [(21726769152, 10863384576)]
  if "model=llama2_7b" in command:
    assert round(s["prediction"]["t_overlapped_s"], 2) == round(MAXTEXT["step_s"], 2)
    assert round(s["memory"]["peak"] / 1e9, 1) == MAXTEXT["peak_gb"]
    doc = (ROOT / "docs" / "targets.md").read_text()
    assert f"predicted at {MAXTEXT['step_s']:.3f} s" in doc and f"{MAXTEXT['peak_gb']} GB compiled for gpu" in doc


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c, k in COMMANDS.items() if k == "pipeline sweep"])
def test_the_pipeline_sweep_answers_which_schedule(command, tmp_path):
  """The README's pipeline sweep, as written (dry runs): summary.md has each schedule's predicted step, bubble and
  microbatches in flight without opening a JSON, and each run's printed step is its pipeline.png's."""
  r = subprocess.run([sys.executable, *shlex.split(command)[1:], "progress=false", f"hydra.sweep.dir={tmp_path}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  md = (tmp_path / "summary.md").read_text()
  head = next(l for l in md.splitlines() if l.startswith("| job"))
  cols = [c.strip() for c in head.strip("|").split("|")]
  rows = [[c.strip() for c in l.strip("|").split("|")] for l in md.splitlines() if l.startswith("| ") and l != head]
  rows = [dict(zip(cols, r)) for r in rows if len(r) == len(cols) and r[0][:1].isdigit()]
  assert [r["overrides"].split("pipeline=")[-1].split()[0] for r in rows] == \
      ["gpipe", "1f1b", "eager_1f1b", "interleaved", "zb_h1"]
  assert all(r["pipeline_bubble"].endswith("%") and r["predicted_step_s"] and "/" in r["pipeline_in_flight"]
             for r in rows), md
  for job in sorted(p for p in tmp_path.iterdir() if (p / "summary.json").exists()):
    s = json.loads((job / "summary.json").read_text())
    assert s["prediction"]["t_overlapped_s"] == s["pipeline_prediction"]["step_s"] and (job / "pipeline.png").exists()


def test_the_pipeline_tool_runs_as_written(tmp_path, monkeypatch, capsys):
  """docs/pipeline.md's export and show, in order, in one directory: the CSV is written, read back and placed."""
  from shardlab.pipeline import main
  monkeypatch.chdir(tmp_path)
  for command in [c for c, k in COMMANDS.items() if k == "pipeline tool"]:
    assert main(shlex.split(command)[3:]) == 0, capsys.readouterr().err
  out = capsys.readouterr().out
  assert (tmp_path / "zb_h1.csv").read_text().startswith("0F0,") and "4 stages, 1 chunk(s) per stage, 8 microbatches" in out
  # a file already there is not written over unasked (nor is the plan's json=): one line, exit 2, the file kept
  export = shlex.split(next(c for c, k in COMMANDS.items() if k == "pipeline tool" and " export " in c))[3:]
  (tmp_path / "zb_h1.csv").write_text("my notes")
  assert main(export) == 2 and "zb_h1.csv already exists; pick another path or add overwrite=true" in \
      capsys.readouterr().err and (tmp_path / "zb_h1.csv").read_text() == "my notes"
  assert main([*export, "overwrite=maybe"]) == 2 and "overwrite=maybe: true or false" in capsys.readouterr().err
  assert main([*export, "overwrite=true"]) == 0 and (tmp_path / "zb_h1.csv").read_text().startswith("0F0,")
  from shardlab import plan
  assert plan.main(["json=zb_h1.csv"]) == 2 and "json=zb_h1.csv: zb_h1.csv already exists" in capsys.readouterr().err
  assert plan.main(["json=no/such/dir.json"]) == 2 and "the directory no/such does not exist" in capsys.readouterr().err
