"""No hang, no traceback, no silent nonsense: a table of bad settings (each: exit 2, one line naming the setting,
no traceback, nothing written to the run dir), run through the real CLI entry point `shardlab.run.cli` in this
process (one Python start for the whole table; a few also as real `python -m shardlab` processes to prove the
wiring), and the run-time faults that used to hang, each bounded in time."""
import contextlib
import importlib.util
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
SLOW = ("import sys, time, shardlab.data as D, shardlab.run as R; b = D.MarkovData.batch; "
        "D.MarkovData.batch = lambda self, i: (time.sleep({s}), b(self, i))[1]; R.cli()")


def _record(tmp, **settings):
  """A checkpoint's JSON record, as Checkpointer.save writes it, at <tmp>/run/checkpoints/<step>/meta/metadata."""
  from conftest import compose
  from shardlab.config import to_config
  from shardlab.preflight import record_settings
  step = settings.pop("step", 6)
  rec = {"step": step, "losses": [5.5] * step, "settings": record_settings(to_config(compose()))}
  rec["settings"].update(settings)
  meta = tmp / "run" / "checkpoints" / str(step) / "meta"
  meta.mkdir(parents=True)
  (meta / "metadata").write_text(json.dumps(rec))


def _finished(tmp):
  """A finished run's files in <tmp>/run: summary.json (ok, 6 steps) and metrics.jsonl."""
  (tmp / "run").mkdir()
  (tmp / "run" / "summary.json").write_text(json.dumps({"status": "ok", "losses": [5.5] * 6}))
  (tmp / "run" / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 5.5}) + "\n" for i in range(6)))


def _file(tmp, name):
  (tmp / name).write_text("a file")
  return tmp / name


