"""The planner: which layout and which batch for a model on some devices (answer), and everything the closed forms
predict for one configured mesh (plan). Pure Python. It composes the analysis by concern:

  closed_forms.py     the Scaling Book's closed forms: parameters, critical batches, a block's roofline (BlockCosts)
  batch_window.py     the largest batch that fits a mesh's HBM (analytic, or through compiled peaks)
  layout_search.py    every data x fsdp x tensor layout placed on the links, priced and ranked
  pipeline_search.py  every pipeline layout (stages x schedule x microbatches x stage mesh), priced by its table

Their public names are this module's too (scripts and tests call `planner.X`).
"""
from __future__ import annotations

import math
from typing import Any

from shardlab.analysis import memory_model as MM
from shardlab.analysis.batch_window import (  # noqa: F401  (re-exported: the planner's names, for scripts)
    at_sequences, at_tokens, batch_window, calibrated_batch_window, last_fitting, memory_affine, microbatches_to_fit)
from shardlab.analysis.closed_forms import (  # noqa: F401  (re-exported)
    BOOK_BYTES, BlockCosts, alpha, attention_params, block_costs, block_shard_params, collective_time, comm_bytes,
    critical_batch_dp, critical_batch_fsdp, critical_batch_fsdp_tp, divisors, embed_params, fsdp_tensor_bandwidth,
    kv_params, layer_params, layer_times, min_devices_to_fit, param_count, step_time, tensor_max_width, x_opt)
from shardlab.analysis.layout_search import (  # noqa: F401  (re-exported)
    CHOICE, RANKING, REMAT_BY_RECOMPUTE, choose, evaluate_layout, placements, rank, search, this_layout)
from shardlab.analysis.memory_model import dtype_bytes
from shardlab.analysis.links import mesh_links
from shardlab.analysis.pipeline_search import (  # noqa: F401  (re-exported)
    PIPELINE_MICROBATCHES, evaluate_pipeline, given_pipeline, pipeline_batch_range, pipeline_layouts, pipeline_memory,
    pipeline_search_summary, pipeline_shapes, pipeline_stage_counts, pipeline_table, pipeline_virtual_stages,
    why_no_pipeline)
from shardlab.axes import DATA, FSDP, PIPELINE, TENSOR
from shardlab.composition import Composition


def batch_range(c: Composition, layout: dict[str, Any]) -> dict[str, Any]:
  """The global batches a layout runs well at, in tokens and sequences: `compute_bound_from_tokens`, the smallest
  with whole sequences per batch shard at which every axis's communication hides behind the math of one pass
  (critical batch per device x N; None when tensor parallelism binds at any batch), and `fits_per_pass_tokens`,
  the largest one forward + backward pass holds in HBM at the layout's remat (whole sequences per batch shard):
  a larger global batch needs ceil(B / it) microbatches, each pass compute-bound while it is above the first."""
  L, shards = c.model.seq_len, layout[DATA] * layout[FSDP]
  n = shards * layout[TENSOR]
  crit = layout["critical_batch_per_device"]["this_mesh"]
  if PIPELINE in layout:
    return pipeline_batch_range(c, layout)
  low = None if crit is None else max(1, math.ceil(crit * n / (shards * L) - 1e-9)) * shards * L
  replica = c.replace(mesh={FSDP: layout[FSDP], TENSOR: layout[TENSOR]},
                     schedule={"remat": layout["remat"], "microbatches": 1},
                     train={"global_batch_tokens": c.global_tokens / layout[DATA]})
  high = batch_window(replica)["max_global_batch_tokens"] * layout[DATA]
  return {"compute_bound_from_tokens": low, "fits_per_pass_tokens": high,
          "compute_bound_from_sequences": None if low is None else low // L, "fits_per_pass_sequences": high // L,
          "configured_tokens": c.global_tokens, "remat": layout["remat"], "microbatches": layout["microbatches"]}


def answer(c: Composition, devices: int | None = None, torus: tuple[int, ...] | None = None,
           remat: str | None = None, microbatches: int | None = None, pipeline: bool = False) -> dict[str, Any]:
  """Which layout and which batch for c's model, hardware and global batch on `devices`: every data x fsdp x
  tensor layout (placements), each at its best remat and microbatches (CHOICE; `remat` / `microbatches` fix
  them), ranked (RANKING), with the best layout's batch range (batch_range). pipeline=True: the pipeline
  layouts too (pipeline_layouts: P stages x a schedule x M microbatches x data x fsdp x tensor; `microbatches`
  fixes their M), ranked with the others."""
  remats = (remat,) if remat else REMAT_BY_RECOMPUTE
  layouts = [choose(c, p, remats, microbatches) for p in placements(c, devices, torus)]
  if pipeline:
    layouts += pipeline_layouts(c, devices, torus, remats, microbatches)
  layouts = rank(layouts)
  n = devices or c.mesh.n_devices
  out = {"devices": n, "considered": len(layouts), "qualifying": sum(not l["rejected_because"] for l in layouts),
         "global_batch_tokens": c.global_tokens, "choice": CHOICE, "ranking": RANKING,
         "batch_window": batch_range(c, layouts[0]), "layouts": layouts}
  if pipeline:
    out[PIPELINE] = pipeline_search_summary(c, n, layouts, microbatches)
  return out


