"""A published pipeline-parallel measurement against shardlab's prediction: Llama 3 405B's pre-training on 8,192
H100s (Meta, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 4; the same figures on Balaji's SC'24 slide):
tensor 8 inside each node, pipeline 16 across nodes, data 64, 8,192-token sequences, 16M tokens per step (32
sequences per data-parallel replica), 430 TFLOP/s per GPU (BF16 MFU 43%).

  python experiments/validate/pipeline.py      # one target dry run (about a minute): writes pipeline.json

The prediction (a MODEL PREDICTION, shardlab/analysis/pipeline_cost.py): one pipeline stage of 405B's shape
(d_model 16384, d_ff 53248, 128 heads, 8 K/V heads, vocabulary 128256; 8 layers, 126 / 16 rounded) compiled by
the H100 compiler for 2 nodes x 8 (mesh.pipeline=2, mesh.tensor=8, cuDNN attention, bf16, no remat), each slot's
time (F, B, head) read off its compiled branch at the preset's rates; the table of 16 stages and 32 microbatches
of one sequence replayed with those times: asynchronously (Llama 3's runtime is PyTorch's, one program per rank,
replay(sync=False)) and in shardlab's one-program ticks (replay(sync=True)). Achieved TFLOP/s per GPU = model
FLOPs (6 N + 6 n_layers L d_model per token: the weights and causal attention) / the predicted step.

The layers as Llama 3 placed them: 126 over 16 stages, one fewer on the first and the last stage ("we reduce one
Transformer layer each from the first and the last stages, respectively. This means that the first model chunk on
the first stage has only the embedding, and the last model chunk on the last stage has only output projection and
loss calculation", Section 3.3.2), replayed with replay(layers=...): the first and the last virtual stage hold one
layer fewer than a chunk, their slots shorter by as much. The same tables with 8 layers on every stage (128, the
stage compiled) beside them. The paper's sentence means the end chunks held one layer before it was taken, which
with equal chunks is V = 8 of a stage's 8 layers; the 1f1b table and interleaved ones with V = 2 and 4 bracket it.
Left out: the data-parallel gradient reduction over 64 replicas (assumed hidden behind the pipeline, as Llama 3 overlaps it) and
the number of microbatches Llama 3 runs back to back per chunk (its N, tuned and not stated).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from shardlab import pipeline_tables as PL
from shardlab.analysis import pipeline_replay as PR

HERE = Path(__file__).parent
PUBLISHED_TFLOPS = 430.0         # per GPU, Llama 3 405B, 8,192 H100, TP 8 / PP 16 / DP 64 (arXiv:2407.21783 Table 4)
N_PARAMS, LAYERS, D, SEQ = 405e9, 126, 16384, 8192
P, M, GPUS_PER_REPLICA = 16, 32, 128
STAGE_LAYERS = 8                 # layers of the stage compiled (128 / 16); Llama 3's first and last stage hold 7
SHAPE = ["model=llama3_70b", "model.name=llama3_405b_stage", "model.d_model=16384", "model.d_ff=53248",
         "model.n_heads=128", "model.n_kv_heads=8", "model.n_layers=16"]
RUN = ["dry_run=true", "compile_for=target", "hardware=h100_multinode", "precision=bf16",
       "model.attention=dot_product", "schedule.remat=none", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8",
       "mesh.pipeline=2", "pipeline=1f1b", "pipeline.microbatches=2", "train.batch_size=2", "progress=false"]


def _figures(ticks, slot: dict, V: int, sync: bool, layers, flops_per_gpu: float) -> dict:
  """The table replayed with the compiled slots: a chunk holds 1/V of the stage's layers (each slot's time / V,
  times `layers` per virtual stage), the head in the last virtual stage's F slot, as in pipeline_cost.predict."""
  r = PR.replay(ticks, slot["F"] / V, slot["B"] / V, 0.0, slot["send"], sync=sync, t_head=slot["head"], layers=layers)
  tflops = flops_per_gpu / r["step_s"] / 1e12
  return {"step_s": r["step_s"], "bubble": r["bubble"], "predicted_tflops_per_gpu": tflops,
          "error": tflops / PUBLISHED_TFLOPS - 1}


def main() -> None:
  out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/shardlab-validate-pipeline")
  shutil.rmtree(out, ignore_errors=True)
  args = SHAPE + RUN + [f"hydra.run.dir={out}"]
  subprocess.run([sys.executable, "-m", "shardlab", *args], check=True, capture_output=True)
  slot = json.loads((out / "summary.json").read_text())["pipeline_prediction"]["slot_s"]
  flops_per_gpu = (6 * N_PARAMS + 6 * LAYERS * SEQ * D) * M * SEQ / GPUS_PER_REPLICA
  rows = []
  for name, V in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("interleaved", 8)):
    chunk = STAGE_LAYERS / V                     # layers in a chunk of the stage compiled
    llama3 = [(chunk - 1) / chunk] + [1.0] * (V * P - 2) + [(chunk - 1) / chunk]
    for sync in (False, True):
      ticks = PL.build(name, P, M, V)
      figures = lambda layers: _figures(ticks, slot, V, sync, layers, flops_per_gpu)
      rows.append({"schedule": name, "virtual_stages": V, "runtime": "one program (shardlab)" if sync else
                   "asynchronous (one program per rank)", "end_chunk_layers": chunk - 1, **figures(llama3),
                   "even_stages": figures(None)})
  result = {"date": time.strftime("%Y-%m-%d"), "command": "python experiments/validate/pipeline.py",
            "published_tflops_per_gpu": PUBLISHED_TFLOPS, "slot_s": slot, "stage_command":
            "python -m shardlab " + " ".join(args[:-1]), "rows": rows}
  (HERE / "pipeline.json").write_text(json.dumps(result, indent=1))
  print(f"published (measurement): {PUBLISHED_TFLOPS:.0f} TFLOP/s per GPU; slots {slot}")
  for r in rows:
    e = r["even_stages"]
    print(f"  {r['schedule']:<12} V={r['virtual_stages']} {r['runtime']:<38} step {r['step_s']:.2f} s  bubble "
          f"{r['bubble']:.1%}  prediction {r['predicted_tflops_per_gpu']:.0f} TFLOP/s  error {r['error']:+.1%}"
          f"  (8 layers on every stage: {e['predicted_tflops_per_gpu']:.0f} TFLOP/s, {e['error']:+.1%})")


if __name__ == "__main__":
  main()
