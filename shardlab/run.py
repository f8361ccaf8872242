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


def build(cfg: Config):
  """Everything a run needs before it has data: mesh, parameter declarations, schedule, optimizer and the
  jitted step, plus the abstract (shape, dtype, sharding) state and batch it compiles for."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from shardlab import params as PM, schedules, train as T
  from shardlab.mesh import FSDP, make_mesh
  mesh = make_mesh(cfg.mesh.fsdp, cfg.mesh.tensor)
  decls = PM.declare(cfg.model)
  sched = schedules.build(cfg.schedule, cfg.model, T.DTYPES[cfg.precision.compute_dtype])
  opt = T.make_optimizer(cfg, decls)
  step_fn = T.make_train_step(cfg, sched, decls, opt, mesh)
  specs = T.state_specs(opt, decls)
  shapes = jax.eval_shape(lambda: T.init_state_local(PM.init(jax.random.key(0), decls, cfg.model), opt))
  abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                                shapes, specs)
  abstract_batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32,
                                        sharding=NamedSharding(mesh, P(FSDP)))
  return dict(mesh=mesh, decls=decls, schedule=sched, opt=opt, step_fn=step_fn, abstract_state=abstract_state,
              abstract_batch=abstract_batch)


def train(cfg: Config, out_dir: str | os.PathLike, resolved: dict | None = None) -> dict:
  """Validate, build, compile, analyze and (unless cfg.dry_run) train; returns the summary, which is also
  written to out_dir/summary.json."""
  from shardlab.mesh import set_cpu_devices
  from shardlab.validate import validate
  set_cpu_devices(cfg.cpu_devices)
  import jax
  validate(cfg, len(jax.devices()))               # before anything is compiled or written
  from jax.sharding import NamedSharding, PartitionSpec as P
  from tqdm import tqdm

  from shardlab import params as PM, train as T
  from shardlab.analysis.program import analyze
  from shardlab.data import MarkovData
  from shardlab.mesh import FSDP

  b = build(cfg)
  mesh = b["mesh"]
  t0 = time.perf_counter()
  compiled = b["step_fn"].lower(b["abstract_state"], b["abstract_batch"]).compile()
  compile_time = time.perf_counter() - t0
  analysis = analyze(compiled, mesh)
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  devs = jax.devices()
  summary = {
      "status": "ok", "mesh": {"fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}, "devices": len(devs),
      "platform": devs[0].platform, "device_kind": devs[0].device_kind, "schedule": cfg.schedule.name,
      "n_params": PM.count(b["decls"]), "compile_time_s": compile_time, "jax_version": jax.__version__,
      **analysis, "config": resolved if resolved is not None else _asdict(cfg)}

  if not cfg.dry_run:
    state = T.init_state(PM.init_sharded(cfg.train.seed, b["decls"], cfg.model, mesh), b["opt"], b["decls"], mesh)
    data = MarkovData(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size,
                      cfg.data.branching, NamedSharding(mesh, P(FSDP)))
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
    median = statistics.median(times[1:] or times)
    summary.update(losses=losses, final_loss=losses[-1], step_time_s_median=median,
                   tokens_per_s_median=tokens / median)
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