@contextlib.contextmanager
def _held_lock(tmp):
  import fcntl
  (tmp / "run").mkdir()
  with open(tmp / "run" / ".lock", "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.write("pid 1 on elsewhere\n")
    f.flush()
    yield


# (overrides, expected text in the one line); {tmp} is the test's temporary directory. Setups: see SETUP.
BAD = [
    (["train.batch_size=0"], "train.batch_size=0: must be >= 1"),
    (["train.batch_size=-4"], "train.batch_size=-4"),
    (["train.lr=-1"], "train.lr=-1.0: must be > 0"),
    (["train.lr=0"], "train.lr=0.0"),
    (["train.lr=nan"], "train.lr=nan"),
    (["train.lr=inf"], "train.lr=inf"),
    (["train.warmup_steps=-1"], "train.warmup_steps=-1"),
    (["train.b1=-0.1"], "train.b1=-0.1"),
    (["train.b1=1.0"], "train.b1=1.0: must be in [0, 1)"),
    (["train.b2=1.5"], "train.b2=1.5"),
    (["train.b2=1"], "train.b2=1"),
    (["train.adam_eps=0"], "train.adam_eps=0"),
    (["train.weight_decay=-0.1"], "train.weight_decay=-0.1"),
    (["train.grad_clip=0"], "train.grad_clip=0.0"),
    (["train.grad_clip=-1"], "train.grad_clip=-1.0"),
    (["train.steps=0"], "train.steps=0"),
    (["train.seed=-1"], "train.seed=-1"),
    (["train.seed=4294967296"], "train.seed=4294967296"),
    (["train.global_batch_tokens=-1"], "train.global_batch_tokens=-1"),
    (["train.mfu=-0.5"], "train.mfu=-0.5"),
    (["train.mfu=1.5"], "train.mfu=1.5"),
    (["model.seq_len=1"], "model.seq_len=1"),
    (["model.seq_len=0"], "model.seq_len=0"),
    (["model.d_model=0"], "model.d_model=0"),
    (["model.d_ff=-8"], "model.d_ff=-8"),
    (["model.n_layers=0"], "model.n_layers=0"),
    (["model.n_heads=0"], "model.n_heads=0"),
    (["model.vocab_size=0"], "model.vocab_size=0"),
    (["model.rope_theta=0"], "model.rope_theta=0"),
    (["model.init_std=0"], "model.init_std=0"),
    (["model.norm_eps=-1e-6"], "model.norm_eps=-1e-06"),
    (["model.d_model=60"], "model.d_model=60 is not divisible by model.n_heads=8"),
    (["model.kind=moe"], "model.kind=moe"),
    (["model.kind=ffn", "schedule.remat=save_qkv_proj"], "schedule.remat=save_qkv_proj: the FFN-only model"),
    (["model.kind=ffn", "mesh=1x8", "model.d_ff=100"], "model.d_ff=100 is not divisible by mesh.tensor=8"),
    (["mesh.fsdp=0"], "mesh.fsdp=0"),
    (["mesh.tensor=-2"], "mesh.tensor=-2"),
    (["mesh.fsdp_ici_axes=0"], "mesh.fsdp_ici_axes=0"),
    (["mesh.tensor_ici_axes=0"], "mesh.tensor_ici_axes=0"),
    (["mesh.fsdp=3", "mesh.tensor=3"], "mesh.fsdp=3 x mesh.tensor=3 = 9 devices, but 8"),
    (["mesh=1x8", "model.n_heads=4"], "model.n_heads=4 is not divisible by mesh.tensor=8"),
    (["schedule.prefetch=-1"], "schedule.prefetch=-1"),
    (["schedule.microbatches=0"], "schedule.microbatches=0"),
    (["schedule.tp=butterfly"], "schedule.tp=butterfly"),
    (["schedule.tp=shardlab.schedules.tp:Butterfly"], "schedule.tp=shardlab.schedules.tp:Butterfly: shardlab.schedules.tp has no Butterfly"),
    (["schedule.impl=no_such_module:Mine"], "schedule.impl=no_such_module:Mine: cannot import no_such_module"),
    (["schedule.impl=mine"], "schedule.impl=mine: unknown; known: explicit, gspmd, or package.module:Class"),
    (["schedule.grad_reduce=later"], "schedule.grad_reduce=later"),
    (["schedule.remat=everything"], "schedule.remat=everything"),
    (["context.kernel=triton"], "context.kernel=triton: choose one of auto, jax, pallas"),
    (["context.load_balance=spiral"], "context.load_balance=spiral: choose false, true (zigzag), zigzag or striped"),
    (["mesh.context=4", "mesh.fsdp=2", "mesh.tensor=1", "context=usp", "context.ulysses=3"],
     "context.ulysses=3: context=usp needs a Ulysses degree that divides mesh.context=4"),
    (["mesh.pipeline=2", "mesh.fsdp=2", "model.n_layers=4", "pipeline=interleaved", "pipeline.microbatches=4",
      "pipeline.consecutive=1"], "pipeline.consecutive=1: groups of at least mesh.pipeline=2 microbatches"),
    (["mesh.pipeline=2", "mesh.fsdp=2", "model.n_layers=4", "pipeline=dualpipev"],
     "pipeline=dualpipev needs at least 2 x mesh.pipeline = 4 microbatches"),
    (["mesh.pipeline=2", "mesh.fsdp=2", "model.n_layers=4", "pipeline=zb_v", "pipeline.virtual_stages=1"],
     "pipeline=zb_v runs two chunks per stage in a V (stage s holds model stages s and 2P - 1 - s): set "
     "pipeline.virtual_stages=2, not 1"),
    (["schedule=deferred_reduce", "train.batch_size=10", "mesh=2x4"], "mesh.fsdp * schedule.microbatches"),
    (["hardware.peak_flops=-1"], "hardware.peak_flops=-1.0"),
    (["hardware.ici_bandwidth=0"], "hardware.ici_bandwidth=0.0"),
    (["hardware.hbm_bytes=0"], "hardware.hbm_bytes=0.0"),
    (["hardware.hbm_bandwidth=0"], "hardware.hbm_bandwidth=0.0"),
    (["hardware.hop_latency_s=-1e-6"], "hardware.hop_latency_s"),
    (["hardware.file={tmp}/none.yaml"], "no such file (write one with `python -m shardlab.calibrate"),
    (["hardware.file={tmp}/none.yaml", "hardware.peak_flops=1"], "hardware.peak_flops= beside hardware.file="),
    (["hardware.dcn_bandwidth=-1"], "hardware.dcn_bandwidth=-1.0"),
    (["hardware.domain_devices=-1"], "hardware.domain_devices=-1"),
    (["hardware.link_efficiency=0"], "hardware.link_efficiency=0.0: must be > 0"),
    (["hardware.gemm_tile=0"], "hardware.gemm_tile=0: must be >= 1"),
    (["hardware.file={tmp}/bad_hw.yaml"], "bad_hw.yaml: link_efficiency: 0.0 must be > 0 (achieved bus bandwidth "
                                          "over ici_bandwidth); e.g. link_efficiency: 1 in that file"),
    (["data.branching=0"], "data.branching=0"),
    (["data.branching=1000"], "data.branching=1000"),
    (["precision.compute_dtype=float16"], "precision.compute_dtype=float16"),
    (["precision.param_dtype=bfloat16"], "precision.param_dtype"),
    (["checkpoint.every=-1"], "checkpoint.every=-1"),
    (["checkpoint.keep=0"], "checkpoint.keep=0"),
    (["checkpoint.dir=''"], "checkpoint.dir=''"),
    (["checkpoint.dir=/proc/shardlab_ck"], "checkpoint.dir=/proc/shardlab_ck: cannot write there"),
    (["checkpoint.dir={tmp}/ck_file"], "is a file"),
    (["distributed.num_processes=0"], "distributed.num_processes=0: must be >= 1"),
    (["distributed.num_processes=2"], "needs distributed.coordinator=HOST:PORT"),
    (["distributed.coordinator=node0"], "distributed.coordinator=node0: must be HOST:PORT"),
    (["distributed.coordinator=localhost:1", "distributed.num_processes=2", "distributed.process_id=2"],
     "distributed.process_id=2"),
    (["distributed.timeout_s=0"], "distributed.timeout_s=0"),
    (["distributed.heartbeat_timeout_s=0"], "distributed.heartbeat_timeout_s=0"),
    (["profile.steps=0"], "profile.steps=0"),
    (["profile.start_step=-1"], "profile.start_step=-1"),
    (["cpu_devices=0"], "cpu_devices=0"),
    (["+typo=1"], "typo: no such setting"),
    (["+xla.flags.xla_bogus_option=true"], "No such compile option: 'xla_bogus_option'"),
    (["+xla.flags.xla_gpu_all_reduce_combine_threshold_bytes=64MB"], "xla.flags: INVALID_ARGUMENT: While setting "
     "option xla_gpu_all_reduce_combine_threshold_bytes, '64MB' is not a valid int64 value"),
    (["xla=maxtext_v5p"], "xla.flags.xla_tpu_enable_async_collective_fusion_fuse_all_gather: a libtpu option; only a "
     "target compile for a TPU preset takes it (compile_for=target hardware=tpu_v5p or tpu_v5e)"),
    # libtpu checks its own options; where it is not installed (the quick start's `.[test]`), the missing extra is
    # the one line, before any option is looked at
    (["dry_run=true", "compile_for=target", "hardware=tpu_v5p", "+xla.flags.xla_tpu_bogus_option=true"],
     "No such compile option: 'xla_tpu_bogus_option'" if importlib.util.find_spec("libtpu") else
     "compile_for=target with hardware=tpu_v5p needs the tpu compiler (libtpu is not installed)"),
    (["+train.typo=1"], "train.typo: no such setting"),
    (["schedule.prefech=1"], "Key 'prefech' not in 'ScheduleConfig'"),
    (["mesh.fsdp=two"], "mesh.fsdp=two"),
    (["model=llama3_8b"], "model=llama3_8b on mesh 4x2 needs"),
    (["hydra.run.dir={tmp}/run_file"], "is a file, not a directory"),
    (["checkpoint.resume=true", "train.seed=1"], "train.seed=1 (checkpoint: 0)"),
    (["checkpoint.resume=true", "model.d_ff=256"], "model.d_ff=256 (checkpoint: 128)"),
    (["checkpoint.resume=true", "train.batch_size=32"], "train.batch_size=32 (checkpoint: 16)"),
    (["checkpoint.resume=true", "data.branching=8"], "data.branching=8 (checkpoint: 4)"),
    (["checkpoint.resume=true", "train.lr=0.5"], "train.lr=0.5 (checkpoint: 0.02)"),
    (["checkpoint.resume=true", "train.steps=4"], "train.steps=4: the checkpoint in"),
    ([], "another run (pid 1 on elsewhere) is writing this directory"),
    (["distributed.auto=true"], "SLURM_PROCID"),
    (["distributed.auto=true"], "SLURM_STEP_NUM_TASKS='two' is not a task count"),
    (["hydra.run.dir=/proc/shardlab_run", "checkpoint.enabled=false"],
     "hydra.run.dir=/proc/shardlab_run: cannot make it in /proc"),
    (["hydra.run.dir=/proc/shardlab_run"], "hydra.run.dir=/proc/shardlab_run: cannot make it in /proc"),
    (["hydra.run.dir=''"], "hydra.run.dir='': empty"),
    (["hydra.run.dir"], "Error parsing override 'hydra.run.dir' (missing EQUAL at '<EOF>'); write each setting as key=value"),
    (["--bogus-flag"], "unknown option --bogus-flag: settings are key=value"),
    (["xla=nonexistent"], "Could not find 'xla/nonexistent'; choose one of: maxtext_a3, maxtext_v5p, none"),
    (["model.vocab_size=1", "mesh=8x1"], "data.branching=4 is more than model.vocab_size=1 (each token's successors are "
     "drawn from the vocabulary); choose data.branching <= 1 or model.vocab_size >= 4"),
    (["profile.enabled=true", "train.steps=1"], "profile.start_step=3: the run has only train.steps=1 steps"),
    (["schedule.impl=os:path"], "schedule.impl=os:path: is a module, not a class"),
    (["schedule.tp=os:path"], "schedule.tp=os:path: is a module, not a class"),
    (["schedule.impl=shardlab.mesh:ConfigError"], "ConfigError is not a Schedule: it has no honours, "),
    (["schedule.tp=shardlab.mesh:ConfigError"], "ConfigError is not a TPContraction: it has no honours, columns, "),
    (["train.seed=1"], "holds another run (summary.json: status ok, 6 steps); a new run would overwrite it"),
    (["checkpoint.every=2"], "holds checkpoints of another run (6); a fresh run would mix with them"),
    # a mixture of experts (conf/model/tiny_moe.yaml: 8 experts, top 2)
    (["model=tiny_moe", "model.top_k=9"], "model.top_k=9: each token picks between 1 and model.n_experts=8 experts"),
    (["model=tiny_moe", "model.n_experts=6", "mesh.expert=4", "mesh.fsdp=2", "mesh.tensor=1"],
     "model.n_experts=6 is not divisible by mesh.expert=4"),
    (["model=tiny_moe", "expert=ragged", "expert.cpu_fallback=false", "mesh.expert=2", "mesh.fsdp=2"],
     "expert=ragged with expert.cpu_fallback=false cannot run on a CPU"),
    (["model=tiny_moe", "expert.capacity_factor=-1"], "expert.capacity_factor=-1.0: must be >= 0"),
    (["model=tiny_moe", "expert=all_gather", "expert.capacity_factor=1.25", "mesh.expert=2", "mesh.fsdp=2"],
     "expert=all_gather is dropless"),
    (["mesh.expert=2", "mesh.fsdp=2"], "mesh.expert=2 splits a MoE layer's experts, but model.n_experts=0"),
    (["model=tiny_moe", "schedule=gspmd", "expert.capacity_factor=1.25"],
     "the gspmd schedule runs the MoE layer dropless"),
    (["model=tiny_moe", "expert=hierarchical", "mesh.expert=2", "mesh.fsdp=2"],
     "expert=hierarchical dispatches over two mesh axes (across nodes, then inside)"),
    (["model=tiny_moe", "expert.chunks=3", "mesh.expert=2", "mesh.fsdp=2"], "expert.chunks=3 does not divide the"),
    (["model=tiny_moe", "schedule=gspmd", "expert.chunks=2"], "expert.chunks=2: schedule=gspmd runs no dispatcher"),
    (["model=tiny_moe", "model.top_k=0"], "model.top_k=0: each token picks between 1 and model.n_experts=8 experts; "
                                          "choose top_k between 1 and 8"),
    (["model=tiny_moe", "expert.capacity_factor=inf"], "expert.capacity_factor=inf: must be >= 0"),
    (["model=tiny_moe", "model.router_skew=inf"], "model.router_skew=inf: must be >= 0"),
    (["model=tiny_moe", "model.router_aux_loss=nan"], "model.router_aux_loss=nan: must be >= 0"),
    # a schedule in torch's CSV format (pipeline.table): the file, its ranks and what it fixes, checked
    (["pipeline.table=no_such_table.csv", "mesh.pipeline=2", "mesh.fsdp=4", "model.n_layers=4"],
     "pipeline.table=no_such_table.csv: cannot read it"),
    (["pipeline.table={tmp}/latin1.csv", "mesh.pipeline=2", "mesh.fsdp=4", "model.n_layers=4"],
     "latin1.csv: not a text CSV (byte 8 is not UTF-8; save it as UTF-8 text)"),
    (["pipeline.table=tests/assets/torchtitan-2-rank.csv", "mesh.pipeline=4", "mesh.fsdp=2", "model.n_layers=8"],
     "has 2 ranks (rows), mesh.pipeline=4: set mesh.pipeline=2"),
    (["pipeline.table=tests/assets/torchtitan-2-rank.csv", "pipeline.microbatches=4", "mesh.pipeline=2",
      "mesh.fsdp=4", "model.n_layers=4"], "runs 8 microbatches, pipeline.microbatches=4"),
]
SETUP = {   # index in BAD -> (make files, environment)
    BAD.index((["checkpoint.dir={tmp}/ck_file"], "is a file")): (lambda t: _file(t, "ck_file"), {}),
    BAD.index((["hydra.run.dir={tmp}/run_file"], "is a file, not a directory")): (lambda t: _file(t, "run_file"), {}),
    **{i: (lambda t, name=name, data=data: (t / name).write_bytes(data), {}) for i, (o, _) in enumerate(BAD)
       for name, data in (("latin1.csv", "0F0,0B0,\xe90\n".encode("latin-1")),
                          ("bad_hw.yaml", b"name: mine\nlink_efficiency: 0.0\n")) if any(name in x for x in o)},
    **{i: (_record, {}) for i, (o, _) in enumerate(BAD) if o[:1] == ["checkpoint.resume=true"]},
    BAD.index(([], "another run (pid 1 on elsewhere) is writing this directory")): (_held_lock, {}),
    BAD.index((["distributed.auto=true"], "SLURM_PROCID")): (None, {"SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "7"}),
    BAD.index((["train.seed=1"], "holds another run (summary.json: status ok, 6 steps); a new run would overwrite "
                                 "it")): (_finished, {}),
    BAD.index((["checkpoint.every=2"], "holds checkpoints of another run (6); a fresh run would mix with them")):
        (_record, {}),
    BAD.index((["distributed.auto=true"], "SLURM_STEP_NUM_TASKS='two' is not a task count")):
        (None, {"SLURM_STEP_NUM_TASKS": "two"}),
}


def _tree(d):
  """Every path under d with its size and mtime: 'nothing written' means this does not change."""
  return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))} if d.exists() else None


