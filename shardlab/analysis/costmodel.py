"""Predicted step time on a hardware preset: each collective and matmul of the compiled step costed, the step's
dependency graph replayed with and without overlap (timeline.py). These are MODEL PREDICTIONS, not measurements.

Costs (links.collective_seconds at the preset's peak rates, the one collective-cost formula; NCCL tests
doc/PERFORMANCE.md and the Scaling Book's sharding.md; n devices on the axis, W its bandwidth
(links.axis_bandwidth), T_hop the preset's hop latency, bytes = what one device sends, ledger.py):
  AllGather, ReduceScatter   max(T_hop n / 2, bytes / W)       bytes = V (n-1)/n  (bidirectional ring)
  AllReduce                  max(T_hop n, bytes / W)           bytes = 2 V (n-1)/n (a reduce-scatter + an all-gather)
  ppermute (ring step)       max(T_hop, bytes / W_dir)         W_dir = W / 2 on a torus (one direction of its
                                                               bidirectional links), W on a switch (GPU egress)
  matmul                     FLOPs / C                         C = the preset's peak (bf16 dense)

Links. On a switch (GPU, `torus: false`) every collective shares the device's egress: one link stream. That is
also what XLA's GPU scheduler does: it keeps at most one async collective in flight
(`xla_gpu_experimental_parallel_collective_overlap_limit`, default 1; ring attention's program asks for two:
schedules/context.py, Ring.compiler_options), so a data axis's NIC traffic queues behind NVLink collectives on the
GPU too (two in flight still take their turns on the device's one egress in the replay). On a torus
each mesh axis has its own links, in each direction: an all-gather, reduce-scatter or all-reduce holds both
directions of its axis, a ring ppermute one, so a bidirectional ring's two halves travel at once.

Step time: t_serial = t_compute + every collective one after another (no overlap); t_overlapped = the replay's
makespan; exposed communication = t_overlapped - t_compute (the compute stream waiting); `critical_path_s` = the
makespan split into the matmuls and each axis's collectives on its critical path (timeline.critical_path: a TP
gather queued behind FSDP gathers on a shared link charges the FSDP ones). MFU = 6 P T / N /
(C t_overlapped) (Scaling Book training.md: "6 * params * tokens"); `matmul_utilization` = t_compute / t_overlapped counts
every matmul the program runs (attention, recomputation) instead.

That peak-rate replay of the dependency graph is the ceiling. A program compiled for a real target and scheduled by
its compiler (GPU), or a local program on a preset measured on its platform (`python -m shardlab.calibrate`), is also
replayed in its own scheduled order at achieved rates (analysis/calibrated.py): that
calibrated figure is the prediction, and the peak-rate one stays beside it as `ceiling`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from shardlab.analysis import hlo, ledger, pipeline_cost, timeline as TL
from shardlab.analysis.links import collective_seconds, link_axes
from shardlab.axes import FSDP, TENSOR
from shardlab.composition import Composition


def matmul_seconds(flops: float, hw) -> float:
  return flops / hw.peak_flops


def resources(t: TL.Task, hw) -> tuple:
  """The streams a task holds (module doc, "Links")."""
  if t.kind == "compute":
    return ("compute",)
  if not t.kind:
    return ()
  if not hw.torus:
    return ("link",)
  axes = t.coll.axis.split("+")
  if t.coll.kind == "collective-permute":
    return tuple(f"{a}{t.direction}" for a in axes)
  return tuple(f"{a}{d}" for a in axes for d in "+-")


def row(t: TL.Task, hw) -> str:
  """The chart row of a task: compute, or the axis whose links it uses (a ring direction on a torus)."""
  if t.kind == "compute":
    return "compute"
  d = f" {t.direction}" if hw.torus and t.coll.kind == "collective-permute" else ""
  return f"comm {t.coll.axis}{d}"


def predict(text: str, mesh, hw, ici_axes: dict | None = None, model_flops: float = 0.0,
            program: list | None = None, scale: dict | None = None) -> tuple[dict, list]:
  """(prediction, timeline events) for one compiled step's HLO text. `model_flops`: 6 P T / N per device, for MFU.
  `program`: the traced step's ledger rows; collectives the compiler widened (bf16 -> f32 on XLA:CPU) are costed
  at the program's bytes (ledger.dtype_scale; `scale`: that, where the caller has it)."""
  from shardlab.analysis.program import Program
  ici_axes = ici_axes or {}
  prog = text if isinstance(text, Program) else Program(text, mesh.device_ids, tuple(mesh.axis_names))
  if scale is None:
    scale = ledger.dtype_scale(program, ledger.from_hlo(prog.collectives)) if program is not None else {}
  walked = unrolled_instructions(prog)
  if calibrates(prog, hw) and walked > GRAPH_LIMIT:   # the graph would be millions of tasks: the ceiling is
    # the scheduled order at peak rates (loops folded) instead
    ceiling = {"hardware": hw.name, "model": f"not built: the dependency graph would unroll {walked:,} "
               f"instructions (over {GRAPH_LIMIT:,}); the ceiling is the scheduled order at peak rates "
               "(scheduled_order_at_peak_s)", "matmul_flops_per_device": prog.matmul_flops(),
               "model_flops_per_device": model_flops,
               "bytes_scaled_to_program": {"/".join(k): v for k, v in scale.items()}}
    return calibrated_prediction(prog, hw, ici_axes, model_flops, scale, ceiling)
  tasks, dur, res, r = _peak_replay(prog, hw, ici_axes, scale)

  compute = [i for i, t in enumerate(tasks) if t.kind == "compute"]
  comm = [i for i, t in enumerate(tasks) if t.kind == "comm"]
  busy = TL.union((r.start[i], r.finish[i]) for i in compute)
  t_compute = sum(dur[i] for i in compute)
  axes = sorted({tasks[i].coll.axis for i in comm})
  t_comm = {a: sum(dur[i] for i in comm if tasks[i].coll.axis == a) for a in (FSDP, TENSOR, *axes)}
  critical = {"compute": 0.0, **dict.fromkeys(t_comm, 0.0)}
  for i in TL.critical_path(tasks, r):
    k = "compute" if tasks[i].kind == "compute" else tasks[i].coll.axis
    critical[k] += dur[i]

  def hidden(select) -> float:   # fraction of the selected collectives' time during which compute is busy
    u = TL.union((r.start[i], r.finish[i]) for i in comm if select(tasks[i]))
    return TL.overlap(u, busy) / TL.length(u) if u else 1.0
  gather = lambda t: TL.category(t) == "fsdp all-gather"
  link_busy = {}
  for i in comm:
    for k in res[i]:
      link_busy[k] = link_busy.get(k, 0.0) + dur[i]
  t_serial = t_compute + sum(t_comm.values())
  t_bound = max(t_compute, *link_busy.values(), 0.0)
  t = r.makespan
  prediction = {
      "hardware": hw.name, "model": "peak-rate: the program's dependency graph replayed at the preset's peak rates",
      "t_compute_s": t_compute,
      "t_comm_s": t_comm,
      "t_serial_s": t_serial,
      "t_overlapped_s": t,
      "mfu": model_flops / (hw.peak_flops * t) if t > 0 else 0.0,
      "matmul_utilization": t_compute / t if t > 0 else 0.0,
      "exposed_comm_s": t - t_compute,
      "critical_path_s": critical,
      "t_bound_s": t_bound,
      "overlap_efficiency": (t_serial - t) / (t_serial - t_bound) if t_serial > t_bound else 1.0,
      "fsdp_gather_hidden_fraction": {    # of FSDP all-gather time, the part that runs behind a matmul
          "all": hidden(gather),
          "forward_layer_loop": hidden(lambda t: gather(t) and t.iteration and not t.backward),
          "backward_layer_loop": hidden(lambda t: gather(t) and t.iteration and t.backward)},
      "matmul_flops_per_device": sum(tasks[i].flops for i in compute),
      "model_flops_per_device": model_flops,
      "matmuls": len(compute), "collectives": len(comm),
      "bytes_scaled_to_program": {"/".join(k): v for k, v in scale.items()},
      "note": "model prediction from the compiled HLO's dependency graph and the hardware preset, not a measurement",
  }
  evs = TL.events(tasks, r, dur, [row(t, hw) if t.kind else "" for t in tasks])
  # the target's own order: the calibrated figure and its timeline; a local CPU program too when the preset's rates
  # were measured on a CPU (python -m shardlab.calibrate): XLA:CPU's order is its own, at the rates measured there
  if calibrates(prog, hw):
    return calibrated_prediction(prog, hw, ici_axes, model_flops, scale, prediction)
  return prediction, evs


