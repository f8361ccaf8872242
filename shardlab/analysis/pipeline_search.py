"""Pipeline layouts (answer(pipeline=True), `python -m shardlab.plan pipeline_search=true`): P stages (a divisor of
the devices, >= 2, with n_layers a multiple of P V) x each schedule of pipeline_tables.SCHEDULES (V = 2 for
interleaved, else 1) x M = P, 2P, 4P, 8P microbatches (whole sequences per batch shard) x data x fsdp x tensor of
the devices / P, the pipeline axis outermost (across nodes first: placements(pipeline=P)). Step time: the
stage's per-microbatch slot times from this module's block roofline (F = n_layers / (P V) blocks' forward at one
microbatch's per-device tokens, B its backward, or B and W for a table that splits the weight gradient off; the
head in F) and the send of one microbatch's residual stream over the pipeline axis's bandwidth, replayed through
the schedule's own tick table as the executor runs it (replay(build(...), sync=True): neighbour-synchronised
ticks, so the bubble is the executor's, not the closed form's). With train.mfu, each slot is its roofline (the
communication behind the math) and the step / train.mfu; without it (the default), a slot's math runs at the
fraction of peak the time model predicts for the stage's kernels (step_model.kernel_efficiency) and each part's
communication is hidden or exposed by the part's own rule, as step_model prices the layouts without stages (the
weights part's gathers hidden only where it prefetches, TP collectives only where the contraction overlaps them),
so that the two kinds of layout are ranked by one time model. Memory per stage: memory_model.breakdown's
terms for the stage's layers, with activations for the most microbatch-chunks a stage holds in flight by the
table (in_flight) at one microbatch's tokens, plus the residual-stream buffers the executor allocates
(evaluate_pipeline, pipeline_memory). These are predictions of the closed forms and the replay, like every other
number here: summary.json's `pipeline` (analysis/pipeline_cost.py) replays a compiled run's own slot times.
answer's `pipeline` (pipeline_search_summary) lists the P costed and those the layers rule out, and when no
pipeline layout applies, why (why_no_pipeline), so that a table without one is not read as pipelines that lost.
"""
from __future__ import annotations

import math
from typing import Any

from shardlab.analysis.batch_window import at_tokens, last_fitting
from shardlab.analysis.closed_forms import block_costs, divisors, embed_params, param_count
from shardlab.analysis.layout_search import REMAT_BY_RECOMPUTE, placements, sharding_problems
from shardlab.analysis.memory_model import breakdown, dtype_bytes
from shardlab.analysis.pipeline_replay import replay
from shardlab.analysis.step_model import kernel_efficiency
from shardlab.axes import CONTEXT, DATA, FSDP, PIPELINE, TENSOR, shape_of
from shardlab.composition import Composition
from shardlab.pipeline_tables import (SCHEDULES, Plan, check_shape, chunks_per_stage, closed_form_bubble,
                                      in_flight, table_of)


PIPELINE_MICROBATCHES = (1, 2, 4, 8)   # M = m P for these m: the microbatch counts a pipeline layout tries


def _schedules() -> tuple[str, ...]:
  return tuple(SCHEDULES)


def pipeline_virtual_stages(name: str) -> int:
  """V the search runs a schedule at: 2 where its table runs several chunks per stage (interleaved, looped_bfs, a
  V), else 1: asked of the table (pipeline_tables.chunks_per_stage), not the name."""
  return chunks_per_stage(name)


_TABLES: dict = {}


def pipeline_table(name: str, P: int, M: int, V: int, csv: str = "", consecutive: int = 0) -> dict[str, Any]:
  """The schedule's tick table (pipeline_tables.py: table_of, a named schedule's or a torch-format CSV's) and what a
  stage holds by it, cached:
  {"ticks", "split" (W split off), "in_flight" (the most microbatch-chunks of residuals a stage holds, on the
  stage that holds the most: max of pipeline.in_flight, until W when split), "x" and "w" (residual-stream
  blocks and per-layer output-gradient chunks the executor allocates: Plan.buffers)}."""
  key = (name, P, M, V, csv, consecutive)
  if key not in _TABLES:
    ticks = table_of(name, csv, P, M, V, consecutive)
    split = any(a.kind == "W" for row in ticks for cell in row for a in cell)
    units = Plan(ticks, M, V).buffers()
    _TABLES[key] = {"ticks": ticks, "split": split, "in_flight": max(in_flight(ticks, "W" if split else "B")),
                    "x": units["x"], "w": units["w"]}
  return _TABLES[key]