def run_cli(argv, env=None):
  """`python -m shardlab ARGV` in this process: (exit code, stderr)."""
  from shardlab import run
  old_argv, old_env = sys.argv, {k: os.environ.get(k) for k in (env or {})}
  sys.argv = ["shardlab", *argv]
  os.environ.update(env or {})
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err):
      try:
        run.cli()
        code = 0
      except SystemExit as e:
        code = e.code
  finally:
    sys.argv = old_argv
    for k, v in old_env.items():
      os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
  return code, err.getvalue()


def test_the_table_is_big_enough():
  assert len(BAD) >= 60 and len({tuple(o) + (m,) for o, m in BAD}) == len(BAD)


def check_case(i, tmp_path) -> str:
  """One row of BAD through the CLI entry point in this process: '' if it held, else what went wrong."""
  overrides, message = BAD[i]
  make, env = SETUP.get(i, (None, {}))
  run = tmp_path / "run"
  with (make(tmp_path) if make is _held_lock else contextlib.nullcontext()):
    if make is not None and make is not _held_lock:
      make(tmp_path)
    before = _tree(run)
    code, err = run_cli([f"hydra.run.dir={run}", *[o.format(tmp=tmp_path) for o in overrides]], env)
    lines = [l for l in err.splitlines() if l.strip()]
    if not (code == 2 and len(lines) == 1 and lines[0].startswith("shardlab: error: ")):
      return f"exit {code}, stderr {err!r}"
    if message not in lines[0]:
      return f"{message!r} not in {lines[0]!r}"
    if "Traceback" in err:
      return f"traceback: {err!r}"
    if _tree(run) != before:
      return "a rejected run wrote into the run directory"
  return ""


