"""Design rules a command can check."""
import functools
import re

import pytest

from conftest import ROOT


def test_only_collectives_calls_lax_collectives():
  """The audit's rule is "placed through shardlab.collectives": a schedule that called jax.lax itself would be
  flagged unplanned, so no module but collectives.py may."""
  pattern = re.compile(r"lax\.(all_gather|psum_scatter|ppermute|psum|pmean|pmax|all_to_all|ragged_all_to_all|pcast)\b")
  stray = []
  for path in (ROOT / "shardlab").rglob("*.py"):
    rel = path.relative_to(ROOT).as_posix()
    if rel == "shardlab/collectives.py":
      continue
    stray += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
  assert not stray, f"collectives placed outside collectives.py: {stray}"


def test_core_does_not_import_hydra_or_experiments():
  allowed = {"shardlab/run.py", "shardlab/plan.py", "shardlab/config.py", "shardlab/sweep.py"}
  bad = [p.relative_to(ROOT).as_posix() for p in (ROOT / "shardlab").rglob("*.py")
         if p.relative_to(ROOT).as_posix() not in allowed
         and re.search(r"^\s*(import|from)\s+(hydra|omegaconf|experiments)\b", p.read_text(), re.M)]
  assert not bad, bad


def test_no_axis_name_literal_outside_the_declarations():
  """`python -m shardlab.axes` lists every string constant equal to a mesh axis name outside shardlab/axes.py,
  collectives.py and schedules/: everything else reads axis names from the declarations, the mesh or the program."""
  import subprocess
  import sys
  out = subprocess.run([sys.executable, "-m", "shardlab.axes"], capture_output=True, text=True, cwd=ROOT)
  assert out.returncode == 0, out.stdout + out.stderr
  assert out.stdout.strip().endswith("0 axis-name literals outside axes.py, collectives.py, schedules/")


@pytest.mark.slow            # builds a wheel
def test_the_wheel_ships_conf_inside_the_package(tmp_path):
  """conf/ is at the repository's top level; a wheel (pip install ., not editable) carries it as shardlab/conf/,
  which shardlab.config.CONF_DIR finds when the source tree is not there."""
  import subprocess
  import sys
  import zipfile
  out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                        str(tmp_path), str(ROOT)], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  names = set(zipfile.ZipFile(next(tmp_path.glob("shardlab-*.whl"))).namelist())
  want = {"shardlab/conf/" + p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml")}
  assert want and want <= names, sorted(want - names)[:5]


@functools.lru_cache(maxsize=None)
def _imports() -> tuple[dict, dict]:
  """({module: the shardlab modules it imports, in functions too}, {module: parsed tree}); `from pkg import mod`
  is an import of mod, and a module's own package __init__ (run first anyway) is left out. Parsed once per process
  (the tests only read it)."""
  import ast
  mods = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
          for p in (ROOT / "shardlab").rglob("*.py")}
  graph, trees = {}, {}
  for m, p in mods.items():
    trees[m] = tree = ast.parse(p.read_text())
    out = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods] or [node.module]
      else:
        continue
      out |= {n for n in names if n in mods and n != m and not m.startswith(n + ".")}
    graph[m] = out
  return graph, trees


def test_no_import_circle_and_analysis_imports_nothing_above_it():
  """The import graph of shardlab/ (imports inside functions included) has no circle, and nothing in analysis/
  imports the application layer (the trainer, the run and plan entry points, preflight, sweeps, reports)."""
  graph, _ = _imports()
  done, circles = set(), []

  def visit(m, path):
    if m in path:
      circles.append(path[path.index(m):] + [m])
      return
    if m in done:
      return
    for n in sorted(graph[m]):
      visit(n, path + [m])
    done.add(m)
  for m in sorted(graph):
    visit(m, [])
  assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])
  above = {f"shardlab.{m}" for m in ("trainer", "run", "plan", "preflight", "sweep", "report", "train")}
  upward = {m: sorted(graph[m] & above) for m in graph if m.startswith("shardlab.analysis") and graph[m] & above}
  assert not upward, upward
  from shardlab.analysis import LAYERS          # inside analysis/: each module imports only from earlier layers
  rank = {f"shardlab.analysis.{m}": i for i, layer in enumerate(LAYERS) for m in layer}
  assert set(rank) == {m for m in graph if m.startswith("shardlab.analysis.")}, "a module missing from LAYERS"
  up = {m: sorted(n for n in graph[m] if rank.get(n, -1) >= rank[m]) for m in rank}
  assert not any(up.values()), {m: n for m, n in up.items() if n}


def test_no_private_name_crosses_a_module_boundary():
  """`from shardlab.x import _name` and `x._name` from another module: a private name used outside its module
  (the private JAX API is the one exception, behind shardlab/jax_private.py)."""
  import ast
  graph, trees = _imports()
  crossings = []
  for m, tree in trees.items():
    aliases = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardlab"):
        for a in node.names:
          if f"{node.module}.{a.name}" in graph:
            aliases[a.asname or a.name] = f"{node.module}.{a.name}"
          elif a.name.startswith("_"):
            crossings.append(f"{m} imports {node.module}.{a.name}")
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
          and node.attr.startswith("_") and not node.attr.startswith("__")):
        crossings.append(f"{m} uses {aliases[node.value.id]}.{node.attr}")
  assert not crossings, crossings


