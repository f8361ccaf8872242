"""Explicit schedules against the compiler's own sharding (gspmd) on the same mesh: interleaved steps,
medians and ratios. On fake CPU devices collectives run synchronously, so this measures the cost of the
program each schedule compiles to on this CPU (a regression canary), not overlap on a GPU.

  python experiments/bench/bench.py                       # 8 fake CPU devices, mesh 4x2, 30 rounds
  python experiments/bench/bench.py --mesh 2x4 --rounds 50 --schedules baseline,collective_matmul,gspmd
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--mesh", default="4x2")
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--rounds", type=int, default=30)
  ap.add_argument("--schedules", default="baseline,fsdp_prefetch,collective_matmul,prefetch_ring,megatron_allreduce,gspmd")
  ap.add_argument("--model", default="d_model=256,d_ff=1024,n_layers=4,n_heads=8,seq_len=128,vocab_size=1024")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--out", default=None, help="write the results as JSON here")
  a = ap.parse_args()

  from shardlab.mesh import set_cpu_devices
  set_cpu_devices(a.devices)
  import jax
  from hydra import compose, initialize_config_dir

  from shardlab import params as PM, train as T
  from shardlab.config import register_configs, to_config
  from shardlab.data import MarkovData
  from shardlab.run import CONF_DIR, build
  from shardlab.validate import validate

  register_configs()
  fsdp, tensor = a.mesh.split("x")
  model = [f"model.{kv}" for kv in a.model.split(",")]
  runs = {}
  for name in a.schedules.split(","):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
      cfg = to_config(compose("config", overrides=[f"schedule={name}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}",
                                                   f"cpu_devices={a.devices}", f"train.batch_size={a.batch}", *model]))
    validate(cfg, len(jax.devices()))
    b = build(cfg)
    compiled = b["step_fn"].lower(b["abstract_state"], b["abstract_batch"]).compile()
    state = T.init_state(PM.init_sharded(0, b["decls"], cfg.model, b["mesh"]), b["opt"], b["decls"], b["mesh"])
    data = MarkovData(0, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size, cfg.data.branching,
                      jax.tree.map(lambda x: x.sharding, b["abstract_batch"]))
    batch = data.batch(0)
    for _ in range(3):   # warm up
      state, met = compiled(state, batch)
      jax.block_until_ready(met)
    runs[name] = {"compiled": compiled, "state": state, "batch": batch, "times": []}
  for _ in range(a.rounds):   # interleaved: A B C A B C ..., so drift in the machine hits every schedule alike
    for r in runs.values():
      t = time.perf_counter()
      r["state"], met = r["compiled"](r["state"], r["batch"])
      jax.block_until_ready(met)
      r["times"].append(time.perf_counter() - t)
  ref = statistics.median(runs["gspmd"]["times"]) if "gspmd" in runs else None
  rows = [{"schedule": n, "median_ms": 1e3 * statistics.median(r["times"]),
           "p10_ms": 1e3 * sorted(r["times"])[len(r["times"]) // 10],
           "p90_ms": 1e3 * sorted(r["times"])[(9 * len(r["times"])) // 10],
           "vs_gspmd": statistics.median(r["times"]) / ref if ref else None} for n, r in runs.items()]
  meta = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {jax.devices()[0].device_kind}, "
          f"{len(jax.devices())} devices", "mesh": a.mesh, "model": a.model, "batch": a.batch, "rounds": a.rounds,
          "jax": jax.__version__}
  print(json.dumps(meta))
  print("| schedule | median ms | p10 ms | p90 ms | explicit / gspmd |\n|---|---|---|---|---|")
  for r in rows:
    ratio = f"{r['vs_gspmd']:.2f}" if r["vs_gspmd"] else ""
    print(f"| {r['schedule']} | {r['median_ms']:.1f} | {r['p10_ms']:.1f} | {r['p90_ms']:.1f} | {ratio} |")
  if a.out:
    with open(a.out, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
