"""Cost any program on a real target: a researcher's own shard_map function, compiled by the H100 or TPU compiler
on this machine and replayed by the cost model.

  def build(mesh):
    f = jax.jit(jax.shard_map(my_fn, mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))
    args = (jax.ShapeDtypeStruct((8 * 1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("x"))), ...)
    return f, args
  r = predict_fn(build, hardware="h100", axes={"x": 8})
  r["t_overlapped_s"], r["memory"]["peak"], r["collectives"]

Everything it returns is a MODEL PREDICTION (or the target compiler's report), not a measurement.
"""
from __future__ import annotations

import math

from shardlab.config import CONF_DIR
from shardlab.hardware import HardwareConfig

CONF_HARDWARE = CONF_DIR / "hardware"


def hardware_preset(name: str | HardwareConfig) -> HardwareConfig:
  """A preset of conf/hardware/ by name (or a HardwareConfig, returned as is)."""
  if isinstance(name, HardwareConfig):
    return name
  import dataclasses

  import yaml
  path = CONF_HARDWARE / f"{name}.yaml"
  if not path.is_file():
    from shardlab.errors import ConfigError
    have = ", ".join(sorted(p.stem for p in CONF_HARDWARE.glob("*.yaml")))
    raise ConfigError(f"hardware={name}: no such preset; choose one of {have}")
  fields = {f.name for f in dataclasses.fields(HardwareConfig)}
  raw = yaml.safe_load(path.read_text())
  default = HardwareConfig()   # each value as its field's type (YAML 1.1 reads 1e-6 as a string)
  return HardwareConfig(**{k: type(getattr(default, k))(v) for k, v in raw.items() if k in fields})


def predict_fn(build, hardware: str | HardwareConfig = "h100", axes: dict | None = None,
               ici_axes: dict | None = None, model_flops: float = 0.0) -> dict:
  """Compile `build(mesh)`'s `(jitted_fn, args)` for `axes` (mesh axis name -> size, in order) laid over the
  target's devices, and predict its time. Returns `t_serial_s`, `t_overlapped_s`, `t_compute_s`, `t_comm_s` (per
  axis), `memory` (the target compiler's memory_analysis per device; `allocated`: its buffer assignment),
  `collectives` (the compiled ledger: kind -> axis -> dtype -> count, bytes per device), `overlap`, `target`, and
  the whole `prediction`."""
  import jax
  from jax.sharding import AxisType, Mesh

  from shardlab import target as TG
  from shardlab.analysis import costmodel, ledger
  from shardlab.analysis.program import Program, analyze
  hw = hardware_preset(hardware)
  axes = dict(axes or {"x": 8})
  n = math.prod(axes.values())
  devs = TG.devices(hw, n)
  mesh = Mesh(TG.mesh_devices(devs, tuple(axes.values())), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))
  fn, args = build(mesh)
  if any(getattr(a, "sharding", None) is None for a in jax.tree.leaves(args)):   # else jit compiles for the CPU
    from shardlab.errors import ConfigError
    raise ConfigError("predict_fn: every argument build(mesh) returns needs a sharding on that mesh "
                      "(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)))")
  compiled, buffers = TG.compile_reading_buffers(fn.lower(*args))
  prog = Program.of(compiled, mesh, buffers)
  a = analyze(compiled, mesh, prog)
  pred, _ = costmodel.predict(prog, mesh, hw, ici_axes or {}, model_flops)
  return {"t_serial_s": pred["t_serial_s"], "t_overlapped_s": pred["t_overlapped_s"],
          "t_compute_s": pred["t_compute_s"], "t_comm_s": pred["t_comm_s"], "memory": a["memory"],
          "collectives": ledger.nested(ledger.from_hlo(prog.collectives)), "overlap": a["overlap"],
          "flops_per_device": a["flops_per_device"], "target": TG.describe(devs, TG.topology(hw, n)),
          "prediction": pred}
