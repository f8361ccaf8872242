"""The planner reproduces the JAX Scaling Book's worked examples (to 1% unless a comment says otherwise).

Sources, read for these tests (github.com/jax-ml/scaling-book):
  training.md  "How to Parallelize a Transformer for Training", current version (FSDP+TP in the OVERLAPPED form,
               max(T_fsdp, T_tp) < T_math); an older version (commit 04d8de58) used the ADDITIVE form.
  gpus.md      "Rooflines for LLM Scaling on GPUs" and Quiz 5.
Where the book prints a rounded number we compare with its own arithmetic and say so. No JAX here.
"""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.analysis import links, planner
from shardlab.analysis import memory_model as MM
from shardlab.composition import resolve
from shardlab.config import CONF_DIR, Config, MeshConfig, ModelConfig, PrecisionConfig, ScheduleConfig, TrainConfig
from shardlab.hardware import HardwareConfig
from shardlab.plan import compose

REPO = Path(__file__).resolve().parents[1]
V5P = HardwareConfig(name="tpu_v5p", peak_flops=4.59e14, ici_bandwidth=1.8e11, hbm_bytes=95e9, torus=True)
H100 = HardwareConfig(name="h100", peak_flops=9.9e14, ici_bandwidth=4.5e11, torus=False)
LLAMA2_13B = ModelConfig(name="llama2_13b", d_model=5120, d_ff=13824, n_layers=40, n_heads=40, n_kv_heads=40,
                         vocab_size=32000, seq_len=4096, norm_eps=1e-5, attention="blockwise", attention_block=512)
BF16 = PrecisionConfig(param_dtype="float32", compute_dtype="bfloat16")
CONTRACT = ["n_params", "memory_per_device_bytes", "critical_batch_per_device", "x_opt", "t_math_s", "t_comm_s",
            "compute_bound", "min_devices_to_fit", "step_time_s"]


def close(got, want, rel=0.01):
  return got == pytest.approx(want, rel=rel)


# ------------------------------------------------------------------------------------------- TPU v5p, training.md

def test_v5p_alpha_and_dp_fsdp_critical_batch():
  # "For TPUv5p, C=4.6e14 and W=2 * 9e10 ... our batch size per chip must be at least 2,550"; "if we dedicate
  # all three axes ... we 3x our bandwidth W and can scale down to only BS=850 per TPU". DP and FSDP share it.
  a = planner.alpha(V5P)
  assert close(a, 2550)
  assert close(planner.critical_batch_dp(a, m_x=1), 2550)
  assert close(planner.critical_batch_fsdp(a, m_x=3), 850)
  # LLaMA-3 70B: "split a batch of 16M tokens over roughly 16e6 / (2550 / 3) = 18,823 chips".
  assert close(16e6 / planner.critical_batch_fsdp(a, m_x=3), 18_823)
  # "... each with 4.59e14 FLOPs running at 50% ... train it in approximately 17 days" (6.3e24 FLOPs).
  days = planner.step_time(70e9, 15e12, 4.59e14, 18_823, 0.5) / 86_400
  assert close(days, 17)


def test_v5p_fsdp_tp_critical_batch_overlapped_form():
  # Current book, OVERLAPPED form: "plug in F=32,768, alpha=2550, and M_X M_Y=2 ... This gives roughly B/N > 99".
  a = planner.alpha(V5P)
  assert close(planner.critical_batch_fsdp_tp(a, 32_768, m_x=2, m_y=1), 2550 ** 2 / (2 * 32_768))
  assert close(planner.critical_batch_fsdp_tp(a, 32_768, m_x=2, m_y=1), 99.2)
  # LLaMA-3 70B: "become comms-bound when we have B / N < 2550^2 / 2 * 30,000 = 108".
  assert close(planner.critical_batch_fsdp_tp(a, 30_000, m_x=2, m_y=1), 108.4)
  # v5p 16x16x16 figure: "our expected 4096 * 2550^2 / (2 * 8192 * 4) = 4e5" (the expression is 4.06e5; the book
  # rounds it to 4e5, 1.6% off, so we compare with the expression).
  assert close(4096 * planner.critical_batch_fsdp_tp(a, 4 * 8192, m_x=2, m_y=1), 4096 * 2550 ** 2 / (2 * 8192 * 4))


def test_additive_form_is_four_times_overlapped():
  # Older book (training.md at 04d8de58), ADDITIVE form: "BS per device > 4 alpha^2 / (F M_X M_Y)", "2 * 2550^2 / F
  # ... around BS per device of around 396" for F = 32,768 with M_X = 2, M_Y = 1.
  a = planner.alpha(V5P)
  assert close(4 * planner.critical_batch_fsdp_tp(a, 32_768, m_x=2, m_y=1), 396)


def test_x_opt():
  # LLaMA-2 13B, Q3: "sqrt(3e6 * 2 * 4096 / 13824) = 1333" (M_X / M_Y = 2).
  assert close(planner.x_opt(3e6, 13_824, 4096, m_x=2, m_y=1), 1333)
  # 4x4x4 example: "N = 64, B=48,000, F=32768, gives roughly X ~ 13.9". The formula gives sqrt(187.5) = 13.69
  # with M_X / M_Y = 2 (9.68 with 1): the printed 13.9 is 1.5% off its own formula, so 2% here.
  assert close(planner.x_opt(48_000, 32_768, 64, m_x=2, m_y=1), 13.9, rel=0.02)
  assert close(planner.x_opt(48_000, 32_768, 64, m_x=2, m_y=1), math.sqrt(187.5), rel=1e-9)


def test_tensor_max_width():
  # "Tensor Parallelism becomes communication bound when Y > M_Y * F / 2550"; LLaMA-3 70B (F ~ 30,000): "we can
  # do Tensor Parallelism up to ... Y = M_Y * F / 2550 ~ 11 * M_Y".
  assert close(planner.tensor_max_width(planner.alpha(V5P), 30_000, m_y=1), 11.76)


