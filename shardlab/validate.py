"""Every check of a setting, before anything starts: the range of each number (`RANGES`, one table) and the
cross-field checks (mesh against devices, dimensions against axis sizes, schedule knobs against each other).
Each failure is one ConfigError line naming the setting, its value and the fix."""
from __future__ import annotations

import math

from shardlab import axes as X
from shardlab.config import Config, MeshConfig
from shardlab.errors import ConfigError, RunError  # noqa: F401  (RunError re-exported)
from shardlab.layout import from_config
from shardlab.mesh import describe
from shardlab.params import check_divisible


def _divides(what: str, value: int, by: str, size: int, why: str) -> None:
  if size > 0 and value % size:
    raise ConfigError(f"{what}={value} is not divisible by {by}={size} ({why}); "
                      f"choose {what.split('.')[-1]} a multiple of {size} or change {by}")


# The range of every numeric setting: (setting, lowest, highest, why). A bound in a list is open ([0] is "> 0"),
# a plain number closed; None: no bound. Floats must also be finite. The default of the setting is the example
# fix the message gives.
RANGES = [
    ("cpu_devices", 1, None, "fake CPU devices of this process"),
    *[(f"mesh.{a}", 1, None, f"size of the {a} mesh axis: {X.get(a).doc}") for a in MeshConfig().sizes],
    *[(f"mesh.{a}_ici_axes", 0.5, None, f"physical interconnect axes the {a} axis spans (0.5: one without "
                                       f"wraparound)")
      for a in MeshConfig().sizes],
    ("model.d_model", 1, None, "model width"),
    ("model.d_ff", 1, None, "feed-forward width"),
    ("model.n_layers", 1, None, "transformer layers"),
    ("model.n_heads", 1, None, "attention heads"),
    ("model.vocab_size", 1, None, "vocabulary size"),
    ("model.seq_len", 2, None, "tokens per sequence: one token has nothing to attend to"),
    ("model.rope_theta", [0], None, "RoPE base"),
    ("model.init_std", [0], None, "initial weight scale: 0 makes every unit the same"),
    ("model.norm_eps", [0], None, "RMSNorm epsilon: 0 divides by zero on a zero row"),
    ("schedule.prefetch", 0, None, "FSDP prefetch depth"),
    ("schedule.microbatches", 1, None, "microbatches per step"),
    ("pipeline.microbatches", 0, None, "microbatches per step through the pipeline (0: one per stage)"),
    ("pipeline.virtual_stages", 1, None, "model chunks per pipeline stage"),
    ("pipeline.consecutive", 0, None, "interleaved: microbatches per group (0: mesh.pipeline)"),
    ("train.steps", 1, None, "optimizer steps"),
    ("train.batch_size", 1, None, "global batch in sequences"),
    ("train.seed", 0, 2**32 - 1, "JAX keys take 32 bits"),
    ("train.lr", [0], None, "peak learning rate"),
    ("train.warmup_steps", 0, None, "learning-rate warmup steps"),
    ("train.b1", 0, [1], "Adam's first-moment decay"),
    ("train.b2", 0, [1], "Adam's second-moment decay"),
    ("train.adam_eps", [0], None, "Adam's epsilon: 0 divides by zero"),
    ("train.weight_decay", 0, None, "AdamW weight decay"),
    ("train.grad_clip", [0], None, "global gradient-norm clip: 0 would zero every update"),
    ("train.global_batch_tokens", 0, None, "prediction's batch in tokens (0: batch_size * seq_len)"),
    ("train.mfu", 0, 1, "the planner's assumed model FLOP utilization (0: its time model)"),
    ("data.branching", 1, None, "successors per token"),
    ("model.router_aux_loss", 0, None, "the load-balancing loss's weight"),
    ("model.router_z_loss", 0, None, "the router z-loss's weight"),
    ("model.router_skew", 0, None, "a fixed skew of the router's top-k pick"),
    ("expert.capacity_factor", 0, None, "all_to_all's slots per expert over the balanced share (0: dropless)"),
    ("context.ulysses", 0, None, "usp, a2a_p2p: the Ulysses degree (0: chosen)"),
    ("context.node_devices", 0, None, "a2a_p2p: devices per node (0: one node)"),
    ("hardware.peak_flops", [0], None, "FLOP/s per device"),
    ("hardware.ici_bandwidth", [0], None, "bytes/s per device on one mesh axis"),
    ("hardware.dcn_bandwidth", 0, None, "bytes/s per device beyond the fast domain (0: not modeled)"),
    ("hardware.hop_latency_s", 0, None, "latency of one collective hop"),
    ("hardware.hbm_bytes", [0], None, "memory per device"),
    ("hardware.hbm_bandwidth", [0], None, "memory bandwidth per device"),
    ("hardware.domain_devices", 0, None, "devices on the fast interconnect (0: no limit)"),
    ("hardware.gemm_efficiency", [0], None, "the fraction of peak_flops a large GEMM reaches"),
    ("hardware.attention_efficiency", [0], None, "the fraction of peak_flops a fused attention kernel reaches"),
    ("hardware.flash_kernel_efficiency", 0, None, "that of shardlab's Pallas kernel (0: attention_efficiency)"),
    ("hardware.hbm_efficiency", [0], None, "the fraction of hbm_bandwidth a memory-bound kernel reaches"),
    ("hardware.link_efficiency", [0], None, "achieved bus bandwidth over ici_bandwidth"),
    ("hardware.link_half_bytes", 0, None, "message bytes at half the bus bandwidth (0: no ramp)"),
    ("hardware.collective_latency_s", 0, None, "a collective's launch latency"),
    ("hardware.kernel_launch_s", 0, None, "a kernel's launch overhead"),
    ("hardware.gemm_tile", 1, None, "a GEMM output tile's edge"),
    ("hardware.compute_units", 0, None, "SMs or cores a GEMM's tiles run in waves over (0: no quantization)"),
    ("checkpoint.every", 0, None, "save every N steps (0: only at the end and on SIGTERM/SIGINT)"),
    ("checkpoint.keep", 1, None, "how many of the newest checkpoints to keep"),
    ("distributed.num_processes", 1, None, "processes that share the mesh"),
    ("distributed.process_id", 0, None, "this process's index"),
    ("distributed.timeout_s", [0], None, "how long to wait for the other processes"),
    ("distributed.heartbeat_timeout_s", 1, None, "silence after which a process counts as lost"),
    ("profile.start_step", 0, None, "first profiled step"),
    ("profile.steps", 1, None, "profiled steps"),
]


