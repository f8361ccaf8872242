"""Typed configuration: one dataclass per Hydra group, registered in Hydra's ConfigStore.

Hydra validates overrides against these schemas, so a typo (`schedule.prefech=1`) or a wrong type
(`mesh.fsdp=two`) fails before anything runs. Cross-field checks (mesh against devices, dimensions against
axis sizes, schedule knobs against each other) live in `validate.py` and also run before any compile.
The core never imports Hydra except here, in `register_configs` and `compose`, which only the entry points call.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from shardlab.data import striped, zigzag
from shardlab.hardware import HardwareConfig
from shardlab.layout import LayoutConfig

# The Hydra config groups: conf/ at the repository's top level in a source checkout (and an editable install);
# the wheel ships the same files inside the package, as shardlab/conf/ (pyproject.toml: package-dir), so an
# installed shardlab runs from any directory without the source tree.
_PACKAGE = Path(__file__).resolve().parent
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf" / "config.yaml").is_file() else _PACKAGE.parent / "conf"


@dataclass
class MeshConfig:
  """The size of each declared mesh axis (shardlab/axes.py), outer to inner; 1: no such axis (fsdp and tensor
  are always in the mesh). `mesh.<axis>_ici_axes`: the physical interconnect axes each spans (the Scaling Book's
  M_X, M_Y), used only by prediction."""
  pipeline: int = 1        # pipeline stages: the layers split over `pipeline`
  data: int = 1            # size of the `data` mesh axis (HSDP replicas: batch only, weights replicated); 1: none
  fsdp: int = 4            # size of the `fsdp` mesh axis: batch and every large weight's `embed` dim
  expert: int = 1          # size of the `expert` mesh axis: a MoE layer's experts (the batch elsewhere)
  context: int = 1         # size of the `context` mesh axis: the sequence of every activation
  tensor: int = 2          # size of the `tensor` mesh axis: heads, d_ff, vocab (and sequence, when sequence-parallel)
  fsdp_ici_axes: float = 1        # 0.5: one slice axis without wraparound (a line: hardware.torus_wrap)
  tensor_ici_axes: float = 1
  data_ici_axes: float = 1
  pipeline_ici_axes: float = 1
  context_ici_axes: float = 1
  expert_ici_axes: float = 1

  @property
  def sizes(self) -> dict:
    """{axis: size} for every declared axis this config sizes (1 for none)."""
    from shardlab.axes import names
    return {a: getattr(self, a) for a in names() if hasattr(self, a)}

  @property
  def shape(self) -> dict:
    """{axis: size} of the mesh, outer to inner (fsdp and tensor always, other axes when > 1): axes.shape_of."""
    from shardlab.axes import shape_of
    return shape_of(self.sizes)

  @property
  def n_devices(self) -> int:
    return math.prod(self.sizes.values())

  @property
  def label(self) -> str:
    """'4x2' (fsdp x tensor), '2x2x2' (data x fsdp x tensor), or with other axes named ('p2xf2xt2'): axes.label."""
    from shardlab.axes import label
    return label(self.shape)

  def ici_axes(self, axis: str) -> float:
    """Physical interconnect axes `axis` spans (mesh.<axis>_ici_axes; 1 for an axis with no such setting)."""
    return getattr(self, f"{axis}_ici_axes", 1)


@dataclass
class ModelConfig:
  name: str = "tiny"
  kind: str = "transformer"  # transformer | ffn (the Scaling Book's L blocks of D->F->D on fixed token codes)
  d_model: int = 64
  d_ff: int = 128
  n_layers: int = 2
  n_heads: int = 8
  n_kv_heads: int = 0        # key/value heads (grouped-query attention); 0: = n_heads (multi-head attention)
  vocab_size: int = 256
  seq_len: int = 32
  rope_theta: float = 10000.0
  init_std: float = 0.02
  norm_eps: float = 1e-6
  attention: str = "plain"   # plain (materialises [B, H, L, L]) | blockwise (online softmax, O(L) memory)
                             # | dot_product (jax.nn.dot_product_attention: cuDNN flash attention on GPU)
  attention_block: int = 512  # blockwise: queries and keys per block (min(this, seq_len))
  head_size: int = 0         # each head's width; 0: d_model / n_heads (Qwen3 sets 128 beside d_model 2048, 32 heads)
  # Mixture of experts (model.n_experts > 0): every layer's MLP is a router and n_experts SwiGLU experts of width
  # expert_d_ff, each token through its top_k (softmax, then the top k renormalised: Mixtral, Qwen3-MoE), plus
  # n_shared_experts always-on experts (one dense SwiGLU of n_shared_experts x expert_d_ff, DeepSeek-MoE). The
  # dispatch over `mesh.expert` is the `expert` group (schedules/expert.py).
  n_experts: int = 0         # 0: dense (d_ff); else experts per layer
  top_k: int = 2
  expert_d_ff: int = 0       # 0: d_ff
  n_shared_experts: int = 0
  router_aux_loss: float = 0.01  # load-balancing loss (Switch, arXiv:2101.03961), per sequence, times this
  router_z_loss: float = 0.0     # router z-loss (ST-MoE, arXiv:2202.08906): mean logsumexp(logits)^2, times this
  router_skew: float = 0.0       # a fixed offset skew x (E-1-e)/(E-1) on expert e's logit when the top k are picked
                                 # (not in the gates: DeepSeek-V3's selection bias, untrained): early experts get
                                 # more tokens, to compare dispatchers under imbalance

  @property
  def label(self) -> str:
    """The preset's name, or `<name>+overrides` where the architecture differs from conf/model/<name>.yaml (a model
    built by overrides on a preset is not that preset: run names, summary.json's `model`, the figures)."""
    return model_label(self.__dict__)

  @property
  def head_dim(self) -> int:
    return self.head_size or self.d_model // self.n_heads

  @property
  def kv_heads(self) -> int:
    """Key/value heads: n_kv_heads, or n_heads when it is 0."""
    return self.n_kv_heads or self.n_heads

  @property
  def moe(self) -> bool:
    return self.n_experts > 0

  @property
  def expert_ff(self) -> int:
    """Each routed expert's hidden width: expert_d_ff, or d_ff when it is 0."""
    return self.expert_d_ff or self.d_ff

  @property
  def mlp_ff(self) -> int:
    """The dense SwiGLU's width: d_ff, or in a MoE layer the shared experts' n_shared_experts x expert_ff (0:
    none)."""
    return self.n_shared_experts * self.expert_ff if self.moe else self.d_ff


