"""The search's time model: a candidate's step as the closed-form program its schedule runs, priced kernel by kernel
at the calibrated rates, without a compile. MODEL PREDICTIONS.

For one layer and one microbatch on one device (t tokens of the gathered tensor group; t / Y of them between
sublayers when the TP contraction keeps the residual stream sequence-sharded), the forward's pieces in order:

  norm1  tp_in1  qkv  rope  attention  o  tp_out1  add1  norm2  tp_in2  w_in  act  w_out  tp_out2  add2

each priced as the replay of a compiled program prices its kernel (analysis/calibrated.py), so that a layout's
figure here and its compiled replay (`top=K`) differ by what XLA does that no closed form knows:

  GEMM        calibrated.gemm_seconds: FLOPs at the preset's GEMM rate with wave quantization of its output tiles
              over the compute units (or its bytes at HBM rate); backward: dX and dW, each with its own output
  attention   the context strategy's own layer_time (context_cost.py) at the rate of the kernel that runs
              (cuDNN's, shardlab's Pallas kernel), causal blocks skipped where the kernel skips them
  elementwise norms, RoPE, residual adds, the activation: bytes read and written at HBM rate
  collective  links.transfer_seconds: latency, hop floor, bus bandwidth with its ramp, on the axis's link
  each kernel + kernel_launch_s

What the schedule adds, each from its part (never its name): recomputation of the pieces the remat policy does
not save (RECOMPUTED), the TP collectives exposed or, for a contraction that overlaps them (`point_to_point`:
the ring decomposition), hidden behind the GEMM they feed; the weights part's gathers and gradient
reduce-scatters hidden behind a layer's compute when it prefetches, exposed when it does not; the gradient
all-reduce over `data` behind the last microbatch's backward. Around the layers: the embedding, the unembedding
GEMM and its float32 softmax, the scan's stacks of saved activations, the gradient sums of microbatches, and the
optimizer's update of each device's shard (AdamW: 32 bytes per parameter).

Left out, so that the compiled replay is the judge (`top=K` says how far): XLA's fusion decisions (a compiled
program has more, smaller kernels than these pieces), its own rematerialization, layout copies.
"""
from __future__ import annotations

import math

from shardlab.analysis import context_cost as CC
from shardlab.analysis import memory_model as MM
from shardlab.analysis.calibrated import gemm_seconds
from shardlab.analysis.closed_forms import block_shard_params, embed_params, param_count
from shardlab.analysis.links import mesh_links, transfer_seconds
from shardlab.axes import CONTEXT, DATA, FSDP, TENSOR
from shardlab.composition import Composition

# The forward pieces each remat policy runs again in backward (schedules/stage.py's REMAT: what it saves; JAX
# recomputes what the backward needs of the rest: the last GEMM's output, which no backward reads, never).
_ALL = ("norm1", "tp_in1", "qkv", "rope", "attention", "o", "tp_out1", "add1", "norm2", "tp_in2", "w_in", "act")
RECOMPUTED = {
    "none": (),
    "full": _ALL,
    "save_matmuls": ("norm1", "tp_in1", "rope", "attention", "norm2", "tp_in2", "act"),
    "save_matmuls_attn_out": ("norm1", "tp_in1", "rope", "norm2", "tp_in2", "act"),
    "save_qkv_proj": ("norm1", "tp_in1", "rope", "attention", "o", "tp_out1", "add1", "norm2", "tp_in2", "w_in",
                      "act"),
    "save_qkv_attn_out": ("norm1", "tp_in1", "rope", "o", "tp_out1", "add1", "norm2", "tp_in2", "w_in", "act"),
}
ADAMW_BYTES = 32     # per parameter: read weight, gradient, two moments (4 B each), write weight and moments, and
                     # the gradient read again for its global norm (train.grad_clip)


class _Priced:
  """One pass's kernels of one layer: seconds per piece, and how many kernels."""

  def __init__(self):
    self.compute, self.kernels = {}, 0

  def add(self, piece: str, seconds: float, kernels: int = 1):
    self.compute[piece] = self.compute.get(piece, 0.0) + seconds
    self.kernels += kernels


