"""The pipeline's prediction: the run's schedule table replayed (pipeline_replay.py: replay) with each slot's
time read off the compiled program, and the picture of it (pipeline.png).

A slot (F, B, W, and the head inside the last stage's F) is a conditional in the tick loop, its branch a
computation of the compiled program (analysis/hlo.py: declared_runs). Its time here is that computation replayed
by the model that predicts the run's step, which the caller hands in (costmodel.predict_run passes
computation_seconds: the calibrated replay of the compiler's scheduled order, overlap inside the slot as the
compiler placed it, or the peak-rate dependency graph for a local program), with the same kernel rates, collective
latency and bandwidth ramp. A tick ends with the two sends over `pipeline` (costmodel.link_seconds; its link: the
nodes' NICs on a multi-node preset). The executor's ticks are
synchronised between neighbouring stages by those sends (replay(sync=True)): that is the run's predicted step
(the printed one, summary.json prediction.t_overlapped_s); the table's own ideal, an asynchronous runtime's, is
replay(sync=False). Both are predictions, not measurements.
"""
from __future__ import annotations

from shardlab import pipeline_tables as PT
from shardlab.analysis import hlo, pipeline_replay as PR
from shardlab.axes import PIPELINE


def slot_seconds(prog, seconds, link) -> tuple[dict, dict]:
  """({"F", "B", "W", "head", "send"}: seconds of one run of each pipeline slot's branch (0 if absent; the longest
  branch, the slot's work, not the idle one) and of one tick's sends over `pipeline`; {"F", "B", "W", "head"}: the
  part of each slot's seconds its compute waits for a collective inside it (a tensor-parallel transfer the
  compiler left exposed)), by the run's model: `seconds(computation)` gives (seconds of one run of a computation,
  its exposed communication), `link(collective)` one collective."""
  out = {"F": 0.0, "B": 0.0, "W": 0.0, "head": 0.0, "send": 0.0}
  exposed = {"F": 0.0, "B": 0.0, "W": 0.0, "head": 0.0}
  for comp, instrs in prog.comps.items():
    for ins in instrs:
      got = hlo.declared_runs(ins.op_name) if ins.opcode == "conditional" else None
      if got is None or got[0] not in out:       # a kernel's declared branch (flash_kernel.py) is no slot
        continue
      t, e = max(seconds(b) for b in hlo.branches(ins))
      if t > out[got[0]]:
        out[got[0]], exposed[got[0]] = t, e
  sends = [c for c in prog.collectives if c.kind == "collective-permute" and c.axis == PIPELINE
           and "pipeline_forward" in c.op_name]
  if sends:
    out["send"] = link(max(sends, key=lambda c: c.bytes_moved))
  return out, exposed


def predict(prog, pipeline, ticks, seconds, link) -> dict:
  """summary.json's `pipeline`: the slot times (slot_seconds, by the run's model: `seconds`, `link`), the
  executor's step and bubble (sync replay), the table's ideal (async replay) and the closed form, and what each
  stage holds in flight. `pipeline`: the run's PipelineConfig."""
  t, exposed = slot_seconds(prog, seconds, link)
  P, M, V = len(ticks[0]), pipeline.count(len(ticks[0])), pipeline.virtual_stages
  run = PR.replay(ticks, t["F"], t["B"], t["W"], t["send"], sync=True, t_head=t["head"])
  ideal = PR.replay(ticks, t["F"], t["B"], t["W"], t["send"], sync=False, t_head=t["head"])
  split = any(a.kind == "W" for row in ticks for cell in row for a in cell)
  return {"schedule": pipeline.name, "stages": P, "microbatches": M, "virtual_stages": V, "ticks": len(ticks),
          "slot_s": t, "slot_exposed_comm_s": exposed, "step_s": run["step_s"], "bubble": run["bubble"],
          "table_step_s": ideal["step_s"], "table_bubble": ideal["bubble"],
          "closed_form_bubble": None if pipeline.table else PT.closed_form_bubble(pipeline.impl, P, M, V),
          "in_flight": PT.in_flight(ticks, "W" if split else "B"),
          "note": "prediction: the table replayed with each slot's compiled computation timed by the run's model, "
                  "ticks synchronised between neighbouring stages; not a measurement"}, run


def draw(result: dict, path, c, pred: dict) -> None:
  """pipeline.png: the executor's replay, one row per stage (pipeline_replay.py: draw)."""
  v = f", V={pred['virtual_stages']}" if pred["virtual_stages"] > 1 else ""
  PR.draw(result, path, title=f"{c.pipeline.name}, P={pred['stages']}, M={pred['microbatches']}{v} on "
          f"{c.hardware.name}, prediction: ", unit="s")
