"""Design rules a command can check."""
import re

from conftest import ROOT


def test_only_collectives_calls_lax_collectives():
  """The audit's rule is "placed through shardlab.collectives": a schedule that called jax.lax itself would be
  flagged unplanned, so no module but collectives.py may."""
  pattern = re.compile(r"lax\.(all_gather|psum_scatter|ppermute|psum|pmean|pmax|all_to_all|pcast)\b")
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