def _gemms(c: Composition, t: float) -> list[tuple[str, float, float, float]]:
  """(piece, M, K, N) of one layer's forward matmuls on one device: M the gathered tokens, K the contraction."""
  m, Y = c.model, c.mesh.tensor
  D = m.d_model
  if m.kind == "ffn":
    return [("w_in", t, D, m.d_ff / Y), ("w_out", t, m.d_ff / Y, D)]
  H, K = m.n_heads / Y, m.head_dim
  G = m.kv_heads / Y if m.kv_heads % Y == 0 else m.kv_heads
  if m.moe:                   # the tokens' top_k experts and the shared ones, as one grouped GEMM
    routed = t * (m.top_k + m.n_shared_experts)
    ffn = [("router", t, D, m.n_experts), ("w_in", routed, D, 2 * m.expert_ff / Y),
           ("w_out", routed, m.expert_ff / Y, D)]
  else:
    ffn = [("w_in", t, D, 2 * m.d_ff / Y), ("w_out", t, m.d_ff / Y, D)]
  return [("qkv", t, D, (H + 2 * G) * K), ("o", t, H * K, D)] + ffn


def _elementwise(c: Composition, t: float, ts: float, e: int) -> dict[str, tuple[float, float]]:
  """{piece: (forward bytes, backward bytes)} of one layer's memory-bound kernels on one device."""
  m, Y = c.model, c.mesh.tensor
  D = m.d_model
  if m.kind == "ffn":
    return {"act": (2 * t * m.d_ff / Y * e, 3 * t * m.d_ff / Y * e)}
  H, K = m.n_heads / Y, m.head_dim
  G = m.kv_heads / Y if m.kv_heads % Y == 0 else m.kv_heads
  f = (m.top_k + m.n_shared_experts) * m.expert_ff if m.moe else m.d_ff
  return {"norm1": (2 * ts * D * e, 3 * ts * D * e), "norm2": (2 * ts * D * e, 3 * ts * D * e),
          "rope": (2 * t * (H + G) * K * e, 2 * t * (H + G) * K * e),
          "add1": (3 * ts * D * e, 3 * ts * D * e), "add2": (3 * ts * D * e, 3 * ts * D * e),
          "act": (3 * t * f / Y * e, 5 * t * f / Y * e)}


def _collectives(hw, sizes: dict, bandwidth: dict, hops: dict | None):
  """seconds(axes, kind, nbytes): one collective of an array of `nbytes` over mesh axes `axes` (a name or a
  tuple: their sizes multiply, the slowest link sets the pace, the hops add up); all-gather, reduce-scatter: the
  ring's (n - 1) / n of it sent per device; all-reduce: twice that, over twice the hops."""
  hops = hops or {}

  def seconds(axes, kind: str, nbytes: float) -> float:
    axes = [a for a in ((axes,) if isinstance(axes, str) else axes) if sizes.get(a, 1) > 1]
    n = math.prod(sizes[a] for a in axes)
    if n <= 1 or nbytes <= 0:
      return 0.0
    twice = 2 if kind == "all-reduce" else 1
    return transfer_seconds(nbytes * (n - 1) / n * twice, min(bandwidth.get(a, hw.ici_bandwidth) for a in axes), hw,
                            sum(hops.get(a, sizes[a] / 2) for a in axes) * twice)
  return seconds


