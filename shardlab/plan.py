"""Predict memory, step time and communication bounds for a config, without devices.

  python -m shardlab.plan                                              # the default config (tiny, h100, 4x2)
  python -m shardlab.plan model=llama2_13b hardware=tpu_v5p mesh.fsdp=1024 mesh.tensor=4 \\
      mesh.fsdp_ici_axes=2 train.global_batch_tokens=3000000 train.mfu=0.4

Takes the same Hydra overrides as `python -m shardlab`, composes conf/, and prints one JSON object (keys and
formulas: shardlab/analysis/planner.py). Any mesh size works: nothing here touches JAX. A bad override, a setting
out of range or a mesh axis that does not divide the dimensions it shards prints one line to stderr and exits
with status 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: list[str]):
  """conf/ + overrides -> typed `Config` (Hydra validates every override against the schemas)."""
  from hydra import compose as hydra_compose, initialize_config_dir
  from shardlab.config import register_configs, to_config
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="plan"):
    return to_config(hydra_compose(config_name="config", overrides=list(overrides)))


def _one_line(e: BaseException) -> str:
  """An exception and its causes, whitespace collapsed onto one line."""
  name, parts = type(e).__name__, []
  while e is not None:
    text = " ".join(str(e).split())
    if text and text not in parts:
      parts.append(text)
    e = e.__cause__
  return " | ".join(parts) or name


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    return 0
  from shardlab.analysis.planner import plan
  from shardlab.validate import validate_plan
  try:
    cfg = compose(argv)
    validate_plan(cfg)   # the same ranges as a run, and every sharded dim divisible by its mesh axis
    result = plan(cfg)
  except Exception as e:  # Hydra/OmegaConf errors, ConfigError and planner.check's ValueError: one line, exit 2
    print(f"shardlab.plan: error: {_one_line(e)}", file=sys.stderr)
    return 2
  print(json.dumps(result, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
