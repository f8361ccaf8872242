"""User code plugged in from the command line (`schedule.impl`, `schedule.tp`, `context.impl`, `pipeline.impl`)
and the layout's rules keep the promise of a bad setting: exit 2, one `shardlab: error:` line naming the setting
(and, for an exception raised inside the user's code, the user's file and line), no traceback, nothing written
to the run directory. And what the protocols allow still runs: a pipeline table given as a plain function, a
schedule class with only the protocol's 4-argument constructor.

The bad cases run through the CLI entry point in one fresh Python process (test_fuzz.run_cli: one start for all
rows), as tests/test_fuzz.py's table does."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, compose
from joints import ENV, checksums, shardlab

# The user's files, written into a directory on sys.path. `# line N` comments mark the lines messages must name.
FILES = {
    "uc_table.py": (
        "from shardlab.schedules.pipeline import Action\n"
        "class Strings:\n"
        "  def orders(self, P, M, V):\n"
        "    return [['F0', 'B0'] for _ in range(P)]\n"
        "class Nothing:\n"
        "  def orders(self, P, M, V):\n"
        "    return None\n"
        "class Boom:\n"
        "  def orders(self, P, M, V):\n"
        "    raise ValueError('boom')\n"                                     # line 10
        "class BadInit:\n"
        "  def __init__(self):\n"
        "    raise RuntimeError('no table today')\n"                         # line 13
        "  def orders(self, P, M, V):\n"
        "    return []\n"
        "def gpipe_orders(P, M, V):\n"
        "  return [[Action(k, m) for k in 'FB' for m in range(M)] for _ in range(P)]\n"
        "class Ticks:\n"
        "  def table(self, P, M, V):\n"
        "    return [[('F0',)] * P]\n"),
    "uc_syntax.py": "def orders(P, M, V) return 1\n",                         # line 1
    "uc_parts.py": (
        "from shardlab.schedules.context import AllGatherKV\n"
        "from shardlab.schedules.explicit import ExplicitSchedule\n"
        "from shardlab.schedules.tp import AllGatherTP\n"
        "class RaisingSchedule(ExplicitSchedule):\n"
        "  def __init__(self, cfg, model, compute_dtype, layout, context=None, pipeline=None):\n"
        "    raise RuntimeError('schedule broken')\n"                        # line 6
        "class RaisingTP(AllGatherTP):\n"
        "  def __init__(self):\n"
        "    raise ValueError('tp broken')\n"                                # line 9
        "class RaisingContext(AllGatherKV):\n"
        "  def __init__(self, model, layout, cfg):\n"
        "    raise KeyError('context broken')\n"                             # line 12
        "class FourArgs(ExplicitSchedule):\n"
        "  def __init__(self, cfg, model, compute_dtype, layout):\n"
        "    super().__init__(cfg, model, compute_dtype, layout)\n"
        "import jax\n"
        "from shardlab.schedules.tp import AllReduceTP\n"
        "class ImplicitTP(AllReduceTP):\n"      # the input marked varying over tensor without collectives.pvary:
        "  def _column(self, x, f):\n"          # its gradient's sum over tensor is JAX's, with no shardlab scope
        "    return f(jax.lax.pcast(x, 'tensor', to='varying'))\n"),
}
PIPE = ["mesh.pipeline=2", "mesh.fsdp=4", "mesh.tensor=1", "model.n_layers=2", "pipeline=gpipe"]
CTX = ["mesh.context=2", "mesh.fsdp=2"]

# (overrides, texts the one line must hold); {dir} is where FILES are.
BAD = [
    # a. a schedule class that cannot run pipeline stages, asked of the class
    (["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2", "model.n_layers=4", "pipeline=gpipe", "schedule=gspmd"],
     ["pipeline=gpipe: schedule=gspmd", "class GSPMDSchedule) cannot run pipeline stages"]),
    ([*PIPE, "schedule.impl=uc_parts:FourArgs"],
     ["pipeline=gpipe: ", "class FourArgs) cannot run pipeline stages", "takes no pipeline="]),
    # b. pipeline.impl of the wrong kind
    ([*PIPE, "pipeline.impl=shardlab.mesh:ConfigError"],
     ["pipeline.impl=shardlab.mesh:ConfigError: ConfigError has neither orders(P, M, V) nor table(P, M, V)"]),
    ([*PIPE, "pipeline.impl=os:path"], ["pipeline.impl=os:path: it is a module and has neither orders"]),
    # c. a user table that returns the wrong thing, raises, or does not parse
    ([*PIPE, "pipeline.impl=uc_table:Strings"],
     ["pipeline.impl=uc_table:Strings: orders(2, 2, 1) returned 'F0' at stage 0 item 0: not an Action"]),
    ([*PIPE, "pipeline.impl=uc_table:Nothing"],
     ["pipeline.impl=uc_table:Nothing: orders(2, 2, 1) returned None; it must be a list of 2 lists of Actions"]),
    ([*PIPE, "pipeline.impl=uc_table:Ticks"],
     ["pipeline.impl=uc_table:Ticks: table(2, 2, 1) returned 'F0' at tick 0 stage 0: not an Action"]),
    ([*PIPE, "pipeline.impl=uc_syntax:orders"],
     ["pipeline.impl=uc_syntax:orders: import uc_syntax raised SyntaxError", "(at {dir}/uc_syntax.py:1)"]),
    # d. a context strategy that is none
    ([*CTX, "context.impl=shardlab.mesh:ConfigError"],
     ["context.impl=shardlab.mesh:ConfigError: ConfigError is not a ContextStrategy: it has no ", "attend"]),
    ([*CTX, "context.impl=os:path"], ["context.impl=os:path: is a module, not a class"]),
    # e. layout rules: a value of the wrong type, a logical dim nobody knows
    (["layout.rules.embed=5"], ["layout.rules.embed=5: a rule maps a logical dim to a list of mesh axis names"]),
    (["layout.rules.embed=[1]"], ["layout.rules.embed=[1]: a rule maps"]),
    (["+layout.rules.emebd=[]"], ["layout.rules.emebd=[]: no logical dim 'emebd'", "embed"]),
    # f. an exception inside user code: the setting, the call and the user's file and line
    ([*PIPE, "pipeline.impl=uc_table:Boom"],
     ["pipeline.impl=uc_table:Boom: orders(2, 2, 1) raised ValueError: boom", "(at {dir}/uc_table.py:10)"]),
    ([*PIPE, "pipeline.impl=uc_table:BadInit"],
     ["pipeline.impl=uc_table:BadInit: BadInit() raised RuntimeError: no table today", "(at {dir}/uc_table.py:13)"]),
    (["schedule.impl=uc_parts:RaisingSchedule"],
     ["schedule.impl=uc_parts:RaisingSchedule: RaisingSchedule(...) raised RuntimeError: schedule broken",
      "(at {dir}/uc_parts.py:6)"]),
    (["schedule.tp=uc_parts:RaisingTP"],
     ["schedule.tp=uc_parts:RaisingTP: ", "raised ValueError: tp broken", "(at {dir}/uc_parts.py:9)"]),
    ([*CTX, "context.impl=uc_parts:RaisingContext"],
     ["context.impl=uc_parts:RaisingContext: RaisingContext(...) raised KeyError: 'context broken'",
      "(at {dir}/uc_parts.py:12)"]),
]


def check_case(i: int, base) -> str:
  """Row i of BAD through the CLI entry point in this process: '' if it held, else what went wrong. Even rows run
  into a run directory that does not exist (it must not appear), odd rows into one already holding a file (its
  files must not change)."""
  from pathlib import Path
  from test_fuzz import run_cli
  overrides, texts = BAD[i]
  run = Path(base) / str(i) / "run"
  if i % 2:
    run.mkdir(parents=True)
    (run / "notes.txt").write_text("an earlier file")
  before = checksums(run)
  code, err = run_cli(["progress=false", "figures=false", "train.steps=1", f"hydra.run.dir={run}", *overrides])
  lines = [l for l in err.splitlines() if l.strip()]
  if "Traceback" in err or not (code == 2 and len(lines) == 1 and lines[0].startswith("shardlab: error: ")):
    return f"exit {code}, stderr {err[-2000:]!r}"
  missing = [t.format(dir=base) for t in texts if t.format(dir=base) not in lines[0]]
  if missing:
    return f"{missing} not in {lines[0]!r}"
  if checksums(run) != before:
    return f"the run directory changed: {before} -> {checksums(run)}"
  return ""


def run_table(base: str) -> None:
  """Every row of BAD, the user's files in `base` (on sys.path); prints {row: problem} as JSON."""
  sys.path.insert(0, base)
  print("RESULTS " + json.dumps({i: check_case(i, base) for i in range(len(BAD))}))