# ----------------------------------------------------------------------------------------------- H100, gpus.md

def test_h100_critical_batches():
  # "Within a node, we just need the per-GPU token batch size > 990e12 / 450e9 = 2200"; "Within an SU or at the
  # spine level, BS > 990e12 / 400e9 = 2475". A switch: the mesh's ici axes do not multiply the bandwidth.
  assert close(planner.alpha(H100), 2200)
  assert close(planner.critical_batch_fsdp(planner.alpha(H100), H100.physical_axes(3)), 2200)
  assert H100.axis_bandwidth(3) == H100.ici_bandwidth and V5P.axis_bandwidth(3) == 3 * V5P.ici_bandwidth
  multinode = compose(["hardware=h100_multinode"]).hardware
  assert close(planner.alpha(multinode), 2475)


def test_h100_llama3_70b_quiz():
  # gpus.md Quiz 5 Q2: "2 bytes for the weights and 8 for the optimizer state, so at least 700GB ... at least 9
  # GPUs"; "6 * 70e9 * 15e12 = 6.3e24 ... at 45% MFU ... 3.5e6 seconds" (the expression is 3.45e6; 2% here).
  assert planner.min_devices_to_fit(70e9, 80e9, bytes_per_param=10) == 9
  assert close(planner.step_time(70e9, 15e12, 9.9e14, 4096, 0.45), 3.5e6, rel=0.02)
  assert close(planner.step_time(70e9, 15e12, 9.9e14, 4096, 0.45), 6.3e24 / (4096 * 9.9e14 * 0.45), rel=0.01)


# ------------------------------------------------------------------------------------ LLaMA-2 13B, training.md Q1-3

def test_llama2_13b_params():
  # Q1: "FFW parameters: 3LDF = 8.5e9; Attention parameters: 4DNHL = 4.2e9; Vocabulary parameters: 2VD = 0.3e9;
  # Total: ... 13.1e9" (the three terms sum to 13.02e9; ours adds 82k norm scales).
  m = LLAMA2_13B
  assert close(m.n_layers * 3 * m.d_model * m.d_ff, 8.5e9)
  assert close(m.n_layers * 4 * m.d_model ** 2, 4.2e9)
  assert close(planner.param_count(m), 13.1e9)
  assert compose(["model=llama2_13b"]).model == m


@pytest.mark.parametrize("preset,published", [("llama3_8b", 8.03e9), ("llama3_70b", 70.6e9), ("llama2_7b", 6.74e9)])
def test_planned_parameter_count_counts_grouped_query_attention(preset, published):
  # Published sizes: Meta's Llama 3 model card (8.03B, 70.6B on the Hugging Face hub) and Llama 2 7B (6.74B,
  # config.json dims). Grouped-query attention: W_q D x HK, W_kv D x 2GK, W_o HK x D (8 KV heads of 128 for both
  # Llama 3 models); counted as 4 D^2 (multi-head) the 8B model would plan 8.84e9 parameters.
  m = compose([f"model={preset}"]).model
  assert abs(planner.param_count(m) / published - 1) < 0.005
  d, h, g = m.d_model, m.n_heads, m.kv_heads
  k = d // h
  assert planner.attention_params(m) == d * h * k + 2 * d * g * k + h * k * d
  if g < h:
    assert planner.param_count(dataclasses.replace(m, n_kv_heads=0)) / published > 1.09   # the MHA count


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
def test_closed_form_parameter_count_is_the_declarations(preset):
  """One count of parameters: the planner's closed form (plain Python, the book's formulas) equals the sum of
  the shapes the model declares (params.declare, what a run allocates), for every model preset."""
  from shardlab import params as PM
  m = compose([f"model={preset}"]).model
  assert planner.param_count(m) == PM.count(PM.declare(m))


def test_replicated_kv_heads_are_gathered_whole():
  # Llama 3 70B has 8 KV heads: tensor 8 shards them (a device gathers 1/8 of every weight); tensor 16 does not
  # divide them, so W_kv [D, 2, 8, 128] is replicated over tensor and each device gathers all of it.
  m = compose(["model=llama3_70b"]).model
  kv = 2 * m.d_model * 8 * 128
  assert planner.block_shard_params(m, 8) == planner.layer_params(m) / 8
  assert planner.block_shard_params(m, 16) == (planner.layer_params(m) - kv) / 16 + kv
  cfg = resolve(Config(model=m, mesh=MeshConfig(fsdp=4, tensor=16), precision=BF16, hardware=H100,
               schedule=ScheduleConfig(gather_dtype="compute"), train=TrainConfig(global_batch_tokens=4 * 8192)))
  c = planner.block_costs(cfg, H100.ici_bandwidth, H100.ici_bandwidth)
  assert close(c.fsdp, 2 * planner.block_shard_params(m, 16) * 3 / 4 / H100.ici_bandwidth)


def _llama2_13b_q3(fsdp: int, tensor: int, fsdp_axes: int) -> Config:
  # Q3: "32k sequence length and a total batch size of 3M tokens on a TPUv5p 16x16x16 slice", bf16, 40% MFU.
  return resolve(Config(mesh=MeshConfig(fsdp=fsdp, tensor=tensor, fsdp_ici_axes=fsdp_axes, tensor_ici_axes=1),
                model=LLAMA2_13B, precision=BF16, schedule=ScheduleConfig(gather_dtype="compute"),
                train=TrainConfig(global_batch_tokens=3_000_000, mfu=0.4), hardware=V5P))