def schedule_label(name: str, impl: str, tp: str) -> str:
  """ScheduleConfig.label from its fields (also the `schedule_label` resolver of the run directory's name)."""
  cls = lambda spec: spec.rpartition(":")[2] if ":" in spec else None
  return (cls(impl) or name) + (f"-{cls(tp)}" if cls(tp) else "")


@dataclass
class ScheduleConfig:
  name: str = "baseline"
  impl: str = "explicit"          # explicit | gspmd | package.module:Class (schedules/__init__.py, protocol.py)
  prefetch: int = 0               # FSDP prefetch depth: layer l+k's weights gathered while layer l computes
  reshard_after_forward: bool = True  # True: re-gather in backward; False: keep gathered weights as residuals
  gather_dtype: str = "param"     # param | compute: cast before the all-gather (half the bytes in bf16)
  tp: str = "allgather"           # allgather | ring | ring_bidi | allreduce | package.module:Class (schedules/tp.py)
  grad_reduce: str = "per_layer"  # per_layer | next_layer (one backward iteration later) | deferred (once per step)
  weights: str = "sharded"        # sharded (FSDP / HSDP / data parallel, by the layout) | package.module:Class
                                  # (schedules/weights.py): the part the four knobs above configure
  microbatches: int = 1
  remat: str = "none"             # none | full | save_matmuls | save_qkv_proj | save_qkv_attn_out
                                  # | save_matmuls_attn_out (schedules/stage.py: REMAT)

  @property
  def label(self) -> str:
    """What the run ran, for run and sweep directory names, summary.json and reports: the preset's name, or a
    user's class (`impl=my_sched:AllReduceSlice` -> 'AllReduceSlice'), with a user's TP class after it."""
    return schedule_label(self.name, self.impl, self.tp)


