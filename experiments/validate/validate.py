"""Predictions of the calibrated cost model against published measurements (experiments/validate/README.md).

  python experiments/validate/validate.py            # writes results.json and results.md beside this file

Each case is compiled for the real target on this machine (shardlab[cuda12]: the CUDA compiler, no GPU needed)
and replayed by shardlab's cost model. Every predicted number is a MODEL PREDICTION; every published number is
quoted from its source, named in CASES.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardlab.mesh import set_cpu_devices

set_cpu_devices(1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from shardlab.analysis import predict_fn  # noqa: E402

HERE = Path(__file__).resolve().parent
PALLAS_DOC = ("JAX docs, docs/pallas/gpu/collective_matmul.md (shapes: jax/experimental/pallas/ops/gpu/"
              "collective_matmul_mgpu.py `_run_example`)")
# "NCCL + cuBLAS" rows of the doc's table: summed kernel times, min over devices, 8 x H100 SXM on NVLink.
PUBLISHED_AG_MATMUL_US = {2: 147.0, 4: 290.0, 8: 565.0}
PUBLISHED_GEMM_US = 43.0   # the doc: one 1024 x 4096 x 4096 bf16 GEMM takes "about 43 us"


def all_gather_matmul(mesh):
  """all_gather(A) @ B on a mesh ('x',) of D devices: A[D*1024, 4096] sharded on rows, B[4096, D*4096] on columns."""
  d = mesh.shape["x"]

  def f(a_MK, b_KN):
    return jax.lax.all_gather(a_MK, "x", tiled=True) @ b_KN    # A[M_x, K] -> A[M, K]; then A @ B[K, N_x]
  fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x")))
  return fn, (jax.ShapeDtypeStruct((d * 1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("x"))),
              jax.ShapeDtypeStruct((4096, d * 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x"))))


def one_gemm(mesh):
  """A[1024, 4096] @ B[4096, 4096] on one device (the shardings place it on the target's device)."""
  one = NamedSharding(mesh, P())
  return jax.jit(lambda a, b: a @ b), (jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16, sharding=one),
                                       jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=one))


MAXTEXT = ("MaxText, MaxText/configs/a3/llama_2_7b/README.md (1x A3 (h100-80gb-8): 492 TFLOP/sec/chip) and 1vm.sh "
           "(ici_fsdp_parallelism=8 per_device_batch_size=4 max_target_length=4096 attention=cudnn_flash_te "
           "remat_policy=minimal_flash); FLOPs per step: MaxText/maxtext_utils.py calculate_tflops_training_per_device "
           "of that time (attention counted without the causal half)")
MAXTEXT_TFLOPS = 492.0
# shardlab's nearest configuration: FSDP over 8 with prefetch, cuDNN flash attention, the weights' matmul outputs
# and the attention output saved for backward (MaxText's minimal_flash), MaxText's XLA flags (conf/xla/maxtext_a3).
LLAMA2_7B = ["model=llama2_7b", "mesh=8x1", "precision=bf16", "train.batch_size=32", "model.seq_len=4096",
             "model.attention=dot_product", "schedule=fsdp_prefetch", "schedule.remat=save_matmuls_attn_out",
             "xla=maxtext_a3", "hardware=h100", "compile_for=target", "dry_run=true"]


def maxtext_tflops_per_device(b=4, s=4096, e=4096, mlp=11008, heads=32, kv_heads=32, head_dim=128, layers=32,
                              vocab=32000, mlp_linears=2) -> float:
  """MaxText's calculate_tflops_training_per_device (the version of the A3 README): 3 x (weights' matmuls x layers
  + embedding) + 3 x non-causal attention, per device, for per-device batch b."""
  ffn = 2 * b * s * mlp * e * mlp_linears + 2 * b * s * mlp * e
  qkv = 2 * b * s * e * (heads + 2 * kv_heads) * head_dim
  proj = 2 * b * s * e * heads * head_dim
  attention = 4 * b * s ** 2 * heads * head_dim
  embedding = 2 * b * s * e * vocab
  return (((ffn + qkv + proj) * layers + embedding) * 3 + attention * layers * 3) / 1e12


def llama2_7b_step() -> dict:
  """shardlab's calibrated prediction of its Llama2-7B step on 8 x H100 (the CLI, a dry run for the target)."""
  with tempfile.TemporaryDirectory() as d:
    cmd = [sys.executable, "-m", "shardlab", *LLAMA2_7B, f"hydra.run.dir={d}", "progress=false"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((Path(d) / "summary.json").read_text())


def main() -> None:
  rows = []
  r = predict_fn(one_gemm, "h100", {"x": 1})
  rows.append({"case": "one GEMM 1024x4096x4096 bf16, 1 x H100", "published_us": PUBLISHED_GEMM_US,
               "predicted_us": r["t_overlapped_s"] * 1e6, "ceiling_us": r["prediction"]["ceiling"]["t_overlapped_s"] * 1e6,
               "source": PALLAS_DOC, "kind": "calibration (gemm_efficiency is derived from this figure)"})
  for d, us in PUBLISHED_AG_MATMUL_US.items():
    r = predict_fn(all_gather_matmul, "h100", {"x": d})
    rows.append({"case": f"all_gather(A) @ B, NCCL + cuBLAS, {d} x H100", "published_us": us,
                 "predicted_us": r["t_overlapped_s"] * 1e6,
                 "ceiling_us": r["prediction"]["ceiling"]["t_overlapped_s"] * 1e6,
                 "predicted_comm_us": sum(r["t_comm_s"].values()) * 1e6,
                 "predicted_compute_us": r["t_compute_s"] * 1e6, "source": PALLAS_DOC, "kind": "validation"})
  published_s = maxtext_tflops_per_device() / MAXTEXT_TFLOPS
  summary = llama2_7b_step()
  pred = summary["prediction"]
  rows.append({"case": "Llama2-7B train step, FSDP 8, 4 x 4096 tokens per device, 8 x H100 (MaxText A3)",
               "published_us": published_s * 1e6, "predicted_us": pred["t_overlapped_s"] * 1e6,
               "ceiling_us": pred["ceiling"]["t_overlapped_s"] * 1e6, "source": MAXTEXT, "kind": "validation",
               "memory_peak_bytes": summary["memory"]["peak"], "memory_analytic_bytes": summary["memory"]["analytic"]["total"],
               "command": "python -m shardlab " + " ".join(LLAMA2_7B)})
  for row in rows:
    row["error_pct"] = 100 * (row["predicted_us"] - row["published_us"]) / row["published_us"]
    row["ceiling_error_pct"] = 100 * (row["ceiling_us"] - row["published_us"]) / row["published_us"]
  out = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "rows": rows}
  (HERE / "results.json").write_text(json.dumps(out, indent=2))
  lines = ["| case | published (measurement) | prediction | error | peak-rate ceiling | its error | kind |",
           "|---|---:|---:|---:|---:|---:|---|"]
  for row in rows:
    lines.append(f"| {row['case']} | {_t(row['published_us'])} | {_t(row['predicted_us'])} | "
                 f"{row['error_pct']:+.1f}% | {_t(row['ceiling_us'])} | {row['ceiling_error_pct']:+.1f}% | "
                 f"{row['kind']} |")
  (HERE / "results.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


def _t(us: float) -> str:
  return f"{us / 1e6:.3f} s" if us >= 1e5 else f"{us:.0f} us"


if __name__ == "__main__":
  main()