def run_table(base: str) -> None:
  """Every row of BAD, each in its own directory under `base`; prints {row: problem} as JSON."""
  from pathlib import Path
  out = {}
  for i in range(len(BAD)):
    d = Path(base) / str(i)
    d.mkdir(parents=True)
    out[i] = check_case(i, d)
  print("RESULTS " + json.dumps(out))


def test_bad_setting_is_exit_2_one_line_nothing_written(tmp_path):
  """The whole table in one fresh Python process (one start for all rows, and Hydra's in-process runs kept away
  from pytest's own capture and logging, which an earlier Hydra compose in the same process leaves them to close)."""
  code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_fuzz; test_fuzz.run_table({str(tmp_path)!r})"
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
  got = [l for l in r.stdout.splitlines() if l.startswith("RESULTS ")]
  assert r.returncode == 0 and got, r.stderr[-3000:]
  results = json.loads(got[-1][len("RESULTS "):])
  assert len(results) == len(BAD)
  bad = {" ".join(BAD[int(i)][0]) or BAD[int(i)][1]: why for i, why in results.items() if why}
  assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_a_check_that_fails_unexpectedly_stops_the_run_in_one_line(tmp_path):
  """An error no check expected (a bug in one, a file system fault) while the settings are checked: one line,
  exit 1, and no run directory (Hydra turns a callback's error into a warning and went on to run and write)."""
  run = tmp_path / "run"
  code = ("import sys; from shardlab import preflight, run\n"
          "def boom(*a, **k): raise RuntimeError('boom\\nsecond line')\n"
          f"preflight.check = boom; sys.argv = ['shardlab', 'train.steps=1', 'hydra.run.dir={run}']; run.cli()")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
  assert r.returncode == 1 and _one_shardlab_line(r.stderr) == (
      "shardlab: error: checking the settings failed: RuntimeError: boom (HYDRA_FULL_ERROR=1 for the traceback)"), \
      r.stderr[-2000:]
  assert not run.exists()