def test_the_analysis_asks_the_parts_not_their_names():
  """No module of analysis/ (nor the planner's entry point) compares a value with the name of a context strategy
  or a TP contraction: a strategy is priced by its class's own terms (schedules/context.py's cost terms,
  schedules/tp.py's partial_products and seq_sharded), so a user's `module:Class` is priced like the built-in it
  copies. By hand: grep -rnE '(==|!=|in) *\\(?"(ring|ulysses|all_gather|allgather|allreduce|ring_bidi)"'
  shardlab/analysis shardlab/plan.py"""
  import ast
  from shardlab.schedules.context import STRATEGIES
  from shardlab.schedules.tp import TP
  names = set(STRATEGIES) | set(TP)
  root = ROOT / "shardlab"
  found = []
  for p in [*sorted((root / "analysis").glob("*.py")), root / "plan.py"]:
    for node in ast.walk(ast.parse(p.read_text())):
      if not isinstance(node, ast.Compare):
        continue
      sides = [node.left, *node.comparators]
      consts = [c for s in sides for c in ([s] if isinstance(s, ast.Constant) else
                                          getattr(s, "elts", []) if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [])]
      hit = [c.value for c in consts if isinstance(c, ast.Constant) and c.value in names]
      if hit:
        found.append(f"{p.relative_to(root.parent)}:{node.lineno} compares with {hit}")
  assert not found, found


def test_the_weights_knobs_are_read_by_the_weights_part_only():
  """schedule.prefetch, reshard_after_forward, gather_dtype and grad_reduce configure the weights part
  (schedules/weights.py); the explicit schedule and the analysis ask the part (its stage, its cost terms), so a
  user's `schedule.weights=module:Class` runs and is priced by its own class. By hand: grep -rnE
  '\\.(prefetch|reshard_after_forward|gather_dtype|grad_reduce)\\b' shardlab/analysis shardlab/schedules/explicit.py"""
  import ast
  knobs = {"prefetch", "reshard_after_forward", "gather_dtype", "grad_reduce"}
  root = ROOT / "shardlab"
  found = [f"{p.relative_to(root.parent)}:{node.lineno} reads .{node.attr}"
           for p in [*sorted((root / "analysis").glob("*.py")), root / "plan.py", root / "schedules" / "explicit.py",
                     root / "schedules" / "pipeline.py"]
           for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.Attribute) and node.attr in knobs]
  assert not found, found


def test_errors_live_in_a_leaf_module():
  """ConfigError and RunError are defined in shardlab/errors.py, which imports nothing of shardlab's, and every
  module of shardlab raises them from there: raising an error never pulls in the mesh (or JAX)."""
  graph, trees = _imports()
  assert not graph["shardlab.errors"], graph["shardlab.errors"]
  import ast
  wrong = [f"{m} imports {node.module}.{a.name}" for m, tree in trees.items() for node in ast.walk(tree)
           if isinstance(node, ast.ImportFrom) and node.module in ("shardlab.mesh", "shardlab.validate")
           for a in node.names if a.name in ("ConfigError", "RunError")]
  assert not wrong, wrong


def test_pipeline_tables_are_pure_python_and_the_analysis_imports_no_executor():
  """The tables (shardlab/pipeline_tables.py) and their replay (analysis/pipeline_replay.py) import no JAX, and no
  module of analysis/ imports the pipeline executor (schedules/pipeline.py): what the analysis prices is the table."""
  import subprocess
  import sys
  graph, _ = _imports()
  assert not [m for m in graph if m.startswith("shardlab.analysis") and "shardlab.schedules.pipeline" in graph[m]]
  code = "import sys, shardlab.pipeline_tables, shardlab.analysis.pipeline_replay; print('jax' in sys.modules)"
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert r.stdout.strip() == "False", r.stderr[-2000:]


# The entry points: where a run, a plan, a sweep or a test starts, read the whole config and resolve it once
# (shardlab/composition.py). The test kit (shardlab/testing/) is one: it composes a config from knobs, as the CLI does.
ENTRY = {"shardlab.run", "shardlab.trainer", "shardlab.plan", "shardlab.calibrate", "shardlab.preflight",
         "shardlab.validate", "shardlab.sweep", "shardlab.report", "shardlab.outputs", "shardlab.config",
         "shardlab.composition", "shardlab.__main__", "shardlab.pipeline", "shardlab.pytest_plugin"}


def test_nothing_below_the_entry_points_takes_the_whole_config():
  """Below the entry points (ENTRY and the test kit) no module imports the whole config's class (`Config`),
  resolves or composes a config, or has a parameter named `cfg` that is not annotated with one group's class
  (ScheduleConfig, ContextConfig, ...): the analysis, the planner and the step take the composition
  (shardlab/composition.py), each part its own group. By hand: grep -rn "def .*\\bcfg\\b" shardlab/analysis"""
  import ast
  graph, trees = _imports()
  found = []
  for m, tree in trees.items():
    if m in ENTRY or m.startswith("shardlab.testing"):
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module == "shardlab.config":
        found += [f"{m} imports Config" for a in node.names if a.name == "Config"]
        found += [f"{m} imports {a.name}" for a in node.names if a.name in ("to_config", "compose")]
      if isinstance(node, ast.ImportFrom) and node.module == "shardlab.composition":
        found += [f"{m} imports resolve" for a in node.names if a.name == "resolve"]
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for a in node.args.args + node.args.kwonlyargs:
          ann = ast.unparse(a.annotation).strip("'\"").split("|")[0].strip() if a.annotation else ""
          if a.arg == "cfg" and not (ann.endswith("Config") and ann != "Config"):
            found.append(f"{m}.{node.name}({a.arg}: {ann or 'unannotated'})")
  assert not found, found
