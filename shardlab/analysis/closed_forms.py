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
`plan` passes the configured dtypes (the weights part's element_bytes, precision.compute_dtype).

Shapes of the shardlab model (per layer): norm [D], W_q [D,H,K], W_kv [D,2,G,K] (G key/value heads, = H without
grouped-query attention), W_o [H,K,D], norm [D], W_in [D,2,F], W_out [F,D]; plus embed [V,D], final norm [D],
unembed [D,V]. `kind: ffn` is the book's L blocks of
W_in [D,F], W_out [F,D] only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardlab.analysis.links import mesh_links
from shardlab.analysis.memory_model import dtype_bytes
from shardlab.axes import DATA, FSDP, TENSOR
from shardlab.composition import Composition

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
      fsdp_bwd_passes=1 + c.weights.regathers)


def comm_bytes(c: Composition) -> tuple[int, int]:
  """(bytes per weight element gathered / gradient reduced: the weights part's, bytes per activation element moved
  by TP)."""
  return c.weights.element_bytes(c.precision), dtype_bytes(c.precision.compute_dtype)


def fsdp_tensor_bandwidth(c: Composition) -> tuple[float, float]:
  """(bytes/s of the fsdp axis, of the tensor axis) of c.mesh (mesh_links): on a GPU preset an axis that
  crosses nodes gets the nodes' NICs, the same placement the search and the cost model use."""
  bws = mesh_links(c)[1]
  return bws.get(FSDP, c.hardware.ici_bandwidth), bws.get(TENSOR, c.hardware.ici_bandwidth)


def divisors(n: int) -> list[int]:
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return sorted(set(small + [n // d for d in small]))


def factorizations(n: int):
  """Every (data, fsdp, tensor) with data * fsdp * tensor = n."""
  for data in divisors(n):
    for fsdp in divisors(n // data):
      yield data, fsdp, n // data // fsdp
