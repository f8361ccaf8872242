"""Megatron-Core's weak-scaling measurements on H100 with a pipeline, against shardlab's prediction of one
data-parallel replica's pipeline.

  python experiments/validate/megatron_pipeline.py    # five target dry runs (a stage each): megatron_pipeline.json

Published (measurement; Megatron-LM README, "Weak Scaling Results", its table image as of r0.8.0): GPT models with
sequence 4096 and vocabulary 131072 on H100s in BF16, data parallel 48, the gradient reduce-scatter, parameter
all-gather and tensor-parallel communication overlapped, the global batch 192 for the rows without a pipeline and
doubled with each row after them:

  70B   h 8192   84 layers  TP 8  PP 2   419.7 TFLOP/s per GPU
  119B  h 10240  92 layers  TP 8  PP 4   420.5
  177B  h 12288  96 layers  TP 8  PP 6   432.8
  314B  h 16384  96 layers  TP 8  PP 8   474.4
  462B  h 18432 112 layers  TP 8  PP 16  459.9

The prediction (a MODEL PREDICTION, not a measurement), as experiments/validate/pipeline.py makes it for Llama 3:
one pipeline stage of the row's shape (L / PP layers) compiled by the H100 compiler for 2 nodes x 8
(mesh.pipeline=2, mesh.tensor=8, cuDNN attention, bf16, no remat), its F, B and head slots timed by the calibrated
replay of their compiled branches, then the row's table of PP stages and M microbatches of one sequence replayed
with those times, asynchronously (Megatron's runtime is one program per rank: replay(sync=False)). TFLOP/s per GPU
with the published convention (Narayanan et al. 2021, arXiv:2104.04473, eq. 3 without recompute, as
experiments/validate/megatron.py): 72 B s l h^2 (1 + s / 6h + V / 12 h l) for the replica's B = M sequences, over
its TP x PP GPUs.

Assumptions where the README is silent, the same for every row: tensor 8 on every pipelined row (the README's 70B
row; the others name only the pipeline degree); one sequence per microbatch, so M = global batch / 48; heads of
128; shardlab's SwiGLU MLP with 8h/3 (rounded to 128) for GPT's 4h GELU (the same parameters and FLOPs). The
README's wording "doubled with each row" gives M = 8, 16, 32, 64, 128; read as "192 x PP" it gives 8, 16, 24, 32,
64: both are computed (they differ from the third row on). Megatron's interleaving (virtual stages) is not in the
table either: 1f1b and, where the stage's layers divide, interleaved with 2 chunks per stage bracket it. Left out:
the data-parallel reduction over 48 replicas (assumed hidden, as Megatron overlaps it), the embedding and head
placed on the first and last stages beside their layers (the head is timed in the last stage's F slot).

Two predictions per row, as experiments/validate/megatron.py gives them: the slots as the H100 compiler scheduled
them (`predicted_*`), and Megatron's setting, each slot without the tensor-parallel communication the compiler
left exposed in it (`tp_hidden_*`; pipeline_prediction.slot_exposed_comm_s; an upper bound on speed).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron import SEQ, VOCAB, megatron_flops   # the rows without a pipeline: the same shapes and convention
from shardlab import pipeline_tables as PL
from shardlab.analysis import pipeline_replay as PR

HERE = Path(__file__).parent
TP, DP = 8, 48
ROWS = [  # (name, h, layers, PP, published TFLOP/s per GPU, global batch doubled per row, 192 x PP)
    ("70B", 8192, 84, 2, 419.7, 384, 384), ("119B", 10240, 92, 4, 420.5, 768, 768),
    ("177B", 12288, 96, 6, 432.8, 1536, 1152), ("314B", 16384, 96, 8, 474.4, 3072, 1536),
    ("462B", 18432, 112, 16, 459.9, 6144, 3072)]


def stage(name: str, h: int, per_stage: int, root: Path) -> tuple[dict, list[str]]:
  """One stage of the row's shape compiled for 2 x 8 H100s: the summary's pipeline_prediction and the overrides."""
  d_ff = round(8 * h / 3 / 128) * 128
  args = ["dry_run=true", "compile_for=target", "hardware=h100_multinode", "precision=bf16", "model=gpt_1b",
          f"model.name=megatron_{name}_stage", f"model.d_model={h}", f"model.d_ff={d_ff}",
          f"model.n_layers={2 * per_stage}", f"model.n_heads={h // 128}", f"model.vocab_size={VOCAB}",
          f"model.seq_len={SEQ}", "model.attention=dot_product", "schedule.remat=none", "mesh.data=1",
          "mesh.fsdp=1", f"mesh.tensor={TP}", "mesh.pipeline=2", "pipeline=1f1b", "pipeline.microbatches=2",
          "train.batch_size=2", "progress=false", "figures=false", "tensorboard=false"]
  out = root / name
  shutil.rmtree(out, ignore_errors=True)
  subprocess.run([sys.executable, "-m", "shardlab", *args, f"hydra.run.dir={out}"], check=True,
                 capture_output=True)
  return json.loads((out / "summary.json").read_text())["pipeline_prediction"], args


def main() -> None:
  root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/shardlab-validate-megatron-pipeline")
  rows = []
  for name, h, layers, pp, published, doubled, times_pp in ROWS:
    t0 = time.time()
    pred, args = stage(name, h, layers // pp, root)
    slot = pred["slot_s"]
    for reading, batch in (("doubled per row", doubled), ("192 x PP", times_pp)):
      if reading != "doubled per row" and batch == doubled:
        continue
      M = batch // DP
      for table, V in (("1f1b", 1), ("interleaved", 2)):
        if (layers // pp) % V or (V > 1 and M % pp):
          continue
        r = PR.replay(PL.build(table, pp, M, V), slot["F"] / V, slot["B"] / V, 0.0, slot["send"], sync=False,
                      t_head=slot["head"])
        tflops = megatron_flops(h, layers, M) / (TP * pp) / r["step_s"] / 1e12
        # Megatron's setting: its TP communication overlapped with the GEMMs, so each slot without the part of it
        # the H100 compiler left exposed (pipeline_prediction.slot_exposed_comm_s; an upper bound on speed)
        ex = pred["slot_exposed_comm_s"]
        rh = PR.replay(PL.build(table, pp, M, V), (slot["F"] - ex["F"]) / V, (slot["B"] - ex["B"]) / V, 0.0,
                       slot["send"], sync=False, t_head=slot["head"] - ex["head"])
        hidden = megatron_flops(h, layers, M) / (TP * pp) / rh["step_s"] / 1e12
        rows.append({"model": name, "hidden": h, "layers": layers, "tensor": TP, "pipeline": pp,
                     "batch_reading": reading, "global_batch": batch, "microbatches": M, "schedule": table,
                     "virtual_stages": V, "published_tflops_per_gpu": published, "predicted_step_s": r["step_s"],
                     "bubble": r["bubble"], "predicted_tflops_per_gpu": tflops, "error": tflops / published - 1,
                     "tp_hidden_step_s": rh["step_s"], "tp_hidden_tflops_per_gpu": hidden,
                     "tp_hidden_error": hidden / published - 1,
                     "slot_s": slot, "slot_exposed_comm_s": ex, "stage_command": "python -m shardlab " + " ".join(args),
                     "wall_s": round(time.time() - t0, 1)})
        x = rows[-1]
        print(f"{name:>5} PP {pp:>2} M {M:>3} ({reading}) {table} V={V}: published {published:.1f} TFLOP/s "
              f"(measurement), predicted {tflops:.1f} (step {r['step_s']:.2f} s, bubble {r['bubble']:.1%}), error "
              f"{x['error']:+.1%}; with the TP communication hidden as Megatron hides it {hidden:.1f} "
              f"({x['tp_hidden_error']:+.1%})", flush=True)
  import jax
  result = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
            "command": "python experiments/validate/megatron_pipeline.py", "rows": rows}
  (HERE / "megatron_pipeline.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