def test_a_changed_setting_resumes_when_allowed(tmp_path):
  """checkpoint.allow_changed=true lets the record check pass (the run would then resume)."""
  from conftest import compose
  from shardlab import preflight
  from shardlab.config import to_config
  _record(tmp_path)
  cfg = to_config(compose("checkpoint.resume=true", "train.seed=1", "checkpoint.allow_changed=true"))
  preflight.check_resume(cfg, tmp_path / "run")


def test_non_finite_gradient_norm_is_not_called_a_loss():
  from shardlab.outputs import non_finite as _non_finite

  class Ck:
    latest, dir = 4, "/ck"
  assert _non_finite(5.5, float("nan"), 7, Ck()).startswith("non-finite gradient norm nan (loss 5.5) at step 7")
  assert _non_finite(float("inf"), 1.0, 7, Ck()).startswith("non-finite loss inf")


def test_summary_json_is_strict():
  from shardlab.outputs import strict as _strict
  assert json.dumps(_strict({"l": [1.0, float("nan")], "g": float("-inf")}), allow_nan=False) == \
      '{"l": [1.0, null], "g": null}'


def _one_shardlab_line(err: str, prefix: str = "shardlab: error: ") -> str:
  """The stderr of a real process: no Python traceback, one line of ours (JAX's own C++ start-up notes may
  surround it)."""
  assert "Traceback" not in err, err[-3000:]
  ours = [l for l in err.splitlines() if l.startswith("shardlab")]
  assert len(ours) == 1 and ours[0].startswith(prefix), err[-3000:]
  return ours[0]


