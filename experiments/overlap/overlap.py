"""What XLA's GPU scheduler makes of fsdp_prefetch's hand-placed FSDP gathers, by model size and XLA flag bundle,
and of next_layer_reduce's late gradient reduce-scatters (prefetch 1 too, no bundle).

For the gradient step of a 4-layer model on 8 x H100 (compiled here, on a CPU, for the real target: shardlab's
target compilation), lists each async all-gather / reduce-scatter of the layer loops with the matmuls and
kernels the compiler scheduled between its start and its done. Writes results.json and prints a table.

  python experiments/overlap/overlap.py            # 6 compiles, a few minutes on 2 cores
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"tiny (D=64)": {}, "D=1024": {"d_model": 1024, "d_ff": 4096, "n_heads": 8, "seq_len": 512}}
# (schedule preset, knobs changed, XLA bundle)
RUNS = [("fsdp_prefetch", {}, "none"), ("fsdp_prefetch", {}, "maxtext_a3"), ("next_layer_reduce", {"prefetch": 1}, "none")]


def loop_collectives(model: dict, flags: dict, preset: str = "fsdp_prefetch", change: dict | None = None) -> list[dict]:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from shardlab import params as PM, schedules, target as TG, train as T
  from shardlab.analysis.predict import hardware_preset
  from shardlab.analysis.program import Program
  from shardlab.composition import resolve
  from shardlab.mesh import make_mesh
  from shardlab.testing import abstract_batch, tiny_config
  knobs = {k: v for k, v in yaml.safe_load((ROOT / f"conf/schedule/{preset}.yaml").read_text()).items()
           if k not in ("name", "defaults")}
  knobs.update(change or {})
  cfg = tiny_config(model=model, **knobs)
  mesh = make_mesh(8, 1, TG.mesh_devices(TG.devices(hardware_preset("h100"), 8), (8, 1)))
  decls = PM.declare(cfg.model)
  fn = T.make_grad_fn(resolve(cfg), schedules.build(cfg.schedule, cfg.model, jnp.float32), decls, mesh)
  params = jax.tree.map(lambda d: jax.ShapeDtypeStruct(d.shape, jnp.float32, sharding=NamedSharding(mesh, d.spec())),
                        decls, is_leaf=PM.is_param)
  tokens = abstract_batch(cfg.train.batch_size, cfg.model.seq_len, mesh)
  prog = Program.of(TG.compile_(fn.lower(params, tokens), flags), mesh)
  return [{"kind": p.coll.kind, "pass": "backward" if "transpose(" in p.coll.op_name else "forward",
           "bytes": p.coll.bytes_full, "matmuls_between": p.gemms, "kernels_between": p.kernels, "sync": p.is_sync}
          for p in prog.async_pairs() if p.in_loop and p.coll.kind in ("all-gather", "reduce-scatter")]


def main() -> None:
  from shardlab.mesh import set_cpu_devices
  set_cpu_devices(8)
  out = []
  for size, model in SIZES.items():
    for preset, change, bundle in RUNS:
      flags = yaml.safe_load((ROOT / f"conf/xla/{bundle}.yaml").read_text())["flags"]
      t0 = time.perf_counter()
      rows = loop_collectives(model, flags, preset, change)
      out.append({"model": size, "schedule": preset, "knobs": change, "xla": bundle,
                  "compile_s": round(time.perf_counter() - t0, 1), "loop": rows})
      for r in rows:
        print(f"{size:12s} {preset:17s} {bundle:11s} {r['pass']:8s} {r['kind']:14s} {r['bytes']:>10d} B  matmuls {r['matmuls_between']:2d}"
              f"  kernels {r['kernels_between']:2d}{'  sync' if r['sync'] else ''}", flush=True)
  (Path(__file__).parent / "results.json").write_text(json.dumps(
      {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv), "runs": out}, indent=1))


if __name__ == "__main__":
  main()
