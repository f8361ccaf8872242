"""shardlab's pytest plugin, loaded through the `pytest11` entry point whenever shardlab is installed.

  fake devices    pytest_configure, which runs before any test module is imported (so before JAX starts),
                  asks for `--shardlab-devices` fake CPU devices (or the ini value `shardlab_devices`; 0
                  leaves JAX alone) through shardlab.mesh.set_cpu_devices. Neither given: the count a
                  conftest already set (shardlab's own sets 8), else 8.
  `mesh`          a fixture: a test that takes `mesh` runs once per fsdp x tensor factorization of the device
                  count (ids '1x8', '2x4', ...; with the ini value `shardlab_mesh_axes = 3`, once per
                  data x fsdp x tensor factorization: '1x1x8', ..., '2x2x2', ...), or over the shapes a
                  `meshes` marker names:
                      @pytest.mark.meshes((2, 4), "4x2")   # these shapes
                      @pytest.mark.meshes(n=4)             # every factorization of 4 (on the first 4 devices)
                      @pytest.mark.meshes(rank=3)          # every data x fsdp x tensor factorization (HSDP)
Disable the plugin with `-p no:shardlab`.
"""
from __future__ import annotations

import pytest

from shardlab import testing


def pytest_addoption(parser):
  group = parser.getgroup("shardlab")
  group.addoption("--shardlab-devices", type=int, default=None,
                  help="fake CPU devices to set up before JAX starts (default: ini shardlab_devices, the "
                       "count a conftest set, or 8; 0: leave JAX alone)")
  parser.addini("shardlab_devices", f"fake CPU devices for tests (default {testing.DEFAULT_DEVICES})", default="")
  parser.addini("shardlab_mesh_axes", "mesh axes the `mesh` fixture factorizes the devices into by default: 2 "
                "(fsdp x tensor) or 3 (data x fsdp x tensor)", default="2")
  parser.addini("shardlab_fast_compile", "compile tests with testing.FAST_COMPILE (LLVM optimizations off, elemental "
                "IR emitters, machine code in one piece) unless XLA_FLAGS is set",
                type="bool", default=True)


def pytest_configure(config):
  config.addinivalue_line("markers", "meshes(*shapes, n=None, rank=2): the mesh shapes the `mesh` fixture runs a test "
                                     "on ('2x4' or (2, 4)); n=N: every fsdp x tensor factorization of N")
  n = config.getoption("shardlab_devices")
  n = int(config.getini("shardlab_devices") or -1) if n is None else n
  if n == 0:
    return
  if n < 0:   # not asked for: keep what a conftest loaded before this hook set, else the default
    n = testing.configured_devices() or testing.DEFAULT_DEVICES
  from shardlab.errors import ConfigError
  try:
    testing.set_devices(n, fast_compile=config.getini("shardlab_fast_compile"))
  except ConfigError as e:
    raise pytest.UsageError(f"shardlab: {e}") from None


def _user_parametrized(metafunc) -> bool:
  for m in metafunc.definition.iter_markers("parametrize"):
    names = m.args[0] if m.args else m.kwargs.get("argnames", ())
    names = [s.strip() for s in names.split(",")] if isinstance(names, str) else list(names)
    if "mesh" in names:
      return True
  return False


def mesh_shapes_for(marker, n_devices: int, rank: int = 2) -> list[tuple[int, ...]]:
  """The shapes a `meshes` marker (or none) asks for, checked against the device count. `meshes(rank=3)`: every
  data x fsdp x tensor factorization (of `n`, default the device count)."""
  import math
  if marker is None or not (marker.args or marker.kwargs):
    return testing.mesh_shapes(n_devices, rank)
  if marker.args:
    shapes = [testing.parse_mesh_shape(s) for s in marker.args]
  else:
    shapes = testing.mesh_shapes(marker.kwargs.get("n") or n_devices, marker.kwargs.get("rank", rank))
  for s in shapes:
    if math.prod(s) > n_devices:
      pytest.fail(f"meshes({testing.mesh_id(s)}) needs {math.prod(s)} devices; the tests have {n_devices} "
                  f"(--shardlab-devices)", pytrace=False)
  return shapes


def pytest_generate_tests(metafunc):
  if "mesh" not in metafunc.fixturenames or _user_parametrized(metafunc):
    return
  rank = metafunc.config.getini("shardlab_mesh_axes")
  if str(rank) not in ("2", "3"):
    raise pytest.UsageError(f"shardlab_mesh_axes = {rank}: choose 2 (fsdp x tensor) or 3 (data x fsdp x tensor)")
  shapes = mesh_shapes_for(metafunc.definition.get_closest_marker("meshes"), testing.device_count(), int(rank))
  metafunc.parametrize("mesh", shapes, indirect=True, ids=testing.mesh_id)


@pytest.fixture
def mesh(request):
  """A `fsdp x tensor` (or `data x fsdp x tensor`) mesh (jax.sharding.Mesh, Auto axes); the test runs once per
  shape."""
  shape = getattr(request, "param", None) or testing.mesh_shapes(testing.device_count())[0]
  return testing.mesh_of(*shape)
