"""8 fake CPU devices, set here, once, before anything starts JAX; strict rank promotion.

Tests compile with LLVM's optimizations off (XLA's HLO passes, fusion and buffer assignment still run): it
halves compile time, and tests check numbers, bytes and memory, never speed.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

from shardlab.mesh import set_cpu_devices  # noqa: E402

set_cpu_devices(8)

import functools  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# Dtype promotion stays "standard": optax's bias correction mixes Python floats and int32 counts.

ROOT = Path(__file__).resolve().parents[1]
MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]


def tiny_config(**schedule):
  """The tiny model used by the tests: 4 layers, so that prefetch depth 2 still runs a loop of 2 trips."""
  from shardlab.config import Config, ModelConfig, ScheduleConfig, TrainConfig
  return Config(model=ModelConfig(n_layers=4), schedule=ScheduleConfig(**schedule), train=TrainConfig(steps=3))


def preset_names():
  return sorted(p.stem for p in (ROOT / "conf" / "schedule").glob("*.yaml"))


def compose(*overrides: str):
  """The config `python -m shardlab OVERRIDES` would run, composed by Hydra (nothing runs)."""
  from hydra import compose as hydra_compose, initialize_config_dir
  from shardlab.config import register_configs
  register_configs()
  with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
    return hydra_compose(config_name="config", overrides=list(overrides))


def load_preset(name: str) -> dict:
  from omegaconf import OmegaConf
  return OmegaConf.to_container(compose(f"schedule={name}").schedule)


@functools.lru_cache(maxsize=None)
def mesh_of(fsdp: int, tensor: int):
  from shardlab.mesh import make_mesh
  return make_mesh(fsdp, tensor, jax.devices()[: fsdp * tensor])


@functools.lru_cache(maxsize=None)
def batch():
  from shardlab.data import markov_batch
  cfg = tiny_config()
  return markov_batch(0, 0, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size, cfg.data.branching)


@functools.lru_cache(maxsize=None)
def reference_loss_and_grads():
  from shardlab import params as PM, reference as R
  cfg = tiny_config()
  p = PM.init(jax.random.key(0), PM.declare(cfg.model), cfg.model)
  b = batch()
  with jax.numpy_dtype_promotion("strict"):
    return jax.jit(jax.value_and_grad(lambda p: R.loss(p, b[:, :-1], b[:, 1:], cfg)))(p)


@functools.lru_cache(maxsize=None)
def compiled_grads(mesh_shape: tuple, schedule_items: tuple):
  """(compiled grad fn, its outputs) for one mesh and schedule: shared by every test that needs them."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from shardlab import params as PM, schedules, train as T
  cfg = tiny_config(**dict(schedule_items))
  mesh = mesh_of(*mesh_shape)
  decls = PM.declare(cfg.model)
  params = PM.init_sharded(0, decls, cfg.model, mesh)
  b = jax.device_put(batch(), NamedSharding(mesh, P("fsdp")))
  sched = schedules.build(cfg.schedule, cfg.model, jnp.float32)
  with jax.numpy_dtype_promotion("strict"):
    compiled = T.make_grad_fn(cfg, sched, decls, mesh).lower(params, b).compile()
  return compiled, compiled(params, b)


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: runs the CLI in subprocesses")
