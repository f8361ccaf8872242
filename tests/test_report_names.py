"""One prediction per run, named: the report says which model made each prediction (calibrated replay of a target
program, peak-rate model over a local one) on its table, its step-time figure and each timeline heading, and
draws "no overlap" and "with overlap" once where they agree. Summaries written by hand: no compile."""
from __future__ import annotations

import json

from shardlab import report
from shardlab.outputs import prediction_label, prediction_model


def _run(d, name: str, serial: float, overlapped: float, model: str | None, program: str) -> None:
  pred = {"hardware": "h100", "t_serial_s": serial, "t_overlapped_s": overlapped, "mfu": 0.1}
  if model:
    pred["model"] = model
  (d / name).mkdir()
  (d / name / "summary.json").write_text(json.dumps({
      "status": "ok", "schedule": "baseline", "mesh": {"fsdp": 4, "tensor": 2}, "platform": "cpu",
      "step_time_s_median": 0.02, "final_loss": 5.0, "prediction": pred,
      "memory": {"peak": 2e6, "compiled_by": program},
      "comm": {"all-gather": {"fsdp": {"bytes": 1000}}}}))


def test_each_prediction_says_which_model_made_it(tmp_path):
  _run(tmp_path, "0_local", 1e-4, 1e-4, "peak-rate: the program's dependency graph", "cpu")
  _run(tmp_path, "1_older", 2e-4, 2e-4, None, "cpu")                    # a summary from before the names
  _run(tmp_path, "2_target", 3e-3, 2.5e-3, "calibrated: the target's scheduled order", "gpu")
  jobs = report.load_jobs(tmp_path)
  assert [prediction_model(j["summary"]["prediction"]) for j in jobs] == ["peak-rate", "peak-rate", "calibrated"]
  assert [prediction_label(j["summary"]) for j in jobs] == ["peak-rate, cpu program", "peak-rate, cpu program",
                                                            "calibrated, gpu program"]
  title = report.predicted_title(jobs)
  assert "calibrated, gpu program" in title and "peak-rate, cpu program" in title
  assert list(report.predicted_series(jobs)) == ["no overlap", "with overlap"]       # the target run overlaps
  assert list(report.predicted_series(jobs[:2])) == ["predicted (no overlap = with overlap)"]   # drawn once
  text = report.write_report(tmp_path).read_text()
  rows = [l for l in text.splitlines() if l.startswith("| 2_target") or l.startswith("| 0_local")]
  assert "| calibrated, gpu program |" in rows[1] and "| peak-rate, cpu program |" in rows[0]
  assert "calibrated: calibrated replay of the target program" in text