# The dependency graph unrolls every loop iteration into tasks: past this many instructions (a 70B step has
# millions) a scheduled target program keeps its calibrated replay, whose loops fold, and skips the graph.
GRAPH_LIMIT = 400_000


def unrolled_instructions(prog) -> int:
  """Instructions the dependency graph would hold: each walked computation's (the entry, loop bodies, calls,
  slot branches) times how often it runs."""
  walked = {prog.entry} | prog.loop_bodies | {c for instrs in prog.comps.values() for i in instrs
                                               for c in (hlo.branches(i) if i.opcode == "conditional" else
                                                         re.findall(r"to_apply=%?([\w.\-]+)", i.attrs)
                                                         if i.opcode == "call" else ())}
  return sum(len(prog.comps.get(c, [])) * prog.mult.get(c, 0) for c in walked)


def _peak_replay(prog, hw, ici_axes: dict, scale: dict, entry: str | None = None) -> tuple:
  """(tasks, durations, resources, TL.Replay) of the peak-rate model over computation `entry` (None: the step)."""
  tasks = TL.build(prog, entry)
  bytes_of = lambda c: c.bytes_moved * scale.get((c.kind, c.axis, c.scope), 1.0)
  peak = hw.peak()                   # module doc: links at their peak bus bandwidth, no launch latency
  dur = [matmul_seconds(t.flops, hw) if t.kind == "compute" else
         collective_seconds(t.coll.kind, bytes_of(t.coll), t.coll.group_size, t.coll.axis, peak, ici_axes)
         if t.kind == "comm" else 0.0 for t in tasks]
  res = [resources(t, hw) for t in tasks]
  return tasks, dur, res, TL.replay(tasks, dur, res)


