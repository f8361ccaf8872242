"""The layout search: every data x fsdp x tensor factorization of the devices, placed on the links (a switch's
NVLink and NICs, a torus's axes), each priced by the closed forms (closed_forms.py: BlockCosts) at its memory
(memory_model.breakdown) and ranked (RANKING); each at its best remat and microbatches (CHOICE)."""
from __future__ import annotations

import math
from typing import Any

from shardlab import params as PM
from shardlab.analysis import memory_model as MM
from shardlab.analysis.batch_window import batch_window, microbatches_to_fit
from shardlab.analysis.closed_forms import block_costs, divisors, embed_params, param_count
from shardlab.analysis.links import default_torus, mesh_links, switch_bandwidths, torus_axes
from shardlab.analysis import step_model
from shardlab.axes import CONTEXT, DATA, FSDP, PIPELINE, TENSOR, shape_of
from shardlab.composition import Composition


def factorizations(n: int):
  """Every (data, fsdp, tensor) with data * fsdp * tensor = n."""
  for data in divisors(n):
    for fsdp in divisors(n // data):
      yield data, fsdp, n // data // fsdp


def sharding_problems(c: Composition, shape: dict) -> list[str]:
  """What shardlab cannot shard: the dims a layout rule does not divide on this mesh (params.problems, the
  requirements validation checks too)."""
  return [f"sharding: {n.setting}={n.value} is not divisible by {n.by().replace('mesh.', '')}={n.size}"
          for n in PM.problems(c.model, c.layout, shape)]


def evaluate_layout(c: Composition, data: int, fsdp: int, tensor: int, bandwidth: dict[str, float],
                    ici_axes: dict[str, int], hops: dict[str, float] | None = None) -> dict[str, Any]:
  """One data x fsdp x tensor layout at the configured global batch: memory, compute-bound, step time and MFU.

  data is the HSDP replica axis: parameters replicated over it (state 16 B/param / (fsdp tensor)), the batch
  sharded over data x fsdp, each block's gradient AllReduced over data in backward. Roofline: per block,
  max(math, each axis's comms) forward and backward (comms overlap each other and the math, the book's current
  form), plus the embeddings as one more block without TP traffic. Step time = roofline / train.mfu (the
  fraction of its roofline a compute-bound step reaches: the book's 40% gives its 300 ms), so a comm-bound
  layout is slower by its comm / math. compute_bound is the book's test: every axis's comms within the math of
  its pass. mfu = 6 P B / (N C step).

  Without train.mfu (its default, 0) the step time is the time model's instead (analysis/step_model.py: the
  layout's program priced kernel by kernel at the preset's calibrated rates, recomputation and the exposed
  communication of the schedule's parts included), and `step_model` holds its breakdown; the roofline's
  comm/math ratios still decide compute_bound.
  """
  m, hw, hbm = c.model, c.hardware, c.hardware.hbm_bytes
  tokens = c.global_tokens
  b = tokens / (data * fsdp * tensor)
  sub = c.replace(mesh={FSDP: fsdp, TENSOR: tensor, "fsdp_ici_axes": ici_axes[FSDP],
                         "tensor_ici_axes": ici_axes[TENSOR]}, train={"global_batch_tokens": tokens / data})
  args = (bandwidth[FSDP], bandwidth[TENSOR], data, bandwidth[DATA])
  block, embed = block_costs(sub, *args, hops=hops), block_costs(sub, *args, params=embed_params(m), hops=hops)
  k = max(1, c.schedule.microbatches)
  step, timed = (m.n_layers * block.step(b, k) + embed.step(b, k)) / (c.train.mfu or 1), None
  if not c.train.mfu:
    timed = step_model.predict(sub.replace(mesh={CONTEXT: 1}), b, data, {**bandwidth}, hops)
    step = timed["t_step_s"]
  ratios = block.comm_to_math(b / k)         # per microbatch: what one pass's communication hides behind
  mem = MM.breakdown(sub)
  state = mem["master_params"] + mem["grads"] + mem["optimizer"]
  critical, binding = block.critical_batch()

  why = sharding_problems(c, shape_of({DATA: data, FSDP: fsdp, TENSOR: tensor}))
  k_fit = 1 if mem["total"] <= hbm else microbatches_to_fit(sub)
  if mem["total"] > hbm:
    why.append(f"memory: {mem['total'] / 1e9:.1f} GB per device > {hbm / 1e9:.0f} GB HBM (training state "
               f"{state / 1e9:.1f} GB: {state * fsdp * tensor / param_count(m):.3g} B/param / fsdp x tensor = "
               f"{fsdp * tensor})" + (f"; fits with schedule.microbatches={k_fit}" if k_fit else ""))
  need = block.critical_batches()
  what = {FSDP: "the weight AllGather", TENSOR: "the activation AllGather/ReduceScatter",
          DATA: "the gradient AllReduce"}
  for axis, r in ratios.items():
    if r > 1:
      per = f"per-device batch {b / k:.0f} (of {k} microbatches)" if k > 1 else f"per-device batch {b:.0f}"
      at = ("at any batch (tensor > M_Y F / alpha)" if need[axis] is None
            else f"{per} < {need[axis]:.0f} tokens")
      why.append(f"communication: {axis}: {what[axis]} takes {r:.2f}x the math it overlaps, {at}")

  notes = []
  local_seqs = tokens / (data * fsdp) / m.seq_len
  if local_seqs != int(local_seqs) or local_seqs < 1:
    notes.append(f"each batch shard holds {local_seqs:.3g} sequences: shardlab shards whole sequences over "
                 "data x fsdp (fractions need sequence sharding)")
  return {
      DATA: data, FSDP: fsdp, TENSOR: tensor, "remat": c.schedule.remat, "microbatches": k,
      "fits": mem["total"] <= hbm,
      "compute_bound": max(ratios.values()) <= 1, "step_time_s": step,
      "mfu": 6 * param_count(m) * b / (hw.peak_flops * step), "rejected_because": why,
      "memory_per_device_bytes": mem["total"], "memory_margin_bytes": hbm - mem["total"],
      "microbatches_to_fit": k_fit, "batch_per_device_tokens": b, "comm_to_math": ratios,
      "critical_batch_per_device": {"this_mesh": critical, "binding_axis": binding},
      **{key: v for key, v in batch_window(sub).items() if key.startswith("max_batch_per_device")},
      "ici_axes": ici_axes, "axis_bandwidth": bandwidth, "latency_hops": hops, "notes": notes,
      **({"step_model": timed} if timed else {}),
  }


def placements(c: Composition, devices: int | None = None, torus: tuple[int, ...] | None = None,
               pipeline: int = 1) -> list[tuple]:
  """Every data x fsdp x tensor factorization of the device count (default mesh.data * mesh.fsdp * mesh.tensor)
  laid out tensor innermost, then fsdp, then data: (data, fsdp, tensor, {axis: bytes/s}, {axis: torus axes
  spanned}, {axis: latency hops} or None, why it does not tile the TPU torus or None). With `pipeline` = P > 1:
  data x fsdp x tensor factor devices / P, and the pipeline axis is the outermost (across nodes first), its
  bandwidth, torus axes and hops in the dicts beside the others'."""
  hw = c.hardware
  n = devices or c.mesh.n_devices
  if n < 1:
    raise ValueError(f"devices={n} must be >= 1")
  if pipeline < 1 or n % pipeline:
    raise ValueError(f"pipeline={pipeline} does not divide the {n} devices searched")
  if torus is not None and not hw.torus:
    raise ValueError(f"torus={'x'.join(map(str, torus))}: hardware={hw.name} is a switch, not a torus")
  dims = (torus or default_torus(hw, n)) if hw.torus else None
  if dims is not None and math.prod(dims) != n:
    raise ValueError(f"torus={'x'.join(map(str, dims))} holds {math.prod(dims)} chips, not the {n} devices searched")
  out = []
  names_ = (TENSOR, FSDP, DATA) + ((PIPELINE,) if pipeline > 1 else ())
  for data, fsdp, tensor in factorizations(n // pipeline):
    sizes = [tensor, fsdp, data] + ([pipeline] if pipeline > 1 else [])    # innermost first
    placed = torus_axes(sizes, dims, hw.wraps) if dims is not None else None
    if placed:
      axes, hops = [a for a, _ in placed], dict(zip(names_, [h for _, h in placed]))
      bws = [hw.axis_bandwidth(a) for a in axes]
    else:                                          # a switch (or sizes that do not tile the torus)
      axes, hops = [1] * len(sizes), None
      bws = switch_bandwidths(hw, sizes) if dims is None else [hw.ici_bandwidth] * len(sizes)
    shown = "x".join(map(str, sizes[::-1]))
    untiled = (f"sharding: {shown} does not tile the torus {'x'.join(map(str, dims))}"
               if dims is not None and not placed else None)
    out.append((data, fsdp, tensor, dict(zip(names_, bws)), dict(zip(names_, axes)), hops, untiled))
  return out


def _evaluate_placed(c: Composition, place: tuple) -> dict[str, Any]:
  data, fsdp, tensor, bws, axes, hops, untiled = place
  layout = evaluate_layout(c, data, fsdp, tensor, bws, axes, hops)
  if untiled:
    layout["rejected_because"].insert(0, untiled)
  return layout


def rank(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Best first (RANKING). Step times equal to 6 significant digits tie."""
  return sorted(layouts, key=lambda l: (bool(l["rejected_because"]),
                                        len({r.split(":")[0] for r in l["rejected_because"]}),
                                        l["microbatches_to_fit"] or math.inf, float(f"{l['step_time_s']:.6g}"),
                                        REMAT_BY_RECOMPUTE.index(l["remat"]), l["microbatches"],
                                        max(l["comm_to_math"].values()), l["memory_per_device_bytes"]))


RANKING = ("qualifying layouts (they fit, shard and are compute-bound) first, by predicted step time; at equal "
           "times (6 significant digits) the costs the step time leaves out decide: the least recomputation, then "
           "the fewest microbatches; then the most slack (smallest worst comm/math ratio), then the least memory. "
           "Then the rejected layouts, fewest kinds of problem first (sharding, memory, communication), then by the "
           "microbatches they need to fit, then in the same order")


def search(c: Composition, devices: int | None = None, torus: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
  """Every layout of placements() at the configured remat and microbatches, ranked best first (RANKING)."""
  return rank([_evaluate_placed(c, p) for p in placements(c, devices, torus)])


# Remat policies from the least recomputation to the most (activation_elements_per_token: the most saved first).
REMAT_BY_RECOMPUTE = ("none", "save_matmuls_attn_out", "save_matmuls", "save_qkv_attn_out", "save_qkv_proj", "full")

CHOICE = ("each layout runs at the remat policy and microbatch count that fit its memory with the shortest predicted "
          "step time (a microbatch gathers the weights again; the time model charges the recomputation, train.mfu "
          "when given absorbs it, as in the book); at equal times the least recomputation (none, save_matmuls_attn_out, save_matmuls, "
          "save_qkv_attn_out, save_qkv_proj, full), then the fewest microbatches. Nothing fits: the setting with "
          "the least memory")


def choose(c: Composition, place: tuple, remats: tuple[str, ...], microbatches: int | None) -> dict[str, Any]:
  """The layout `place` at its best (remat, microbatches) by CHOICE: for each policy the fewest microbatches (a
  divisor of each batch shard's sequences, or `microbatches` when given) that fit; the fastest of those."""
  data, fsdp, tensor = place[:3]
  tokens = c.global_tokens
  sub = c.replace(mesh={FSDP: fsdp, TENSOR: tensor}, train={"global_batch_tokens": tokens / data})
  local = tokens / (data * fsdp) / c.model.seq_len
  counts = [microbatches] if microbatches else divisors(int(local)) if local >= 1 and local == int(local) else [1]
  fitting, least = [], (math.inf, None)
  for remat in remats:
    for k in counts:
      total = MM.breakdown(sub.replace(schedule={"remat": remat, "microbatches": k}))["total"]
      least = min(least, (total, (remat, k)), key=lambda t: t[0])
      if total <= c.hardware.hbm_bytes:
        fitting.append((remat, k))
        break
  if not fitting:                                  # nothing fits: shown at the least memory
    fitting = [least[1]]
  evaluated = [_evaluate_placed(c.replace(schedule={"remat": r, "microbatches": k}), place) for r, k in fitting]
  return min(evaluated, key=lambda l: (l["step_time_s"], REMAT_BY_RECOMPUTE.index(l["remat"]), l["microbatches"]))


def this_layout(c: Composition) -> dict[str, Any]:
  """evaluate_layout for c.mesh as configured (data x fsdp x tensor, its *_ici_axes and links: mesh_links)."""
  ici, bws = mesh_links(c)
  return evaluate_layout(c, c.mesh.data, c.mesh.fsdp, c.mesh.tensor, bws, ici)