@dataclass
class ContextConfig:
  """Context parallelism (`mesh.context=C`): how attention works across the sequence's split (schedules/context.py)."""
  name: str = "all_gather"
  impl: str = "all_gather"        # all_gather | ring | ulysses | usp | a2a_p2p | package.module:Class
  load_balance: Any = False       # causal load balancing: false (contiguous chunks) | true or zigzag (device r holds
                                  # chunks r and 2C-1-r, data.zigzag) | striped (tokens r, r+C, r+2C, ..., data.striped)
  kernel: str = "auto"            # ring's per-step kernel: auto (the Pallas kernel in a program lowered for a GPU
                                  # or a TPU, pure JAX elsewhere) | jax | pallas (also here: Pallas's interpreter)
  ulysses: int = 0                # usp, a2a_p2p: the Ulysses degree U (all-to-all among U consecutive context
                                  # ranks, the ring over C/U); 0: usp, the most the heads allow below C; a2a_p2p,
                                  # the context ranks of one node
  node_devices: int = 0           # a2a_p2p: devices per node (its preset reads hardware.domain_devices); 0: one node

  def order(self, seq_len: int, parts: int):
    """The order the data holds a sequence's tokens in over `parts` context devices (None: as they come)."""
    if parts <= 1 or self.placement == "none":
      return None
    return striped(seq_len, parts) if self.placement == "striped" else zigzag(seq_len, parts)

  @property
  def placement(self) -> str:
    """none, zigzag or striped (context.load_balance: false, true or zigzag, striped); anything else as given."""
    return placement_of(self.load_balance)

  @property
  def balanced(self) -> bool:
    """The tokens placed so that every device does about the same causal work (zigzag or striped)."""
    return self.placement != "none"


PLACEMENTS = ("none", "zigzag", "striped")


def placement_of(load_balance) -> str:
  """context.load_balance's placement: false -> none, true or zigzag -> zigzag, striped -> striped."""
  v = str(load_balance).lower()
  return {"false": "none", "none": "none", "true": "zigzag"}.get(v, v)


@dataclass
class ExpertConfig:
  """Expert parallelism (`mesh.expert=N`, model.n_experts > 0): how a MoE layer's tokens reach their experts and
  come back (schedules/expert.py, docs/experts.md)."""
  name: str = "all_to_all"
  impl: str = "all_to_all"        # all_to_all | all_gather | hierarchical | ragged | package.module:Class
  capacity_factor: float = 0.0    # all_to_all: slots per expert = ceil(factor x tokens x top_k / experts) per
                                  # device, the rest dropped (GShard); 0: dropless (every token kept)
  cpu_fallback: bool = True       # ragged on a CPU (no ragged_all_to_all there): the same exchange through a
                                  # padded all_to_all; false refuses to run ragged on a CPU
  chunks: int = 1                 # dispatch, experts and combine in this many chunks of each device's tokens, so
                                  # one chunk's transfers can run behind another's experts (MaxText's
                                  # num_moe_token_chunks); a capacity then applies per chunk


