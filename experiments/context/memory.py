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
ones. (It also compiles at 1/16 of the sequence and writes (temp(L) - temp(L/16)) x 16/15 as
`activations.compiled`; that is not the activations where the peak falls in another phase at the shorter length,
the backward instead of the loss: experiments/context/README.md.)
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


def compile_memory(overrides: list[str], shorter: int = 16) -> dict:
  """Target-compile the step for `overrides`, and again at 1/`shorter` of the sequence: the compiler's memory,
  the analytic breakdown, and the activations of both (module doc)."""
  from shardlab.analysis import memory_model as MM
  cfg, compiled, secs = _compile(overrides)
  ws = compiled["gemm_workspace"]
  short = _compile(overrides + [f"model.seq_len={cfg.model.seq_len // shorter}"])[1]
  a = MM.breakdown(cfg)   # per-token estimate: cuDNN's attention keeps its own O(L) set (as costmodel.predict_run)
  measured = (compiled["temp"] - short["temp"]) * shorter / (shorter - 1)
  return {"devices": cfg.mesh.n_devices, "compile_s": secs, "local_tokens": MM.local_tokens(cfg),
          "compiled": {k: compiled[k] for k in ("argument", "output", "temp", "peak")},
          "compiled_short_sequence": {k: short[k] for k in ("argument", "output", "temp", "peak")},
          "analytic": a, "activations": {"compiled": measured, "analytic": a["activations"]},
          "components": MM.compare(cfg, compiled, gemm_workspace=ws)["components"]}


def _compile(overrides: list[str]):
  from hydra import compose, initialize_config_dir
  from shardlab import target as TG
  from shardlab.analysis.program import memory
  from shardlab.config import register_configs, to_config
  from shardlab.run import CONF_DIR, build, lower
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    cfg = to_config(compose("config", overrides=overrides))
  devs = TG.devices(cfg.hardware, cfg.mesh.n_devices)
  b = build(cfg, TG.mesh_devices(devs, tuple(cfg.mesh.shape.values())))
  t0 = time.perf_counter()
  c = TG.compile_(lower(b), cfg.xla.flags)
  from shardlab.analysis.memory_model import gemm_workspace_bytes
  return cfg, {**memory(c), "gemm_workspace": gemm_workspace_bytes(c.as_text())}, round(time.perf_counter() - t0, 1)


def main() -> None:
  from shardlab.mesh import set_cpu_devices
  set_cpu_devices(8)
  extra = sys.argv[1:]
  out = {}
  for c in DEGREES:
    r = out[c] = compile_memory(BASE + [f"mesh.context={c}"] + extra)
    act = r["activations"]
    print(f"context {c}: {r['devices']} H100s, {r['local_tokens']} tokens per device; peak {r['compiled']['peak'] / 1e9:.2f} GB;"
          f" activations compiled {act['compiled'] / 1e9:.2f} GB, model {act['analytic'] / 1e9:.2f} GB "
          f"({act['analytic'] / act['compiled'] - 1:+.1%}); peak model {r['components']['peak']['analytic'] / 1e9:.2f} GB "
          f"({r['components']['peak']['error']:+.1%}), working {r['components']['working']['error']:+.1%}  "
          f"[{r['compile_s']} s]", flush=True)
  one = out[1]
  for c in DEGREES[1:]:
    r = out[c]
    ratio = r["activations"]["compiled"] / one["activations"]["compiled"]
    removed = one["compiled"]["peak"] - r["compiled"]["peak"]
    model_removed = one["activations"]["analytic"] - r["activations"]["analytic"]
    r["vs_context_1"] = {"activation_ratio_compiled": ratio,
                         "activation_ratio_analytic": r["activations"]["analytic"] / one["activations"]["analytic"],
                         "peak_removed_compiled": removed, "peak_removed_analytic": model_removed}
    print(f"context {c} / context 1: activations x{ratio:.3f} compiled, x{r['vs_context_1']['activation_ratio_analytic']:.3f}"
          f" model; peak removed {removed / 1e9:.2f} GB compiled, {model_removed / 1e9:.2f} GB model "
          f"({model_removed / removed - 1:+.1%})")
  (HERE / "memory.json").write_text(json.dumps(
      {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv), "overrides": BASE + extra,
       "contexts": out}, indent=1))


if __name__ == "__main__":
  main()