def _get(cfg, path: str):
  for part in path.split("."):
    cfg = getattr(cfg, part)
  return cfg


def _bounds(lo, hi) -> str:
  if hi is None:
    return f"{'>' if isinstance(lo, list) else '>='} {lo[0] if isinstance(lo, list) else lo}"
  left, right = ("(", lo[0]) if isinstance(lo, list) else ("[", lo), ((hi[0], ")") if isinstance(hi, list) else (hi, "]"))
  return f"in {left[0]}{left[1]}, {right[0]}{right[1]}"


def _inside(v, lo, hi) -> bool:
  ok = v > lo[0] if isinstance(lo, list) else v >= lo
  if hi is not None:
    ok = ok and (v < hi[0] if isinstance(hi, list) else v <= hi)
  return ok and not (isinstance(v, float) and not math.isfinite(v))


def check_ranges(cfg: Config, rows=RANGES) -> None:
  """The first setting outside its range (or not finite) -> ConfigError naming it, its range and an example."""
  default = Config()
  for path, lo, hi, why in rows:
    v = _get(cfg, path)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not _inside(v, lo, hi):
      ex = _get(default, path)
      where = cfg.hardware.file if path.startswith("hardware.") else ""
      if where:      # the figure came from hardware.file=, beside which an override is refused: fix it there
        raise ConfigError(f"hardware.file={where}: {path.split('.', 1)[1]}: {v!r} must be {_bounds(lo, hi)} "
                          f"({why}); e.g. {path.split('.', 1)[1]}: {ex:g} in that file")
      raise ConfigError(f"{path}={v!r}: must be {_bounds(lo, hi)} ({why}); e.g. {path}={ex:g}")