def test_llama2_13b_q3_mixed_fsdp_tp():
  # Q3.3 (overlapped form): "needs to be above 2550^2 / 2F = 235"; "sqrt(3e6 * 2 * 4096 / 13824) = 1333, meaning
  # we'll do roughly 1024 way DP and 4 way TP"; "6 * 3e6 * 13e9 / (4096 * 4.6e14 * 0.4) = 300ms" (the expression is
  # 310 ms; the printed 300 ms is 3.5% below it, so we compare with the expression).
  out = planner.plan(_llama2_13b_q3(1024, 4, 2))
  assert close(out["critical_batch_per_device"]["fsdp_tp"], 235)
  assert close(out["x_opt"], 1333)
  assert close(out["step_time_s"], 6 * 3e6 * 13e9 / (4096 * 4.6e14 * 0.4))
  assert out["compute_bound"]          # 732 tokens / chip > 235


def test_llama2_13b_q3_pure_fsdp_is_comm_bound():
  # Q3.2: "With 4096 chips and 3 axes of parallelism, we can do a minimum batch size of 850 * 4096 = 3.48M ...
  # So we're actually comms-bound". Q3.1: pure DP replicates ~130 GB of state (10 B/param) > 96 GB per chip.
  out = planner.plan(_llama2_13b_q3(4096, 1, 3))
  assert close(out["critical_batch_per_device"]["fsdp"] * 4096, 3.48e6)
  assert not out["compute_bound"] and out["t_comm_s"]["tensor"] == 0.0
  assert planner.min_devices_to_fit(planner.param_count(LLAMA2_13B), 96e9, bytes_per_param=10) > 1


def test_layer_times_agree_with_closed_forms():
  # The book's model (kind: ffn, bf16 comms) on v5p: the planner's per-layer T's flip compute_bound where the
  # closed forms say, up to the AllGather's (n-1)/n factor. Pure FSDP over 64 chips: B/X > 2550 * 63/64 = 2510.
  ffn = ModelConfig(name="ffn", kind="ffn", d_model=8192, d_ff=32_768, n_layers=4, seq_len=4096)

  def bound(x, y, per_device):
    cfg = resolve(Config(mesh=MeshConfig(fsdp=x, tensor=y, fsdp_ici_axes=2 if y > 1 else 1), model=ffn, precision=BF16,
                 schedule=ScheduleConfig(gather_dtype="compute"), hardware=V5P,
                 train=TrainConfig(global_batch_tokens=per_device * x * y)))
    return planner.plan(cfg)["compute_bound"]
  assert bound(64, 1, 2600) and not bound(64, 1, 2400)
  # FSDP + TP on 8 x 8 with M_X = 2 (overlapped form, B/N > 99): bound at 200 tokens per chip, not at 50.
  assert bound(8, 8, 200) and not bound(8, 8, 50)


# ------------------------------------------------------------------------------------------------------ memory

def test_memory_zero3_divides_state_not_activations():
  # 16 B/param of fp32 state over all N devices; activations follow the local batch B / X, not FSDP.
  def mem(fsdp, tokens):
    return MM.breakdown(resolve(Config(mesh=MeshConfig(fsdp=fsdp, tensor=2), model=LLAMA2_13B, precision=BF16,
                                            train=TrainConfig(global_batch_tokens=tokens))))
  a, b = mem(64, 64 * 4096), mem(128, 128 * 4096)
  p = planner.param_count(LLAMA2_13B)
  # exact local shards: the norm scales [D] are replicated over tensor (a few KB beyond 16 P / N)
  assert a["master_params"] + a["grads"] + a["optimizer"] == pytest.approx(16 * p / 128, rel=1e-4)
  assert b["optimizer"] == pytest.approx(a["optimizer"] / 2)
  assert b["activations"] == pytest.approx(a["activations"])
  assert a["total"] <= sum(v for k, v in a.items() if k != "total")    # the peak: not every part lives at once
  assert planner.min_devices_to_fit(p, 80e9) == math.ceil(16 * p / 80e9) == 3


# -------------------------------------------------------------------------------------------- presets and the CLI

