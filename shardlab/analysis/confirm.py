"""The planner's closed forms checked against the target's compiler: a layout of the search, or a batch window,
compiled for the hardware preset's real devices (shardlab/target.py: nothing allocated, no device here) by the
same train step a run builds (run.build). What comes back is the target compiler's memory per device and the
calibrated step-time prediction of its scheduled program (analysis/costmodel.py): a compile and a MODEL
PREDICTION, not a measurement.

  python -m shardlab.plan search=true top=3 ...      # confirm_layouts: the best 3 layouts
"""
from __future__ import annotations

import time
from typing import Any

from shardlab.analysis import costmodel
from shardlab.axes import DATA, FSDP, TENSOR
from shardlab.composition import Composition


def start_jax() -> None:
  """Keep JAX on the CPU (one device: the target's devices come from its topology) in a process that has not
  started it yet, so that an installed target plugin neither initializes nor logs; a no-op when JAX already runs
  (a second call) or this process already asked for its devices (a test session's 8: otherwise the first test of
  a worker that plans would start JAX with one device, and the worker's later tests fail)."""
  import jax
  from shardlab.mesh import set_cpu_devices
  from shardlab.errors import ConfigError
  if jax.config.jax_num_cpu_devices > 0:
    return
  try:
    set_cpu_devices(1)
  except ConfigError:
    pass


def compile_on_target(c: Composition, build) -> dict[str, Any]:
  """Compile c's train step (c.mesh.fsdp x c.mesh.tensor, train.batch_size sequences) for c.hardware's
  target. Returns `memory` (the target compiler's memory_analysis per device: argument, output, temp, alias,
  peak; `allocated`, its buffer assignment), `memory_analytic` (memory_model.breakdown of the same config), `fits` and `headroom_bytes` against
  hardware.hbm_bytes, `prediction` (the calibrated replay: t_overlapped_s, mfu, ...), `target` and
  `compile_time_s`. Raises ConfigError when the extra or the topology is missing. `build(c, devices)`: the
  application's step builder (shardlab.trainer.build), passed in so that analysis/ imports nothing above it."""
  from shardlab import params as PM, target as TG
  from shardlab.analysis import memory_model
  from shardlab.analysis.links import link_axes
  from shardlab.analysis.program import Program
  hw, n = c.hardware, c.mesh.n_devices
  topo = TG.check(hw, n)
  start_jax()
  devs = TG.devices(hw, n)
  b = build(c, TG.mesh_devices(devs, tuple(c.mesh.shape.values())))
  t0 = time.perf_counter()
  flags = c.target_flags({})                      # the parts' options (a candidate carries no xla.flags)
  compiled, buffers = TG.compile_reading_buffers(b["step_fn"].lower(b["abstract_state"], b["abstract_batch"]), flags)
  seconds = time.perf_counter() - t0
  prog = Program.of(compiled, b["mesh"], buffers)
  mem = prog.memory()
  flops = 6 * PM.count(b["decls"]) * c.train.batch_size * c.model.seq_len / n
  pred, _ = costmodel.predict(prog, b["mesh"], hw, link_axes(c), flops)
  need = costmodel.needed_bytes(mem)
  return {"memory": mem, "memory_analytic": memory_model.breakdown(c), "fits": need <= hw.hbm_bytes,
          "headroom_bytes": hw.hbm_bytes - need, "prediction": pred,
          "target": {**TG.describe(devs, topo), "compiler_options": flags},
          "compile_time_s": seconds}


def layout_config(c: Composition, layout: dict) -> tuple[Composition | None, str | None]:
  """(the composition that runs `layout` at the configured global batch, None) or (None, why it cannot be built):
  shardlab's train step shards whole sequences over data x fsdp and needs every sharded dim divisible by its mesh
  axis."""
  m = c.model
  sharding = [r for r in layout["rejected_because"] if r.startswith("sharding:")]
  if sharding:
    return None, sharding[0]
  seqs = c.global_tokens / m.seq_len
  shards = layout[DATA] * layout[FSDP]
  if seqs != int(seqs) or int(seqs) % shards:
    return None, (f"the global batch is {seqs:.3g} sequences of {m.seq_len} tokens: not a whole number per batch "
                  f"shard of data x fsdp = {shards} (shardlab shards whole sequences)")
  sub = c.replace(mesh={DATA: layout[DATA], FSDP: layout[FSDP], TENSOR: layout[TENSOR],
                                    "fsdp_ici_axes": layout["ici_axes"][FSDP],
                                    "tensor_ici_axes": layout["ici_axes"][TENSOR],
                                    "data_ici_axes": layout["ici_axes"][DATA]},
                         train={"batch_size": int(seqs), "global_batch_tokens": 0})
  return sub, None