def pipeline_shapes(c: Composition, devices: int, microbatches: int | None = None) -> list[tuple[int, str, int, list[int]]]:
  """(P, schedule, V, [M, ...]) the search tries on `devices`: P a divisor of the devices >= 2 with n_layers a
  multiple of P V, every schedule of pipeline.SCHEDULES (V = 2 where its table runs chunks, else 1), M = P, 2P, 4P, 8P (or
  `microbatches`) that the schedule accepts (check_shape: interleaved needs M a multiple of P) and that leave each
  microbatch a whole number (>= 1) of sequences on each batch shard of the smallest data x fsdp (1): the per-
  layout limit is applied in `choose_pipeline`."""
  from shardlab.errors import ConfigError
  out = []
  for P in divisors(devices):
    if P < 2:
      continue
    for name in _schedules():
      V = pipeline_virtual_stages(name)
      if c.model.n_layers % (P * V):
        continue
      counts = []
      for M in ([microbatches] if microbatches else [m * P for m in PIPELINE_MICROBATCHES]):
        try:
          check_shape(name, P, M, V)
        except ConfigError:
          continue
        counts.append(M)
      if counts:
        out.append((P, name, V, counts))
  return out


def pipeline_memory(c: Composition, data: int, fsdp: int, tensor: int, P: int, name: str, M: int,
                    tokens: float | None = None, V: int | None = None, csv: str = "",
                    consecutive: int = 0) -> dict[str, float]:
  """Bytes per device on a pipeline stage: memory_model.breakdown of c on P stages by the named schedule (V =
  pipeline_virtual_stages, or V; `csv`: a CSV table's) at M microbatches, each stage a data x fsdp x tensor mesh, at `tokens` (default
  c's global batch): the stage's n_layers / P layers of state and gathered weights, the embeddings every
  stage holds, and the activations the executor allocates from the schedule's table (in-flight microbatch-chunks
  of residuals, residual-stream blocks, a split weight gradient's output gradients, one microbatch's logits)."""
  tokens = c.global_tokens if tokens is None else tokens
  stage = c.replace(mesh={PIPELINE: P, FSDP: fsdp, TENSOR: tensor, DATA: 1},
                   pipeline={"name": name, "impl": name, "microbatches": M, "table": csv, "consecutive": consecutive,
                             "virtual_stages": V or pipeline_virtual_stages(name)}, schedule={"microbatches": 1})
  return breakdown(at_tokens(stage, tokens / data))