def calibrates(prog, hw) -> bool:
  """Whether a run's prediction is the calibrated replay (the target's scheduled order; a local CPU program too
  when the preset's rates were measured on a CPU) rather than the peak-rate dependency graph."""
  return prog.scheduled and (prog.platform != "cpu" or hw.describes(prog.platform))


def computation_seconds(prog, hw, ici_axes: dict, entry: str, scale: dict | None = None) -> tuple[float, float]:
  """(seconds of one run of computation `entry` of the compiled program (a pipeline slot's branch), the part of
  them its compute waits for a collective), by the model that predicts the run's step (`calibrates`): the same
  kernel rates, collective latency and bandwidth ramp."""
  if calibrates(prog, hw):
    from shardlab.analysis import calibrated
    r = calibrated.replay(prog, hw, ici_axes, scale, entry=entry)
    return r.t_total_s, r.t_exposed_comm_s
  tasks, dur, _, rep = _peak_replay(prog, hw, ici_axes, scale or {}, entry)
  busy = sum(d for t, d in zip(tasks, dur) if t.kind == "compute")
  return rep.makespan, max(0.0, rep.makespan - busy)


def link_seconds(prog, hw, ici_axes: dict, c, scale: dict | None = None) -> float:
  """One collective `c` of the compiled program by the run's model (links.collective_seconds at achieved rates,
  or at peak for the peak-rate model), its bytes scaled as the step's are."""
  nbytes = c.bytes_moved * (scale or {}).get((c.kind, c.axis, c.scope), 1.0)
  return collective_seconds(c.kind, nbytes, c.group_size, c.axis, hw if calibrates(prog, hw) else hw.peak(), ici_axes)


