"""Cross-field checks that run before JAX starts: each failure is one line naming the setting and the fix."""
from __future__ import annotations

from shardlab.config import Config
from shardlab.mesh import ConfigError


def _divides(what: str, value: int, by: str, size: int, why: str) -> None:
  if size > 0 and value % size:
    raise ConfigError(f"{what}={value} is not divisible by {by}={size} ({why}); "
                      f"choose {what.split('.')[-1]} a multiple of {size} or change {by}")


def validate(cfg: Config, n_devices: int | None = None) -> None:
  """Raise ConfigError for the first setting that cannot work. `n_devices`: the devices present, if known."""
  from shardlab import schedules
  from shardlab.attention import IMPLS, block_size
  from shardlab.train import DTYPES
  m, mesh, s, t = cfg.model, cfg.mesh, cfg.schedule, cfg.train
  if mesh.fsdp < 1 or mesh.tensor < 1:
    raise ConfigError(f"mesh.fsdp={mesh.fsdp} mesh.tensor={mesh.tensor}: axis sizes must be >= 1")
  if n_devices is not None and mesh.fsdp * mesh.tensor != n_devices:
    raise ConfigError(f"mesh.fsdp={mesh.fsdp} x mesh.tensor={mesh.tensor} = {mesh.fsdp * mesh.tensor} devices, "
                      f"but {n_devices} are present; choose a mesh whose product is {n_devices}"
                      + (" (or set cpu_devices)" if cfg.cpu_devices != n_devices else ""))
  if cfg.compile_for not in ("local", "target"):
    raise ConfigError(f"compile_for={cfg.compile_for}: choose local (the devices here) or target (the hardware "
                      f"preset's real devices, compiled on this machine)")
  if cfg.cpu_devices < 1:
    raise ConfigError(f"cpu_devices={cfg.cpu_devices}: must be >= 1")
  for name in ("param_dtype", "compute_dtype"):
    if getattr(cfg.precision, name) not in DTYPES:
      raise ConfigError(f"precision.{name}={getattr(cfg.precision, name)}: choose one of {', '.join(DTYPES)}")
  if cfg.precision.param_dtype != "float32":
    raise ConfigError("precision.param_dtype must be float32 (master weights and optimizer state)")
  if m.kind != "transformer":
    raise ConfigError(f"model.kind={m.kind}: only 'transformer' trains (the 'ffn' model is for the planner)")
  for name in ("d_model", "d_ff", "n_layers", "n_heads", "vocab_size", "seq_len"):
    if getattr(m, name) < 1:
      raise ConfigError(f"model.{name}={getattr(m, name)}: must be >= 1")
  _divides("model.d_model", m.d_model, "model.n_heads", m.n_heads, "head_dim = d_model / n_heads")
  if m.n_kv_heads < 0:
    raise ConfigError(f"model.n_kv_heads={m.n_kv_heads}: must be >= 1 (or 0: as many as model.n_heads)")
  if m.n_heads % m.kv_heads:
    raise ConfigError(f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads={m.n_kv_heads} (each "
                      f"key/value head serves the same number of query heads); choose n_kv_heads dividing n_heads")
  if m.attention not in IMPLS:
    raise ConfigError(f"model.attention={m.attention}: unknown; choose one of {', '.join(IMPLS)}")
  if m.attention_block < 1:
    raise ConfigError(f"model.attention_block={m.attention_block}: must be >= 1")
  if m.attention == "blockwise" and m.seq_len % block_size(m.seq_len, m.attention_block):
    raise ConfigError(f"model.seq_len={m.seq_len} is not a multiple of model.attention_block={m.attention_block} "
                      f"(blockwise attention splits the sequence into blocks); choose a block dividing seq_len")
  if m.head_dim % 2:
    raise ConfigError(f"model.d_model / model.n_heads = {m.head_dim} must be even (RoPE rotates pairs)")
  _divides("model.d_model", m.d_model, "mesh.fsdp", mesh.fsdp, "every weight's d_model dim is sharded over fsdp")
  _divides("model.n_heads", m.n_heads, "mesh.tensor", mesh.tensor, "heads are sharded over tensor")
  _divides("model.d_ff", m.d_ff, "mesh.tensor", mesh.tensor, "d_ff is sharded over tensor")
  _divides("model.vocab_size", m.vocab_size, "mesh.tensor", mesh.tensor, "the vocabulary is sharded over tensor")
  _divides("train.batch_size", t.batch_size, "mesh.fsdp", mesh.fsdp, "the batch is sharded over fsdp")
  _divides("train.batch_size", t.batch_size, "mesh.fsdp * schedule.microbatches", mesh.fsdp * s.microbatches,
           "each device splits its batch into microbatches")
  schedules.build(s, m, DTYPES[cfg.precision.compute_dtype])   # the schedule checks its own knobs
  if s.tp in ("allgather", "ring"):
    _divides("model.seq_len", m.seq_len, "mesh.tensor", mesh.tensor, "sequence parallelism shards it over tensor")
  if s.tp == "ring_bidi":
    _divides("model.seq_len", m.seq_len, "2 * mesh.tensor", 2 * mesh.tensor,
             "the bidirectional ring splits each sequence block in halves")
  if t.steps < 1:
    raise ConfigError(f"train.steps={t.steps}: must be >= 1")
  if not 1 <= cfg.data.branching <= m.vocab_size:
    raise ConfigError(f"data.branching={cfg.data.branching}: must be between 1 and model.vocab_size")
  validate_launch(cfg)


def validate_launch(cfg: Config) -> None:
  """Checkpoint and process settings: checked before JAX starts (jax.distributed would wait for bad peers)."""
  c, d = cfg.checkpoint, cfg.distributed
  if c.every < 0:
    raise ConfigError(f"checkpoint.every={c.every}: must be >= 0 (0 saves only at the end and on SIGTERM/SIGINT)")
  if c.keep < 1:
    raise ConfigError(f"checkpoint.keep={c.keep}: must be >= 1 (how many of the newest checkpoints to keep)")
  if d.coordinator is None:
    if d.num_processes != 1 or d.process_id != 0:
      raise ConfigError(f"distributed.num_processes={d.num_processes} distributed.process_id={d.process_id} "
                        "needs distributed.coordinator=HOST:PORT (process 0's address) too")
    return
  host, _, port = d.coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ConfigError(f"distributed.coordinator={d.coordinator}: must be HOST:PORT, e.g. localhost:1234")
  if d.num_processes < 1 or not 0 <= d.process_id < d.num_processes:
    raise ConfigError(f"distributed.process_id={d.process_id}: must be in 0..distributed.num_processes-1 "
                      f"(num_processes={d.num_processes})")
