"""The search's time model (shardlab/analysis/step_model.py): each layout's program priced kernel by kernel, so
that the planner's step times differ between layouts for reasons it names. Pure Python, no compile (the compiled
replay beside it: test_target.py's top=K test and experiments/plan/search_vs_compiled.md)."""
from __future__ import annotations

import pytest

from shardlab.analysis import planner, step_model
from shardlab.analysis.calibrated import gemm_seconds
from shardlab.composition import resolve
from shardlab.plan import compose

L70 = ["model=llama3_70b", "hardware=h100", "precision=bf16", "train.global_batch_tokens=4194304"]


def _c(*over):
  return resolve(compose([*L70, *over]))


def _p(*over):
  return step_model.predict(_c(*over))


def test_the_parts_add_up_to_the_step_and_mfu_is_six_pb_over_it():
  c = _c("mesh.fsdp=16", "mesh.tensor=4", "schedule.remat=full", "schedule.microbatches=8")
  p = step_model.predict(c)
  parts = p["t_gemm_s"] + p["t_attention_s"] + p["t_recompute_s"] + p["t_other_kernels_s"] + p["t_exposed_comm_s"]
  assert p["t_step_s"] == pytest.approx(parts)
  assert p["t_exposed_comm_s"] == pytest.approx(sum(p["exposed_comm_s"].values()))
  b = 4194304 / 64
  assert p["mfu"] == pytest.approx(6 * planner.param_count(c.model) * b / (989e12 * p["t_step_s"]), rel=1e-2)
  assert 0.2 < p["mfu"] < 0.6 and p["tflops_per_device"] == pytest.approx(p["mfu"] * c.hardware.peak_flops / 1e12)


def test_a_gemm_is_priced_as_the_compiled_replay_prices_it():
  """One layer's forward matmuls at tensor 1: gemm_seconds of each (M tokens, K, N) plus a launch, the replay's
  rule (calibrated.py), summed: the model's forward GEMM time is exactly that per layer and microbatch."""
  c = _c("mesh.fsdp=64", "mesh.tensor=1", "schedule.remat=none", "schedule.microbatches=8")
  hw, m = c.hardware, c.model
  t = 4194304 / 64 / 8
  D, F, H, G, K = m.d_model, m.d_ff, m.n_heads, m.kv_heads, m.head_dim
  shapes = [(t, D, (H + 2 * G) * K), (t, H * K, D), (t, D, 2 * F), (t, F, D)]
  fwd = sum(gemm_seconds(2 * a * b * n, [a, n], 2 * (a * b + b * n + a * n), hw, "bfloat16") + hw.kernel_launch_s
            for a, b, n in shapes)
  assert [(p, M, K_, N) for p, M, K_, N in step_model._gemms(c, t)] == [
      ("qkv", t, D, (H + 2 * G) * K), ("o", t, H * K, D), ("w_in", t, D, 2 * F), ("w_out", t, F, D)]
  got = step_model.predict(c)
  assert got["t_gemm_s"] > 3 * 80 * 8 * fwd           # forward + dX + dW of every layer and microbatch, and the head
  assert 0.5 < got["gemm_fraction_of_peak"] <= hw.gemm_efficiency    # the shapes' efficiency, below a large GEMM's


def test_recomputation_is_charged_by_what_the_policy_saves():
  """remat=none recomputes nothing; save_matmuls_attn_out only the elementwise pieces; save_matmuls the
  attention as well; full every piece but the last matmul. Each costs more than the one before."""
  base = ["mesh.fsdp=16", "mesh.tensor=4", "schedule.microbatches=8"]
  t = {r: _p(*base, f"schedule.remat={r}")["t_recompute_s"]
       for r in ("none", "save_matmuls_attn_out", "save_matmuls", "full")}
  assert t["none"] == 0 < t["save_matmuls_attn_out"] < t["save_matmuls"] < t["full"]
  assert "w_out" not in step_model.RECOMPUTED["full"]
  assert set(step_model.RECOMPUTED) == set(planner.REMAT_BY_RECOMPUTE)


def test_the_parts_decide_what_communication_is_exposed():
  """Asked of the parts, not their names: a weights part that prefetches hides the gathers behind the previous
  layer (prefetch=0 exposes them); a TP contraction that overlaps (point_to_point: the ring) hides its collectives
  behind the GEMM they feed, the all-gather one exposes them; more microbatches gather the weights again."""
  base = ["mesh.fsdp=16", "mesh.tensor=4", "schedule.remat=full", "schedule.microbatches=4"]
  waits, prefetched = _p(*base, "schedule.prefetch=0"), _p(*base, "schedule.prefetch=1")
  assert prefetched["exposed_comm_s"]["fsdp"] < waits["exposed_comm_s"]["fsdp"]
  assert prefetched["t_step_s"] < waits["t_step_s"]
  gathered, ring = _p(*base, "schedule.tp=allgather"), _p(*base, "schedule.tp=ring")
  exposed_tp = lambda p: p["exposed_comm_s"]["tensor"]
  assert exposed_tp(gathered) > 0 and exposed_tp(ring) < exposed_tp(gathered)
  more = _p("mesh.fsdp=16", "mesh.tensor=4", "schedule.remat=full", "schedule.microbatches=8", "schedule.prefetch=0")
  assert more["exposed_comm_s"]["fsdp"] > waits["exposed_comm_s"]["fsdp"]
  hsdp = _p("mesh.data=2", "mesh.fsdp=8", "mesh.tensor=4", "schedule.remat=full", "schedule.microbatches=4",
            "schedule.prefetch=0")
  assert hsdp["exposed_comm_s"]["data"] > 0 and waits["exposed_comm_s"]["data"] == 0


def test_the_search_ranks_layouts_by_the_time_model_and_train_mfu_is_the_books_form():
  """Without train.mfu every layout gets its own predicted step (no two of the qualifying ones alike, a
  `step_model` breakdown each); with train.mfu=0.5 the Scaling Book's roofline / mfu as before, no breakdown."""
  c = _c()
  ans = planner.answer(c, devices=64)
  top = [l for l in ans["layouts"] if not l["rejected_because"]]
  assert len(top) >= 3 and len({round(l["step_time_s"], 6) for l in top}) == len(top)
  assert all("step_model" in l and l["step_time_s"] == l["step_model"]["t_step_s"] for l in top)
  assert [l["step_time_s"] for l in top] == sorted(l["step_time_s"] for l in top)
  book = planner.answer(_c("train.mfu=0.5"), devices=64)
  assert all("step_model" not in l for l in book["layouts"])
  assert max(l["mfu"] for l in book["layouts"]) == pytest.approx(0.5)


def test_the_configured_plan_and_the_pipeline_search_use_it_too():
  """planner.plan's step for the configured mesh is the time model's (its breakdown in `step_model`); a pipeline
  layout divides its roofline replay by the fraction of peak the model predicts for its kernels."""
  out = planner.plan(_c("mesh.fsdp=16", "mesh.tensor=4", "schedule.remat=full", "schedule.microbatches=8"))
  assert out["step_time_s"] == out["step_model"]["t_step_s"] and out["mfu"] == out["step_model"]["mfu"]
  c = resolve(compose(["model=llama3_70b", "hardware=h100_multinode", "precision=bf16",
                       "train.global_batch_tokens=4194304", "schedule.remat=full"]))
  place = next(p for p in planner.placements(c, 32, pipeline=4) if p[:3] == (1, 2, 4))
  row = planner.evaluate_pipeline(c, place, 4, "1f1b", 8)
  assert 0.2 < row["kernel_efficiency"] < 1 and row["pipeline_step_s"] > 0