def _write_files(d) -> str:
  for name, text in FILES.items():
    (d / name).write_text(text)
  return str(d.resolve())


@pytest.mark.slow
def test_bad_user_code_is_exit_2_one_line_nothing_written(tmp_path):
  """Every row of BAD in one fresh Python process (Hydra's in-process runs kept away from pytest's capture)."""
  base = _write_files(tmp_path)
  code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_user_code; "
          f"test_user_code.run_table({base!r})")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
  got = [l for l in r.stdout.splitlines() if l.startswith("RESULTS ")]
  assert r.returncode == 0 and got, r.stderr[-3000:]
  results = json.loads(got[-1][len("RESULTS "):])
  assert len(results) == len(BAD)
  bad = {" ".join(BAD[int(i)][0]): why for i, why in results.items() if why}
  assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


@pytest.mark.slow
def test_a_table_given_as_a_function_trains(tmp_path):
  """pipeline.impl=module:function (docs/pipeline.md): the function is the orders, f(P, M, V); one step trains
  and writes its summary, the same loss as the built-in gpipe table it spells out."""
  base = _write_files(tmp_path)
  r = shardlab("mesh.pipeline=2", "mesh.fsdp=4", "mesh.tensor=1", "model.n_layers=2", "train.steps=1",
               "pipeline=gpipe", "pipeline.impl=uc_table:gpipe_orders", "tensorboard=false",
               "checkpoint.enabled=false", f"hydra.run.dir={tmp_path / 'run'}", env={"PYTHONPATH": base})
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["status"] == "ok" and len(summary["losses"]) == 1