def calibrated_prediction(prog, hw, ici_axes: dict, model_flops: float, scale: dict, ceiling: dict) -> tuple:
  """(prediction, timeline events): the target's scheduled order replayed at the preset's achieved rates
  (calibrated.py), with the peak-rate dependency-graph replay kept as `ceiling`."""
  from shardlab.analysis import calibrated
  r = calibrated.replay(prog, hw, ici_axes, scale)
  peak = calibrated.replay(prog, hw.peak(), ici_axes, scale)
  ceiling.setdefault("t_overlapped_s", peak.t_total_s)   # the graph skipped: the scheduled order at peak
  t = r.t_total_s
  comm = {a: r.t_comm_s.get(a, 0.0) for a in (*prog.axis_names, *sorted(r.t_comm_s))}
  pred = {
      "hardware": hw.name, "model": "calibrated: the target's scheduled order at achieved rates",
      "t_compute_s": r.t_compute_s, "t_gemm_s": r.t_gemm_s, "t_attention_kernels_s": r.t_attention_s,
      # t_gemm_s holds the fused attention kernels too; the matmuls alone, as the search's time model prices them
      # (step_model's t_gemm_s): t_compute_s = t_matmul_s + t_attention_kernels_s + t_other_kernels_s
      "t_matmul_s": r.t_gemm_s - r.t_attention_s,
      "t_other_kernels_s": r.t_other_kernels_s,
      "t_comm_s": comm, "t_serial_s": r.t_compute_s + sum(comm.values()), "t_overlapped_s": t,
      "exposed_comm_s": r.t_exposed_comm_s, "mfu": model_flops / (hw.peak_flops * t) if t > 0 else 0.0,
      "kernels": r.kernels, "model_flops_per_device": model_flops,
      "scheduled_order_at_peak_s": peak.t_total_s,
      "ceiling": ceiling,
      "bytes_scaled_to_program": ceiling.get("bytes_scaled_to_program", {}),
      "note": "model prediction (the target compiler's schedule replayed at the preset's achieved rates), "
              "not a measurement"}
  return pred, r.events


def needed_bytes(memory: dict) -> int:
  """The device memory a compiled program needs, as its compiler says: the larger of memory_analysis()'s peak
  and the buffer assignment's total (`allocated`, where read). libtpu's two differ either way (v5p: the first
  is 5-7 GB above its assignment for the 8B step; v5e: it reports no temporaries at all)."""
  return max(memory["peak"], (memory.get("allocated") or {}).get("total", 0))


def predict_run(compiled, mesh, c: Composition, out_dir, analysis: dict, built: dict | None = None, prog=None,
                figures: bool = True) -> dict:
  """For run.py: summary.json's `prediction`, `memory` with its analytic breakdown, and `ledger` (collectives by
  kind, axis and dtype with forward and backward bytes, from the traced program and from the compiled HLO, and
  where they differ); timeline.json and (with `figures`) timeline.png and a pipeline's pipeline.png in out_dir
  (process 0). `c`: the run's composition. `built`: run.build's step and abstract inputs, to trace the program
  (without it, the compiled ledger only)."""
  import jax
  from shardlab import params as PM
  from shardlab.analysis import memory_model
  program, residuals = None, None
  if built is not None:
    traced = built.get("traced") or built["step_fn"].trace(built["abstract_state"], built["abstract_batch"])
    platform = mesh.devices.flat[0].platform    # what the program was lowered for: its branch of a
    program = ledger.from_program(traced.jaxpr, platform={"gpu": "cuda"}.get(platform, platform))  # platform choice
    residuals = built.get("layer_residuals")      # one layer's residual bytes, read off that trace by trainer.lower
  n_params = PM.count_active(c.model)          # a MoE token computes with its top k experts only
  tokens = c.train.batch_size * c.model.seq_len
  ici = link_axes(c)
  from shardlab.analysis.program import Program
  prog = prog or Program.of(compiled, mesh)
  rows = ledger.from_hlo(prog.collectives)
  scale = ledger.dtype_scale(program, rows) if program is not None else {}
  pred, evs = predict(prog, mesh, c.hardware, ici, 6 * n_params * tokens / mesh.devices.size, program, scale)
  stages = getattr((built or {}).get("schedule"), "stages_on", None)
  pipe = stages(c.mesh.shape) if stages else None
  extra = {}
  if pipe is not None:     # the step is the table replayed with the slots timed by the same model (pipeline_cost)
    extra["pipeline_prediction"], replayed = pipeline_cost.predict(
        prog, c.pipeline, pipe.ticks(), lambda comp: computation_seconds(prog, c.hardware, ici, comp, scale),
        lambda coll: link_seconds(prog, c.hardware, ici, coll, scale))
    step = extra["pipeline_prediction"]["step_s"]
    pred.update(t_device_program_s=pred["t_overlapped_s"], t_overlapped_s=step,
                mfu=pred["model_flops_per_device"] / (c.hardware.peak_flops * step) if step > 0 else 0.0,
                step_from="pipeline_prediction: the schedule's table replayed with each slot timed by this model "
                          "(t_device_program_s: one device's program walked with its ticks back to back)")
  if jax.process_index() == 0:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "timeline.json").write_text(json.dumps(TL.chrome_trace(evs, pred)))
    if figures:
      TL.plot(evs, out / "timeline.png", title(c, pred))
    if pipe is not None and figures:
      pipeline_cost.draw(replayed, out / "pipeline.png", c, extra["pipeline_prediction"])
  led = {"program": None, "compiled": ledger.nested(rows), "rewrites": None, "differences": None, "per_axis": None}
  audit = dict(analysis.get("audit") or prog.audit())
  if program is not None:
    rec = ledger.reconcile(program, rows)
    led.update(program=ledger.nested(program), rewrites=rec.rewrites, differences=rec.differences,
               per_axis=ledger.per_axis(program, rows))
    audit = reconcile_audit(audit, rec, prog)
  # cuDNN's kernel runs where the model's own attention does: no context split, or a strategy that attends with it
  own_kernel = c.mesh.context == 1 or memory_model.attention_kept(c).attention == c.model.attention
  if prog.platform in ("cuda", "gpu") and c.model.attention == "dot_product" and own_kernel:
    # cuDNN's fused attention saves its own (O(L)) set, not the XLA attention the trace records; what a waiting
    # zero-bubble W holds has no attention probabilities in it (schedules/split.py), so it is kept
    residuals = {"held": residuals["held"]} if residuals and "held" in residuals else None
  mem = {**analysis["memory"], **memory_model.compare(c, analysis["memory"], residuals,
                                                       memory_model.gemm_workspace_bytes(prog.text))}
  mem["compiled_by"] = prog.platform
  if prog.platform != "cpu":                     # the target compiler's buffers against the preset's HBM
    need = needed_bytes(analysis["memory"])
    mem.update(hbm_bytes=c.hardware.hbm_bytes, fits=need <= c.hardware.hbm_bytes,
               headroom_bytes=c.hardware.hbm_bytes - need)
  return {"prediction": pred, "memory": mem, "ledger": led, "audit": audit, **extra}


