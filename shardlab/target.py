"""Devices of hardware that is not here: the real H100 / TPU compiler, run on this machine.

`jax.experimental.topologies.get_topology_desc` describes a GPU or TPU system without touching one; a mesh laid
over its devices lowers and compiles the train step into the program that system would run (its async collective
schedule, its fusions and custom calls, its buffer assignment), with nothing allocated. What it needs:

  GPU  the CUDA PJRT plugin (`pip install "shardlab[cuda12]"`), the preset's GpuTargetConfig text (shardlab/targets/)
       and a topology "slices x hosts x devices per host" ("1x1x8": one node of 8; "1x8x8": 8 nodes of 8).
       JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 keeps the plugin from looking for a driver.
  TPU  libtpu, pinned to the version JAX pins (`pip install "shardlab[tpu]"`), and a topology name
       ("v5p:2x2x2", "v5e:2x4": libtpu 0.0.42 does not take "v5litepod"). ALLOW_MULTIPLE_LIBTPU_LOAD=1 lets several compiling processes share it.

The local devices stay what they were (the fake CPU devices a run trains on): mesh.set_cpu_devices keeps JAX on
the CPU wherever no accelerator is present, so an installed plugin neither initializes nor logs.
"""
from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

from shardlab.hardware import HardwareConfig
from shardlab.errors import ConfigError

TARGETS_DIR = Path(__file__).resolve().parent / "targets"
EXTRA = {"cuda": ("jax_cuda12_plugin", "cuda12"), "tpu": ("libtpu", "tpu")}


def check(hw: HardwareConfig, n_devices: int) -> str:
  """The topology `hw` compiles for with `n_devices`, or a ConfigError naming what is missing (before JAX runs)."""
  if hw.target_platform not in EXTRA:
    have = "cuda/tpu" if not hw.target_platform else hw.target_platform
    raise ConfigError(f"compile_for=target: hardware={hw.name} describes no real target (hardware.target_platform="
                      f"{have!r}); choose hardware=h100, h200, h100_multinode, tpu_v5p or tpu_v5e")
  module, extra = EXTRA[hw.target_platform]
  if importlib.util.find_spec(module) is None:
    raise ConfigError(f"compile_for=target with hardware={hw.name} needs the {hw.target_platform} compiler "
                      f"({module} is not installed): pip install \"shardlab[{extra}]\"")
  if hw.target_platform == "cuda" and not (TARGETS_DIR / hw.target_config).is_file():
    raise ConfigError(f"hardware.target_config={hw.target_config!r}: no such file in {TARGETS_DIR}")
  return topology(hw, n_devices)


def topology(hw: HardwareConfig, n: int) -> str:
  """GPU: "1 x hosts x per-host"; TPU: "<type>:<shape>", the most cube-like (v5p, 3D) or square (2D) slice."""
  per_host = max(1, hw.devices_per_host)
  if hw.target_platform == "cuda":
    if hw.topology:
      return hw.topology
    if n > per_host and n % per_host:
      raise ConfigError(f"{n} devices do not fill whole nodes of hardware.devices_per_host={per_host}; "
                        f"choose a mesh of a multiple of {per_host} devices or set hardware.topology=1xHOSTSxGPUS")
    return f"1x{max(1, n // per_host)}x{min(n, per_host)}"
  if hw.topology:
    return hw.topology if ":" in hw.topology else f"{hw.tpu_type}:{hw.topology}"
  if n & (n - 1):
    raise ConfigError(f"{n} TPU chips: slices come in powers of two; choose a mesh of 4, 8, 16, ... devices or "
                      f"set hardware.topology")
  rank = 2 if hw.tpu_type.startswith(("v5litepod", "v5e", "v6e")) else 3
  dims = [1] * rank
  for _ in range(int(math.log2(n))):
    dims[dims.index(min(dims))] *= 2
  return f"{hw.tpu_type}:{'x'.join(map(str, sorted(dims)))}"


