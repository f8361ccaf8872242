"""The Hydra entry point: `python -m shardlab [overrides]` trains one configuration and writes
metrics.jsonl and summary.json in the run directory."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from shardlab.config import Config, register_configs, to_config
from shardlab.mesh import ConfigError

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def train(cfg: Config, out_dir: str | os.PathLike, resolved: dict | None = None) -> dict:
  """Validate, build, compile and run; returns the summary (also written to out_dir/summary.json)."""
  from shardlab.mesh import make_mesh, set_cpu_devices
  from shardlab.validate import validate
  set_cpu_devices(cfg.cpu_devices)
  import jax
  validate(cfg, len(jax.devices()))               # before anything is compiled or written
  from jax.sharding import NamedSharding, PartitionSpec as P
  from tqdm import tqdm

  from shardlab import params as PM, schedules, train as T
  from shardlab.data import MarkovData
  from shardlab.mesh import FSDP

  mesh = make_mesh(cfg.mesh.fsdp, cfg.mesh.tensor)
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  decls = PM.declare(cfg.model)
  sched = schedules.build(cfg.schedule, cfg.model, T.DTYPES[cfg.precision.compute_dtype])
  opt = T.make_optimizer(cfg, decls)
  state = T.init_state(PM.init_sharded(cfg.train.seed, decls, cfg.model, mesh), opt, decls, mesh)
  data = MarkovData(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size,
                    cfg.data.branching, NamedSharding(mesh, P(FSDP)))
  step_fn = T.make_train_step(cfg, sched, decls, opt, mesh)

  t0 = time.perf_counter()
  compiled = step_fn.lower(state, data.batch(0)).compile()
  compile_time = time.perf_counter() - t0

  tokens = cfg.train.batch_size * cfg.model.seq_len
  losses, times = [], []
  with open(out / "metrics.jsonl", "w") as f:
    bar = tqdm(range(cfg.train.steps), disable=not cfg.progress or jax.process_index() != 0, desc="train")
    for step in bar:
      batch = data.batch(step)
      t = time.perf_counter()
      state, met = compiled(state, batch)
      loss, gnorm = float(met["loss"]), float(met["grad_norm"])   # waits for the step
      dt = time.perf_counter() - t
      losses.append(loss)
      times.append(dt)
      rec = {"step": step, "loss": loss, "grad_norm": gnorm, "step_time_s": dt, "tokens_per_s": tokens / dt}
      f.write(json.dumps(rec) + "\n")
      f.flush()
      bar.set_postfix(loss=f"{loss:.4f}")
      if loss != loss or abs(loss) == float("inf"):
        raise FloatingPointError(f"non-finite loss {loss} at step {step}")

  devs = jax.devices()
  summary = {
      "status": "ok", "losses": losses, "final_loss": losses[-1],
      "mesh": {"fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}, "devices": len(devs),
      "platform": devs[0].platform, "device_kind": devs[0].device_kind,
      "schedule": cfg.schedule.name, "n_params": PM.count(decls),
      "compile_time_s": compile_time, "step_time_s_median": statistics.median(times[1:] or times),
      "tokens_per_s_median": tokens / statistics.median(times[1:] or times),
      "jax_version": jax.__version__, "config": resolved if resolved is not None else _asdict(cfg),
  }
  (out / "summary.json").write_text(json.dumps(summary, indent=2))
  return summary


def _asdict(cfg):
  import dataclasses
  return dataclasses.asdict(cfg)


def _task(dcfg) -> None:
  from hydra.core.hydra_config import HydraConfig
  from omegaconf import OmegaConf
  out_dir = HydraConfig.get().runtime.output_dir
  try:
    train(to_config(dcfg), out_dir, OmegaConf.to_container(dcfg, resolve=True))
  except ConfigError as e:
    print(f"shardlab: error: {e}", file=sys.stderr)
    sys.exit(2)
  except Exception as e:
    Path(out_dir, "summary.json").write_text(json.dumps(
        {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}, indent=2))
    raise


def cli() -> None:
  import hydra
  register_configs()
  hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)(_task)()


if __name__ == "__main__":
  cli()