def evaluate_pipeline(c: Composition, place: tuple, P: int, name: str, M: int, V: int | None = None,
                      csv: str = "", consecutive: int = 0) -> dict[str, Any]:
  """One pipeline layout: P stages by the named schedule (V = pipeline_virtual_stages, or V; `csv`: the table
  of a torch-format CSV) at M microbatches, each
  stage a data x fsdp x tensor mesh of `place` (placements(..., pipeline=P)), at c's remat. The same row as
  evaluate_layout's, with pipeline, schedule, virtual_stages, bubble (and the slot times the replay took).

  Slot times (per microbatch and chunk of k = n_layers / (P V) layers, at the microbatch's per-device tokens b = B /
  (data fsdp tensor M): each stage's devices run every microbatch): F = k x (math b, gather, tensor) (a stage's
  weights gathered in every F and B: pipeline.gather=microbatch), B = k x (2 math b, the backward's gathers and
  reduce-scatter, tensor) (without the data AllReduce), or, for a table that splits the weight gradient off, B = k
  x (math b, re-gather, tensor) and W = k x (math b, reduce-scatter), where (math, fsdp, tensor) is their max
  with train.mfu (the roofline) and otherwise math / kernel_efficiency with fsdp added unless the weights part
  prefetches and tensor added unless the contraction overlaps it (the max where they hide); the head (the
  unembedding's forward and backward matmuls, 3 x 2 vocab d_model b / C: b is per device) in the last virtual
  stage's F slot, where the last stage runs it (replay's t_head, as
  pipeline_cost.predict does). send = one microbatch's residual stream per device (B
  / (data fsdp M) tokens x d_model x compute bytes, / tensor when sequence-parallel) over the pipeline axis's
  bandwidth, at least one hop's latency. Step = replay(build(...), F, B, W, send, sync=True) (the executor's
  neighbour-synchronised ticks) + the data AllReduce of the stage's gradients beyond its last B + the embeddings'
  gather and reduce-scatter (once per step), / train.mfu where it is set (the head's matmuls otherwise at
  kernel_efficiency, the sends and the step's collectives as they are). All predictions."""
  data, fsdp, tensor, bws, axes, hops, untiled = place
  m, hw, hbm = c.model, c.hardware, c.hardware.hbm_bytes
  V = V or pipeline_virtual_stages(name)
  tab = pipeline_table(name, P, M, V, csv, consecutive)
  tokens = c.global_tokens
  n = P * data * fsdp * tensor
  b = tokens / (data * fsdp * tensor) / M    # per-device tokens of one microbatch (every stage runs all of it)
  k = m.n_layers // (P * V)
  sub = c.replace(mesh={FSDP: fsdp, TENSOR: tensor, "fsdp_ici_axes": axes[FSDP],
                         "tensor_ici_axes": axes[TENSOR]}, train={"global_batch_tokens": tokens / data})
  args = (bws[FSDP], bws[TENSOR], data, bws[DATA])
  block, embed = block_costs(sub, *args, hops=hops), block_costs(sub, *args, params=embed_params(m), hops=hops)
  # train.mfu (the book's step): each slot its roofline, communication hidden behind the math, all / mfu. Without
  # it (the time model's): the math at the fraction of peak the time model predicts for the stage's kernels, and
  # each part's communication hidden or exposed by its own rule, as step_model prices the layouts beside these:
  # the weights part's gathers behind the math only where it prefetches, the TP collectives only where the
  # contraction overlaps them (point_to_point)
  eff = c.train.mfu or kernel_efficiency(sub.replace(mesh={CONTEXT: 1}), b, data, bws, hops)
  timed = not c.train.mfu
  hides_fsdp, hides_tp = bool(getattr(c.weights, "prefetches", False)), bool(getattr(c.tp, "point_to_point", False))

  def slot(math: float, fsdp: float, tensor: float) -> float:
    if not timed:
      return max(math, fsdp, tensor)
    t = math / eff
    t = max(t, fsdp) if hides_fsdp else t + fsdp
    return max(t, tensor) if hides_tp else t + tensor
  head = 0.0 if m.kind == "ffn" else 3 * 2 * m.vocab_size * m.d_model * b / hw.peak_flops / (eff if timed else 1)
  t_f = k * slot(block.math * b, block.fsdp, block.tensor_time(b))
  regather = block.fsdp * c.weights.regathers
  if tab["split"]:
    t_b = k * slot(block.math * b, regather, block.tensor_time(b))
    t_w = k * slot(block.math * b, block.fsdp, 0.0)
  else:
    t_b, t_w = k * slot(2 * block.math * b, block.fsdp_bwd_passes * block.fsdp, block.tensor_time(b)), 0.0
  cb = dtype_bytes(c.precision.compute_dtype)
  tp = c.tp                 # a sequence-parallel contraction sends 1/tensor of the residual stream
  send_bytes = tokens / (data * fsdp * M) * m.d_model * cb / (tensor if tp.seq_sharded else 1)
  t_send = max(send_bytes / bws[PIPELINE], hw.hop_latency_s)
  run = replay(tab["ticks"], t_f, t_b, t_w, t_send, sync=True, t_head=head)
  tail = max(0.0, m.n_layers // P * block.data - t_b)     # the data AllReduce behind the stage's last backward
  once = 2 * embed.fsdp                                   # embeddings: gathered, reduce-scattered once per step
  scale = 1.0 if timed else eff          # the time model's slots are seconds already; the book's are / mfu
  step = (run["step_s"] + tail + once) / scale

  ratios = block.comm_to_math(b)
  mem = pipeline_memory(c, data, fsdp, tensor, P, name, M, V=V, csv=csv, consecutive=consecutive)
  state = mem["master_params"] + mem["grads"] + mem["optimizer"]
  critical, binding = block.critical_batch()
  why = sharding_problems(c, shape_of({PIPELINE: P, DATA: data, FSDP: fsdp, TENSOR: tensor}))
  if untiled:
    why.insert(0, untiled)
  fits = mem["total"] <= hbm
  if not fits:
    why.append(f"memory: {mem['total'] / 1e9:.1f} GB per device > {hbm / 1e9:.0f} GB HBM (pipeline stage of "
               f"{m.n_layers // P} layers: training state {state / 1e9:.1f} GB, activations "
               f"{mem['activations'] / 1e9:.1f} GB for {tab['in_flight']} microbatch-chunks in flight)")
  need = block.critical_batches()
  what = {FSDP: "the weight AllGather", TENSOR: "the activation AllGather/ReduceScatter",
          DATA: "the gradient AllReduce"}
  for axis, r in ratios.items():
    if r > 1:
      at = ("at any batch (tensor > M_Y F / alpha)" if need[axis] is None
            else f"per-device batch {b:.0f} (of {M} pipeline microbatches) < {need[axis]:.0f} tokens")
      why.append(f"communication: {axis}: {what[axis]} takes {r:.2f}x the math it overlaps, {at}")
  notes = []
  local_seqs = tokens / (data * fsdp * M) / m.seq_len
  if local_seqs != int(local_seqs) or local_seqs < 1:
    notes.append(f"each microbatch holds {local_seqs:.3g} sequences per batch shard: shardlab shards whole "
                 "sequences over data x fsdp (fractions need sequence sharding)")
  return {
      DATA: data, FSDP: fsdp, TENSOR: tensor, "remat": c.schedule.remat, "microbatches": M,
      "fits": fits, "compute_bound": max(ratios.values()) <= 1, "step_time_s": step,
      "mfu": 6 * param_count(m) * (tokens / n) / (hw.peak_flops * step), "rejected_because": why,
      "memory_per_device_bytes": mem["total"], "memory_margin_bytes": hbm - mem["total"],
      "microbatches_to_fit": 1 if fits else None, "batch_per_device_tokens": tokens / n, "comm_to_math": ratios,
      "critical_batch_per_device": {"this_mesh": critical, "binding_axis": binding},
      "ici_axes": axes, "axis_bandwidth": bws, "latency_hops": hops, "notes": notes,
      PIPELINE: P, "schedule": name, "virtual_stages": V, "consecutive": consecutive, "bubble": run["bubble"],
      "bubble_closed_form": None if csv else closed_form_bubble(name, P, M, V), "in_flight": tab["in_flight"],
      "stage_layers": m.n_layers // P, "activations_per_device_bytes": mem["activations"],
      "slot_s": {"F": t_f, "B": t_b, "W": t_w, "head": head, "send": t_send},
      "pipeline_step_s": run["step_s"] / scale, "kernel_efficiency": eff,
  }


def choose_pipeline(c: Composition, place: tuple, P: int, name: str, counts: list[int],
                     remats: tuple[str, ...], V: int | None = None, csv: str = "",
                     consecutive: int = 0) -> dict[str, Any] | None:
  """The pipeline layout at its best (remat, M) by CHOICE: for each M of `counts` that leaves each microbatch
  whole sequences on every batch shard, the least recomputation that fits (the step time does not charge it);
  the fastest of those (ties: the fewest microbatches). Nothing fits: the setting with the least memory. None
  when no M leaves whole sequences."""
  data, fsdp, tensor = place[:3]
  local = c.global_tokens / (data * fsdp) / c.model.seq_len
  counts = [M for M in counts if local >= M and local / M == int(local / M)]
  if not counts:
    return None
  fitting, least = [], (math.inf, None)
  for M in counts:
    for remat in remats:
      total = pipeline_memory(c.replace(schedule={"remat": remat}), data, fsdp, tensor, P, name, M, V=V,
                              csv=csv, consecutive=consecutive)["total"]
      least = min(least, (total, (remat, M)), key=lambda t: t[0])
      if total <= c.hardware.hbm_bytes:
        fitting.append((remat, M))
        break
  if not fitting:
    fitting = [least[1]]
  evaluated = [evaluate_pipeline(c.replace(schedule={"remat": r}), place, P, name, M, V, csv, consecutive)
               for r, M in fitting]
  return min(evaluated, key=lambda l: (float(f"{l['step_time_s']:.6g}"), REMAT_BY_RECOMPUTE.index(l["remat"]),
                                       l["microbatches"]))


def given_pipeline(c: Composition) -> dict[str, Any] | None:
  """The pipeline of c as configured (mesh.pipeline = P > 1 with pipeline=NAME or pipeline.table=PATH.csv):
  evaluate_pipeline's row on its data x fsdp x tensor stages at c's remat, its V, and its M, or (M = 0 and no
  CSV) the M of P, 2P, 4P, 8P that fits and is fastest (choose_pipeline); where nothing fits, "fits_with" names
  the remat and M that would. None without stages or without an M of whole sequences per batch shard."""
  from shardlab.errors import ConfigError
  P = c.mesh.sizes.get(PIPELINE, 1)
  if P < 2 or (c.pipeline.impl == "none" and not c.pipeline.table):
    return None
  pipe = c.pipeline.with_table(P)
  M, V = pipe.microbatches, pipe.virtual_stages
  counts = [M] if M else []
  for m in ([] if M else PIPELINE_MICROBATCHES):
    try:
      check_shape(pipe.impl, P, m * P, V, pipe.consecutive)
      counts.append(m * P)
    except ConfigError:
      continue
  shape = (c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
  place = next(p for p in placements(c, c.mesh.n_devices, pipeline=P) if tuple(p[:3]) == shape)
  row = choose_pipeline(c, place, P, pipe.impl, counts, (c.schedule.remat,), V, pipe.table, pipe.consecutive)
  if row is not None and not row["fits"]:     # what would fit: more recomputation, another M
    other = choose_pipeline(c, place, P, pipe.impl, counts, REMAT_BY_RECOMPUTE, V, pipe.table, pipe.consecutive)
    if other["fits"]:
      row["fits_with"] = {"schedule.remat": other["remat"], "pipeline.microbatches": other["microbatches"]}
  return row


def pipeline_layouts(c: Composition, devices: int | None = None, torus: tuple[int, ...] | None = None,
                     remats: tuple[str, ...] = REMAT_BY_RECOMPUTE, microbatches: int | None = None) -> list[dict]:
  """Every pipeline layout of `devices` (pipeline_shapes x placements(..., pipeline=P)) at its best remat and M
  (choose_pipeline), unranked."""
  n = devices or c.mesh.n_devices
  out = []
  for P, name, V, counts in pipeline_shapes(c, n, microbatches):
    for place in placements(c, n, torus, pipeline=P):
      row = choose_pipeline(c, place, P, name, counts, remats)
      if row is not None:
        out.append(row)
  return out


def _listed(xs) -> str:
  """'2', '2 or 4', '2, 4 or 8'."""
  xs = [str(x) for x in xs]
  return xs[0] if len(xs) == 1 else f"{', '.join(xs[:-1])} or {xs[-1]}"


def pipeline_stage_counts(c: Composition, devices: int) -> dict[str, Any]:
  """{"tried": [P, ...], "excluded": {P: why}}: the stage counts P >= 2 that divide `devices`, split by whether the
  layers split evenly into P stages (by a schedule's V: interleaved needs n_layers a multiple of 2P): so that a
  search can say which pipelines it costed and why not the others."""
  layers, tried, excluded = c.model.n_layers, [], {}
  for P in (p for p in divisors(devices) if p >= 2):
    if any(layers % (P * pipeline_virtual_stages(name)) == 0 for name in _schedules()):
      tried.append(P)
    else:
      excluded[str(P)] = f"model.n_layers={layers} is not a multiple of {P}: no stages of whole layers"
  return {"tried": tried, "excluded": excluded}


def why_no_pipeline(c: Composition, devices: int, microbatches: int | None = None) -> str | None:
  """Why pipeline_search costed no pipeline layout on `devices`, in one line naming the setting to change; None
  when one applies. A table without a pipeline row otherwise leaves the reader to guess whether pipelines lost or
  were never tried. The checks follow pipeline_layouts: stage counts, layers per stage, then whole-sequence
  microbatches on the most permissive stage mesh (data x fsdp = 1, where each shard holds the whole batch)."""
  stages = [P for P in divisors(devices) if P >= 2]
  if not stages:
    return (f"{devices} device: a pipeline needs at least 2 stages of one device each; search more devices "
            "(devices=N, N >= 2)")
  layers = c.model.n_layers
  if not pipeline_stage_counts(c, devices)["tried"]:
    unit = next((d for d in divisors(layers) if d >= 2), None)        # None: one layer splits no way
    fix = f"set model.n_layers to a multiple of {stages[0]}" + (f", or devices=N to a multiple of {unit}"
                                                                 if unit else "")
    what = "1 layer cannot be split" if layers == 1 else f"model.n_layers={layers} does not split evenly"
    return f"{what} into {_listed(stages)} stages (the stage counts that divide {devices} devices); {fix}"
  shapes = pipeline_shapes(c, devices, microbatches)
  counts = sorted({M for *_, ms in shapes for M in ms})
  if not counts:
    return (f"schedule.microbatches={microbatches}: no pipeline schedule runs at that count on "
            f"{_listed(pipeline_stage_counts(c, devices)['tried'])} stages; leave schedule.microbatches out")
  seqs = c.global_tokens / c.model.seq_len
  if any(seqs >= M and seqs % M == 0 for M in counts):
    return None
  setting = "train.global_batch_tokens" if c.train.global_batch_tokens else "train.batch_size"
  if microbatches:
    return (f"schedule.microbatches={microbatches} does not cut the global batch of {seqs:,.4g} sequences into "
            f"microbatches of whole sequences; set {setting} to a multiple of {microbatches}, or leave "
            "schedule.microbatches out")
  return (f"the global batch of {seqs:,.4g} sequences does not cut into {_listed(counts)} pipeline microbatches "
          f"(M = P, 2P, 4P, 8P) of whole sequences; set {setting} to a multiple of {counts[0]} sequences")


def pipeline_search_summary(c: Composition, devices: int, layouts: list[dict], microbatches: int | None = None) -> dict:
  """answer's `pipeline` with pipeline=True: the stage counts tried and those excluded with why, how many pipeline
  layouts were costed, and `none_because`: why none was (why_no_pipeline), or None."""
  stages = pipeline_stage_counts(c, devices)
  n = sum(PIPELINE in l for l in layouts)
  none = None if n else (why_no_pipeline(c, devices, microbatches)
                         or "no stage mesh leaves each microbatch whole sequences")
  return {"stages_tried": stages["tried"], "stages_excluded": stages["excluded"], "layouts": n, "none_because": none}


def pipeline_batch_range(c: Composition, layout: dict[str, Any]) -> dict[str, Any]:
  """batch_range of a pipeline layout at its M: a batch shard's microbatch is whole sequences, so global batches
  step by data fsdp M sequences; compute-bound from the critical per-device batch of one microbatch's pass, fits
  up to the largest such batch its stage holds in HBM (pipeline_memory grows with the batch)."""
  L, M, P = c.model.seq_len, layout["microbatches"], layout[PIPELINE]
  unit = layout[DATA] * layout[FSDP] * M * L            # tokens: one more sequence per shard per microbatch
  crit = layout["critical_batch_per_device"]["this_mesh"]
  n = layout[DATA] * layout[FSDP] * layout[TENSOR]      # a stage's devices: each runs every microbatch
  low = None if crit is None else max(1, math.ceil(crit * n * M / unit - 1e-9)) * unit
  at_remat = c.replace(schedule={"remat": layout["remat"]})
  mem = lambda t: pipeline_memory(at_remat, layout[DATA], layout[FSDP], layout[TENSOR], P, layout["schedule"], M, t)["total"]
  seqs = last_fitting(lambda s: mem(s * unit), c.hardware.hbm_bytes, 1)
  return {"compute_bound_from_tokens": low, "fits_per_pass_tokens": seqs * unit,
          "compute_bound_from_sequences": None if low is None else low // L,
          "fits_per_pass_sequences": seqs * unit // L,
          "configured_tokens": c.global_tokens, "remat": layout["remat"], "microbatches": M,
          PIPELINE: P, "schedule": layout["schedule"]}