def _launch(*args, slow=None, **kw):
  cmd = ["-c", SLOW.format(s=slow)] if slow else ["-m", "shardlab"]
  return subprocess.Popen([sys.executable, *cmd, "progress=false", "figures=false", *args], cwd=ROOT, env=ENV, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


def test_real_cli_processes(tmp_path):
  """The wiring, in real processes: exit 2 and one line before anything is compiled, each within 30 s; a
  checkpoint.dir that is a file or under /proc used to hang in the background save or give a traceback."""
  (tmp_path / "ck_file").write_text("x")
  cases = {"train.batch_size=0": "train.batch_size=0", "+typo=1": "typo: no such setting",
           f"checkpoint.dir={tmp_path / 'ck_file'}": "is a file", "checkpoint.dir=/proc/shardlab": "cannot write there",
           "train.b2=1.5": "train.b2=1.5"}
  todo, running = list(enumerate(cases)), []
  while todo or running:
    while todo and len(running) < 2:           # two at a time (the cores), each timed from its own start
      i, k = todo.pop(0)
      running.append((i, k, time.monotonic(), _launch(k, f"hydra.run.dir={tmp_path / f'run{i}'}")))
    i, k, t0, p = running.pop(0)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and cases[k] in _one_shardlab_line(err), err[-3000:]
    assert time.monotonic() - t0 < 30 and not (tmp_path / f"run{i}").exists()


def test_read_only_checkpoint_dir(tmp_path):
  """A checkpoint.dir that cannot be written (it used to hang in the background save): exit 2 within 30 s, one
  line. Root writes into a directory without write permission anyway, so as root the directory is a read-only
  tmpfs, mounted in a mount namespace of the process's own (gone with it)."""
  ck, args = tmp_path / "ck", [f"checkpoint.dir={tmp_path / 'ck'}", f"hydra.run.dir={tmp_path / 'run'}"]
  ck.mkdir(mode=0o500)
  t0 = time.monotonic()
  if os.geteuid() != 0:
    p = _launch(*args)
  else:
    p = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                          'mount -t tmpfs -o ro tmpfs "$0" || exit 99; exec "$@"', str(ck), sys.executable, "-m",
                          "shardlab", "progress=false", "figures=false", *args], cwd=ROOT, env=ENV, text=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  _, err = p.communicate(timeout=60)
  if p.returncode == 99:
    pytest.skip(f"root, and no read-only mount possible here: {err.strip()[:200]}")
  assert p.returncode == 2 and "cannot write there" in _one_shardlab_line(err) and f"checkpoint.dir={ck}" in err
  assert time.monotonic() - t0 < 30 and not (tmp_path / "run").exists()


def _procs(tmp_path, n, *args, ranks=None, slow=None):
  port = free_port()
  return [_launch("cpu_devices=4", f"distributed.coordinator=localhost:{port}", f"distributed.num_processes={n}",
                  f"distributed.process_id={i}", f"hydra.run.dir={tmp_path / f'p{i}'}", *args, slow=slow)
          for i in (ranks if ranks is not None else range(n))]