@dataclass
class PipelineConfig:
  """Pipeline parallelism (`mesh.pipeline=P`): the layer stack split into P stages, run by a schedule table
  (pipeline_tables.py, schedules/pipeline.py, docs/pipeline.md)."""
  name: str = "none"
  impl: str = "none"              # none | gpipe | 1f1b | eager_1f1b | interleaved | zb_h1 | zb_h2 | zb_v |
                                  # dualpipev | looped_bfs | package.module:Class
  microbatches: int = 0           # M; 0: one per stage (M = mesh.pipeline), the fewest every schedule runs with
  virtual_stages: int = 1         # V: model chunks per stage (interleaved, looped_bfs; 2 for zb_v, dualpipev)
  consecutive: int = 0            # interleaved: microbatches back to back per chunk (Llama 3's flexible interleave;
                                  # 0: mesh.pipeline, Megatron's groups of P)
  gather: str = "microbatch"      # FSDP weights of a stage: gathered in every F and B (microbatch) or once (step)
  table: str = ""                 # PATH.csv: a schedule in torch.distributed.pipelining's CSV format (one row per
                                  # rank); it fixes the stages, microbatches and virtual stages (pipeline_tables.py)

  def count(self, pipeline: int) -> int:
    """M on a pipeline of `pipeline` stages."""
    return self.microbatches or pipeline

  @property
  def staged(self) -> bool:
    """A schedule table runs the layers as stages (impl is not `none`, or a CSV table is given): the one place
    that reads the sentinel."""
    return self.impl != "none" or bool(self.table)

  def with_table(self, stages: int) -> "PipelineConfig":
    """This config with what its CSV table fixes filled in (microbatches, virtual_stages; the name, where none
    was picked: the file's stem), checked against `stages` (mesh.pipeline) and the values set: one line where
    they disagree. Itself without a table."""
    if not self.table:
      return self
    from shardlab.errors import ConfigError
    from shardlab.pipeline_tables import read_csv
    _, P, V, M, _ = read_csv(self.table)
    where = f"pipeline.table={self.table}"
    if P != stages:
      raise ConfigError(f"{where} has {P} ranks (rows), mesh.pipeline={stages}: set mesh.pipeline={P}")
    for key, got in (("microbatches", M), ("virtual_stages", V)):
      asked = getattr(self, key)
      if asked not in (got, 0 if key == "microbatches" else 1):      # (0 and 1: left at their defaults)
        raise ConfigError(f"{where} runs {got} {key.replace('_', ' ')}, pipeline.{key}={asked}: leave pipeline.{key} "
                          f"out (the file fixes it) or set it to {got}")
    name = Path(self.table).stem if self.impl == "none" else self.name
    return dataclasses.replace(self, microbatches=M, virtual_stages=V, name=name)


@dataclass
class TrainConfig:
  steps: int = 30
  batch_size: int = 16            # global batch, in sequences
  seed: int = 0
  lr: float = 2e-2
  warmup_steps: int = 5
  b1: float = 0.9
  b2: float = 0.95
  adam_eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  # Used by prediction and the planner only.
  global_batch_tokens: int = 0    # 0: batch_size * seq_len
  mfu: float = 0.0                # 0: the planner times each layout by its program (analysis/step_model.py);
                                  # a fraction in (0, 1]: the Scaling Book's form, roofline / mfu


@dataclass
class DataConfig:
  name: str = "markov"
  branching: int = 4              # successors per token: the loss floor is log(branching)


@dataclass
class PrecisionConfig:
  param_dtype: str = "float32"    # master weights and optimizer state
  compute_dtype: str = "float32"  # float32 | bfloat16


@dataclass
class CheckpointConfig:
  """What is saved when, and where a run resumes from (docs/failure_handling.md)."""
  enabled: bool = True            # save at the end, and on SIGTERM/SIGINT before exiting; false: never save
  every: int = 0                  # also save every N steps (0: only at the end and on a signal)
  keep: int = 3                   # keep the last k checkpoints; older ones are deleted
  dir: Optional[str] = None       # null: <run dir>/checkpoints. Several hosts: a directory all of them see
  resume: bool = False            # restore the latest complete checkpoint in `dir` (if any) and continue
  allow_changed: bool = False     # resume even if model, batch, seed or data settings differ from the checkpoint's