def predict(c: Composition, tokens_per_device: float | None = None, data: int | None = None,
            bandwidth: dict | None = None, hops: dict | None = None, skips_masked: bool | None = None) -> dict:
  """A prediction of one training step on one device of c's mesh (data x fsdp x tensor x context; no pipeline
  stages: pipeline_search prices those from these layers): the module doc's program. `tokens_per_device`: the
  step's tokens per device (default the global batch over every device's share of it), `data`: the replicas
  (default mesh.data), `bandwidth` / `hops`: per mesh axis (default mesh_links: the search passes its
  placement's), `skips_masked`: whether the attention kernel skips the blocks the causal mask hides (None: what
  the run's kernel does, context_search.predict's rule). Returns seconds by kind, the exposed communication per
  axis, MFU and TFLOP/s per device."""
  m, hw, mesh = c.model, c.hardware, c.mesh
  X, Y, C = mesh.fsdp, mesh.tensor, mesh.context
  d = mesh.data if data is None else data
  b = tokens_per_device if tokens_per_device is not None else c.global_tokens / (d * X * Y * C)
  k = max(1, c.microbatches)
  t = b * Y / k                                      # tokens a device's TP group computes per microbatch
  ts = t / Y if c.tp.seq_sharded else t              # between sublayers
  e = MM.dtype_bytes(c.precision.compute_dtype)
  hbm = hw.hbm_bandwidth * hw.hbm_efficiency
  launch = hw.kernel_launch_s
  dtype = c.precision.compute_dtype
  bandwidth = bandwidth or mesh_links(c)[1]
  coll = _collectives(hw, {DATA: d, FSDP: X, TENSOR: Y, CONTEXT: C}, bandwidth, hops)

  fwd, bwd = _Priced(), _Priced()
  for piece, M, K, N in _gemms(c, t):
    fwd.add(piece, gemm_seconds(2 * M * K * N, [M, N], e * (M * K + K * N + M * N), hw, dtype) + launch)
    bwd.add(piece, gemm_seconds(2 * M * K * N, [M, K], e * (M * N + K * N + M * K), hw, dtype)
            + gemm_seconds(2 * M * K * N, [K, N], e * (M * N + M * K) + 4 * K * N, hw, dtype) + 2 * launch, 2)
  for piece, (f_bytes, b_bytes) in _elementwise(c, t, ts, e).items():
    fwd.add(piece, f_bytes / hbm + launch)
    bwd.add(piece, b_bytes / hbm + launch)
  exposed = {CONTEXT: 0.0}
  if m.kind != "ffn":
    seqs = max(1, round(t / (m.seq_len / C)))
    a = CC.attn_of(m, seqs, C, Y, e)
    skips = skips_masked if skips_masked is not None else \
        CC.own_kernel_skips(m) if C == 1 else CC.strategy_of(c.cp).skips_masked()
    lt = CC.layer_time(c.cp, a, hw, bandwidth.get(CONTEXT, hw.ici_bandwidth),
                       c.context.balanced, skips)
    share = 1 / (1 + CC.bwd_over_fwd(CC.runs_pallas(c.cp, a, hw)))    # of the attention, the forward's
    fwd.add("attention", lt.attention_s * share + launch)
    bwd.add("attention", lt.attention_s * (1 - share) + launch)
    if m.attention == "plain" and C == 1:   # the [b, H, L, L] scores and probabilities in float32, each way
      scores = seqs * a.H * m.seq_len * m.seq_len * 4
      fwd.add("attention", 3 * scores / hbm + 2 * launch, 2)
      bwd.add("attention", 4 * scores / hbm + 2 * launch, 2)
    exposed[CONTEXT] = k * m.n_layers * lt.exposed_s
  recomputed = RECOMPUTED[c.schedule.remat]
  window_f = sum(fwd.compute.values())              # a layer's kernels, forward and backward (with recompute)
  window_b = sum(bwd.compute.values()) + sum(fwd.compute.get(p, 0.0) for p in recomputed)

  # TP: every sublayer gathers its input and reduce-scatters its output (all-reduces it, unsharded), each way;
  # a contraction that overlaps them (point_to_point: the ring) hides each behind the GEMM it feeds
  tp_pieces = {"tp_in1": "qkv", "tp_out1": "o", "tp_in2": "w_in", "tp_out2": "w_out"} if m.kind != "ffn" else \
      {"tp_in2": "w_in", "tp_out2": "w_out"}
  act, sharded = t * m.d_model * e, c.tp.seq_sharded
  tp_f = tp_b = 0.0
  for piece, gemm in tp_pieces.items():
    gathers = piece.startswith("tp_in")
    f_kind = ("all-gather" if gathers else "reduce-scatter") if sharded else (None if gathers else "all-reduce")
    b_kind = ("reduce-scatter" if gathers else "all-gather") if sharded else ("all-reduce" if gathers else None)
    hide = getattr(c.tp, "point_to_point", False)
    f = coll(TENSOR, f_kind, act) if f_kind else 0.0
    g = coll(TENSOR, b_kind, act) if b_kind else 0.0
    f = max(0.0, f - fwd.compute.get(gemm, 0.0)) if hide else f
    g = max(0.0, g - bwd.compute.get(gemm, 0.0)) if hide else g
    tp_f += f
    tp_b += g + (f if piece in recomputed else 0.0)
  exposed[TENSOR] = k * m.n_layers * (tp_f + tp_b)

  # the weights part: each layer's shard gathered over the axes the layout shards weights over (forward, and again
  # in backward when it re-gathers), its gradient reduce-scattered, once per microbatch or once per step, and
  # all-reduced over the replicas (data; context where the weights are not sharded over it) once per step. A part
  # that prefetches runs the next layer's behind this one's kernels; one that does not makes the layer wait
  w = c.weights
  wb = w.element_bytes(c.precision)
  sizes = {DATA: d, FSDP: X, TENSOR: Y, CONTEXT: C}
  over = tuple(a for a in c.layout.rule("embed", c.names) if a != TENSOR)
  replicas = (DATA,) + ((CONTEXT,) if CONTEXT not in over else ())
  n_over = math.prod(sizes.get(a, 1) for a in over)
  shard = block_shard_params(m, Y)
  gather, reduce = coll(over, "all-gather", shard * wb), coll(over, "reduce-scatter", shard * wb)
  allreduce = coll(replicas, "all-reduce", shard / n_over * wb)
  passes = 1 if w.once_per_step else k
  hidden = bool(getattr(w, "prefetches", False))     # a part that does not say is priced as one that waits
  x_f = max(0.0, gather - window_f) if hidden else gather
  x_b = max(0.0, w.regathers * gather + reduce - window_b) if hidden else w.regathers * gather + reduce
  x_last = max(0.0, w.regathers * gather + reduce + allreduce - window_b) if hidden else x_b + allreduce
  exposed[FSDP] = m.n_layers * passes * (x_f + x_b)
  exposed[DATA] = m.n_layers * (x_last - x_b)       # what the all-reduce adds to the last backward's wait

  # around the layers: the embedding's gather, the unembedding GEMM (forward, dX, dW) and its float32 softmax, the
  # scan's stacks of saved activations, the microbatches' gradient sums, the optimizer's update of the shard
  V, D = m.vocab_size, m.d_model
  head_gemm = head = 0.0
  if m.kind != "ffn":
    logits = e * (t * D + D * V / Y + t * V / Y)
    head_gemm = (gemm_seconds(2 * t * D * V / Y, [t, V / Y], logits, hw, dtype)
                 + gemm_seconds(2 * t * D * V / Y, [t, D], logits, hw, dtype)
                 + gemm_seconds(2 * t * D * V / Y, [D, V / Y], logits, hw, dtype) + 3 * launch)
    head = head_gemm + t * V / Y * (2 * e + 8) / hbm + ts * D * 3 * e / hbm + 3 * launch
    exposed[FSDP] += passes * (1 + w.regathers) * coll(over, "all-gather", embed_params(m) / Y * wb)
  saved = MM.activation_elements_per_token(MM.attention_kept(c), c.schedule.remat) / Y * t * e
  stacks = 2 * saved / hbm + 2 * launch             # written in forward, read in backward, per layer
  per_device = param_count(m) / (n_over * Y)
  accumulate = (k - 1) * 12 * (param_count(m) / Y if w.once_per_step else per_device) / hbm
  compute = {"layers": k * m.n_layers * (window_f + sum(bwd.compute.values())),
             "recompute": k * m.n_layers * sum(fwd.compute.get(p, 0.0) for p in recomputed),
             "head": k * head, "stacks": k * m.n_layers * stacks, "accumulate": accumulate,
             "optimizer": ADAMW_BYTES * per_device / hbm + 3 * launch * 12}
  shapes = _gemms(c, t)
  gemms = {g[0] for g in shapes}
  gemm_flops = k * (m.n_layers * sum(6 * M * K * N for _, M, K, N in shapes)
                    + (6 * t * D * V / Y if m.kind != "ffn" else 0))
  t_gemm = k * m.n_layers * sum(fwd.compute.get(p, 0.0) + bwd.compute.get(p, 0.0) for p in gemms) + k * head_gemm
  t_attn = k * m.n_layers * (fwd.compute.get("attention", 0.0) + bwd.compute.get("attention", 0.0))
  t_exposed = sum(exposed.values())
  step = sum(compute.values()) + t_exposed
  flops = 6 * param_count(m) * b
  return {"t_step_s": step, "t_gemm_s": t_gemm, "t_attention_s": t_attn, "t_recompute_s": compute["recompute"],
          "t_other_kernels_s": sum(compute.values()) - t_gemm - t_attn - compute["recompute"],
          "t_exposed_comm_s": t_exposed, "exposed_comm_s": exposed,
          "gemm_fraction_of_peak": gemm_flops / (hw.peak_flops * t_gemm) if t_gemm else 0.0,   # shapes, waves
          "kernels_s": compute,          # the layers (forward and backward), recompute, and around them
          "mfu": flops / (hw.peak_flops * step) if step > 0 else 0.0,
          "tflops_per_device": flops / step / 1e12 if step > 0 else 0.0,
          "model": "the search's time model (analysis/step_model.py): a prediction"}


def kernel_efficiency(c: Composition, tokens_per_device: float, data: int = 1, bandwidth: dict | None = None,
                      hops: dict | None = None) -> float:
  """The fraction of peak the time model predicts for c's kernels alone at `tokens_per_device` per pass (one
  microbatch, the exposed communication left out): 6 P b / (C t_kernels). What a roofline that prices the math
  at peak divides by in place of an assumed train.mfu (pipeline_search's slots)."""
  got = predict(c.replace(schedule={"microbatches": 1}), tokens_per_device, data, bandwidth, hops)
  kernels = got["t_step_s"] - got["t_exposed_comm_s"]
  return min(1.0, 6 * param_count(c.model) * tokens_per_device / (c.hardware.peak_flops * kernels))