def validate_plan(cfg: Config) -> None:
  """The planner's checks (`python -m shardlab.plan`): ranges, and every sharded dimension divisible by its mesh
  axis (the planner's formulas assume even shards). No device count: the planner needs no devices."""
  check_ranges(cfg, [r for r in RANGES if r[0].split(".")[0] not in ("checkpoint", "distributed", "profile")])
  m, mesh = cfg.model, cfg.mesh
  if m.kind not in ("transformer", "ffn"):
    raise ConfigError(f"model.kind={m.kind}: choose transformer or ffn")
  if m.moe:
    raise ConfigError(f"model.n_experts={m.n_experts}: the planner's layout search prices dense models; plan a mixture "
                      f"of experts with expert_search=true (dispatcher, expert-parallel degree and capacity)")
  if m.kind == "transformer" and not m.head_size:
    _divides("model.d_model", m.d_model, "model.n_heads", m.n_heads, "head_dim = d_model / n_heads")
  layout = from_config(cfg.layout)
  layout.check(tuple(mesh.shape))
  check_divisible(m, layout, mesh.shape)


def validate(cfg: Config, n_devices: int | None = None) -> None:
  """Raise ConfigError for the first setting that cannot work. `n_devices`: the devices present, if known."""
  from shardlab.composition import resolve
  from shardlab.train import DTYPES
  m, mesh, t = cfg.model, cfg.mesh, cfg.train
  check_ranges(cfg)
  if min(mesh.sizes.values()) < 1:
    raise ConfigError(f"{describe(mesh.shape)}: axis sizes must be >= 1")
  if n_devices is not None and mesh.n_devices != n_devices:
    raise ConfigError(f"{describe(mesh.shape)} = {mesh.n_devices} devices, "
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
  if m.kind not in ("transformer", "ffn"):
    raise ConfigError(f"model.kind={m.kind}: choose transformer or ffn")
  for name in ("d_model", "d_ff", "n_layers", "n_heads", "vocab_size", "seq_len"):
    if getattr(m, name) < 1:
      raise ConfigError(f"model.{name}={getattr(m, name)}: must be >= 1")
  if m.kind == "ffn":
    _validate_ffn(cfg)
  else:
    _validate_attention(cfg)
  validate_experts(cfg)
  c = resolve(cfg)
  _validate_kernel(cfg, c)
  c.layout.check(tuple(mesh.shape))      # the rules themselves, before anything is declared with them
  sched = c.build_schedule()             # its knobs
  c.check(sched)
  ep = getattr(sched, "ep", None)
  if m.moe and cfg.expert.chunks > 1 and ep is None:
    raise ConfigError(f"expert.chunks={cfg.expert.chunks}: schedule={sched.cfg.name} runs no dispatcher of "
                      f"shardlab's (the compiler places the MoE layer's communication), so nothing is chunked; drop "
                      f"expert.chunks")
  if m.moe and cfg.expert.chunks > 1:
    layout, shape = c.layout, mesh.shape
    size = lambda axes: math.prod(shape[a] for a in axes)
    names = tuple(shape)
    tokens = (t.batch_size // size(layout.batch_axes(names)) // c.microbatches_of(sched)[0]
              * (m.seq_len // size(layout.rule("length", names))))
    tokens //= mesh.tensor if sched.ops.seq_sharded else 1
    if tokens % cfg.expert.chunks:
      raise ConfigError(f"expert.chunks={cfg.expert.chunks} does not divide the {tokens} tokens each device routes "
                        f"per layer; choose chunks dividing them")
  if m.moe and ep is not None and n_devices is not None:   # the local devices run it (not a target's dry run)
    import jax
    why = ep.runs_on(jax.devices()[0].platform)
    if why:
      raise ConfigError(why)
  if t.steps < 1:
    raise ConfigError(f"train.steps={t.steps}: must be >= 1")
  if not 1 <= cfg.data.branching <= m.vocab_size:
    raise ConfigError(f"data.branching={cfg.data.branching}: must be between 1 and model.vocab_size")
  validate_launch(cfg)


def validate_experts(cfg: Config) -> None:
  """A mixture of experts' settings, and an expert axis only for one."""
  m, n = cfg.model, cfg.mesh.sizes.get(X.EXPERT, 1)
  if m.n_experts < 0:
    raise ConfigError(f"model.n_experts={m.n_experts}: must be >= 0 (0: a dense MLP)")
  if not m.moe:
    if n > 1:
      raise ConfigError(f"mesh.expert={n} splits a MoE layer's experts, but model.n_experts=0 (a dense model); "
                        f"set model.n_experts (e.g. model=tiny_moe) or mesh.expert=1")
    return
  if m.kind == "ffn":
    raise ConfigError("model.n_experts: the FFN-only model (model.kind=ffn) has no MoE layers; set model.n_experts=0")
  if not 1 <= m.top_k <= m.n_experts:
    raise ConfigError(f"model.top_k={m.top_k}: each token picks between 1 and model.n_experts={m.n_experts} experts; "
                      f"choose top_k between 1 and {m.n_experts}")
  for name in ("expert_d_ff", "n_shared_experts", "router_aux_loss", "router_z_loss", "router_skew"):
    if getattr(m, name) < 0:
      raise ConfigError(f"model.{name}={getattr(m, name)}: must be >= 0")
  if cfg.expert.capacity_factor < 0:
    raise ConfigError(f"expert.capacity_factor={cfg.expert.capacity_factor}: must be >= 0 (0: dropless)")


FFN_REMAT = ("none", "full", "save_matmuls")   # the FFN-only model has no attention to save or recompute


def _validate_ffn(cfg: Config) -> None:
  if cfg.schedule.remat not in FFN_REMAT:
    raise ConfigError(f"schedule.remat={cfg.schedule.remat}: the FFN-only model (model.kind=ffn) has no attention; "
                      f"choose {' | '.join(FFN_REMAT)}")


def _validate_attention(cfg: Config) -> None:
  """The transformer's heads, attention and vocabulary."""
  from shardlab.attention import IMPLS, block_size
  m = cfg.model
  if m.head_size < 0:
    raise ConfigError(f"model.head_size={m.head_size}: must be >= 1 (or 0: d_model / n_heads)")
  if not m.head_size:
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
  from shardlab.config import PLACEMENTS
  if cfg.context.placement not in PLACEMENTS:
    raise ConfigError(f"context.load_balance={cfg.context.load_balance}: choose false, true (zigzag), zigzag or "
                      f"striped")
  from shardlab.schedules.context import KERNEL_SETTINGS
  if cfg.context.kernel not in KERNEL_SETTINGS:
    raise ConfigError(f"context.kernel={cfg.context.kernel}: choose one of {', '.join(KERNEL_SETTINGS)}")


def _validate_kernel(cfg: Config, c) -> None:
  """context.kernel=pallas for a GPU target where the context strategy runs per-step kernels (it says on which
  platforms: `kernel(local, head_dim)`, the ring's) and the Triton kernel does not take this run's shapes."""
  C = cfg.mesh.sizes.get(X.CONTEXT, 1)
  if cfg.context.kernel != "pallas" or C == 1 or cfg.compile_for != "target" or cfg.hardware.target_platform != "cuda":
    return
  strategy = c.cp
  if not callable(getattr(strategy, "kernel", None)):
    return
  step = getattr(strategy, "step_tokens", None)   # the ring's block: L / C, or USP's U L / C
  local = step(cfg.model.seq_len, cfg.mesh.shape) if callable(step) else cfg.model.seq_len // C
  if "cuda" not in strategy.kernel(local, cfg.model.head_dim):
    from shardlab.flash_kernel import usable
    raise ConfigError(f"context.kernel=pallas: the Pallas kernel's Triton tiles do not fit this run "
                      f"({usable(local, local, cfg.model.head_dim)}); use context.kernel=auto (the kernel where it "
                      f"fits, pure JAX elsewhere) or jax")


def validate_launch(cfg: Config) -> None:
  """Checkpoint and process settings: checked before JAX starts (jax.distributed would wait for bad peers)."""
  c, d = cfg.checkpoint, cfg.distributed
  check_ranges(cfg)
  if c.dir is not None and not str(c.dir).strip():
    raise ConfigError(f"checkpoint.dir={c.dir!r}: empty; use checkpoint.dir=null for <run dir>/checkpoints, or a path")
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
