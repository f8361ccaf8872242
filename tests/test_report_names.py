"""One prediction per run, named: the report says which model made each prediction (calibrated replay of a target
program, peak-rate model over a local one) on its table, its step-time figure and each timeline heading, and
draws the serial sum and the predicted step once where they agree; the tables carry the columns of the parts the
runs have (a pipeline's bubble, a mixture of experts' dropped tokens) in units people read. Summaries written by
hand: no compile."""
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
  assert list(report.predicted_series(jobs)) == ["compute + comm, serial", "predicted step"]   # the target overlaps
  assert list(report.predicted_series(jobs[:2])) == ["predicted step (= compute + comm, serial)"]   # drawn once
  text = report.write_report(tmp_path).read_text()
  rows = [l for l in text.splitlines() if l.startswith("| 2_target") or l.startswith("| 0_local")]
  assert "| calibrated, gpu program |" in rows[1] and "| peak-rate, cpu program |" in rows[0]
  assert "calibrated: calibrated replay of the target program" in text


def test_the_tables_carry_the_parts_columns_in_units_people_read(tmp_path):
  """A pipeline run (its predicted bubble and microbatches in flight, its picture) and a MoE run (dropped tokens
  and load, means over metrics.jsonl's steps), both dry: report.md and the sweep's summary.md show those columns,
  bytes in kB/MB/GB and times in us/ms, leave out the columns no run fills, embed pipeline.png, and draw no empty
  measured panel."""
  from shardlab import sweep
  _run(tmp_path, "0_pipe", 3e-4, 4e-4, "peak-rate: the program's dependency graph", "cpu")
  _run(tmp_path, "1_moe", 1e-4, 1e-4, "peak-rate: the program's dependency graph", "cpu")
  for name in ("0_pipe", "1_moe"):
    s = json.loads((tmp_path / name / "summary.json").read_text())
    s.pop("step_time_s_median")
    if name == "0_pipe":
      s["pipeline_prediction"] = {"step_s": 4e-4, "bubble": 0.514, "table_bubble": 0.298, "in_flight": [4, 3, 2, 1]}
      (tmp_path / name / "pipeline.png").write_bytes(b"png")
    else:
      s["mesh"] = {"expert": 2, "fsdp": 2, "tensor": 2}
      s["prediction"]["t_comm_s"] = {"expert": 2.5e-3, "fsdp": 1e-3}
      (tmp_path / name / "metrics.jsonl").write_text(
          "\n".join(json.dumps({"step": i, "loss": 5.0, "dropped_fraction": d, "expert_load_max_over_mean": 1.5})
                    for i, d in enumerate((0.1, 0.3))) + "\n")
    (tmp_path / name / "summary.json").write_text(json.dumps(s))
    (tmp_path / name / ".hydra").mkdir()
  text = report.write_report(tmp_path).read_text()
  header = next(l for l in text.splitlines() if l.startswith("| run"))
  assert "pipeline bubble" in header and "pipeline in flight" in header and "dropped fraction" in header
  assert "bytes fsdp" in header and "bytes data" not in header              # no run moves bytes over data
  assert "step (measured)" not in header and "| error |" not in header      # dry runs, none failed: no such column
  pipe = next(l for l in text.splitlines() if l.startswith("| 0_pipe"))
  assert "| 51.4% | 29.8% | 4/3/2/1 |" in pipe and "| 400 us |" in pipe and "| 1 kB |" in pipe and "| 2 MB |" in pipe
  moe = next(l for l in text.splitlines() if l.startswith("| 1_moe"))
  assert "| 2.5 ms | 20% | 1.5 |" in moe and "expert comm s" in header
  assert "![pipeline 0_pipe](pipeline_0_pipe.png)" in text and (tmp_path / "pipeline_0_pipe.png").exists()
  rows = sweep.write(tmp_path)
  md = (tmp_path / "summary.md").read_text()
  head = next(l for l in md.splitlines() if l.startswith("| job"))
  assert "pipeline_bubble" in head and "dropped_fraction" in head and "step_time_s_median" not in head
  assert "| 51.4% |" in md and rows[0]["pipeline_bubble"] == 0.514
  csv_head = (tmp_path / "summary.csv").read_text().splitlines()[0]
  assert "step_time_s_median" in csv_head and "bytes_data" in csv_head     # the CSV keeps every column


def test_a_single_runs_mesh_rates_and_a_pipelines_serial_time_are_named_as_what_they_are(tmp_path):
  """A single run's report names its mesh as its run directory does (f2xc2xt2, not 2x2x2: that is the HSDP
  mesh data x fsdp x tensor); a rate is a rate in the tables (tokens_per_s used to read `1.2e+04 s`); a pipeline
  run's t_serial_s is one device's program without the bubble, named so beside its predicted step."""
  from shardlab.outputs import cell
  _run(tmp_path, "run", 1.94e-4, 2.39e-4, "peak-rate: the program's dependency graph", "cpu")
  s = json.loads((tmp_path / "run" / "summary.json").read_text())
  s["mesh"] = {"fsdp": 2, "context": 2, "tensor": 2}
  s["pipeline_prediction"] = {"step_s": 2.39e-4, "bubble": 0.347, "table_bubble": 0.345, "in_flight": [2, 1]}
  (tmp_path / "run" / "summary.json").write_text(json.dumps(s))
  jobs = report.load_jobs(tmp_path / "run")
  assert [j["label"] for j in jobs] == ["baseline_f2xc2xt2"]
  assert list(report.predicted_series(jobs)) == ["one device's program, serial (no bubble)", "predicted step"]
  assert "| one device's program, serial (no bubble) |" in report.write_report(tmp_path / "run").read_text()
  assert cell("tokens_per_s", 11976.7) == "11,977/s" and cell("step_time_s_median", 0.0295) == "29.5 ms"