def devices(hw: HardwareConfig, n_devices: int) -> list:
  """`n_devices` devices of the preset's target, in the order a mesh should be laid over them."""
  topo = check(hw, n_devices)
  from jax.experimental import topologies
  if hw.target_platform == "cuda":
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    desc = topologies.get_topology_desc(platform="cuda", topology=topo,
                                        target_config=(TARGETS_DIR / hw.target_config).read_text())
  else:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # This host's own TPU (there is none): without these libtpu fills them with "could not determine" text and
    # prints "Failed to find host bounds" and "E0000 ... unexpected worker hostname" on every compile. They do
    # not reach the compiled program: the slice is topology_name's (the same program with or without them).
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{hw.tpu_type}-8")
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topo)
  devs = list(desc.devices)
  if len(devs) != n_devices:
    raise ConfigError(f"hardware.topology={topo!r} has {len(devs)} devices, the mesh {n_devices}")
  return devs


_KERNELS: list[str] = []
DEVICELESS = {"xla_gpu_disable_gpuasm_optimizations": True}   # compile_: machine code that never runs


def kernel_cache_file() -> str:
  """This process's file for the GPU compiler's kernel cache (XLA's `xla_gpu_kernel_cache_file`): a kernel that a
  later target compile in the process shares with an earlier one (the same model's fusions under another schedule,
  layout or batch: the planner's top-K, a test module) is reused instead of generated and assembled again. The
  program is the same either way (its HLO, schedule and memory analysis, checked on five schedules' H100
  programs); on this VM's tiny programs it saves about a third of a compile. One file per process (XLA appends to
  it after each compile; processes do not share it), removed at exit. libtpu takes the option and ignores it."""
  if not _KERNELS:
    import atexit
    import tempfile
    path = Path(tempfile.gettempdir()) / f"shardlab-gpu-kernels-{os.getpid()}.bin"
    atexit.register(lambda: path.unlink(missing_ok=True))
    _KERNELS.append(str(path))
  return _KERNELS[0]


ASSEMBLER_ENV = "SHARDLAB_GPU_ASSEMBLER"   # "none": deviceless GPU compiles skip ptxas (no_assembler_dir)
_NO_ASSEMBLER: list[str] = []
_NO_ASSEMBLER_SH = """#!/bin/sh
# shardlab.target.no_assembler_dir: ptxas for deviceless compiles whose machine code nobody reads
for a in "$@"; do [ "$a" = "--version" ] && exec "{real}" "$@"; done
echo >> "${{0%/*}}/skipped"
out=; prev=
for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; done
[ -n "$out" ] && : > "$out"
exit 0
"""


def no_assembler_dir() -> str | None:
  """A CUDA directory for `xla_gpu_cuda_data_dir` whose ptxas writes an empty cubin (and answers `--version`
  with the real one's; each kernel it skips is a line of `bin/skipped`), its `nvvm/` the real libdevice: where
  `SHARDLAB_GPU_ASSEMBLER=none` is set (the test suite, tests/conftest.py) a deviceless H100 compile skips the
  assembler altogether. What shardlab reads of a
  target compile (the optimized HLO and its schedule, the buffer assignment, memory_analysis()'s sizes) is the
  same text and the same numbers either way (tests/test_target.py compares them); only the machine code, which a
  deviceless compile never runs, is missing. A run's own target compiles keep the real assembler. None where the
  cuda12 extra (nvidia-cuda-nvcc) is not installed. One directory per process, removed at exit."""
  if not _NO_ASSEMBLER:
    try:
      spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ImportError:          # no `nvidia` package at all
      spec = None
    real = next((Path(d) for d in (spec.submodule_search_locations or []) if (Path(d) / "bin" / "ptxas").exists())
                if spec else (), None)
    if real is None:
      return None
    import atexit
    import shutil
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="shardlab-no-assembler-"))
    atexit.register(shutil.rmtree, root, True)
    (root / "bin").mkdir()
    (root / "nvvm").symlink_to(real / "nvvm")
    sh = root / "bin" / "ptxas"
    sh.write_text(_NO_ASSEMBLER_SH.format(real=real / "bin" / "ptxas"))
    sh.chmod(0o755)
    _NO_ASSEMBLER.append(str(root))
  return _NO_ASSEMBLER[0]


STUB_KERNELS_ENV = "SHARDLAB_GPU_STUB_KERNELS"   # a file the processes of one session share (tests/conftest.py)


