"""Design rules a command can check."""
import re

from conftest import ROOT


def test_only_collectives_and_schedules_call_lax_collectives():
  pattern = re.compile(r"lax\.(all_gather|psum_scatter|ppermute|psum|pmean|pmax|all_to_all|pcast)\b")
  stray = []
  for path in (ROOT / "shardlab").rglob("*.py"):
    rel = path.relative_to(ROOT).as_posix()
    if rel == "shardlab/collectives.py" or rel.startswith("shardlab/schedules/"):
      continue
    stray += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
  assert not stray, f"collectives placed outside collectives.py and schedules/: {stray}"


def test_core_does_not_import_hydra_or_experiments():
  allowed = {"shardlab/run.py", "shardlab/plan.py", "shardlab/config.py", "shardlab/sweep.py"}
  bad = [p.relative_to(ROOT).as_posix() for p in (ROOT / "shardlab").rglob("*.py")
         if p.relative_to(ROOT).as_posix() not in allowed
         and re.search(r"^\s*(import|from)\s+(hydra|omegaconf|experiments)\b", p.read_text(), re.M)]
  assert not bad, bad