@dataclass
class DistributedConfig:
  """Several processes (one per host, or several per host) that together own the mesh's devices."""
  coordinator: Optional[str] = None  # HOST:PORT of process 0; null: one process (or `auto`)
  num_processes: int = 1
  process_id: int = 0
  auto: bool = True               # no coordinator: join the job when srun or mpirun started several tasks
  timeout_s: float = 120.0        # wait this long for every process to join (and at each barrier), then fail
  heartbeat_timeout_s: int = 20   # a process silent this long is lost: the others stop with one line naming it


@dataclass
class ProfileConfig:
  enabled: bool = False           # write a jax.profiler trace (TensorBoard / Perfetto) to <run dir>/profile
  start_step: int = 3             # after compilation and warm-up
  steps: int = 3


@dataclass
class XlaConfig:
  """A bundle of XLA compiler options (DebugOptions fields, e.g. `xla_gpu_enable_pipelined_all_gather: true`),
  passed to every compile of the run (`lowered.compile(compiler_options=...)`), local and target alike, over
  the options the context strategy asks for on that platform (Composition.target_flags: a ring's two collectives
  in flight on a GPU), and recorded in summary.json. conf/xla/ holds the bundles real GPU recipes set
  (docs/targets.md)."""
  name: str = "none"
  flags: dict[str, Any] = field(default_factory=dict)


@dataclass
class Config:
  cpu_devices: int = 8            # fake CPU devices, set before JAX starts; ignored on GPU/TPU
  mesh: MeshConfig = field(default_factory=MeshConfig)
  layout: LayoutConfig = field(default_factory=LayoutConfig)
  model: ModelConfig = field(default_factory=ModelConfig)
  schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
  context: ContextConfig = field(default_factory=ContextConfig)
  expert: ExpertConfig = field(default_factory=ExpertConfig)
  pipeline: PipelineConfig = field(default_factory=PipelineConfig)
  train: TrainConfig = field(default_factory=TrainConfig)
  data: DataConfig = field(default_factory=DataConfig)
  precision: PrecisionConfig = field(default_factory=PrecisionConfig)
  hardware: HardwareConfig = field(default_factory=HardwareConfig)
  xla: XlaConfig = field(default_factory=XlaConfig)
  checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
  distributed: DistributedConfig = field(default_factory=DistributedConfig)
  progress: bool = True
  tensorboard: bool = True        # TensorBoard event files in <run dir>/tensorboard (process 0)
  figures: bool = True            # the run's pictures (timeline.png; a pipeline's pipeline.png): false draws none,
                                  # which saves matplotlib's import and drawing (seconds per run of a large sweep)
  profile: ProfileConfig = field(default_factory=ProfileConfig)
  dry_run: bool = False           # compile and analyze only: no parameters allocated, no step run
  # local: analyze the program compiled for the devices here; target: compile the same step for the hardware
  # preset's real devices (shardlab/target.py) and analyze that program (a non-dry run still trains here)
  compile_for: str = "local"


# Every group of Config that has a schema: {name: dataclass}
GROUPS = {f.name: f.default_factory for f in dataclasses.fields(Config)
          if f.default_factory is not dataclasses.MISSING and f.name not in ("profile",)}


def _mesh_label(*args) -> str:
  from shardlab.axes import CLASSIC, label, shape_of
  if len(args) == 1 and hasattr(args[0], "items"):
    sizes = {k: int(v) for k, v in args[0].items() if not str(k).endswith("_ici_axes") and k != "_target_"}
  else:
    sizes = dict(zip(CLASSIC, map(int, args)))
  return label(shape_of(sizes))


# The fields that make a model what its preset names (its parameters); seq_len, attention and the like do not.
ARCHITECTURE = ("kind", "d_model", "d_ff", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "head_size",
                "n_experts", "top_k", "expert_d_ff", "n_shared_experts")


@functools.lru_cache(maxsize=None)
def _preset(group: str, name: str) -> dict | None:
  import yaml
  path = CONF_DIR / group / f"{name}.yaml"
  return yaml.safe_load(path.read_text()) if path.is_file() else None


