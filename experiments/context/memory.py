"""Activation memory per device under context parallelism, on the H100 target: the compiler's `memory_analysis()`
of the train step (a measurement of the compiled program, not of a GPU) against shardlab/analysis/memory_model.py
(a prediction), at context 1, 2 and 4 for the same global sequence.

  python experiments/context/memory.py                       # llama3_8b, 32 layers, 32K tokens: writes memory.json
  python experiments/context/memory.py model.n_layers=4      # extra overrides go to every configuration

Every configuration: fsdp 2 x context C (C = 1, 2, 4: 2 to 8 H100s), 2 sequences of 32768 tokens (one per fsdp
shard), bf16, cuDNN's flash attention (model.attention=dot_product) run by Ulysses at C > 1 (the strategy that
runs the model's own kernel; schedules/context.py), remat save_qkv_attn_out, and XLA's rematerialization pass off
(it would otherwise rewrite the program to fit 80 GB and the compiler's figure would no longer be the program's).

Each configuration's compiled peak and temporaries (the working memory) beside memory_model.compare's analytic
ones. The layers' saved activations themselves are in the compiler's buffer assignment: add
`+xla.flags.xla_dump_to=DIR` to a dry run and read its `*memory-usage-report.txt` (experiments/context/README.md).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
BASE = ["model=llama3_8b", "model.seq_len=32768", "train.batch_size=2", "mesh.fsdp=2", "mesh.tensor=1",
        "precision=bf16", "model.attention=dot_product", "schedule.remat=save_qkv_attn_out", "hardware=h100",
        "context=ulysses", "+xla.flags.xla_disable_hlo_passes=rematerialization"]
DEGREES = (1, 2, 4)


def compile_memory(overrides: list[str]) -> dict:
  """Target-compile the step for `overrides`: the compiler's memory beside the analytic breakdown (module doc)."""
  from shardlab.analysis import memory_model as MM
  from shardlab.composition import resolve
  cfg, compiled, secs = _compile(overrides)
  cfg = resolve(cfg)
  return {"devices": cfg.mesh.n_devices, "compile_s": secs, "local_tokens": cfg.local_tokens,
          "compiled": {k: compiled[k] for k in ("argument", "output", "temp", "peak")},
          "analytic": MM.breakdown(cfg),   # per-token estimate: cuDNN's attention keeps its own set (costmodel)
          "components": MM.compare(cfg, compiled, gemm_workspace=compiled["gemm_workspace"])["components"]}


def _compile(overrides: list[str]):
  from hydra import compose, initialize_config_dir
  from shardlab import target as TG
  from shardlab.analysis.program import memory
  from shardlab.composition import resolve
  from shardlab.config import register_configs, to_config
  from shardlab.run import CONF_DIR, build, lower
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    cfg = to_config(compose("config", overrides=overrides))
  devs = TG.devices(cfg.hardware, cfg.mesh.n_devices)
  b = build(cfg, TG.mesh_devices(devs, tuple(cfg.mesh.shape.values())))
  t0 = time.perf_counter()
  c = TG.compile_(lower(b), resolve(cfg).target_flags(cfg.xla.flags))   # as the run compiles it
  from shardlab.analysis.memory_model import gemm_workspace_bytes
  return cfg, {**memory(c), "gemm_workspace": gemm_workspace_bytes(c.as_text())}, round(time.perf_counter() - t0, 1)


def main() -> None:
  from shardlab.mesh import set_cpu_devices
  set_cpu_devices(8)
  extra = sys.argv[1:]
  out = {}
  for c in DEGREES:
    r = out[c] = compile_memory(BASE + [f"mesh.context={c}"] + extra)
    peak = r["components"]["peak"]
    print(f"context {c}: {r['devices']} H100s, {r['local_tokens']} tokens per device; peak {peak['compiled'] / 1e9:.2f} GB"
          f" compiled, {peak['analytic'] / 1e9:.2f} GB model ({peak['error']:+.1%}); working "
          f"{r['components']['working']['error']:+.1%}; model activations {r['analytic']['activations'] / 1e9:.2f} GB  "
          f"[{r['compile_s']} s]", flush=True)
  one = out[1]
  for c in DEGREES[1:]:
    r = out[c]
    r["vs_context_1"] = {"peak_ratio_compiled": r["compiled"]["peak"] / one["compiled"]["peak"],
                         "activation_ratio_analytic": r["analytic"]["activations"] / one["analytic"]["activations"]}
    print(f"context {c} / context 1: peak x{r['vs_context_1']['peak_ratio_compiled']:.3f} compiled; model activations "
          f"x{r['vs_context_1']['activation_ratio_analytic']:.3f}")
  (HERE / "memory.json").write_text(json.dumps(
      {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv), "overrides": BASE + extra,
       "contexts": out}, indent=1))


if __name__ == "__main__":
  main()
