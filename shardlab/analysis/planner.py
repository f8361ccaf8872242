"""Roofline planner: parameters, memory, compute/communication times and critical batch sizes. Pure Python.

Every formula is the JAX Scaling Book's (training.md "How to Parallelize a Transformer for Training", gpus.md
"Rooflines for LLM Scaling on GPUs"), in its notation:
  B  tokens in the global batch           D, F  d_model, d_ff          L  layers
  X  fsdp axis size, Y  tensor axis size   N = X Y devices             C  peak FLOP/s per device
  W_ici  bandwidth of one link (TPU) or of the switch (GPU)            alpha = C / W_ici
  M_X, M_Y  physical interconnect axes the fsdp / tensor mesh axes span (1 on GPUs: see hardware.py)

Forms used. FSDP+TP follows the CURRENT book: comms on X and on Y overlap each other and the FLOPs, so a layer is
compute-bound when max(T_fsdp, T_tp) < T_math, giving B/N > alpha^2 / (M_X M_Y F). Older versions added the two
(T_fsdp + T_tp < T_math, B/N > 4 alpha^2 / (M_X M_Y F)); `compute_bound_additive` reports that form.

Bytes. The book moves bf16 (2 bytes) weights and activations; its closed forms below take `w_bytes` (weights
gathered and gradients reduced) and `a_bytes` (activations moved by TP) and reduce to the book at 2 and 2.
`plan` passes the configured dtypes (schedule.gather_dtype, precision.compute_dtype).

Shapes of the shardlab model (per layer): norm [D], W_q [D,H,K], W_kv [D,2,G,K] (G key/value heads, = H without
grouped-query attention), W_o [H,K,D], norm [D], W_in [D,2,F], W_out [F,D]; plus embed [V,D], final norm [D],
unembed [D,V]. `kind: ffn` is the book's L blocks of
W_in [D,F], W_out [F,D] only.

Pipeline layouts (answer(pipeline=True), `python -m shardlab.plan pipeline_search=true`): P stages (a divisor of
the devices, >= 2, with n_layers a multiple of P V) x each schedule of pipeline_tables.SCHEDULES (V = 2 for
interleaved, else 1) x M = P, 2P, 4P, 8P microbatches (whole sequences per batch shard) x data x fsdp x tensor of
the devices / P, the pipeline axis outermost (across nodes first: placements(pipeline=P)). Step time: the
stage's per-microbatch slot times from this module's block roofline (F = n_layers / (P V) blocks' forward at one
microbatch's per-device tokens, B its backward, or B and W for a table that splits the weight gradient off; the
head in F) and the send of one microbatch's residual stream over the pipeline axis's bandwidth, replayed through
the schedule's own tick table as the executor runs it (replay(build(...), sync=True): neighbour-synchronised
ticks, so the bubble is the executor's, not the closed form's), / train.mfu. Memory per stage: memory_model.breakdown's
terms for the stage's layers, with activations for the most microbatch-chunks a stage holds in flight by the
table (in_flight) at one microbatch's tokens, plus the residual-stream buffers the executor allocates
(evaluate_pipeline, pipeline_memory). These are predictions of the closed forms and the replay, like every other
number here: summary.json's `pipeline` (analysis/pipeline_cost.py) replays a compiled run's own slot times.
answer's `pipeline` (pipeline_search_summary) lists the P costed and those the layers rule out, and when no
pipeline layout applies, why (why_no_pipeline), so that a table without one is not read as pipelines that lost.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardlab import params as PM
from shardlab.axes import DATA, FSDP, PIPELINE, TENSOR, shape_of
from shardlab.analysis import memory_model as MM
from shardlab.composition import Composition
from shardlab.analysis.links import default_torus, mesh_links, switch_bandwidths, torus_axes
from shardlab.analysis.memory_model import dtype_bytes
from shardlab.analysis.pipeline_replay import replay
from shardlab.pipeline_tables import (SCHEDULES, Plan, check_shape, chunks_per_stage, closed_form_bubble,
                                      in_flight, table_of)

BOOK_BYTES = 2  # bf16, what every closed form in the book assumes


# ---------------------------------------------------------------------------------------------------- parameters

def attention_params(model) -> int:
  """Parameters of one block's attention: W_q [D, H K] + W_kv [D, 2, G K] + W_o [H K, D], with K = D / H the head
  dim and G = model.kv_heads the key/value heads (grouped-query attention): D H K + 2 D G K + H K D. Multi-head
  (G = H) gives the book's 4 D^2 (training.md's 4DNH per layer); Llama 3 8B (D 4096, H 32, G 8): 2 D^2 + D^2 / 2."""
  d, h = model.d_model, model.n_heads
  k = getattr(model, "head_size", 0) or d // h       # model.head_size: Qwen3's 128 beside D / H = 64
  g = getattr(model, "n_kv_heads", 0) or h
  return d * h * k + 2 * d * g * k + h * k * d


def layer_params(model) -> int:
  """Parameters of one block. transformer: attention_params (4 D^2 for MHA, less with grouped-query attention)
  + 3 D F (SwiGLU) + 2 D (norms); ffn: 2 D F. A mixture of experts (model.n_experts = E): the router D E, E
  experts of 3 D F_e and the shared experts' 3 D (S F_e) in place of the dense 3 D F."""
  d, f = model.d_model, model.d_ff
  if model.kind == "ffn":
    return 2 * d * f
  if getattr(model, "n_experts", 0):
    fe = model.expert_d_ff or f
    mlp = d * model.n_experts + model.n_experts * 3 * d * fe + 3 * d * model.n_shared_experts * fe
    return attention_params(model) + mlp + 2 * d
  return attention_params(model) + 3 * d * f + 2 * d


