"""Analytic memory per device (shardlab/analysis/memory_model.py) against the H100 compiler's own
`memory_analysis()` of the same train step, for every explicit schedule preset, on two models: a small
transformer and the FFN-only model (model.kind=ffn, the Scaling Book's blocks), bf16, 4x2.

  python experiments/validate/memory.py       # one target compile per preset; writes memory.json, prints a table

Components compared: the training state (fp32 master weights and Adam moments: the compiled program's arguments,
less the token batch), the working memory (gradients, gathered weights, saved activations and the loss's logits:
the compiled program's temporaries) and the peak (arguments + outputs + temporaries - donated aliases).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
SMALL = ["model.d_model=256", "model.d_ff=1024", "model.n_layers=4", "model.n_heads=4", "model.vocab_size=1024",
         "model.seq_len=256", "train.batch_size=16", "precision=bf16", "model.attention=blockwise",
         "model.attention_block=128", "mesh=4x2", "hardware=h100"]
FFN = ["model.kind=ffn", "model.d_model=1024", "model.d_ff=4096", "model.n_layers=4", "model.seq_len=256",
       "train.batch_size=16", "precision=bf16", "mesh=4x2", "hardware=h100"]
MODELS = {"transformer": SMALL, "ffn": FFN}
PRESETS = ["baseline", "fsdp_prefetch", "keep_gathered", "deferred_reduce", "collective_matmul",
           "collective_matmul_bidi", "megatron_allreduce", "prefetch_ring"]


def compare(overrides: list[str]) -> dict:
  """Target-compile the train step for `overrides`; the analytic and compiled components and their errors."""
  from hydra import compose, initialize_config_dir
  from shardlab import target as TG
  from shardlab.analysis import memory_model as MM
  from shardlab.analysis.program import memory
  from shardlab.composition import resolve
  from shardlab.config import register_configs, to_config
  from shardlab.run import CONF_DIR, build, lower
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    cfg = to_config(compose("config", overrides=overrides))
  devs = TG.devices(cfg.hardware, cfg.mesh.n_devices)
  b = build(cfg, TG.mesh_devices(devs, tuple(cfg.mesh.shape.values())))
  c = TG.compile_(lower(b), resolve(cfg).target_flags(cfg.xla.flags))   # as the run compiles it
  return MM.compare(resolve(cfg), memory(c), b["layer_residuals"], MM.gemm_workspace_bytes(c.as_text()))["components"]


def main() -> None:
  from shardlab.mesh import set_cpu_devices
  set_cpu_devices(8)
  out = {}
  for model, overrides in MODELS.items():
    out[model] = {}
    for p in PRESETS:
      t0 = time.perf_counter()
      got = out[model][p] = compare(overrides + [f"schedule={p}"])
      print(f"{model:11s} {p:24s} " + "  ".join(f"{k} {v['analytic'] / 1e6:6.1f} / {v['compiled'] / 1e6:6.1f} MB "
                                                 f"({v['error']:+.1%})" for k, v in got.items())
            + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
  (HERE / "memory.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "overrides": MODELS,
                                                 "command": " ".join(["python"] + sys.argv), "models": out}, indent=1))


if __name__ == "__main__":
  main()
