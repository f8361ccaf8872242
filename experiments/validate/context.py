"""A context-parallel measurement against shardlab's prediction: zhuzilin/ring-flash-attention's README table
(batch api, 8 x H800: ring attention with FlashAttention inside, Llama-3-8B's attention: 32 query heads, 8 K/V
heads, head dim 128, bf16, causal, one sequence of 8192 tokens per GPU; benchmark/benchmark_kvpacked_func.py),
each figure as a fraction of "theoretic flash_attn" (one GPU's flash attention on its 8192 tokens, divided by 8).

  python experiments/validate/context.py      # analytic, a second: writes context.json, prints a table

The prediction (shardlab/analysis/context_cost.py, a MODEL PREDICTION): the causal work per ring step of each
device with a block-skipping kernel (contiguous chunks for ring_attn, zigzag for zigzag_ring), the ring's
makespan with each K/V (and backward dK/dV) shift overlapping the step before it, each step's online-softmax
merge at HBM rate, against the ideal C x half a block (fwd) per device. Rates: the h100 preset
(conf/hardware/h100.yaml) with the H800's NVLink: 400 GB/s in all (NVIDIA H800 SXM datasheet), 200 GB/s each way.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from shardlab.analysis import context_cost as CC
from shardlab.analysis.links import transfer_seconds

HERE = Path(__file__).parent
PUBLISHED = {   # ring-flash-attention README, "batch api" rows on 8xH800: fraction of theoretic flash_attn
    ("fwd", False): 0.521, ("fwd", True): 0.852, ("fwd+bwd", False): 0.539, ("fwd+bwd", True): 0.902}
C, LOCAL, H, G, K = 8, 8192, 32, 8, 128


def efficiency(hw, passes: str, balanced: bool) -> float:
  """Predicted fraction of ideal: ideal = C blocks' worth of causal work / C devices, no transfer, no merge."""
  a = CC.Attn(1, C * LOCAL, C, H, G, K, 2)
  rate = hw.peak_flops * hw.attention_efficiency
  hbm = hw.hbm_bandwidth * hw.hbm_efficiency
  work = CC.causal_work(C, balanced)
  mf, mb = CC.merge_bytes(a)
  fwd, bwd = a.block_flops() / rate, a.block_flops() * CC.BWD_OVER_FWD / rate
  t, _ = CC.ring_pass(work, fwd, mf / hbm + hw.kernel_launch_s, transfer_seconds(2 * a.block * 2, hw.ici_bandwidth, hw))
  ideal = C * 0.5 * fwd
  if passes == "fwd+bwd":
    tb, _ = CC.ring_pass(work, bwd, mb / hbm + hw.kernel_launch_s,
                         transfer_seconds(2 * a.block * 2 + 2 * a.block * 4, hw.ici_bandwidth, hw))
    t += tb + transfer_seconds(2 * a.block * 4, hw.ici_bandwidth, hw)
    ideal += C * 0.5 * bwd
  return ideal / t


def h100():
  """The h100 preset (conf/hardware/h100.yaml), composed as the CLI composes it."""
  from hydra import compose, initialize_config_dir
  from shardlab.config import CONF_DIR, register_configs, to_config
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    return to_config(compose("config", overrides=["hardware=h100"])).hardware


def main() -> None:
  h800 = dataclasses.replace(h100(), name="h800", ici_bandwidth=2.0e11)
  rows = []
  for (passes, balanced), published in PUBLISHED.items():
    pred = efficiency(h800, passes, balanced)
    rows.append({"passes": passes, "order": "zigzag" if balanced else "contiguous", "published": published,
                 "prediction": pred, "error": pred / published - 1})
  speed = {p: [r["prediction"] for r in rows if r["passes"] == p] for p in ("fwd", "fwd+bwd")}
  pub = {p: [r["published"] for r in rows if r["passes"] == p] for p in ("fwd", "fwd+bwd")}
  for p in speed:
    s, m = speed[p][1] / speed[p][0], pub[p][1] / pub[p][0]
    rows.append({"passes": p, "order": "zigzag over contiguous (speedup)", "published": m, "prediction": s,
                 "error": s / m - 1})
  print(f"{'passes':8s} {'order':34s} {'published':>9s} {'prediction':>10s} {'error':>7s}")
  for r in rows:
    print(f"{r['passes']:8s} {r['order']:34s} {r['published']:9.3f} {r['prediction']:10.3f} {r['error']:+7.1%}")
  (HERE / "context.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                                  "command": "python experiments/validate/context.py",
                                                  "rows": rows}, indent=1))


if __name__ == "__main__":
  main()