def confirm_layouts(layouts: list[dict[str, Any]], c: Composition, k: int, build) -> list[dict[str, Any]]:
  """The best k layouts, each with `target`: the compiled memory and calibrated step time beside the closed
  forms (`memory_closed_form_bytes` = the layout's memory_per_device_bytes, `step_time_closed_form_s` = its
  step_time_s), or `compiled: false` and `why` for a layout the train step cannot express. A layout that fails
  to compile records the error; a missing target compiler raises (ConfigError: one line from the CLI)."""
  from shardlab import target as TG
  if layouts:                             # the extra and the preset, before anything compiles
    l = layouts[0]
    TG.check(c.hardware, l[DATA] * l[FSDP] * l[TENSOR])
  out = []
  for layout in layouts[:k]:
    sub, why = layout_config(c, layout)
    if sub is None:
      out.append({**layout, "target": {"compiled": False, "why": why}})
      continue
    try:
      r = compile_on_target(sub, build)
    except Exception as e:   # a layout the target cannot take (topology, compiler error): said, not fatal
      out.append({**layout, "target": {"compiled": False, "why": f"{type(e).__name__}: {' '.join(str(e).split())}"}})
      continue
    pred = r["prediction"]
    out.append({**layout, "target": {
        "compiled": True, "hardware": c.hardware.name, **r["target"],
        "memory_compiled_bytes": costmodel.needed_bytes(r["memory"]), "memory_compiled": r["memory"],
        "memory_analytic_bytes": r["memory_analytic"]["total"],
        "memory_closed_form_bytes": layout["memory_per_device_bytes"],
        "fits": r["fits"], "headroom_bytes": r["headroom_bytes"],
        "step_time_s": pred["t_overlapped_s"], "step_time_closed_form_s": layout["step_time_s"],
        # how far the search's figure (the time model's, or train.mfu's) is from the compiled replay's
        "search_error": layout["step_time_s"] / pred["t_overlapped_s"] - 1 if pred["t_overlapped_s"] else None,
        "mfu": pred["mfu"], "prediction_model": pred["model"], "compile_time_s": r["compile_time_s"]}})
  return out


def confirm_batch_window(c: Composition, build, samples: tuple[int, int] = (1, 4)) -> dict[str, Any]:
  """The largest batch of c's mesh that fits hardware.hbm_bytes by the target compiler's memory report, found
  by compiling (nothing runs): compile the train step at `samples` sequences per fsdp shard, take the line
  through the two peaks (fixed bytes plus bytes per sequence) as the first guess
  (planner.calibrated_batch_window), then compile there and step by one microbatch's worth of sequences until
  the batch fits and the next one does not. `confirmed`: that boundary was found (peaks of both compiles in
  `peaks`, by sequences per shard). Beside it the analytic window (planner.batch_window) and the target's peak
  at the analytic maximum: how far the closed-form memory is from the compiler's."""
  from shardlab.analysis import planner
  x, mb, hbm = c.mesh.data * c.mesh.fsdp, max(1, c.schedule.microbatches), c.hardware.hbm_bytes   # batch shards
  cache: dict[int, dict] = {}

  def peak(seqs: int) -> float:            # seqs per fsdp shard -> the target's compiled peak bytes per device
    if seqs not in cache:
      cache[seqs] = compile_on_target(c.replace(train={"batch_size": seqs * x, "global_batch_tokens": 0}),
                                      build)
    return costmodel.needed_bytes(cache[seqs]["memory"])

  samples = tuple(max(mb, s - s % mb) for s in samples)
  line = planner.calibrated_batch_window(c, {s: peak(s) for s in samples})
  seqs = max(mb, line["max_sequences_per_fsdp_shard"])
  while seqs > mb and peak(seqs) > hbm:
    seqs -= mb
  while peak(seqs + mb) <= hbm:
    seqs += mb
  fits = peak(seqs) <= hbm
  seqs = seqs if fits else 0
  analytic = planner.batch_window(c)
  a_seqs = analytic["max_sequences_per_fsdp_shard"]
  a_peak = peak(a_seqs) if a_seqs > 0 else None
  return {"max_sequences_per_fsdp_shard": seqs,
          "max_batch_per_device_tokens": seqs * c.model.seq_len / c.mesh.tensor, "confirmed": fits,
          "peaks": {s: costmodel.needed_bytes(r["memory"]) for s, r in sorted(cache.items())},
          "line": {"fixed_bytes": line["fixed_bytes"], "bytes_per_local_sequence": line["bytes_per_local_sequence"],
                   "max_sequences_per_fsdp_shard": line["max_sequences_per_fsdp_shard"]},
          "hbm_bytes": hbm, "analytic": {"max_sequences_per_fsdp_shard": a_seqs,
                                         "max_batch_per_device_tokens": analytic["max_batch_per_device_tokens"],
                                         "fixed_bytes": analytic["fixed_bytes"],
                                         "bytes_per_local_sequence": analytic["bytes_per_local_sequence"],
                                         "peak_on_target": a_peak},
          "target": next(iter(cache.values()))["target"]}