def _stub_kernels(stub_dir: str) -> str:
  """The kernel cache file of this process's assembler-less compiles (no_assembler_dir), started, on the first
  call, as a copy of the session's shared snapshot where SHARDLAB_GPU_STUB_KERNELS names one: the test suite's
  processes (two workers, the CLI runs they start) then generate each tiny kernel once per session instead of once
  per process (a Triton GEMM fusion's emission is most of a small H100 compile: 2.7 s cold, 1.2 s warm on this
  project's VM). Every cubin in it is the stub's empty one: only assembler-less compiles, whose machine code
  nobody runs, read it. XLA appends to the file it is given without a lock, so each process keeps its own. The
  snapshot is named by jaxlib's version where it is set (XLA's kernel cache format is its own)."""
  own = Path(stub_dir) / "kernels.bin"
  shared = os.environ.get(STUB_KERNELS_ENV)
  if shared and not own.exists() and Path(shared).is_file():
    import shutil
    try:
      shutil.copyfile(shared, own)
    except OSError:                # the snapshot vanished or cannot be read: start empty, as without one
      own.unlink(missing_ok=True)
  return str(own)


def _publish_stub_kernels(own: str) -> None:
  """This process's stub kernels become the session's snapshot (written beside it and renamed over it: a reader
  copies a whole file, old or new) when they hold more than it does. Snapshots of two processes do not merge:
  the larger wins, which keeps most kernels most of the time, and a kernel missing from it is only generated
  again."""
  shared = os.environ.get(STUB_KERNELS_ENV)
  if not shared or not Path(own).is_file():
    return
  import shutil
  target = Path(shared)
  try:
    if target.is_file() and target.stat().st_size >= Path(own).stat().st_size:
      return
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    shutil.copyfile(own, part)
    os.replace(part, target)       # only a whole file XLA wrote ever becomes the snapshot
  except OSError:                  # a snapshot is an optimisation: a full disk or a read-only dir loses nothing
    Path(f"{shared}.{os.getpid()}.part").unlink(missing_ok=True)