def test_peer_that_never_starts_unreachable_coordinator_port_taken(tmp_path):
  """Process 0 whose peer never starts, and process 1 with nobody at the coordinator's address: each exits
  within 30 s (distributed.timeout_s=3) with one line naming the setting, instead of JAX's 5-minute wait. And a
  process 0 that cannot serve at distributed.coordinator (another program holds the port): one line naming it."""
  t0 = time.monotonic()
  with socket.socket() as taken:
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    busy = _launch("cpu_devices=4", f"distributed.coordinator=localhost:{port}", "distributed.num_processes=2",
                   "distributed.process_id=0", "distributed.timeout_s=20", f"hydra.run.dir={tmp_path / 'c'}")
    alone0 = _procs(tmp_path / "a", 2, "distributed.timeout_s=3", ranks=[0])[0]
    alone1 = _procs(tmp_path / "b", 2, "distributed.timeout_s=3", ranks=[1])[0]
    for p, text in ((alone0, "distributed.timeout_s=3: process 0 waited 3 s for the others: not every one of the 2 "
                             "processes joined"),
                    (alone1, "distributed.timeout_s=3: process 1 waited 3 s for the others: nothing answers at"),
                    (busy, f"distributed.coordinator=localhost:{port}: process 0 could not start")):
      _, err = p.communicate(timeout=60)
      assert p.returncode == 1 and text in _one_shardlab_line(err), err[-3000:]
  assert time.monotonic() - t0 < 30


def test_checkpoint_dirs_not_shared_fail_in_seconds(tmp_path):
  """Two processes, each with its own run dir and so its own <run dir>/checkpoints (they used to hang in the
  final save): both stop before compiling, naming checkpoint.dir."""
  t0 = time.monotonic()
  procs = _procs(tmp_path, 2, "distributed.timeout_s=20")
  for p in procs:
    _, err = p.communicate(timeout=60)
    line = _one_shardlab_line(err)
    assert p.returncode == 2 and "checkpoint.dir=null" in line and "not one shared directory" in line, err[-3000:]
  assert time.monotonic() - t0 < 30