def reconcile_audit(audit: dict, rec: ledger.Reconciled, prog) -> dict:
  """A collective the compiler built from planned ones (combined several into one buffer, turned a
  reduce-scatter into an all-reduce) carries no op_name, hence no scope; so does a ragged all-to-all, whose
  metadata the GPU compiler drops. It is listed under `combined`, with the ledger rewrites that explain it, when
  the ledger's reconciliation explains every byte of its axis; anything else without a scope stays unplanned."""
  names = {c.name: c for c in prog.collectives}
  keep, combined = [], []
  for u in audit["unplanned"]:
    c = names.get(u["name"])
    if c is not None and not c.op_name and c.axis not in rec.unexplained:
      made = lambda r: (r["rewrite"] == "combined"
                        or (r["compiled"]["kind"], r["compiled"]["dtype"]) == (c.kind, c.dtype))
      why = (["placed; its op_name dropped by the compiler"] if c.kind == "ragged-all-to-all" else
             sorted({r["rewrite"] for r in rec.rewrites if r["axis"] == c.axis and made(r)}))
      combined.append({**u, "rewrite": why})
    else:
      keep.append(u)
  return {**audit, "unplanned": keep, "combined": combined}


def title(c: Composition, pred: dict) -> str:
  from shardlab.outputs import human_seconds as hs
  walk = pred.get("t_device_program_s")
  shown = (f"one device's program {hs(walk)}, pipeline step {hs(pred['t_overlapped_s'])}"
           if walk is not None else f"predicted step {hs(pred['t_overlapped_s'])}")
  return (f"{c.schedule.name} | {c.model.label} | mesh {c.mesh.label} | {pred['hardware']}: "
          f"{shown} (compute + comm serial {hs(pred['t_serial_s'])}), "
          f"MFU {100 * pred['mfu']:.3g}%  [{pred.get('model', 'peak-rate').split(':')[0]} MODEL PREDICTION, "
          "not a measurement]")