@pytest.mark.slow
@pytest.mark.parametrize("hw", sorted(p.stem for p in (CONF_DIR / "hardware").glob("*.yaml")))
@pytest.mark.parametrize("model", sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
def test_every_preset_plans(hw, model):
  out = planner.plan(resolve(compose([f"hardware={hw}", f"model={model}"])))
  assert all(k in out for k in CONTRACT) and out["n_params"] > 0 and out["step_time_s"] > 0


def test_cli_prints_contract_json():
  args = ["hardware=tpu_v5p", "model=llama2_13b", "mesh.fsdp=1024", "mesh.tensor=4", "mesh.fsdp_ici_axes=2",
          "mesh.tensor_ici_axes=1", "train.global_batch_tokens=3000000", "train.mfu=0.4", "--json"]
  r = subprocess.run([sys.executable, "-m", "shardlab.plan", *args], cwd=REPO, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert all(k in out for k in CONTRACT)
  assert set(out["memory_per_device_bytes"]) >= {"master_params", "grads", "optimizer", "compute_params",
                                                  "activations", "total"}
  assert set(out["critical_batch_per_device"]) >= {"dp", "fsdp", "fsdp_tp"}
  assert set(out["t_comm_s"]) == {"fsdp", "tensor"}
  assert out["mesh"]["devices"] == 4096 and close(out["x_opt"], 1333)


@pytest.mark.parametrize("bad", ["mesh.fsdpp=2", *(pytest.param(b, marks=pytest.mark.slow)   # one process each: one quick
                                                   for b in ("mesh.fsdp=two", "hardware=tpu_v9", "train.mfu=-0.1"))])
def test_cli_bad_override_exits_2_with_one_line(bad):
  r = subprocess.run([sys.executable, "-m", "shardlab.plan", bad], cwd=REPO, capture_output=True, text=True)
  assert r.returncode == 2 and r.stdout == ""
  assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("shardlab.plan: error:")


# ------------------------------------------------------------------------------ batch window and critical batch

def _cfg(model, hw, x, y, tokens, **kw):
  return resolve(Config(mesh=MeshConfig(fsdp=x, tensor=y, **kw.pop("mesh", {})), model=model, precision=BF16,
                schedule=ScheduleConfig(gather_dtype="compute", **kw.pop("schedule", {})), hardware=hw,
                train=TrainConfig(global_batch_tokens=tokens, mfu=0.4)))


def test_batch_window_is_the_memory_boundary():
  # The largest whole number of sequences per fsdp shard (a multiple of the microbatches) whose memory fits:
  # one more microbatch's worth does not. LLaMA-2 13B, 4096-token sequences, on 64 x 4 v5p.
  for remat, mb in [("none", 1), ("full", 1), ("none", 2)]:
    cfg = _cfg(LLAMA2_13B, V5P, 64, 4, 64 * 4096, schedule={"remat": remat, "microbatches": mb})
    w = planner.batch_window(cfg)
    seqs = w["max_sequences_per_fsdp_shard"]
    assert seqs >= mb and seqs % mb == 0

    def total(s):
      return MM.breakdown(cfg.replace(train={"global_batch_tokens": s * 64 * 4096}))["total"]
    assert total(seqs) <= V5P.hbm_bytes < total(seqs + mb)
    assert w["max_batch_per_device_tokens"] == seqs * 4096 / 4
    assert seqs * 4096 / 4 <= w["max_batch_per_device_tokens_unrounded"] < (seqs + mb) * 4096 / 4
    assert planner.plan(cfg)["max_batch_per_device_tokens"] == w["max_batch_per_device_tokens"]


def test_microbatches_fit_the_global_batch():
  # 16 sequences per fsdp shard do not fit at once; the fewest microbatches (a divisor of 16) that fit are
  # chosen, and one divisor fewer does not fit.
  cfg = _cfg(LLAMA2_13B, V5P, 64, 4, 16 * 64 * 4096)
  k = planner.microbatches_to_fit(cfg)
  assert k is not None and k > 1 and 16 % k == 0
  mem = lambda mb: MM.breakdown(cfg.replace(schedule={"microbatches": mb}))["total"]
  smaller = max(d for d in range(1, k) if 16 % d == 0)
  assert mem(k) <= V5P.hbm_bytes < mem(smaller)
  assert planner.plan(cfg)["microbatches"] == k and not planner.plan(cfg)["fits_in_hbm"]
  # The gradient accumulator of microbatching is counted: one more sharded copy of the fp32 gradients.
  one, two = (MM.breakdown(cfg.replace(schedule={"microbatches": mb})) for mb in (1, 2))
  assert two["grads"] == pytest.approx(2 * one["grads"])


@pytest.mark.slow
def test_calibrated_batch_window_against_cpu_compiles():
  """What this checks: planner.calibrated_batch_window, the window of a line through compiled peaks at two batch
  sizes, on XLA:CPU (the tiny model on 4x2): its max batch fits the budget and one more sequence per shard does
  not, by two further compiles; the analytic training state is the compile's (its arguments less the batch);
  the analytic line's fixed bytes (memory_affine) lie above the compiled line's (461 KB against 324 KB here: the
  model holds the gathered weights and a layer's whole gradient at once) and within 1.5x. What it does not
  check: the analytic window (XLA:CPU keeps ~2.6x the analytic activations per sequence: docs/planning.md), nor
  the target. The issue's route, the window confirmed by compiling for the
  target, is tests/test_target.py::test_batch_window_confirmed_by_compiling_for_the_target."""
  from shardlab.analysis.program import memory
  from shardlab.run import build

  def compiled(seqs):      # sequences per fsdp shard -> compiled memory per device
    cfg = resolve(Config(mesh=MeshConfig(fsdp=4, tensor=2), train=TrainConfig(batch_size=4 * seqs)))
    b = build(cfg)
    return cfg, memory(b["step_fn"].lower(b["abstract_state"], b["abstract_batch"]).compile())

  def peak(seqs):
    return compiled(seqs)[1]["peak"]

  cfg = resolve(Config(mesh=MeshConfig(fsdp=4, tensor=2)))
  one = compiled(1)
  state = MM.compare(*one)["components"]["state"]
  assert state["analytic"] == pytest.approx(state["compiled"], rel=0.01)
  measured = {1: one[1]["peak"], 4: peak(4)}
  slope = (measured[4] - measured[1]) / 3
  fixed = measured[1] - slope
  analytic_fixed, analytic_per_seq = planner.memory_affine(cfg)
  assert fixed <= analytic_fixed <= 1.5 * fixed
  budget = fixed + 6.5 * slope                       # between 6 and 7 sequences per shard on the line
  w = planner.calibrated_batch_window(cfg.replace(hardware={"hbm_bytes": budget}), measured)
  seqs = w["max_sequences_per_fsdp_shard"]
  assert seqs == 6 and w["max_batch_per_device_tokens"] == 6 * cfg.model.seq_len / 2
  assert peak(seqs) <= budget < peak(seqs + 1)


def _ffn_mesh(x, y, per_device, m_x=1):
  ffn = ModelConfig(name="ffn", kind="ffn", d_model=8192, d_ff=32_768, n_layers=4, seq_len=4096)
  return _cfg(ffn, V5P, x, y, per_device * x * y, mesh={"fsdp_ici_axes": m_x})


def test_binding_axis_flips_where_the_closed_forms_say():
  # TP binds at any batch once T_tp > T_math: 4 B D (Y-1)/Y / (X W) > 4 B D F / (N C), i.e. Y - 1 > F / alpha
  # (the book's Y > M_Y F / alpha with the ring's (Y-1)/Y): F = 32768, alpha = 2550 -> between Y = 13 and 14.
  a = planner.alpha(V5P)
  assert 13 - 1 < 32_768 / a < 14 - 1
  def crit(x, y, per_device=4096, m_x=1):
    c = planner.plan(_ffn_mesh(x, y, per_device, m_x))["critical_batch_per_device"]
    return c["this_mesh"], c["binding_axis"]
  assert crit(14, 13)[1] == "fsdp" and crit(13, 14) == (None, "tensor")
  # Below the flip FSDP binds at B/N = alpha / (Y M_X) (X-1)/X: T_fsdp = 4DF/(Y W M_X) (X-1)/X = T_math.
  for x, y, m_x in [(16, 8, 2), (64, 1, 1), (64, 1, 3)]:
    b, axis = crit(x, y, m_x=m_x)
    assert axis == "fsdp" and close(b, a / (y * m_x) * (x - 1) / x)
    # ... and the planner's own compute_bound flips there.
    assert planner.plan(_ffn_mesh(x, y, b * 1.01, m_x))["compute_bound"]
    assert not planner.plan(_ffn_mesh(x, y, b * 0.99, m_x))["compute_bound"]
  # With no sharded axis nothing binds.
  assert crit(1, 1) == (0.0, "none")


# --------------------------------------------------------------------------------------------- layout search

def _book_exercise(seq_len=32_768):
  # training.md Q3: LLaMA-2 13B, "32k sequence length and a total batch size of 3M tokens on a TPUv5p 16x16x16
  # slice", bf16 weights (gathered and reduced in bf16), 40% MFU. Activations: remat=full (the book
  # checkpoints only after the big matmuls).
  return resolve(Config(mesh=MeshConfig(fsdp=1024, tensor=4), model=dataclasses.replace(LLAMA2_13B, seq_len=seq_len),
                precision=BF16, schedule=ScheduleConfig(gather_dtype="compute", remat="full"), hardware=V5P,
                train=TrainConfig(global_batch_tokens=3_000_000, mfu=0.4)))


def test_a_slice_axis_without_wraparound_is_a_line():
  """tpus.md: a TPU slice's axis has its wraparound link "on inference chips when we have a full 16 axis, or on
  training chips (v*p) when we have an axis which is a multiple of 4"; a shorter one is a line. A mesh axis over
  a whole line gets half a ring's bandwidth (M = 0.5) and n - 1 hops; the run's replay reads the slice as built
  when the mesh sets no *_ici_axes."""
  v5e, v5p = compose(["hardware=tpu_v5e"]).hardware, compose(["hardware=tpu_v5p"]).hardware
  assert links.torus_axes([16, 16], (16, 16), v5e.wraps) == [(1, 8.0), (1, 8.0)]
  assert links.torus_axes([4, 2], (4, 2), v5e.wraps) == [(0.5, 3), (0.5, 1)]           # v5e-8: a 2D mesh
  assert links.torus_axes([4, 16], (4, 4, 4), v5p.wraps) == [(1, 2.0), (2, 4.0)]      # a full cube: rings
  assert links.torus_axes([2, 4], (2, 2, 2), v5p.wraps) == [(0.5, 1), (1.0, 2)]       # v5p-16: lines
  assert links.torus_axes([4, 2], (4, 2)) == [(1, 2.0), (1, 1.0)]                      # unsaid: every axis a ring
  # sharding.md, pop quiz 2: an AllGather of 34 MB over a 4-chip v5e axis "can't do a fully bidirectional
  # AllGather": 3 hops of the 8.4 MB shard at 4.5e10 B/s one way, about 560 us (377 us with wraparound)
  t = links.collective_seconds("all-gather", 34e6 * 3 / 4, 4, "tensor", v5e.peak(), {"tensor": 0.5})
  assert t == pytest.approx(560e-6, rel=0.02)
  assert links.collective_seconds("all-gather", 34e6 * 3 / 4, 4, "tensor", v5e.peak(), {"tensor": 1}) == \
      pytest.approx(t / 2)
  # the run's own mesh on the slice its target compiles: fsdp 2 x tensor 4 on a v5e 4x2 is two lines; on a
  # v5p 4x4x4, tensor 4 and fsdp 16 are rings (M 1 and 2); a mesh that sets its M keeps it
  c = resolve(compose(["hardware=tpu_v5e", "mesh.fsdp=2", "mesh.tensor=4"]))
  assert {a: links.mesh_links(c)[0][a] for a in ("fsdp", "tensor")} == {"fsdp": 0.5, "tensor": 0.5}
  assert links.mesh_links(c)[1]["tensor"] == v5e.ici_bandwidth / 2
  c = resolve(compose(["hardware=tpu_v5p", "mesh.fsdp=16", "mesh.tensor=4"]))
  assert {a: links.mesh_links(c)[0][a] for a in ("fsdp", "tensor")} == {"fsdp": 2, "tensor": 1}
  c = resolve(compose(["hardware=tpu_v5e", "mesh.fsdp=2", "mesh.tensor=4", "mesh.fsdp_ici_axes=2"]))
  assert {a: links.mesh_links(c)[0][a] for a in ("fsdp", "tensor")} == {"fsdp": 2, "tensor": 1}


def test_torus_placement_and_gpu_switch_bandwidths():
  assert links.default_torus(V5P, 4096) == (16, 16, 16)
  # tensor 4 inside one torus axis, fsdp 1024 over the rest: the book's M_X = 2, M_Y = 1 (sqrt(... * 2 ...)).
  assert [m for m, _ in links.torus_axes([4, 1024, 1], (16, 16, 16))] == [1, 2, 1]
  assert [m for m, _ in links.torus_axes([1, 4096, 1], (16, 16, 16))] == [1, 3, 1]   # "3 axes": 2550 / 3
  assert links.torus_axes([1, 3, 1], (16, 16, 16)) is None
  # GPU: NVLink inside the node; the data axis of one GPU per node gets that GPU's NIC (50 GB/s); an axis with all
  # 8 GPUs of each node in it gets the node's 400 GB/s (gpus.md; the h100_multinode preset's W).
  h100 = compose(["hardware=h100"]).hardware
  assert links.switch_bandwidths(h100, [1, 8, 8]) == [4.5e11, 4.5e11, 5e10]
  assert links.switch_bandwidths(h100, [1, 64, 1]) == [4.5e11, 4e11, 4.5e11]
  assert links.switch_bandwidths(h100, [2, 4, 8]) == [4.5e11, 4.5e11, 5e10]


def test_search_works_the_scaling_book_exercise():
  cfg = _book_exercise()
  layouts = planner.search(cfg)
  assert len(layouts) == 91                            # data x fsdp x tensor = 2^12: C(14, 2) factorizations
  by = {(l["data"], l["fsdp"], l["tensor"]): l for l in layouts}
  # Q3.1 pure DP: the replicated state alone exceeds HBM (the book: 10 B/param ~ 130 GB > 96 GB; ours 16 B/param),
  # and its gradient AllReduce is comm-bound like FSDP (B/N = 732 < 2550 / 3).
  dp = by[(4096, 1, 1)]
  assert not dp["fits"] and not dp["compute_bound"]
  assert any(r.startswith("memory:") for r in dp["rejected_because"])
  assert any(r.startswith("communication: data:") for r in dp["rejected_because"])
  # Q3.2 pure FSDP: fits ("safely under the HBM limit"), but "850 * 4096 = 3.48M ... we're actually comms-bound".
  fsdp = by[(1, 4096, 1)]
  assert fsdp["fits"] and not fsdp["compute_bound"] and fsdp["ici_axes"]["fsdp"] == 3
  assert any(r.startswith("communication: fsdp:") for r in fsdp["rejected_because"])
  assert not any(r.startswith("memory:") for r in fsdp["rejected_because"])
  assert close(fsdp["critical_batch_per_device"]["this_mesh"] * 4096, 3.48e6)
  # Q3.3 FSDP + TP: "roughly 1024 way DP and 4 way TP" (X_opt = 1333), "300ms" (the expression: 310 ms) at 40%.
  best = layouts[0]
  x_opt = planner.x_opt(3e6, LLAMA2_13B.d_ff, 4096, 2, 1)
  assert best["data"] == 1 and best["tensor"] == 4 and x_opt / 2 <= best["fsdp"] <= 2 * x_opt
  assert best["fits"] and best["compute_bound"] and best["rejected_because"] == []
  assert close(best["step_time_s"], 6 * 3e6 * 13e9 / (4096 * 4.6e14 * 0.4)) and close(best["mfu"], 0.4)
  # Every qualifying layout fits and is compute-bound, and comes before every rejected one.
  ok = [bool(l["rejected_because"]) for l in layouts]
  assert ok == sorted(ok) and all(l["fits"] and l["compute_bound"] for l in layouts if not l["rejected_because"])
  # Tensor 8 is comm-bound at any batch: Y = 8 > M_Y F / alpha (4 D (Y-1) alpha / P_layer > 1 for our block).
  assert by[(1, 512, 8)]["critical_batch_per_device"] == {"this_mesh": None, "binding_axis": "tensor"}


def test_hsdp_replicates_state_over_data_and_reduces_gradients_over_it():
  # HSDP: state 16 B/param / (fsdp tensor), the batch over data x fsdp; the gradient AllReduce over data against
  # the backward math is the book's DP test with the gradient shard 1 / (X Y) of the weights:
  # alpha / M_data (d-1)/d / (B/N X Y).
  cfg = _book_exercise(4096)
  layouts = {(l["data"], l["fsdp"], l["tensor"]): l for l in planner.search(cfg)}
  p = planner.param_count(LLAMA2_13B)
  for d, f, t in [(4, 256, 4), (1, 1024, 4)]:
    mem = MM.breakdown(cfg.replace(mesh={"fsdp": f, "tensor": t},
                                                  train={"global_batch_tokens": 3e6 / d}))
    assert close(mem["master_params"] + mem["grads"] + mem["optimizer"], 16 * p / (f * t))
    assert layouts[(d, f, t)]["memory_per_device_bytes"] == pytest.approx(mem["total"])
  hsdp = layouts[(4, 256, 4)]
  assert hsdp["ici_axes"]["data"] == 1 and layouts[(1, 1024, 4)]["comm_to_math"]["data"] == 0
  assert close(hsdp["comm_to_math"]["data"], planner.alpha(V5P) * 3 / 4 / (3e6 / 4096 * 256 * 4))


# ------------------------------------------------------------------------------------------------------- the CLI

@pytest.mark.slow
def test_cli_search_top_and_plot(tmp_path):
  args = ["hardware=tpu_v5p", "model=llama2_13b", "mesh.fsdp=1024", "mesh.tensor=4", "model.seq_len=32768",
          "train.global_batch_tokens=3000000", "train.mfu=0.4", "precision.compute_dtype=bfloat16",
          "schedule.gather_dtype=compute", "schedule.remat=full", "plan.top=3", "confirm=false",
          f"plot={tmp_path / 'curve.png'}", "--json"]
  r = subprocess.run([sys.executable, "-m", "shardlab.plan", *args], cwd=REPO, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert len(out["layouts"]) == 3 and out["search"]["considered"] == 91
  keys = {"data", "fsdp", "tensor", "fits", "compute_bound", "step_time_s", "mfu", "rejected_because",
          "memory_per_device_bytes", "memory_margin_bytes"}
  assert all(keys <= set(l) and "target" not in l for l in out["layouts"])   # confirm=false: nothing compiled
  assert (out["layouts"][0]["fsdp"], out["layouts"][0]["tensor"]) == (1024, 4)
  assert {"this_mesh", "binding_axis"} <= set(out["critical_batch_per_device"])
  assert out["max_batch_per_device_tokens"] > 0 and out["microbatches"] == 1
  assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("bad", ["top=0", "search=maybe", "torus=16x16", "plot_layouts=1x2", "confirm=yes",
                                 "confirm_batch=1", "plot_layouts=3x1x1"])
def test_cli_bad_planner_option_exits_2_with_one_line(bad, capsys, tmp_path):
  from shardlab.plan import main
  assert main(["search=true", bad]) == 2
  out, err = capsys.readouterr()
  assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("shardlab.plan: error:")


def test_plan_of_an_hsdp_mesh_costs_the_gradient_allreduce_over_data():
  """mesh.data=8 x fsdp 8 over 8 nodes of 8 H100: the FSDP x TP fields describe one node's replica (a 1/8 of the
  global batch on its 8 GPUs); `hsdp` adds the data axis on the nodes' NICs (50 GB/s per GPU, gpus.md): a
  block's gradient AllReduce of its W[D_X, F] shard, 2 V/X (n-1)/n over n = 8 replicas, against 2x the math."""
  cfg = resolve(compose(["model=llama2_7b", "hardware=h100", "mesh.data=8", "mesh.fsdp=8", "mesh.tensor=1",
                 "train.global_batch_tokens=4194304"]))
  out = planner.plan(cfg)
  h = out["hsdp"]
  assert out["mesh_data"] == 8 and out["batch_per_device_tokens"] == 4194304 / 64 == h["batch_per_device_tokens"]
  assert h["axis_bandwidth"]["data"] == cfg.hardware.dcn_bandwidth and h["axis_bandwidth"]["fsdp"] == 4.5e11
  assert h["comm_to_math"]["data"] > 0 and {"data", "fsdp", "tensor"} == set(h["comm_to_math"])
  same = next(l for l in planner.search(cfg) if (l["data"], l["fsdp"], l["tensor"]) == (8, 8, 1))
  assert same["step_time_s"] == h["step_time_s"] and same["comm_to_math"] == h["comm_to_math"]


def test_cli_bad_override_is_one_readable_line(capsys):
  """A value of the wrong type or an unknown option: Hydra's sentence, without OmegaConf's key/type trailer or
  the config search path, and where to find the settings."""
  from shardlab.plan import main
  assert main(["mesh.fsdp=abc"]) == 2
  err = capsys.readouterr().err
  assert err.strip() == ("shardlab.plan: error: Error merging override mesh.fsdp=abc: Value 'abc' of type 'str' could "
                         "not be converted to Integer (`python -m shardlab --help` lists every group, option and "
                         "setting)")
  assert main(["model=nope"]) == 2
  err = capsys.readouterr().err
  assert "Could not find 'model/nope'" in err and "search path" not in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------- pipeline layouts (search)

PP70 = ["model=llama3_70b", "hardware=h100_multinode", "precision=bf16", "train.global_batch_tokens=4194304"]


@pytest.mark.slow
def test_pipeline_layouts_are_searched_on_request_and_ranked_with_the_others():
  from shardlab.axes import PIPELINE
  from shardlab.pipeline_tables import SCHEDULES, chunks_per_stage
  cfg = resolve(compose(PP70))
  plain = planner.answer(cfg, 32)
  assert all(PIPELINE not in l for l in plain["layouts"])          # off by default: rows as before
  ans = planner.answer(cfg, 32, pipeline=True)
  pp = [l for l in ans["layouts"] if PIPELINE in l]
  flat = [l for l in ans["layouts"] if PIPELINE not in l]
  assert ans["considered"] == plain["considered"] + len(pp)
  assert sorted(map(json.dumps, flat)) == sorted(map(json.dumps, plain["layouts"]))
  shapes = {(l[PIPELINE], l["schedule"]) for l in pp}
  assert {P for P, _ in shapes} == {2, 4, 8, 16}                   # 80 layers: P = 32 does not divide them
  assert {s for _, s in shapes} == set(SCHEDULES)
  assert not any(P == 16 and chunks_per_stage(s) > 1 for P, s in shapes)   # 80 % (16 x 2) != 0
  for l in pp:
    P, M = l[PIPELINE], l["microbatches"]
    assert l["data"] * l["fsdp"] * l["tensor"] * P == 32 and M in (P, 2 * P, 4 * P, 8 * P)
    assert M >= 2 * P or l["schedule"] != "dualpipev"
    assert 512 % (l["data"] * l["fsdp"] * M) == 0                  # whole sequences per shard per microbatch
    assert l["virtual_stages"] == (2 if l["schedule"] in ("interleaved", "looped_bfs", "zb_v", "dualpipev") else 1)
    assert 0 < l["bubble"] < 1 and l["stage_layers"] == 80 // P
    assert l["mfu"] == pytest.approx(6 * planner.param_count(cfg.model) * 4194304 / 32 / 9.9e14 / l["step_time_s"])
  assert ans["layouts"] == planner.rank(ans["layouts"])


def test_pipeline_stage_memory_1f1b_holds_fewer_microbatches_than_gpipe():
  """At M = 4P, gpipe keeps every microbatch's residuals until its backward, 1f1b at most P on stage 0: same
  training state, less activation memory; both state terms are the stage's 80 / P layers' share."""
  cfg = resolve(compose(PP70)).replace(schedule={"remat": "full"})
  P, M = 4, 16
  place = next(p for p in planner.placements(cfg, 32, pipeline=P) if p[:3] == (1, 4, 2))
  g = planner.evaluate_pipeline(cfg, place, P, "gpipe", M)
  f = planner.evaluate_pipeline(cfg, place, P, "1f1b", M)
  assert (g["in_flight"], f["in_flight"]) == (M, P)
  assert f["activations_per_device_bytes"] < g["activations_per_device_bytes"]
  assert f["memory_per_device_bytes"] < g["memory_per_device_bytes"]
  mem = planner.pipeline_memory(cfg, 1, 4, 2, P, "gpipe", M)
  stage = MM.breakdown(cfg.replace(model={"n_layers": 20}, mesh={"fsdp": 4, "tensor": 2},
                                                     schedule={"microbatches": 1}))
  assert mem["optimizer"] == stage["optimizer"] and mem["master_params"] == stage["master_params"]
  # the pipeline axis is the outermost: on nodes of 8, 4 stages of 8 GPUs cross nodes (the NICs), the others not
  h100 = cfg.replace(hardware=dataclasses.asdict(compose(["hardware=h100"]).hardware))
  bws = next(p for p in planner.placements(h100, 32, pipeline=P) if p[:3] == (1, 4, 2))[3]
  assert bws["pipeline"] == 50e9 and bws["tensor"] == bws["fsdp"] == 450e9


def test_pipeline_bubble_is_the_sync_replay_of_the_schedule():
  from shardlab.analysis.pipeline_replay import replay
  from shardlab.pipeline_tables import build, closed_form_bubble
  cfg = resolve(compose(PP70))
  P, M = 4, 8
  place = next(p for p in planner.placements(cfg, 32, pipeline=P) if p[:3] == (1, 2, 4))
  row = planner.evaluate_pipeline(cfg, place, P, "gpipe", M)
  t = row["slot_s"]
  run = replay(build("gpipe", P, M), t["F"], t["B"], t["W"], t["send"], sync=True, t_head=t["head"])
  assert row["bubble"] == pytest.approx(run["bubble"], rel=1e-12)
  assert row["pipeline_step_s"] == pytest.approx(run["step_s"])        # the time model's slots: seconds
  assert row["step_time_s"] >= row["pipeline_step_s"]
  # each part's communication by its own rule, as the layouts without stages are priced (step_model): the
  # default weights part does not prefetch, so a slot waits for its gathers (and for the TP collectives, which the
  # all-gather contraction does not overlap); prefetching hides the gathers behind the math; train.mfu prices
  # the roofline (everything hidden) / mfu
  from shardlab.analysis.closed_forms import block_costs
  data, fsdp, tensor, bws, axes, hops, _ = place
  sub = cfg.replace(mesh={"fsdp": fsdp, "tensor": tensor, "fsdp_ici_axes": axes["fsdp"],
                          "tensor_ici_axes": axes["tensor"]}, train={"global_batch_tokens": 4194304 / data})
  block = block_costs(sub, bws["fsdp"], bws["tensor"], data, bws["data"], hops=hops)
  b, k = 4194304 / (data * fsdp * tensor) / M, 80 // P
  waits = k * (block.math * b / row["kernel_efficiency"] + block.fsdp + block.tensor_time(b))
  assert t["F"] == pytest.approx(waits) and block.fsdp > 0 and block.tensor_time(b) > 0
  pre = planner.evaluate_pipeline(cfg.replace(schedule={"prefetch": 1}), place, P, "gpipe", M)
  assert pre["slot_s"]["F"] == pytest.approx(waits - k * block.fsdp)      # math / eff beside the gathers: hidden
  book = planner.evaluate_pipeline(cfg.replace(train={"mfu": 0.5}), place, P, "gpipe", M)
  assert book["slot_s"]["F"] == pytest.approx(k * block.forward(b)) and book["kernel_efficiency"] == 0.5
  free = replay(build("gpipe", P, M), t["F"] + t["head"], t["B"], t["W"], 0.0, sync=True)["bubble"]   # free links: the book's
  assert free == pytest.approx(closed_form_bubble("gpipe", P, M)) and row["bubble"] >= free
  # its batch window: each microbatch's pass compute-bound from the first, the stage's HBM full just above the last
  w = planner.batch_range(cfg, row)
  unit = 1 * 2 * M * cfg.model.seq_len                              # one more sequence per shard per microbatch
  crit = row["critical_batch_per_device"]["this_mesh"]
  assert w["pipeline"] == P and w["compute_bound_from_tokens"] % unit == 0 and w["fits_per_pass_tokens"] % unit == 0
  assert w["compute_bound_from_tokens"] / (8 * M) >= crit > (w["compute_bound_from_tokens"] - unit) / (8 * M)
  mem = lambda t: planner.pipeline_memory(cfg, 1, 2, 4, P, "gpipe", M, t)["total"]
  assert mem(w["fits_per_pass_tokens"]) <= 80e9 < mem(w["fits_per_pass_tokens"] + unit)


@pytest.mark.slow   # a pipeline search (7 s)
def test_pipeline_shapes_need_layers_divisible_and_interleaved_groups_of_p():
  cfg = resolve(compose(["model=tiny"])).replace(model={"n_layers": 8})
  shapes = {(P, name): counts for P, name, V, counts in planner.pipeline_shapes(cfg, 16)}
  assert {P for P, _ in shapes} == {2, 4, 8}                       # 16 does not divide 8 layers
  assert (8, "interleaved") not in shapes and (4, "interleaved") in shapes   # 8 % (P x V=2)
  assert shapes[(4, "gpipe")] == [4, 8, 16, 32]
  fixed = {(P, name) for P, name, V, counts in planner.pipeline_shapes(cfg, 16, microbatches=6)}
  assert (2, "interleaved") in fixed and (4, "interleaved") not in fixed and (4, "gpipe") in fixed
  ans = planner.answer(cfg.replace(train={"batch_size": 64}), 16, pipeline=True)
  assert all(l["microbatches"] % l["pipeline"] == 0 for l in ans["layouts"] if l.get("schedule") == "interleaved")


def test_confirming_a_plan_keeps_the_device_count_the_process_asked_for(monkeypatch):
  """The planner's target check starts JAX on one CPU device only in a process that asked for none: in this test
  session (8, asked by tests/conftest.py) a worker whose first test confirms a plan used to start JAX with one
  device, and its later tests could not build their 8-device meshes."""
  import jax
  from shardlab import mesh
  from shardlab.analysis import confirm
  asked = []
  monkeypatch.setattr(mesh, "set_cpu_devices", asked.append)
  assert jax.config.jax_num_cpu_devices == 8
  confirm.start_jax()
  assert asked == []
