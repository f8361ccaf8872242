"""8 fake CPU devices, set here, once, before anything starts JAX; strict rank promotion.

Tests compile XLA:CPU programs with shardlab.testing.FAST_COMPILE (what it changes and why: its comment there); tests
check numbers, bytes and memory, never speed. Subprocesses (CLI runs) inherit the flags.
"""
import functools
import os
import re
import tempfile
from pathlib import Path

from shardlab.testing import FAST_COMPILE   # (this imports JAX: see below)

os.environ.setdefault("XLA_FLAGS", FAST_COMPILE)
# One persistent compilation cache for the whole run, shared by every subprocess (CLI runs, sweeps, several
# processes): each distinct program they compile is compiled once per test session. The xdist workers themselves
# compile their own: JAX read its settings when shardlab.testing (above) imported it, before these are set, so a
# worker uses the cache only if JAX_COMPILATION_CACHE_DIR was set before pytest started. Turning it on in the
# workers (jax.config.update of these four) made test_expert and test_context slower on 2 workers, 151.5 s against
# 139.8 s (282.8 and 260.1 s of user CPU, 2026-11-28): writing every program costs more than the other worker's
# hits save.
# (v2: written under mesh.guard_persistent_cache, which keeps out what XLA:CPU cannot restore safely)
_CACHE = Path(tempfile.gettempdir()) / f"shardlab-test-jax-cache-v2-{os.getuid()}"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Deviceless H100 compiles skip NVIDIA's assembler (shardlab.target.no_assembler_dir): the HLO, schedule and memory
# the tests read are the same without the machine code (test_target compares them); ptxas, already without its
# optimizations, was 22-37% of a tiny step's compile (docs/testing.md). test_target's Pallas kernels keep it.
os.environ.setdefault("SHARDLAB_GPU_ASSEMBLER", "none")
# ... and their processes share the stub's kernels (shardlab.target._stub_kernels): each tiny kernel is generated
# once per session, not once per process (a third to a half of a small H100 compile). Named by jaxlib's version:
# XLA's kernel cache format is its own.
import jaxlib  # noqa: E402

_STUB_KERNELS = f"shardlab-test-gpu-stub-kernels-{jaxlib.__version__}-{os.getuid()}.bin"
os.environ.setdefault("SHARDLAB_GPU_STUB_KERNELS", str(Path(tempfile.gettempdir()) / _STUB_KERNELS))
# The audit reads each collective's op_name (its collectives.scope): a cached program must carry its own
# metadata, not that of an identical program traced by other code (JAX leaves metadata out of the key).
os.environ.setdefault("JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY", "true")
# Bytecode as Python keeps it by default, in __pycache__ (git ignores it): under PYTHONDONTWRITEBYTECODE, set in
# this project's development machine, each of the suite's 110 or so processes compiled shardlab's 18,700 lines
# again, 0.33 s of CPU per process (`import shardlab.run` and the trainer's modules, 1.70 s against 1.37 s with
# the bytecode kept, five runs each way alternated, 2026-12-02).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
  import sys
  sys.dont_write_bytecode = False

from shardlab.mesh import set_cpu_devices  # noqa: E402

set_cpu_devices(8)

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# Dtype promotion stays "standard": optax's bias correction mixes Python floats and int32 counts.

from shardlab import testing  # noqa: E402
from shardlab.config import CONF_DIR  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MESHES = testing.mesh_shapes(8)   # 1x8, 2x4, 4x2, 8x1

# The tiny model, its batch and reference, meshes and compiled schedules come from the testing kit
# (shardlab/testing/): one cache, shared by these tests and the kit's own checks.
tiny_config = testing.tiny_config
mesh_of = testing.mesh_of
batch = testing.tiny_batch
reference_loss_and_grads = testing.reference_loss_and_grads


def preset_names():
  return sorted(p.stem for p in (CONF_DIR / "schedule").glob("*.yaml"))


# the quick subset (pytest -m "not slow") compiles one schedule preset of each kind: all-gathers as placed, a
# prefetch, a ring of ppermutes, the compiler's own; the full suite every preset
QUICK_PRESETS = {"baseline", "fsdp_prefetch", "prefetch_ring", "gspmd"}


def preset_params():
  """preset_names() as pytest params, those outside QUICK_PRESETS marked slow."""
  return [pytest.param(p, marks=() if p in QUICK_PRESETS else pytest.mark.slow) for p in preset_names()]


def compose(*overrides: str):
  """The config `python -m shardlab OVERRIDES` would run, composed by Hydra (nothing runs)."""
  from hydra import compose as hydra_compose, initialize_config_dir
  from shardlab.config import register_configs
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    return hydra_compose(config_name="config", overrides=list(overrides))


def load_preset(name: str) -> dict:
  """conf/schedule/NAME.yaml as Hydra composes it (a fresh copy; every preset composed once per process)."""
  import copy
  return copy.deepcopy(_presets()[name])


@functools.lru_cache(maxsize=None)
def _presets() -> dict:
  """{name: conf/schedule/NAME.yaml as `schedule=NAME` composes it} for every preset, by one Hydra compose (each
  preset under a package of its own, typed by ScheduleConfig as the primary config types its group): a compose per
  preset took 4.4 s of every test process's collection; this takes 0.25 s, and gives the same dicts."""
  from hydra import compose as hydra_compose, initialize_config_dir
  from omegaconf import OmegaConf
  from shardlab.config import ScheduleConfig, register_configs
  register_configs()
  names = preset_names()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    each = hydra_compose(config_name=None, overrides=[f"+schedule@{n}={n}" for n in names])
  return {n: OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(ScheduleConfig), each[n])) for n in names}


def compiled_grads(mesh_shape: tuple, schedule_items: tuple):
  """(compiled grad fn, its outputs) for one mesh and schedule: shared by every test that needs them."""
  return testing.compile_schedule(dict(schedule_items), mesh_shape)


_PORTS_HANDED_OUT: set[int] = set()


def free_port() -> int:
  """A TCP port nothing listens on, for a coordinator a subprocess will bind seconds later: never one this process
  handed out before, and below the kernel's ephemeral range (32768-60999 here), in a stretch of its own for each
  xdist worker. Ports from bind(0) came from that range: two pairs of processes started together were once given
  the same one, or the other worker's, and their four processes met at one coordinator (a survivor then failed
  with "key cpu:global_topology/cpu already exists" instead of naming its lost peer)."""
  import random
  import socket
  worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % 4
  low = 20000 + 3000 * worker
  for _ in range(200):
    port = random.randrange(low, low + 3000)
    if port in _PORTS_HANDED_OUT:
      continue
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", port))
      except OSError:
        continue
    _PORTS_HANDED_OUT.add(port)
    return port
  raise RuntimeError(f"no free port in {low}-{low + 3000}")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: left out of the quick subset, `pytest -n 2 -m \"not slow\"` (CLI processes, target compiles, the equivalence matrix): docs/testing.md")


_WHOLE_MODULE_SLOW = re.compile(r"^pytestmark = pytest\.mark\.slow\b", re.M)


def pytest_ignore_collect(collection_path, config):
  """The quick subset (`-m "not slow"`) does not import a test module marked slow as a whole (a line
  `pytestmark = pytest.mark.slow`): none of its tests would run, and importing it (pytest rewrites its asserts)
  took about 4 of the 9 seconds each worker spent collecting. Any other selection collects every module."""
  if collection_path.suffix != ".py" or (config.getoption("markexpr") or "").replace(" ", "") != "notslow":
    return None
  try:
    return True if _WHOLE_MODULE_SLOW.search(collection_path.read_text()) else None
  except OSError:
    return None