@pytest.mark.slow
def test_an_all_reduce_no_code_placed_is_said_at_the_end(tmp_path):
  """A user's TP class that marks a value varying itself (jax.lax.pcast, not collectives.pvary): JAX places the
  gradient's all-reduce over tensor, unscoped. The run ends with a warning line naming it, before its last line
  (and summary.json lists it under audit.unplanned)."""
  base = _write_files(tmp_path)
  r = shardlab("mesh=4x2", "schedule.tp=uc_parts:ImplicitTP", "dry_run=true", "tensorboard=false",
               "checkpoint.enabled=false", f"hydra.run.dir={tmp_path / 'run'}", env={"PYTHONPATH": base})
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert {(u["kind"], u["axis"]) for u in summary["audit"]["unplanned"]} == {("all-reduce", "tensor")}
  warned = [l for l in r.stdout.splitlines()[-4:-1] if l.startswith("shardlab: warning: ")]
  assert len(warned) == 1 and "no code placed (all-reduce over tensor)" in warned[0], r.stdout[-2000:]


def test_table_function_is_the_orders(tmp_path, monkeypatch):
  """The same function's table is gpipe's, placed by `table` and checked (no devices)."""
  from shardlab import pipeline_tables as PL
  monkeypatch.syspath_prepend(_write_files(tmp_path))
  assert PL.load_table("uc_table:gpipe_orders", 2, 4, 1) == PL.build("gpipe", 2, 4)


def test_a_schedule_with_the_protocols_four_argument_constructor_builds(tmp_path, monkeypatch):
  """schedule.impl=module:Class whose constructor takes only (cfg, model, compute_dtype, layout): built and
  validated without a context or pipeline argument (schedules.build passes only what the class takes)."""
  import jax.numpy as jnp
  from shardlab import schedules
  from shardlab.config import to_config
  from shardlab.layout import from_config
  from shardlab.validate import validate
  monkeypatch.syspath_prepend(_write_files(tmp_path))
  cfg = to_config(compose("schedule.impl=uc_parts:FourArgs"))
  sched = schedules.build(cfg.schedule, cfg.model, jnp.float32, from_config(cfg.layout), cfg.context, cfg.pipeline)
  assert type(sched).__name__ == "FourArgs" and sched.pipe.impl == "none"
  validate(cfg, 8)


def test_a_schedule_says_whether_it_runs_pipeline_stages():
  """Asked of the class, never its name: its constructor takes a pipeline and it does not state pipelines =
  False; a class written from the protocol's 4-argument constructor alone cannot, nor can one that inherits
  `pipelines = True` but overrides the constructor without a pipeline."""
  from shardlab import schedules

  class Stated:
    pipelines = True

    def __init__(self, cfg, model, compute_dtype, layout, pipeline=None): ...

  class Silent:
    def __init__(self, cfg, model, compute_dtype, layout): ...
  assert schedules.runs_pipelines(schedules.ExplicitSchedule) and not schedules.runs_pipelines(schedules.GSPMDSchedule)
  class Narrowed(schedules.ExplicitSchedule):
    def __init__(self, cfg, model, compute_dtype, layout): ...
  assert schedules.runs_pipelines(Stated) and not schedules.runs_pipelines(Silent)
  assert not schedules.runs_pipelines(Narrowed)