def check(c: Composition) -> None:
  """Raise ValueError on values the formulas cannot use (the CLI turns it into one line and exit 2)."""
  m, mesh, t, hw = c.model, c.mesh, c.train, c.hardware
  for name, v in [("mesh.fsdp", mesh.fsdp), ("mesh.tensor", mesh.tensor), ("mesh.fsdp_ici_axes", mesh.fsdp_ici_axes),
                  ("mesh.tensor_ici_axes", mesh.tensor_ici_axes), ("model.d_model", m.d_model),
                  ("model.d_ff", m.d_ff), ("model.n_layers", m.n_layers), ("model.seq_len", m.seq_len)]:
    if v < 1:
      raise ValueError(f"{name}={v} must be >= 1")
  if m.kind not in ("transformer", "ffn"):
    raise ValueError(f"model.kind={m.kind!r} must be transformer or ffn")
  if m.kind == "transformer" and (m.n_heads < 1 or m.d_model % m.n_heads):
    raise ValueError(f"model.d_model={m.d_model} must be a multiple of model.n_heads={m.n_heads}")
  if not 0 <= t.mfu <= 1:
    raise ValueError(f"train.mfu={t.mfu} must be in [0, 1] (0: the time model, analysis/step_model.py)")
  if c.global_tokens <= 0:
    raise ValueError("the global batch must hold at least one token (train.global_batch_tokens or batch_size)")
  if hw.peak_flops <= 0 or hw.ici_bandwidth <= 0 or hw.hbm_bytes <= 0:
    raise ValueError("hardware.peak_flops, ici_bandwidth and hbm_bytes must be > 0")


def timed(c: Composition, p: int, tokens: float, n: int) -> dict[str, Any]:
  """{"mfu", "step_time_s", "step_model"}: with train.mfu set, the Scaling Book's step (6 P B / (N C mfu)); else
  the time model's prediction of the configured mesh's program (analysis/step_model.py) and its breakdown."""
  if c.train.mfu:
    return {"mfu": c.train.mfu, "step_time_s": step_time(p, tokens, c.hardware.peak_flops, n, c.train.mfu)}
  from shardlab.analysis import step_model
  got = step_model.predict(c.replace(mesh={DATA: 1}), tokens_per_device=tokens / n, data=1)
  return {"mfu": got["mfu"], "step_time_s": got["t_step_s"], "step_model": got}


# ------------------------------------------------------------------------------------------------------ the plan