def model_label(m) -> str:
  """ModelConfig.label of a model's fields (a dict or a DictConfig: the `model_label` resolver's)."""
  name = str(m["name"])
  preset = _preset("model", name)
  if preset is None:
    return name
  default = ModelConfig.__dataclass_fields__
  changed = [f for f in ARCHITECTURE if m[f] != preset.get(f, default[f].default)]
  return f"{name}+overrides" if changed else name


def parallel_label(mesh, pipeline, context, expert=None) -> str:
  """What splits the model beyond data x fsdp x tensor, for run and sweep directory names (and so the report's
  labels): '' with none; '-1f1b' with pipeline stages (a user's class: its name), '-ring' or '-ring-zigzag'
  with a context split, '-all_to_all' with an expert split; in that order."""
  from shardlab.axes import CONTEXT, EXPERT, PIPELINE
  cls = lambda c: c["impl"].rpartition(":")[2] if ":" in c["impl"] else c["name"]
  pipe = Path(str(pipeline["table"])).stem if pipeline.get("table") else cls(pipeline)   # a CSV table: its file's
  out = f"-{pipe}" if int(mesh.get(PIPELINE, 1)) > 1 else ""
  if int(mesh.get(CONTEXT, 1)) > 1:
    place = placement_of(context["load_balance"])
    out += f"-{cls(context)}" + (f"-{place}" if place != "none" else "")
  if expert is not None and int(mesh.get(EXPERT, 1)) > 1:
    out += f"-{cls(expert)}"
  return out


@functools.cache
def register_configs() -> None:
  """Register the schemas, once per process: `config_schema` (the whole Config), the primary config's first
  default, types every group, so each YAML in conf/<group>/ is checked against its dataclass as it is merged
  (a wrong key or type is one error). The groups' own schemas (`<group>_schema`) stay registered for files that
  name them in their defaults (a calibrate-written hardware file, a user's preset); shardlab's presets do not:
  each would be merged a second time, a quarter of every compose (0.51 -> 0.38 s on this project's 2-core VM)."""
  from hydra.core.config_store import ConfigStore
  from omegaconf import OmegaConf
  # ${mesh_label:${mesh}} -> '4x2', '2x2x2' with a data axis, 'p2xf2xt2' with others (run dir names: axes.label).
  # The old form ${mesh_label:DATA,FSDP,TENSOR} still works.
  if not OmegaConf.has_resolver("mesh_label"):
    OmegaConf.register_new_resolver("mesh_label", _mesh_label)
  if not OmegaConf.has_resolver("schedule_label"):   # ${schedule_label:${schedule}}: ScheduleConfig.label
    OmegaConf.register_new_resolver("schedule_label", lambda s: schedule_label(s["name"], s["impl"], s["tp"]))
  if not OmegaConf.has_resolver("parallel_label"):   # ${parallel_label:${mesh},${pipeline},${context}}
    OmegaConf.register_new_resolver("parallel_label", parallel_label)
  if not OmegaConf.has_resolver("model_label"):      # ${model_label:${model}}: ModelConfig.label
    OmegaConf.register_new_resolver("model_label", model_label)
  cs = ConfigStore.instance()
  cs.store(name="config_schema", node=Config)
  for group, node in GROUPS.items():
    cs.store(group=group, name=f"{group}_schema", node=node)


def compose(overrides: list[str], job_name: str = "shardlab") -> Config:
  """conf/ + overrides -> typed `Config`, outside a Hydra app (the planner, calibrate, experiments): Hydra
  validates every override against the schemas."""
  from hydra import compose as hydra_compose, initialize_config_dir
  register_configs()
  check_hardware_overrides(list(overrides))
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=job_name):
    return to_config(hydra_compose(config_name="config", overrides=list(overrides)))


