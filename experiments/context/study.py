"""Context-parallel strategies side by side on llama3_8b at 32K-256K tokens per sequence over 8-64 H100s and a v5p
slice of 64 chips, and the load-balanced causal ring against the plain one at C = 8. Every time and byte count here is a MODEL PREDICTION
(shardlab/analysis/context_cost.py: `predict`, `choose`), not a measurement.

  python experiments/context/study.py        # analytic, seconds: writes results.md and results.json

Each configuration: devices / 8 sequences (fsdp = devices / C must divide them), bf16, remat save_qkv_attn_out, cuDNN's flash attention
(model.attention=dot_product) where a strategy runs the model's kernel; the context axis innermost after tensor
(hardware=h100: NVLink inside an 8-GPU node, the nodes' NICs beyond; a ring's shift across nodes at one GPU's NIC),
every weight sharded over (fsdp, context). Strategies: all_gather, ring, ulysses, usp at every Ulysses degree the
heads allow, a2a_p2p (the Ulysses group a node). Two inner kernels: shardlab's (all_gather: the plain attention; ring: a pure-JAX flash kernel per
step that skips wholly masked sub-blocks; Ulysses: cuDNN's, which skips masked blocks) and a flash kernel in all three (what TransformerEngine and
ring-flash-attention run).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from shardlab.analysis import context_cost as CC
from shardlab.analysis import context_search as CS

HERE = Path(__file__).parent
BASE = ["model=llama3_8b", "mesh.tensor=1", "precision=bf16", "model.attention=dot_product",
        "schedule.remat=save_qkv_attn_out", "context.load_balance=true"]
# (tokens per sequence, devices, hardware preset): H100 nodes of 8 (NVLink inside, one 400 Gbps NIC per GPU
# across: conf/hardware/h100.yaml), and a v5p slice (a 3D torus: conf/hardware/tpu_v5p.yaml)
CASES = [(32768, 8, "h100"), (65536, 16, "h100"), (131072, 32, "h100"), (262144, 64, "h100"), (131072, 8, "h100"),
         (131072, 64, "tpu_v5p")]
STRATEGIES = ("ulysses", "ring", "usp", "a2a_p2p")   # with the model's own kernel; all_gather with the plain one


def config(overrides: list[str]):
  from hydra import compose, initialize_config_dir
  from shardlab.composition import resolve
  from shardlab.config import CONF_DIR, register_configs, to_config
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    return resolve(to_config(compose("config", overrides=overrides)))


def balance_at_8() -> list[dict]:
  """The ring with a flash kernel at C = 8 on one node, llama3_8b at 64K tokens (8K per GPU): plain against zigzag."""
  cfg = config(BASE + ["model.seq_len=65536", "train.batch_size=1", "hardware=h100"])
  out = []
  for balanced in (False, True):
    p = CS.predict(CS.with_context(cfg, 8, "ring", balanced=balanced, fsdp=1), skips_masked=True)
    out.append({**p, "imbalance": CC.imbalance(8, balanced)})
  return out


def choose(cfg, n: int, degrees: tuple, skips) -> dict:
  """context_search.choose over the three strategies, each with the attention it runs: Ulysses and the ring the
  model's own (cuDNN's, model.attention=dot_product), all_gather the plain one (model.attention=plain: what the run
  needs for it; with dot_product it refuses, and so does the planner)."""
  plain = cfg.replace(model={"attention": "plain"})
  a = CS.choose(cfg, devices=n, degrees=degrees, skips_masked=skips, strategies=STRATEGIES)
  b = CS.choose(plain, devices=n, degrees=degrees, skips_masked=skips, strategies=("all_gather",))
  cands = sorted(a["candidates"] + b["candidates"], key=lambda p: p["t_step_s"])
  return {"best": cands[0] if cands else None, "candidates": cands, "excluded": {**a["excluded"], **b["excluded"]},
          "reason": CS.reason(cands) if cands else "nothing fits"}


def main() -> None:
  rows = []
  for seq, n, hw in CASES:
    cfg = config(BASE + [f"model.seq_len={seq}", f"train.batch_size={max(1, n // 8)}", f"hardware={hw}"])
    for kernel, skips in (("shardlab's", None), ("flash", True)):
      r = choose(cfg, n, tuple(c for c in (2, 4, 8, 16, 32, 64) if c <= n), skips)
      rows.append({"seq": seq, "devices": n, "hardware": hw, "kernel": kernel, "best": r["best"] and r["best"]["label"],
                   "reason": r["reason"], "excluded": r["excluded"],
                   "candidates": [{k: v for k, v in p.items() if k != "note"} for p in r["candidates"]]})
  bal = balance_at_8()
  (HERE / "results.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command":
                                                  "python experiments/context/study.py", "rows": rows,
                                                  "balance_at_8": bal}, indent=1, default=str))
  lines = [f"Written by `python experiments/context/study.py` ({time.strftime('%Y-%m-%d')}). MODEL PREDICTIONS.", "",
           "| tokens | devices | kernel | strategy, C | predicted step (s) | attention (s) | exposed context comm (s) |"
           " context bytes/step (GB) | fsdp bytes/step (GB) | memory/device (GB) |", "|" + "---|" * 10]
  for r in rows:
    for p in r["candidates"]:
      lines.append(f"| {r['seq'] // 1024}K | {r['devices']} {r['hardware']} | {r['kernel']} | {p['label']} | {p['t_step_s']:.2f} | "
                   f"{p['t_attention_s']:.2f} | {p['exposed_comm_s']:.3f} | {p['bytes_per_step']['context'] / 1e9:.1f} | "
                   f"{p['bytes_per_step']['fsdp'] / 1e9:.1f} | {p['memory_bytes'] / 1e9:.0f} |")
    for label, why in r["excluded"].items():
      if "does not divide the batch" not in why:
        lines.append(f"| {r['seq'] // 1024}K | {r['devices']} {r['hardware']} | {r['kernel']} | {label} | excluded: {why} | | | | | |")
  lines += ["", "Choices (`context_search.choose`):", ""]
  lines += [f"- {r['seq'] // 1024}K tokens, {r['devices']} x {r['hardware']}, {r['kernel']} kernel: {r['reason']}"
            for r in rows]
  plain, zig = bal
  lines += ["", "Load-balanced causal ring against the plain one, C = 8, one node of H100s, llama3_8b at 64K tokens "
            "(8K per GPU), flash inner kernel:", "",
            f"- plain: predicted step {plain['t_step_s']:.3f} s (attention {plain['t_attention_s']:.3f} s, busiest device "
            f"{plain['imbalance']:.3f} x the average causal work); zigzag: {zig['t_step_s']:.3f} s (attention "
            f"{zig['t_attention_s']:.3f} s, {zig['imbalance']:.3f} x). Predicted speedup of the step "
            f"{plain['t_step_s'] / zig['t_step_s']:.2f}x, of the attention {plain['t_attention_s'] / zig['t_attention_s']:.2f}x."]
  (HERE / "results.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