def compile_(lowered, flags: dict | None = None):
  """lowered.compile() for a target, past the persistent compilation cache (a deviceless compiler cannot load a
  cached executable: JAX would warn and compile anyway); `flags`: XLA compiler options (conf/xla/), beside this
  process's GPU kernel cache (kernel_cache_file; a flags entry of its own wins). JAX decides
  once per process whether it uses the cache (jax 0.10.2: compilation_cache.is_cache_used), so in a process that
  compiled before (a test worker, a run's local step) the switch alone does not hold: no entry is written either
  (the minimum compile time to write one set beyond reach), so none is found and failed to load later.

  The GPU compiler's assembler (ptxas) runs without optimizations (`xla_gpu_disable_gpuasm_optimizations`,
  DEVICELESS): a deviceless compile's machine code is never run, and everything shardlab reads of it (the HLO
  and its schedule, the buffer assignment, memory_analysis()'s sizes) is decided before the assembler runs,
  which otherwise takes most of a small program's compile (181 kernels, 5.0 s of ptxas CPU time of a 6.2 s
  compile on this project's 2-core VM, 3.5 s without optimizations; the compiled HLO the same text). libtpu takes
  the option and ignores it; a flags entry of its own wins. With SHARDLAB_GPU_ASSEMBLER=none (the test suite)
  the assembler does not run at all (no_assembler_dir)."""
  import jax
  was = (jax.config.jax_enable_compilation_cache, jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_enable_compilation_cache", False)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
  try:
    skip = os.environ.get(ASSEMBLER_ENV) == "none" and no_assembler_dir()
    # the stub's empty kernels go to a kernel cache of their own: a later compile with the assembler (a Pallas
    # kernel's, in the tests) must assemble its kernels, not reuse them
    kernels = _stub_kernels(skip) if skip else kernel_cache_file()
    options = {"xla_gpu_kernel_cache_file": kernels, **DEVICELESS, **({"xla_gpu_cuda_data_dir": skip} if skip else {}),
               **(flags or {})}
    compiled = compile_with(lowered, options)
    if skip:
      _publish_stub_kernels(kernels)
    return compiled
  finally:
    jax.config.update("jax_enable_compilation_cache", was[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", was[1])


BUFFER_ASSIGNMENT = "*after_optimizations-buffer-assignment.txt"   # XLA's dump of BufferAssignment::ToString


def compile_reading_buffers(lowered, flags: dict | None = None) -> tuple:
  """(compile_(lowered, flags), the compiler's buffer assignment of the program or None): the text XLA's dump
  writes (`xla_dump_to`; every allocation with its size, kind and memory space), what the target's runtime will
  allocate. `memory_analysis()` does not say it on TPU: libtpu 0.0.42 reports 5-7 GB more temporaries than its
  own assignment holds for the 8B step on v5p (experiments/predict/README.md), and none at all on v5e. The dump
  goes to a temporary directory, removed after, or to the one `flags` names (kept)."""
  import tempfile
  import time
  flags = dict(flags or {})
  own = flags.get("xla_dump_to")
  with tempfile.TemporaryDirectory(prefix="shardlab-dump-") as tmp:
    where = Path(own or tmp)
    flags.setdefault("xla_dump_to", tmp)
    t0 = time.time()
    compiled = compile_(lowered, flags)
    files = [f for f in where.glob(BUFFER_ASSIGNMENT) if f.stat().st_mtime >= t0 - 1]
    text = max(files, key=lambda f: f.stat().st_size).read_text() if files else None
  return compiled, text


def check_flags(flags: dict, hw: HardwareConfig | None = None, n_devices: int = 1) -> None:
  """The compiler takes every option in `flags`: a trivial program compiled with them raises the one ConfigError
  line compile_with gives, before the run writes or compiles anything. On the local CPU (milliseconds), whose XLA
  knows the options XLA's GPU compiler takes; for a TPU target (`hw`, `n_devices`) by libtpu on a device of that
  slice (seconds), which alone knows its own options (`xla_tpu_...`: conf/xla/maxtext_v5p.yaml)."""
  tpu = hw is not None and hw.target_platform == "tpu"
  own = [k for k in flags if k.startswith("xla_tpu_")]
  if own and not tpu:
    raise ConfigError(f"xla.flags.{own[0]}: a libtpu option; only a target compile for a TPU preset takes it "
                      f"(compile_for=target hardware=tpu_v5p or tpu_v5e)")
  if flags:
    import jax
    import jax.numpy as jnp
    device = (devices(hw, n_devices)[0] if tpu else
              jax.local_devices(backend="cpu")[0])
    probe = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), jnp.float32,
                                                                sharding=jax.sharding.SingleDeviceSharding(device)))
    try:
      compile_with(probe, flags)
    except ConfigError:
      raise
    except Exception as e:   # a known option with a value XLA refuses ('64MB' for an int64): the probe is trivial
      first = (str(e).strip().splitlines() or [type(e).__name__])[0]
      raise ConfigError(f"xla.flags: {first} (see conf/xla/ for the options and values this XLA takes)") from None


def compile_with(lowered, flags: dict | None = None):
  """lowered.compile(compiler_options=flags); an option this XLA does not know is one ConfigError line."""
  from shardlab.errors import ConfigError
  try:
    return lowered.compile(compiler_options=dict(flags)) if flags else lowered.compile()
  except Exception as e:          # XlaRuntimeError: INVALID_ARGUMENT: No such compile option: 'xla_...'
    if "compile option" not in str(e):
      raise
    raise ConfigError(f"xla.flags: {str(e).splitlines()[0]} (see conf/xla/ for the options this XLA takes)") from None


def describe(devs: list, topo: str = "") -> dict:
  """summary.json's `target`: platform, device kind, device count (and hosts, topology)."""
  return {"platform": devs[0].platform, "device_kind": devs[0].device_kind, "devices": len(devs),
          "hosts": len({getattr(d, "process_index", 0) for d in devs}), "topology": topo}


def mesh_devices(devs: list, shape: tuple) -> "object":
  """The devices as an array of the mesh's shape: on a TPU, JAX's physical-topology-aware assignment (so that a
  mesh axis rides whole torus rings); elsewhere in order (a GPU node is a switch: every order is the same)."""
  import numpy as np
  if devs[0].platform == "tpu":
    from jax.experimental import mesh_utils
    try:
      return mesh_utils.create_device_mesh(shape, devices=devs)
    except (ValueError, NotImplementedError, AssertionError):
      pass
  return np.asarray(devs).reshape(shape)