def check_hardware_overrides(overrides: list[str]) -> None:
  """`hardware.file=` takes every figure from its file: another hardware setting beside it would be silently
  dropped, so the two together are a ConfigError (one line)."""
  from shardlab.errors import ConfigError
  keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
  if "hardware.file" in keys:
    other = [k for k in keys if k == "hardware" or (k.startswith("hardware.") and k != "hardware.file")]
    if other:
      raise ConfigError(f"{other[0]}= beside hardware.file=: the file gives every hardware figure; change it in the "
                        f"file (or drop hardware.file)")


def hardware_file(group: dict) -> HardwareConfig:
  """`hardware.file=PATH.yaml`: the preset in that file (one `python -m shardlab.calibrate` wrote, or any file
  shaped like conf/hardware/*.yaml), every figure from it; the group's other settings are replaced whole. A
  missing file, a field no preset has or a value of the wrong kind is a ConfigError (one line)."""
  import dataclasses
  from omegaconf import OmegaConf
  from shardlab.errors import ConfigError
  path = Path(str(group["file"])).expanduser()
  if not path.is_file():
    raise ConfigError(f"hardware.file={path}: no such file (write one with `python -m shardlab.calibrate out={path}`)")
  try:
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
  except Exception as e:  # noqa: BLE001  (a YAML syntax error: one line)
    raise ConfigError(f"hardware.file={path}: not a YAML preset ({' '.join(str(e).split())[:200]})") from None
  if not isinstance(loaded, dict):
    raise ConfigError(f"hardware.file={path}: not a preset (a YAML mapping of hardware settings)")
  loaded.pop("defaults", None)
  names = {f.name for f in dataclasses.fields(HardwareConfig)}
  extra = sorted(set(loaded) - names)
  if extra:
    raise ConfigError(f"hardware.file={path}: {extra[0]}: no such hardware setting; known: {', '.join(sorted(names))}")
  try:   # checked against the schema as Hydra checks conf/hardware/*.yaml
    typed = OmegaConf.merge(OmegaConf.structured(HardwareConfig), loaded)
  except Exception as e:  # noqa: BLE001
    key = f"{e.full_key}: " if getattr(e, "full_key", None) else ""
    raise ConfigError(f"hardware.file={path}: {key}{' '.join(str(e).split('full_key:')[0].split())}") from None
  return HardwareConfig(**{**OmegaConf.to_container(typed), "file": str(path)})


def to_config(cfg: Any) -> Config:
  """An OmegaConf DictConfig (or a plain dict) -> typed `Config`. A key no schema has (`+typo=1`, which Hydra
  lets through) is a ConfigError, not silently dropped. The `hydra` node, if present, is left out."""
  from omegaconf import DictConfig, OmegaConf
  from shardlab.errors import ConfigError
  if isinstance(cfg, DictConfig):
    cfg = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
  cfg = {k: v for k, v in cfg.items() if k != "hydra"}
  fields = {f.name: f for f in dataclasses.fields(Config)}
  default = Config()

  def unknown(path: str, known) -> ConfigError:
    return ConfigError(f"{path}: no such setting (a typo, or added with +?); known here: {', '.join(sorted(known))}")
  out = {}
  for k, v in cfg.items():
    if k not in fields:
      raise unknown(k, fields)
    d = getattr(default, k)
    if dataclasses.is_dataclass(d):
      names = {g.name for g in dataclasses.fields(type(d))}
      if not isinstance(v, dict):
        raise ConfigError(f"{k}={v!r}: must be a group of settings ({', '.join(sorted(names))})")
      extra = [n for n in v if n not in names]
      if extra:
        raise unknown(f"{k}.{extra[0]}", names)
      out[k] = hardware_file(v) if k == "hardware" and v.get("file") else type(d)(**v)
    else:
      out[k] = v
  cfg = Config(**out)
  if cfg.pipeline.table:        # what the CSV table fixes, checked against what was set
    cfg = dataclasses.replace(cfg, pipeline=cfg.pipeline.with_table(cfg.mesh.pipeline))
  return cfg