def test_background_save_failure_is_one_line_not_a_hang(tmp_path):
  """The checkpoint directory turns into a file mid-run (after the step-2 save): the next save fails, the run
  stops within 30 s of it with one line naming checkpoint.dir, exit 1, summary.json with the losses so far."""
  ck, out = tmp_path / "ck", tmp_path / "run"
  code = ("import shutil, sys, time, pathlib, shardlab.data as D, shardlab.run as R; b = D.MarkovData.batch; "
          f"ck = pathlib.Path({str(ck)!r})\n"
          "def batch(self, i):\n"
          "  if i == 3:\n"
          "    time.sleep(2); shutil.rmtree(ck); ck.write_text('x'); print('BROKEN', time.time(), file=sys.stderr)\n"
          "  return b(self, i)\n"
          "D.MarkovData.batch = batch; R.cli()")
  p = subprocess.Popen([sys.executable, "-c", code, "progress=false", "train.steps=6", "checkpoint.every=2",
                        f"checkpoint.dir={ck}", f"hydra.run.dir={out}"], cwd=ROOT, env=ENV, text=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  _, err = p.communicate(timeout=300)
  broken = float(next(l for l in err.splitlines() if l.startswith("BROKEN")).split()[1])
  assert p.returncode == 1 and time.time() - broken < 30
  line = _one_shardlab_line("\n".join(l for l in err.splitlines() if not l.startswith("BROKEN")))
  assert f"checkpoint.dir={ck}" in line and "saving checkpoint 4 failed" in line
  assert "deprecated" not in err, err[-3000:]   # orbax's warning for all_steps(read=True) used to precede the line
  s = json.loads((out / "summary.json").read_text())
  assert s["status"] == "error" and s["error"].startswith("RunError") and len(s["losses"]) >= 4


def test_two_sigints_no_traceback_and_a_summary(tmp_path):
  out = tmp_path / "run"
  p = _launch("train.steps=200", f"hydra.run.dir={out}", slow=0.3)
  deadline = time.monotonic() + 240
  while p.poll() is None and time.monotonic() < deadline and not (
      (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
    time.sleep(0.05)
  p.send_signal(signal.SIGINT)
  time.sleep(0.05)
  p.send_signal(signal.SIGINT)
  t0 = time.monotonic()
  _, err = p.communicate(timeout=60)
  assert p.returncode == 128 + signal.SIGINT and time.monotonic() - t0 < 30, err[-3000:]
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
  assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"


def test_killed_peer_survivor_names_it_within_60s(tmp_path):
  """Two pairs of processes training (together, to share the start-up); in one, process 1 is killed (-9), in the
  other process 0, the coordinator. Each survivor exits within 60 s, non-zero, with one line naming the lost
  process (they used to abort in a C++ check failure naming nobody: 56 s later, or at once for process 0)."""
  pairs = {victim: _procs(tmp_path / f"kill{victim}", 2, "train.steps=400", f"checkpoint.dir={tmp_path / f'ck{victim}'}",
                          "distributed.heartbeat_timeout_s=5", slow=0.3) for victim in (1, 0)}
  deadline = time.monotonic() + 300
  for victim, procs in pairs.items():
    metrics = tmp_path / f"kill{victim}" / "p0" / "metrics.jsonl"
    while procs[0].poll() is None and time.monotonic() < deadline and not (
        metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
      time.sleep(0.1)
  for victim, procs in pairs.items():
    procs[victim].kill()
  t0 = time.monotonic()
  for victim, procs in pairs.items():
    survivor = procs[1 - victim]
    _, err = survivor.communicate(timeout=120)
    procs[victim].communicate()
    assert survivor.returncode not in (0, None) and time.monotonic() - t0 < 60, err[-3000:]
    assert f"lost process {victim}{' (the coordinator)' if victim == 0 else ''} of 2" in _one_shardlab_line(err)
    assert "Check failure" not in err and "Terminating process" not in err, err[-3000:]


def test_sweep_with_failed_jobs_exits_1_after_its_summary(tmp_path):
  r = subprocess.run([sys.executable, "-m", "shardlab", "-m", "train.batch_size=0,-4", f"hydra.sweep.dir={tmp_path}"],
                     cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
  rows = (tmp_path / "summary.csv").read_text()
  assert rows.count("ConfigError: train.batch_size=") == 2
  assert "2 of 2 sweep jobs failed" in r.stderr.splitlines()[-1]


def test_report_rejects_bad_input_in_one_line(tmp_path, capsys):
  from shardlab.report import main
  for content, text in (("{not json", "not valid JSON"), ("[1, 2]", "holds a JSON list")):
    d = tmp_path / content[:2].strip("{[") / "job"
    d.mkdir(parents=True)
    (d / "summary.json").write_text(content)
    with pytest.raises(SystemExit) as e:
      main([str(d.parent)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and text in err, err
  good = tmp_path / "good"
  (good / "job").mkdir(parents=True)
  (good / "job" / "summary.json").write_text(json.dumps({"status": "error", "error": "x"}))
  with pytest.raises(SystemExit) as e:
    main([str(good), "--runs", "nope"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "--runs nope: no run named nope" in err and "runs here: job" in err


def test_plan_rejects_a_mesh_the_dims_do_not_divide(capsys):
  from shardlab.plan import main
  assert main(["mesh.fsdp=3"]) == 2
  assert "model.d_model=64 is not divisible by mesh.fsdp=3" in capsys.readouterr().err
  assert main(["hardware.hbm_bandwidth=0"]) == 2
  assert "hardware.hbm_bandwidth=0.0: must be > 0" in capsys.readouterr().err


def test_sigterm_while_compiling_is_one_line_and_a_summary(tmp_path):
  """SIGTERM before the first step (the step still compiling; here compiling takes 3 s longer) used to kill the
  process with no line and no summary: it now stops once XLA returns, exit 143, one line, summary.json saying
  interrupted; the same command with checkpoint.resume=true then runs the whole run."""
  out = tmp_path / "run"
  code = ("import sys, time, shardlab.trainer as T, shardlab.run as R; c = T.compile_and_analyze\n"
          "def slow(*a):\n"
          "  print('COMPILING', file=sys.stderr, flush=True); time.sleep(3); return c(*a)\n"
          "T.compile_and_analyze = slow; R.cli()")
  p = subprocess.Popen([sys.executable, "-c", code, "progress=false", "train.steps=2", "tensorboard=false",
                        f"hydra.run.dir={out}"], cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
  assert p.stderr.readline().strip() == "COMPILING"
  p.send_signal(signal.SIGTERM)
  t0 = time.monotonic()
  _, err = p.communicate(timeout=120)
  assert p.returncode == 128 + signal.SIGTERM and time.monotonic() - t0 < 30, err[-3000:]
  line = _one_shardlab_line(err, "shardlab: stopped by SIGTERM while compiling")
  assert "checkpoint.resume=true" in line
  assert json.loads((out / "summary.json").read_text()) == {"status": "interrupted", "error": line[len("shardlab: "):],
                                                            "losses": []}
  r = subprocess.run([sys.executable, "-m", "shardlab", "progress=false", "train.steps=2", "tensorboard=false",
                      "checkpoint.resume=true", f"hydra.run.dir={out}"], cwd=ROOT, env=ENV, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads((out / "summary.json").read_text())["status"] == "ok"


def test_non_finite_loss_is_the_only_line(tmp_path):
  """The NaN guard's line used to follow a tensorboardX warning about the NaN scalar: now it is the only line."""
  out = tmp_path / "run"
  r = subprocess.run([sys.executable, "-m", "shardlab", "progress=false", "train.steps=3", "train.lr=1e10",
                      "checkpoint.every=1", f"hydra.run.dir={out}"], cwd=ROOT, env=ENV, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 1 and [l for l in r.stderr.splitlines() if l.strip()] == [
      f"shardlab: error: non-finite loss nan (grad_norm nan) at step 1; last good checkpoint: checkpoint 1 in "
      f"{out / 'checkpoints'}"], r.stderr[-3000:]