def kv_params(model) -> int:
  """One block's W_kv [D, 2, G, K]: 2 D G K (0 for ffn)."""
  if model.kind == "ffn":
    return 0
  g = getattr(model, "n_kv_heads", 0) or model.n_heads
  return 2 * model.d_model * g * (getattr(model, "head_size", 0) or model.d_model // model.n_heads)


def block_shard_params(model, tensor: int) -> float:
  """Weights of one block a device holds once the fsdp dim is gathered, W[D, F_Y]: layer_params / Y, except
  that W_kv stays whole when Y does not divide the key/value heads G (shardlab replicates them over tensor, as
  params.kv_sharded: Llama 3 70B's 8 KV heads at tensor 16), so its gather moves 2 D G K per device."""
  g = getattr(model, "n_kv_heads", 0) or model.n_heads
  if model.kind == "ffn" or g % tensor == 0:
    return layer_params(model) / tensor
  kv = kv_params(model)
  return (layer_params(model) - kv) / tensor + kv


def embed_params(model) -> int:
  """Parameters outside the blocks: embed [V,D] + final norm [D] + untied unembed [D,V]; none for ffn."""
  if model.kind == "ffn":
    return 0
  return 2 * model.vocab_size * model.d_model + model.d_model


def param_count(model) -> int:
  """Total parameters. LLaMA-2 13B: 40 * 317.2e6 + 0.33e9 = 13.02e9 (training.md Q1: 3LDF + 4DNHL + 2VD)."""
  return model.n_layers * layer_params(model) + embed_params(model)


# -------------------------------------------------------------------------------------------------------- memory

def min_devices_to_fit(n_params: int, hbm_bytes: float, bytes_per_param: float = 16) -> int:
  """Fewest devices whose HBM holds the sharded training state: ceil(bytes_per_param * P / HBM).

  16 B/param = fp32 master + fp32 grads + two fp32 Adam moments (ZeRO-3, Rajbhandari et al., arXiv:1910.02054). gpus.md Quiz 5 counts
  10 B/param (bf16 weights + fp32 moments): LLaMA-3 70B -> 700 GB / 80 GB -> 9 H100s. Activations not included.
  """
  return max(1, math.ceil(bytes_per_param * n_params / hbm_bytes))


# ------------------------------------------------------------------------------ closed forms (training.md, gpus.md)

def alpha(hw) -> float:
  """ICI arithmetic intensity alpha = C / W_ici: 4.59e14 / 1.8e11 = 2550 (v5p); 9.9e14 / 4.5e11 = 2200 (H100)."""
  return hw.peak_flops / hw.ici_bandwidth


def critical_batch_dp(alpha_: float, m_x: int = 1, w_bytes: int = BOOK_BYTES) -> float:
  """Per-device tokens above which pure DP is compute-bound. Backward per layer: T_math = 8 B D F / (X C),
  T_comm = 8 D F / (M_X W_ici)  =>  B / X > alpha / M_X (2550 on one v5p axis, 850 on three)."""
  return alpha_ / m_x * w_bytes / BOOK_BYTES


def critical_batch_fsdp(alpha_: float, m_x: int = 1, w_bytes: int = BOOK_BYTES) -> float:
  """FSDP: forward per layer T_math = 4 B D F / (X C), T_comm = 4 D F / (M_X W_ici): the same bound as DP,
  B / X > alpha / M_X (training.md: "both ... become bandwidth bound ... less than 2550 / M_X")."""
  return critical_batch_dp(alpha_, m_x, w_bytes)


def critical_batch_fsdp_tp(alpha_: float, d_ff: int, m_x: int = 1, m_y: int = 1,
                           w_bytes: int = BOOK_BYTES, a_bytes: int = BOOK_BYTES) -> float:
  """FSDP + TP at X = X_opt, overlapped form (current book): B / N > alpha^2 / (M_X M_Y F).

  From T_fsdp = 4DF / (Y W M_X), T_tp = 4BD / (X W M_Y), T_math = 4BDF / (N C) and max(T_fsdp, T_tp) < T_math.
  With byte widths b_w, b_a the bound scales by (b_w / 2)(b_a / 2). The additive form is 4x this.
  """
  return alpha_ ** 2 / (m_x * m_y * d_ff) * (w_bytes / BOOK_BYTES) * (a_bytes / BOOK_BYTES)


def x_opt(tokens: float, d_ff: int, n: int, m_x: int = 1, m_y: int = 1,
          w_bytes: int = BOOK_BYTES, a_bytes: int = BOOK_BYTES) -> float:
  """FSDP width that equalises T_fsdp and T_tp: X_opt = sqrt((B / F) (M_X / M_Y) N) (times sqrt(b_a / b_w))."""
  return math.sqrt(tokens / d_ff * m_x / m_y * n * a_bytes / w_bytes)


def tensor_max_width(alpha_: float, d_ff: int, m_y: int = 1, a_bytes: int = BOOK_BYTES) -> float:
  """Largest compute-bound TP axis: Y < M_Y F / alpha (training.md; gpus.md: F / 2200 within an H100 node)."""
  return m_y * d_ff / alpha_ * BOOK_BYTES / a_bytes


def step_time(n_params: int, tokens: float, peak_flops: float, n_devices: int, mfu: float) -> float:
  """Seconds per step = 6 * params * tokens / (C * N * MFU) (training.md; 13e9 params, 3e6 tokens, 4096 v5p
  at 40% MFU -> about 0.31 s, printed as "300ms")."""
  return 6 * n_params * tokens / (peak_flops * n_devices * mfu)


# --------------------------------------------------------------------------------- times under the configured mesh

def collective_time(v_bytes: float, n: int, bandwidth: float, hop_latency_s: float,
                    hops: float | None = None) -> float:
  """AllGather / ReduceScatter of V bytes (the full array) over n devices: max(V (n-1)/n / W, T_hop n / 2)
  (Scaling Book sharding.md: a bidirectional ring; NCCL tests doc/PERFORMANCE.md). Zero when n = 1. `hops` replaces n / 2 where the collective runs over
  several torus axes at once (one ring per axis: the sum of their n_i / 2)."""
  if n <= 1:
    return 0.0
  return max(v_bytes * (n - 1) / n / bandwidth, hop_latency_s * (n / 2 if hops is None else hops))


def layer_times(c: Composition) -> dict[str, float]:
  """Per-device seconds for ONE block: `*_fwd` for the forward pass, the plain keys for forward + backward.

  math: 2 P_layer B / (N C) forward, 3x that per step (matmul FLOPs; attention's T^2 FLOPs are left out, as in
    step_time).
  fsdp: AllGather of W[D_X, F_Y] -> W[D, F_Y] (V = P_layer / Y weights, block_shard_params: W_kv whole when Y
    does not divide the key/value heads) at the fsdp axis bandwidth; per step also
    the re-gather in backward (when reshard_after_forward) and the ReduceScatter of the gradient.
  tensor: per sublayer (attention and MLP; one for ffn) AllGather In[B_X, L_Y, D] and ReduceScatter Out[B_X, D]
    (V = B D / X activations) at the tensor axis bandwidth; backward does the transposes, so 2x per step.
  Forward is the pass with the most communication per FLOP (training.md), hence the compute-bound test.
  """
  mesh = c.mesh
  costs = block_costs(c, *fsdp_tensor_bandwidth(c))
  b = c.global_tokens / (mesh.fsdp * mesh.tensor)
  math_fwd, tensor_fwd = costs.math * b, costs.tensor_time(b)
  return {"math_fwd": math_fwd, "fsdp_fwd": costs.fsdp, "tensor_fwd": tensor_fwd,
          "math": 3 * math_fwd, FSDP: (1 + costs.fsdp_bwd_passes) * costs.fsdp, TENSOR: 2 * tensor_fwd}


@dataclass(frozen=True)
class BlockCosts:
  """One block's per-device seconds as functions of the per-device batch b = B / N tokens (N = data fsdp tensor):
  forward math = math * b, the fsdp AllGather = fsdp (no b: it moves weights), the tensor AllGather +
  ReduceScatter pairs = tensor_time(b) (bytes grow with b, down to a latency floor), and the gradient AllReduce
  over the data (HSDP replica) axis in backward = data. Backward: 2x the math, the same tensor traffic
  (transposes), fsdp_bwd_passes gathers/reduce-scatters."""
  math: float                 # s per token: 2 P_layer / C
  fsdp: float                 # s
  tensor_per_token: float     # s per token: 2 sublayers a_bytes D (Y - 1) / W_Y
  tensor_floor: float         # s: 2 sublayers T_hop Y / 2
  data: float                 # s: AllReduce = 2 x ReduceScatter of the W[D_X, F_Y] gradient shard over data
  fsdp_bwd_passes: int        # re-gather (reshard_after_forward) + ReduceScatter: 2; kept weights: 1

  def tensor_time(self, b: float) -> float:
    return max(self.tensor_per_token * b, self.tensor_floor) if self.tensor_per_token else 0.0

  def forward(self, b: float) -> float:
    """Roofline seconds of the forward pass: comms overlap each other and the math (the book's current form)."""
    return max(self.math * b, self.fsdp, self.tensor_time(b))

  def backward(self, b: float) -> float:
    return max(2 * self.math * b, self.fsdp_bwd_passes * self.fsdp, self.tensor_time(b), self.data)

  def step(self, b: float, microbatches: int = 1) -> float:
    """Roofline seconds of one step at per-device batch b in `microbatches` forward + backward passes of b / k:
    the fsdp gathers and reduce-scatters repeat per microbatch (each pass gathers the weights again), the data
    AllReduce runs once, behind the last backward. One microbatch: forward(b) + backward(b)."""
    k = max(1, microbatches)
    bk = b / k
    fwd = self.forward(bk)
    bwd = max(2 * self.math * bk, self.fsdp_bwd_passes * self.fsdp, self.tensor_time(bk))
    return k * fwd + (k - 1) * bwd + max(bwd, self.data)

  def comm_to_math(self, b: float) -> dict[str, float]:
    """Forward fsdp and tensor, backward data: each axis's communication over the math it can hide behind."""
    return {FSDP: self.fsdp / (self.math * b), TENSOR: self.tensor_time(b) / (self.math * b),
            DATA: self.data / (2 * self.math * b)}

  def critical_batches(self) -> dict[str, float | None]:
    """Per axis, the per-device tokens below which its communication exceeds the math it overlaps. fsdp:
    b > fsdp / math. data: b > data / (2 math). tensor: None (never compute-bound) when its per-token time
    exceeds the math's (Y > M_Y F / alpha, whatever the batch), else where its latency floor meets the math."""
    tensor = None if self.tensor_per_token > self.math else self.tensor_floor / self.math
    return {FSDP: self.fsdp / self.math, TENSOR: tensor, DATA: self.data / (2 * self.math)}

  def critical_batch(self) -> tuple[float | None, str]:
    """(the largest of critical_batches, its axis): None and TENSOR when TP binds at any batch."""
    need = self.critical_batches()
    if need[TENSOR] is None:
      return None, TENSOR
    axis = max(need, key=need.get)
    return (need[axis], axis) if need[axis] > 0 else (0.0, "none")


def block_costs(c: Composition, w_x: float, w_y: float, data: int = 1, w_d: float = 1.0, params: int | None = None,
                hops: dict[str, float] | None = None) -> BlockCosts:
  """BlockCosts of one block (or, with `params` = embed_params and no TP traffic, the embeddings) on c.mesh
  (fsdp X, tensor Y) with `data` HSDP replicas, at the given per-axis bandwidths (and latency hops per axis,
  default n / 2)."""
  m, mesh, hw = c.model, c.mesh, c.hardware
  x, y = mesh.fsdp, mesh.tensor
  hops = hops or {}
  w_bytes, a_bytes = comm_bytes(c)
  p_l = layer_params(m) if params is None else params
  shard = block_shard_params(m, y) if params is None else params / y    # W[D, F_Y] elements after the gather
  sublayers = 0 if params is not None else 1 if m.kind == "ffn" else 2
  return BlockCosts(
      math=2 * p_l / hw.peak_flops,
      fsdp=collective_time(w_bytes * shard, x, w_x, hw.hop_latency_s, hops.get(FSDP)),
      tensor_per_token=2 * sublayers * a_bytes * m.d_model * (y - 1) / w_y if y > 1 else 0.0,
      tensor_floor=2 * sublayers * hw.hop_latency_s * hops.get(TENSOR, y / 2) if y > 1 else 0.0,
      data=2 * collective_time(w_bytes * shard / x, data, w_d, hw.hop_latency_s, hops.get(DATA)),
      fsdp_bwd_passes=2 if c.schedule.reshard_after_forward else 1)


def comm_bytes(c: Composition) -> tuple[int, int]:
  """(bytes per weight element gathered / gradient reduced, bytes per activation element moved by TP)."""
  cb = dtype_bytes(c.precision.compute_dtype)
  wb = dtype_bytes(c.precision.param_dtype) if c.schedule.gather_dtype == "param" else cb
  return wb, cb


# ---------------------------------------------------------------------------------------- batch window of a mesh

def at_tokens(c: Composition, tokens: float):
  """c with a global batch of `tokens` (0 too: train.global_batch_tokens=0 alone would mean batch_size x L)."""
  return c.replace(train={"global_batch_tokens": tokens, "batch_size": 0})


def at_sequences(c: Composition, seqs: float):
  """c with `seqs` sequences on every batch shard (data x fsdp, as its layout splits the batch)."""
  return at_tokens(c, seqs * c.split("batch") * c.model.seq_len)


def memory_affine(c: Composition) -> tuple[float, float]:
  """(fixed bytes per device, bytes per sequence of a batch shard): the line through memory_model.breakdown at
  one and two sequences per shard at the configured schedule, as a line through compiled peaks is drawn
  (calibrated_batch_window). The model's peak is the larger of two lines (the logits, or the gradients being
  made) in one pass: batch_window searches the model itself."""
  one, two = (MM.breakdown(at_sequences(c, s))["total"] for s in (1, 2))
  return 2 * one - two, two - one


def batch_window(c: Composition, affine: tuple[float, float] | None = None) -> dict[str, float]:
  """The largest batch that fits in HBM on c.mesh: whole sequences per fsdp shard, a multiple of
  schedule.microbatches, by memory_model.breakdown (or, given `affine`, the line fixed + per_sequence * s).
  max_batch_per_device_tokens = sequences * L / Y (B / N, the book's per-device batch); 0 when not one sequence
  per shard fits. `..._tokens_unrounded`: the same limit in tokens, as the book counts a batch (interpolated
  between the last whole sequence that fits and the next; a shard holding part of a sequence needs sequence
  sharding, which shardlab does not do)."""
  m, mesh, mb, hbm = c.model, c.mesh, max(1, c.schedule.microbatches), c.hardware.hbm_bytes
  fixed, per_seq = affine or memory_affine(c)
  total = ((lambda s: fixed + s * per_seq) if affine else (lambda s: MM.breakdown(at_sequences(c, s))["total"]))
  whole = _last_fitting(total, hbm, 1)                 # memory grows with the batch: the boundary by bisection
  seqs = whole - whole % mb
  step = total(whole + 1) - total(whole)
  unrounded = whole + (hbm - total(whole)) / step if whole or total(0) <= hbm else 0.0
  return {"max_batch_per_device_tokens": seqs * m.seq_len / mesh.tensor,
          "max_batch_per_device_tokens_unrounded": max(0.0, unrounded) * m.seq_len / mesh.tensor if step > 0 else 0.0,
          "max_sequences_per_fsdp_shard": seqs,
          "max_global_batch_tokens": seqs * mesh.fsdp * m.seq_len, "fixed_bytes": fixed,
          "bytes_per_local_sequence": per_seq}


def _last_fitting(total, budget: float, lo: int) -> int:
  """The largest s >= 0 with total(s) <= budget (0 when total(lo) does not fit); total grows with s."""
  if total(lo) > budget:
    return 0
  hi = 2 * lo
  while total(hi) <= budget:
    lo, hi = hi, 2 * hi
    if hi > 1 << 40:
      return lo
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
  return lo


def calibrated_batch_window(c: Composition, peaks: dict[int, float]) -> dict[str, float]:
  """batch_window from measured memory instead of the analytic model: `peaks` maps sequences per fsdp shard to
  the compiled peak bytes per device (`compiled.memory_analysis()`, two or more batch sizes); the least-squares
  line through them gives the fixed and per-sequence bytes. How a compile confirms the window."""
  if len(peaks) < 2:
    raise ValueError("calibrated_batch_window needs compiled peaks at two or more batch sizes")
  xs, ys = list(peaks), list(peaks.values())
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
  return batch_window(c, (my - slope * mx, slope))


def microbatches_to_fit(c: Composition) -> int | None:
  """Fewest microbatches (dividing each fsdp shard's sequences) with which the configured global batch fits in
  HBM; None when even one sequence at a time does not (or a shard holds less than one whole sequence and does
  not fit)."""
  local = c.global_tokens / c.mesh.fsdp / c.model.seq_len
  whole = local >= 1 and local == int(local)
  for k in (_divisors(int(local)) if whole else [1]):
    if MM.breakdown(c.replace(schedule={"microbatches": k}))["total"] <= c.hardware.hbm_bytes:
      return k
  return None


# ----------------------------------------------------------------------------------------------- layout search

def _divisors(n: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


def _factorizations(n: int):
  """Every (data, fsdp, tensor) with data * fsdp * tensor = n."""
  for data in _divisors(n):
    for fsdp in _divisors(n // data):
      yield data, fsdp, n // data // fsdp


def _sharding_problems(c: Composition, shape: dict) -> list[str]:
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
  """
  m, hw, hbm = c.model, c.hardware, c.hardware.hbm_bytes
  tokens = c.global_tokens
  b = tokens / (data * fsdp * tensor)
  sub = c.replace(mesh={FSDP: fsdp, TENSOR: tensor, "fsdp_ici_axes": ici_axes[FSDP],
                         "tensor_ici_axes": ici_axes[TENSOR]}, train={"global_batch_tokens": tokens / data})
  args = (bandwidth[FSDP], bandwidth[TENSOR], data, bandwidth[DATA])
  block, embed = block_costs(sub, *args, hops=hops), block_costs(sub, *args, params=embed_params(m), hops=hops)
  k = max(1, c.schedule.microbatches)
  step = (m.n_layers * block.step(b, k) + embed.step(b, k)) / c.train.mfu
  ratios = block.comm_to_math(b / k)         # per microbatch: what one pass's communication hides behind
  mem = MM.breakdown(sub)
  state = mem["master_params"] + mem["grads"] + mem["optimizer"]
  critical, binding = block.critical_batch()

  why = _sharding_problems(c, shape_of({DATA: data, FSDP: fsdp, TENSOR: tensor}))
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
  for data, fsdp, tensor in _factorizations(n // pipeline):
    sizes = [tensor, fsdp, data] + ([pipeline] if pipeline > 1 else [])    # innermost first
    placed = torus_axes(sizes, dims) if dims is not None else None
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


def _rank(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
  return _rank([_evaluate_placed(c, p) for p in placements(c, devices, torus)])


# Remat policies from the least recomputation to the most (activation_elements_per_token: the most saved first).
REMAT_BY_RECOMPUTE = ("none", "save_matmuls_attn_out", "save_matmuls", "save_qkv_attn_out", "save_qkv_proj", "full")

CHOICE = ("each layout runs at the remat policy and microbatch count that fit its memory with the shortest predicted "
          "step time (a microbatch gathers the weights again; recomputation is not charged: train.mfu absorbs it, "
          "as in the book); at equal times the least recomputation (none, save_matmuls_attn_out, save_matmuls, "
          "save_qkv_attn_out, save_qkv_proj, full), then the fewest microbatches. Nothing fits: the setting with "
          "the least memory")


def _choose(c: Composition, place: tuple, remats: tuple[str, ...], microbatches: int | None) -> dict[str, Any]:
  """The layout `place` at its best (remat, microbatches) by CHOICE: for each policy the fewest microbatches (a
  divisor of each batch shard's sequences, or `microbatches` when given) that fit; the fastest of those."""
  data, fsdp, tensor = place[:3]
  tokens = c.global_tokens
  sub = c.replace(mesh={FSDP: fsdp, TENSOR: tensor}, train={"global_batch_tokens": tokens / data})
  local = tokens / (data * fsdp) / c.model.seq_len
  counts = [microbatches] if microbatches else _divisors(int(local)) if local >= 1 and local == int(local) else [1]
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


# ------------------------------------------------------------------------------------------ pipeline layouts

PIPELINE_MICROBATCHES = (1, 2, 4, 8)   # M = m P for these m: the microbatch counts a pipeline layout tries


def _schedules() -> tuple[str, ...]:
  return tuple(SCHEDULES)


def pipeline_virtual_stages(name: str) -> int:
  """V the search runs a schedule at: 2 where its table runs several chunks per stage (interleaved), else 1: asked
  of the table (pipeline_tables.chunks_per_stage), not the name."""
  return chunks_per_stage(name)


_TABLES: dict = {}


def pipeline_table(name: str, P: int, M: int, V: int, csv: str = "") -> dict[str, Any]:
  """The schedule's tick table (pipeline_tables.py: table_of, a named schedule's or a torch-format CSV's) and what a
  stage holds by it, cached:
  {"ticks", "split" (W split off), "in_flight" (the most microbatch-chunks of residuals a stage holds, on the
  stage that holds the most: max of pipeline.in_flight, until W when split), "x" and "w" (residual-stream
  blocks and per-layer output-gradient chunks the executor allocates: Plan.buffers)}."""
  key = (name, P, M, V, csv)
  if key not in _TABLES:
    ticks = table_of(name, csv, P, M, V)
    split = any(a.kind == "W" for row in ticks for cell in row for a in cell)
    units = Plan(ticks, M, V).buffers()
    _TABLES[key] = {"ticks": ticks, "split": split, "in_flight": max(in_flight(ticks, "W" if split else "B")),
                    "x": units["x"], "w": units["w"]}
  return _TABLES[key]


def pipeline_shapes(c: Composition, devices: int, microbatches: int | None = None) -> list[tuple[int, str, int, list[int]]]:
  """(P, schedule, V, [M, ...]) the search tries on `devices`: P a divisor of the devices >= 2 with n_layers a
  multiple of P V, every schedule of pipeline.SCHEDULES (V = 2 for interleaved, else 1), M = P, 2P, 4P, 8P (or
  `microbatches`) that the schedule accepts (check_shape: interleaved needs M a multiple of P) and that leave each
  microbatch a whole number (>= 1) of sequences on each batch shard of the smallest data x fsdp (1): the per-
  layout limit is applied in `_choose_pipeline`."""
  from shardlab.errors import ConfigError
  out = []
  for P in _divisors(devices):
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
                    tokens: float | None = None, V: int | None = None, csv: str = "") -> dict[str, float]:
  """Bytes per device on a pipeline stage: memory_model.breakdown of c on P stages by the named schedule (V =
  pipeline_virtual_stages, or V; `csv`: a CSV table's) at M microbatches, each stage a data x fsdp x tensor mesh, at `tokens` (default
  c's global batch): the stage's n_layers / P layers of state and gathered weights, the embeddings every
  stage holds, and the activations the executor allocates from the schedule's table (in-flight microbatch-chunks
  of residuals, residual-stream blocks, a split weight gradient's output gradients, one microbatch's logits)."""
  tokens = c.global_tokens if tokens is None else tokens
  stage = c.replace(mesh={PIPELINE: P, FSDP: fsdp, TENSOR: tensor, DATA: 1},
                   pipeline={"name": name, "impl": name, "microbatches": M, "table": csv,
                             "virtual_stages": V or pipeline_virtual_stages(name)}, schedule={"microbatches": 1})
  return MM.breakdown(at_tokens(stage, tokens / data))


def evaluate_pipeline(c: Composition, place: tuple, P: int, name: str, M: int, V: int | None = None,
                      csv: str = "") -> dict[str, Any]:
  """One pipeline layout: P stages by the named schedule (V = pipeline_virtual_stages, or V; `csv`: the table
  of a torch-format CSV) at M microbatches, each
  stage a data x fsdp x tensor mesh of `place` (placements(..., pipeline=P)), at c's remat. The same row as
  evaluate_layout's, with pipeline, schedule, virtual_stages, bubble (and the slot times the replay took).

  Slot times (per microbatch and chunk of k = n_layers / (P V) layers, at the microbatch's per-device tokens b = B /
  (data fsdp tensor M): each stage's devices run every microbatch): F = k BlockCosts.forward(b) (a stage's weights
  gathered in every F and B: pipeline.gather=microbatch), B = k x the backward's roofline (without the data
  AllReduce), or, for a table that splits the weight gradient off, B = k max(math b, re-gather, tensor) and W = k
  max(math b, reduce-scatter); the head (the unembedding's forward and backward matmuls, 3 x 2 vocab d_model b / C:
  b is per device) in the F slot, as the last stage runs it and its neighbours wait for it in lockstep
  (pipeline_cost.predict does the same), spread over the V chunks' forwards (only the last virtual stage's runs it:
  an approximation for V > 1, since replay takes one F time). send = one microbatch's residual stream per device (B
  / (data fsdp M) tokens x d_model x compute bytes, / tensor when sequence-parallel) over the pipeline axis's
  bandwidth, at least one hop's latency. Step = replay(build(...), F, B, W, send, sync=True) (the executor's
  neighbour-synchronised ticks) + the data AllReduce of the stage's gradients beyond its last B + the embeddings'
  gather and reduce-scatter (once per step), / train.mfu. All predictions."""
  data, fsdp, tensor, bws, axes, hops, untiled = place
  m, hw, hbm = c.model, c.hardware, c.hardware.hbm_bytes
  V = V or pipeline_virtual_stages(name)
  tab = pipeline_table(name, P, M, V, csv)
  tokens = c.global_tokens
  n = P * data * fsdp * tensor
  b = tokens / (data * fsdp * tensor) / M    # per-device tokens of one microbatch (every stage runs all of it)
  k = m.n_layers // (P * V)
  sub = c.replace(mesh={FSDP: fsdp, TENSOR: tensor, "fsdp_ici_axes": axes[FSDP],
                         "tensor_ici_axes": axes[TENSOR]}, train={"global_batch_tokens": tokens / data})
  args = (bws[FSDP], bws[TENSOR], data, bws[DATA])
  block, embed = block_costs(sub, *args, hops=hops), block_costs(sub, *args, params=embed_params(m), hops=hops)
  head = 0.0 if m.kind == "ffn" else 3 * 2 * m.vocab_size * m.d_model * b / hw.peak_flops
  t_f = k * block.forward(b) + head / V
  regather = block.fsdp if c.schedule.reshard_after_forward else 0.0
  if tab["split"]:
    t_b = k * max(block.math * b, regather, block.tensor_time(b))
    t_w = k * max(block.math * b, block.fsdp)
  else:
    t_b, t_w = k * max(2 * block.math * b, block.fsdp_bwd_passes * block.fsdp, block.tensor_time(b)), 0.0
  cb = dtype_bytes(c.precision.compute_dtype)
  tp = c.tp                 # a sequence-parallel contraction sends 1/tensor of the residual stream
  send_bytes = tokens / (data * fsdp * M) * m.d_model * cb / (tensor if tp.seq_sharded else 1)
  t_send = max(send_bytes / bws[PIPELINE], hw.hop_latency_s)
  run = replay(tab["ticks"], t_f, t_b, t_w, t_send, sync=True)
  tail = max(0.0, m.n_layers // P * block.data - t_b)     # the data AllReduce behind the stage's last backward
  once = 2 * embed.fsdp                                   # embeddings: gathered, reduce-scattered once per step
  step = (run["step_s"] + tail + once) / c.train.mfu

  ratios = block.comm_to_math(b)
  mem = pipeline_memory(c, data, fsdp, tensor, P, name, M, V=V, csv=csv)
  state = mem["master_params"] + mem["grads"] + mem["optimizer"]
  critical, binding = block.critical_batch()
  why = _sharding_problems(c, shape_of({PIPELINE: P, DATA: data, FSDP: fsdp, TENSOR: tensor}))
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
      PIPELINE: P, "schedule": name, "virtual_stages": V, "bubble": run["bubble"],
      "bubble_closed_form": None if csv else closed_form_bubble(name, P, M, V), "in_flight": tab["in_flight"],
      "stage_layers": m.n_layers // P, "activations_per_device_bytes": mem["activations"],
      "slot_s": {"F": t_f, "B": t_b, "W": t_w, "send": t_send},
      "pipeline_step_s": run["step_s"] / c.train.mfu,
  }


def _choose_pipeline(c: Composition, place: tuple, P: int, name: str, counts: list[int],
                     remats: tuple[str, ...], V: int | None = None, csv: str = "") -> dict[str, Any] | None:
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
                              csv=csv)["total"]
      least = min(least, (total, (remat, M)), key=lambda t: t[0])
      if total <= c.hardware.hbm_bytes:
        fitting.append((remat, M))
        break
  if not fitting:
    fitting = [least[1]]
  evaluated = [evaluate_pipeline(c.replace(schedule={"remat": r}), place, P, name, M, V, csv)
               for r, M in fitting]
  return min(evaluated, key=lambda l: (float(f"{l['step_time_s']:.6g}"), REMAT_BY_RECOMPUTE.index(l["remat"]),
                                       l["microbatches"]))


def given_pipeline(c: Composition) -> dict[str, Any] | None:
  """The pipeline of c as configured (mesh.pipeline = P > 1 with pipeline=NAME or pipeline.table=PATH.csv):
  evaluate_pipeline's row on its data x fsdp x tensor stages at c's remat, its V, and its M, or (M = 0 and no
  CSV) the M of P, 2P, 4P, 8P that fits and is fastest (_choose_pipeline); where nothing fits, "fits_with" names
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
      check_shape(pipe.impl, P, m * P, V)
      counts.append(m * P)
    except ConfigError:
      continue
  shape = (c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
  place = next(p for p in placements(c, c.mesh.n_devices, pipeline=P) if tuple(p[:3]) == shape)
  row = _choose_pipeline(c, place, P, pipe.impl, counts, (c.schedule.remat,), V, pipe.table)
  if row is not None and not row["fits"]:     # what would fit: more recomputation, another M
    other = _choose_pipeline(c, place, P, pipe.impl, counts, REMAT_BY_RECOMPUTE, V, pipe.table)
    if other["fits"]:
      row["fits_with"] = {"schedule.remat": other["remat"], "pipeline.microbatches": other["microbatches"]}
  return row


def pipeline_layouts(c: Composition, devices: int | None = None, torus: tuple[int, ...] | None = None,
                     remats: tuple[str, ...] = REMAT_BY_RECOMPUTE, microbatches: int | None = None) -> list[dict]:
  """Every pipeline layout of `devices` (pipeline_shapes x placements(..., pipeline=P)) at its best remat and M
  (_choose_pipeline), unranked."""
  n = devices or c.mesh.n_devices
  out = []
  for P, name, V, counts in pipeline_shapes(c, n, microbatches):
    for place in placements(c, n, torus, pipeline=P):
      row = _choose_pipeline(c, place, P, name, counts, remats)
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
  for P in (p for p in _divisors(devices) if p >= 2):
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
  stages = [P for P in _divisors(devices) if P >= 2]
  if not stages:
    return (f"{devices} device: a pipeline needs at least 2 stages of one device each; search more devices "
            "(devices=N, N >= 2)")
  layers = c.model.n_layers
  if not pipeline_stage_counts(c, devices)["tried"]:
    unit = next((d for d in _divisors(layers) if d >= 2), None)        # None: one layer splits no way
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
    return _pipeline_batch_range(c, layout)
  low = None if crit is None else max(1, math.ceil(crit * n / (shards * L) - 1e-9)) * shards * L
  replica = c.replace(mesh={FSDP: layout[FSDP], TENSOR: layout[TENSOR]},
                     schedule={"remat": layout["remat"], "microbatches": 1},
                     train={"global_batch_tokens": c.global_tokens / layout[DATA]})
  high = batch_window(replica)["max_global_batch_tokens"] * layout[DATA]
  return {"compute_bound_from_tokens": low, "fits_per_pass_tokens": high,
          "compute_bound_from_sequences": None if low is None else low // L, "fits_per_pass_sequences": high // L,
          "configured_tokens": c.global_tokens, "remat": layout["remat"], "microbatches": layout["microbatches"]}


def _pipeline_batch_range(c: Composition, layout: dict[str, Any]) -> dict[str, Any]:
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
  seqs = _last_fitting(lambda s: mem(s * unit), c.hardware.hbm_bytes, 1)
  return {"compute_bound_from_tokens": low, "fits_per_pass_tokens": seqs * unit,
          "compute_bound_from_sequences": None if low is None else low // L,
          "fits_per_pass_sequences": seqs * unit // L,
          "configured_tokens": c.global_tokens, "remat": layout["remat"], "microbatches": M,
          PIPELINE: P, "schedule": layout["schedule"]}


def answer(c: Composition, devices: int | None = None, torus: tuple[int, ...] | None = None,
           remat: str | None = None, microbatches: int | None = None, pipeline: bool = False) -> dict[str, Any]:
  """Which layout and which batch for c's model, hardware and global batch on `devices`: every data x fsdp x
  tensor layout (placements), each at its best remat and microbatches (CHOICE; `remat` / `microbatches` fix
  them), ranked (RANKING), with the best layout's batch range (batch_range). pipeline=True: the pipeline
  layouts too (pipeline_layouts: P stages x a schedule x M microbatches x data x fsdp x tensor; `microbatches`
  fixes their M), ranked with the others."""
  remats = (remat,) if remat else REMAT_BY_RECOMPUTE
  layouts = [_choose(c, p, remats, microbatches) for p in placements(c, devices, torus)]
  if pipeline:
    layouts += pipeline_layouts(c, devices, torus, remats, microbatches)
  layouts = _rank(layouts)
  n = devices or c.mesh.n_devices
  out = {"devices": n, "considered": len(layouts), "qualifying": sum(not l["rejected_because"] for l in layouts),
         "global_batch_tokens": c.global_tokens, "choice": CHOICE, "ranking": RANKING,
         "batch_window": batch_range(c, layouts[0]), "layouts": layouts}
  if pipeline:
    out[PIPELINE] = pipeline_search_summary(c, n, layouts, microbatches)
  return out


def pipeline_search_summary(c: Composition, devices: int, layouts: list[dict], microbatches: int | None = None) -> dict:
  """answer's `pipeline` with pipeline=True: the stage counts tried and those excluded with why, how many pipeline
  layouts were costed, and `none_because`: why none was (why_no_pipeline), or None."""
  stages = pipeline_stage_counts(c, devices)
  n = sum(PIPELINE in l for l in layouts)
  none = None if n else (why_no_pipeline(c, devices, microbatches)
                         or "no stage mesh leaves each microbatch whole sequences")
  return {"stages_tried": stages["tried"], "stages_excluded": stages["excluded"], "layouts": n, "none_because": none}


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
  if not 0 < t.mfu <= 1:
    raise ValueError(f"train.mfu={t.mfu} must be in (0, 1]")
  if c.global_tokens <= 0:
    raise ValueError("the global batch must hold at least one token (train.global_batch_tokens or batch_size)")
  if hw.peak_flops <= 0 or hw.ici_bandwidth <= 0 or hw.hbm_bytes <= 0:
    raise ValueError("hardware.peak_flops, ici_bandwidth and hbm_bytes must be > 0")
  if c.schedule.gather_dtype not in ("param", "compute"):
    raise ValueError(f"schedule.gather_dtype={c.schedule.gather_dtype!r} must be param or compute")


def fsdp_tensor_bandwidth(c: Composition) -> tuple[float, float]:
  """(bytes/s of the fsdp axis, of the tensor axis) of c.mesh (mesh_links): on a GPU preset an axis that
  crosses nodes gets the nodes' NICs, the same placement the search and the cost model use."""
  bws = mesh_links(c)[1]
  return bws.get(FSDP, c.hardware.ici_bandwidth), bws.get(TENSOR, c.hardware.ici_bandwidth)


def this_layout(c: Composition) -> dict[str, Any]:
  """evaluate_layout for c.mesh as configured (data x fsdp x tensor, its *_ici_axes and links: mesh_links)."""
  ici, bws = mesh_links(c)
  return evaluate_layout(c, c.mesh.data, c.mesh.fsdp, c.mesh.tensor, bws, ici)


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
  m_x, m_y = hw.physical_axes(mesh.fsdp_ici_axes), hw.physical_axes(mesh.tensor_ici_axes)
  w_bytes, a_bytes = comm_bytes(c)

  per_layer = layer_times(c)
  w_x, w_y = fsdp_tensor_bandwidth(c)
  critical, binding = block_costs(c, w_x, w_y).critical_batch()
  window = batch_window(c)
  # The embedding / unembedding are gathered over fsdp like a layer; their TP traffic (logits) is left out.
  emb_fsdp = ((3 if c.schedule.reshard_after_forward else 2) * collective_time(
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
      "mfu": c.train.mfu,
      "step_time_s": step_time(p, tokens, hw.peak_flops, n, c.train.mfu),
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