def plan(c: Composition) -> dict[str, Any]:
  """Everything the planner predicts for one `Config`, as a JSON-ready dict (see shardlab/plan.py). With
  mesh.data > 1 (HSDP) the FSDP x TP fields describe one data replica (fsdp x tensor devices, the global batch
  / data) and `hsdp` the whole layout, the gradient AllReduce over data included (evaluate_layout)."""
  check(c)
  if c.mesh.data > 1:
    replica = c.replace(mesh={DATA: 1}, train={"global_batch_tokens": c.global_tokens / c.mesh.data})
    return {**plan(replica), "mesh_data": c.mesh.data, "hsdp": this_layout(c)}
  m, mesh, hw = c.model, c.mesh, c.hardware
  x, y = mesh.fsdp, mesh.tensor
  n = x * y
  tokens = c.global_tokens
  p = param_count(m)
  a = alpha(hw)
  ici = mesh_links(c)[0]           # the configured M, or on a TPU preset the slice's own (links.mesh_links)
  m_x, m_y = hw.physical_axes(ici[FSDP]), hw.physical_axes(ici[TENSOR])
  w_bytes, a_bytes = comm_bytes(c)

  per_layer = layer_times(c)
  w_x, w_y = fsdp_tensor_bandwidth(c)
  critical, binding = block_costs(c, w_x, w_y).critical_batch()
  window = batch_window(c)
  # The embedding / unembedding are gathered over fsdp like a layer; their TP traffic (logits) is left out.
  emb_fsdp = ((2 + c.weights.regathers) * collective_time(
      w_bytes * embed_params(m) / y, x, w_x, hw.hop_latency_s))
  t_math = 6 * p * tokens / (n * hw.peak_flops)
  t_comm = {FSDP: m.n_layers * per_layer[FSDP] + emb_fsdp, TENSOR: m.n_layers * per_layer[TENSOR]}
  mem = MM.breakdown(c)

  warnings = []
  if hw.domain_devices and n > hw.domain_devices and not hw.dcn_bandwidth:
    warnings.append(f"{n} devices exceed {hw.name}'s fast domain of {hw.domain_devices} and the preset names no "
                    "bandwidth beyond it (hardware.dcn_bandwidth): every axis is costed at its ici_bandwidth")
  if mem["total"] > hw.hbm_bytes:
    warnings.append(f"{mem['total'] / 1e9:.1f} GB per device exceeds HBM ({hw.hbm_bytes / 1e9:.0f} GB)")
  if hw.note:
    warnings.append(hw.note)

  return {
      "model": m.name, "kind": m.kind, "hardware": hw.name,
      "mesh": {FSDP: x, TENSOR: y, "devices": n, "fsdp_ici_axes": m_x, "tensor_ici_axes": m_y},
      "global_batch_tokens": tokens,
      "batch_per_device_tokens": tokens / n,
      "n_params": p,
      "memory_per_device_bytes": mem,
      "hbm_bytes": hw.hbm_bytes,
      "fits_in_hbm": mem["total"] <= hw.hbm_bytes,
      "max_batch_per_device_tokens": window["max_batch_per_device_tokens"],
      "batch_window": window,
      "microbatches": microbatches_to_fit(c),
      "min_devices_to_fit": min_devices_to_fit(p, hw.hbm_bytes, 4 * dtype_bytes(c.precision.param_dtype)),
      "alpha": a,
      "axis_bandwidth": {FSDP: w_x, TENSOR: w_y},
      "comm_bytes_per_element": {"weights": w_bytes, "activations": a_bytes},
      "critical_batch_per_device": {
          "dp": critical_batch_dp(a, m_x, w_bytes),
          FSDP: critical_batch_fsdp(a, m_x, w_bytes),
          "fsdp_tp": critical_batch_fsdp_tp(a, m.d_ff, m_x, m_y, w_bytes, a_bytes),
          "this_mesh": critical,       # below it a block's forward fsdp or tensor comms exceed its math
          "binding_axis": binding,     # the axis that binds there (tensor with this_mesh null: at any batch)
      },
      "critical_batch_form": "overlapped (current Scaling Book): fsdp_tp = alpha^2/(M_X M_Y F); additive is 4x",
      "tensor_max_width": tensor_max_width(a, m.d_ff, m_y, a_bytes),
      "x_opt": x_opt(tokens, m.d_ff, n, m_x, m_y, w_bytes, a_bytes),
      "t_math_s": t_math,
      "t_comm_s": t_comm,
      "t_math_per_layer_s": per_layer["math"],
      "t_comm_per_layer_s": {FSDP: per_layer[FSDP], TENSOR: per_layer[TENSOR]},
      "comm_to_math_forward": {FSDP: per_layer["fsdp_fwd"] / per_layer["math_fwd"],
                               TENSOR: per_layer["tensor_fwd"] / per_layer["math_fwd"]},
      "compute_bound": max(per_layer["fsdp_fwd"], per_layer["tensor_fwd"]) <= per_layer["math_fwd"],
      "compute_bound_additive": per_layer["fsdp_fwd"] + per_layer["tensor_fwd"] <= per_layer["math_fwd"],
      "roofline_step_s": {"overlapped": max(t_math, *t_comm.values()), "additive": t_math + sum(t_comm.values())},
      **timed(c, p, tokens, n),
      "warnings": warnings,
      "assumptions": [
          "FSDP is ZeRO-3 over all N = fsdp * tensor devices; Adam moments in param_dtype",
          "C is the bf16 peak whatever precision.compute_dtype is; MFU absorbs the difference",
          "times are per step (forward + backward) per device; matmul FLOPs only (6 * params * tokens)",
          "compute_bound: a layer's forward comms on fsdp and tensor overlap each other and its FLOPs "
          "(max <= T_math, the current book); compute_bound_additive: they do not (sum <= T_math)",
          "critical batches, x_opt and tensor_max_width are the book's closed forms with F = d_ff, "
          "scaled by the configured comm bytes (the book's bf16 is 2 and 2)",
          "GPU presets ignore *_ici_axes: a switch gives each GPU the same egress on any mesh axis",
          "activations are an estimate (plain attention saves [B,H,T,T] probs); measure with memory_analysis()",
          "max_batch_per_device_tokens: whole sequences per fsdp shard that fit in HBM by this memory model; "
          "microbatches: the fewest that fit the global batch (null: none does)",
      ],
  }
