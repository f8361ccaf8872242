"""Predict memory, step time and communication bounds for a config, without devices.

  python -m shardlab.plan                                              # the default config (tiny, h100, 4x2)
  python -m shardlab.plan model=llama2_13b hardware=tpu_v5p mesh.fsdp=1024 mesh.tensor=4 \\
      mesh.fsdp_ici_axes=2 train.global_batch_tokens=3000000 train.mfu=0.4

Takes the same Hydra overrides as `python -m shardlab`, composes conf/, and prints one JSON object (keys and
formulas: shardlab/analysis/planner.py). Any mesh size works: nothing here touches JAX. A bad override, a setting
out of range or a mesh axis that does not divide the dimensions it shards prints one line to stderr and exits
with status 2.

Options of the planner itself (also as plan.NAME=VALUE; docs/planning.md):
  search=true        rank every data x fsdp x tensor layout of the devices: the JSON gains `layouts`, best first
  top=K              list only the K best layouts (implies search=true) and compile them for the target: each
                     gains `target` (compiled memory per device, calibrated step time, beside the closed forms;
                     needs the hardware preset's extra: pip install "shardlab[cuda12]" or "shardlab[tpu]")
  devices=N          the device count searched (default mesh.data * mesh.fsdp * mesh.tensor)
  torus=16x16x16     the TPU slice's torus (default: the most nearly cubic one of the preset's rank)
  plot=PATH.png      the efficiency curve: step time and MFU against per-device batch, for the configured mesh
                     or, with search, the best (top, default 3) layouts
  plot_layouts=1x1024x4,1x4096x1   plot these data x fsdp x tensor layouts instead (implies search=true)
  confirm=false      with top=K: list the K best by the closed forms only, compile nothing
  confirm=true       compile the best (top, default 3) layouts for the target (the default with top=K)
  confirm_batch=true confirm the configured mesh's batch window by compiling for the target: `batch_window.target`
                     (the largest batch that fits by the compiled peaks, compiled at it and at one more sequence)
"""
from __future__ import annotations

import json
import sys

from shardlab.axes import DATA, FSDP, TENSOR
from shardlab.config import CONF_DIR
from shardlab.analysis.confirm import confirm_batch_window, confirm_layouts
from shardlab.trainer import build


def compose(overrides: list[str]):
  """conf/ + overrides -> typed `Config` (Hydra validates every override against the schemas)."""
  from hydra import compose as hydra_compose, initialize_config_dir
  from shardlab.config import register_configs, to_config
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="plan"):
    return to_config(hydra_compose(config_name="config", overrides=list(overrides)))


def _one_line(e: BaseException) -> str:
  """An exception and its causes, whitespace collapsed onto one line; OmegaConf's trailer (full_key, reference
  and object types) left out, a bad override pointed at the list of settings."""
  name, parts, hydra = type(e).__name__, [], False
  while e is not None:
    hydra = hydra or type(e).__module__.split(".")[0] in ("hydra", "omegaconf")
    text = " ".join(str(e).split("full_key:")[0].split("Config search path:")[0].split())
    if text and text not in parts and not any(text in p for p in parts):
      parts.append(text)
    e = e.__cause__
  out = ": ".join(parts) or name
  return out + (" (`python -m shardlab --help` lists every group, option and setting)" if hydra else "")


# The planner's own options: not part of conf/, so they are taken out of argv before Hydra sees it.
OPTIONS = {"search": "bool", "top": "int", "devices": "int", "torus": "dims", "plot": "path", "confirm": "bool",
           "confirm_batch": "bool", "plot_layouts": "layouts"}


def split_options(argv: list[str]) -> tuple[dict, list[str]]:
  """(planner options, the Hydra overrides left). `search=true` and `plan.search=true` are the same."""
  opts = {"search": False, "top": 0, "devices": 0, "torus": None, "plot": None, "confirm": None, "plot_layouts": [],
          "confirm_batch": False}
  rest = []
  for arg in argv:
    key, eq, value = arg.partition("=")
    name = key.removeprefix("plan.")
    if not eq or name not in OPTIONS:
      rest.append(arg)
      continue
    kind = OPTIONS[name]
    if kind == "bool":
      if value.lower() not in ("true", "false"):
        raise ValueError(f"{arg}: {name} must be true or false")
      opts[name] = value.lower() == "true"
    elif kind == "int":
      if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{arg}: {name} must be a positive integer")
      opts[name] = int(value)
    elif kind == "dims":
      dims = value.lower().split("x")
      if not all(d.isdigit() and int(d) >= 1 for d in dims):
        raise ValueError(f"{arg}: torus must look like 16x16x16")
      opts[name] = tuple(int(d) for d in dims)
    elif kind == "layouts":
      shapes = [v.lower().split("x") for v in value.split(",")]
      if not all(len(d) == 3 and all(n.isdigit() and int(n) >= 1 for n in d) for d in shapes):
        raise ValueError(f"{arg}: plot_layouts must look like 1x1024x4,1x4096x1 (data x fsdp x tensor)")
      opts[name] = [tuple(int(n) for n in d) for d in shapes]
    else:
      if not value:
        raise ValueError(f"{arg}: {name} needs a file name")
      opts[name] = value
  if opts["confirm"] is None:            # top=K compiles the K best unless confirm=false
    opts["confirm"] = bool(opts["top"])
  opts["search"] = opts["search"] or bool(opts["top"]) or opts["confirm"] or bool(opts["plot_layouts"])
  return opts, rest


def run(argv: list[str]) -> dict:
  """The plan of argv (options and overrides), with `layouts` when searching; writes the figure if asked."""
  from shardlab.analysis import planner
  opts, overrides = split_options(argv)
  cfg = compose(overrides)
  from shardlab.validate import validate_plan
  validate_plan(cfg)   # the same ranges as a run, and every sharded dim divisible by its mesh axis
  result = planner.plan(cfg)
  chosen = None
  if opts["confirm_batch"]:
    result["batch_window"]["target"] = confirm_batch_window(cfg, build)
  if opts["search"]:
    layouts = planner.search(cfg, opts["devices"] or None, opts["torus"])
    result["search"] = {"devices": opts["devices"] or cfg.mesh.n_devices, "considered": len(layouts),
                        "qualifying": sum(not l["rejected_because"] for l in layouts)}
    result["layouts"] = layouts[:opts["top"]] if opts["top"] else layouts
    if opts["confirm"]:
      confirmed = confirm_layouts(layouts, cfg, opts["top"] or 3, build)
      result["layouts"] = confirmed + result["layouts"][len(confirmed):]
    chosen = layouts[:opts["top"] or 3]
    if opts["plot_layouts"]:
      by_shape = {(l[DATA], l[FSDP], l[TENSOR]): l for l in layouts}
      missing = [s for s in opts["plot_layouts"] if s not in by_shape]
      if missing:
        raise ValueError(f"plot_layouts: {'x'.join(map(str, missing[0]))} is not a data x fsdp x tensor layout of "
                         f"the {result['search']['devices']} devices searched")
      chosen = [by_shape[s] for s in opts["plot_layouts"]]
  if opts["plot"]:
    from shardlab.analysis.plan_figure import efficiency_curve
    result["plot"] = str(efficiency_curve(cfg, opts["plot"], chosen))
  return result


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    return 0
  try:
    result = run(argv)
  except Exception as e:  # Hydra/OmegaConf errors, planner.check's ValueError, ConfigError: one line, exit 2
    print(f"shardlab.plan: error: {_one_line(e)}", file=sys.stderr)
    return 2
  print(json.dumps(result, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
