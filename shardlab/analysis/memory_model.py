"""The one analytic memory per device for the configured schedule: what the planner searches layouts and batch
windows with (analysis/planner.py), what the preflight check holds against HBM, and what every run reports beside
what the compiler reports (`compiled.memory_analysis()`, program.memory): their ratio says how much the compiler
adds (temporaries, copies, fusion buffers) or saves (buffer reuse) against the textbook count.

ZeRO-3 (arXiv:1910.02054): fp32 master weights, fp32 gradients and two fp32 Adam moments are 16 B/param,
sharded over every device (ZeRO-3); the compute-dtype copy, the gathered weights (one layer at prefetch 0, k+1 at
depth k, every layer when they are kept for backward or gathered once per step; the embedding and head gathered
for the forward's lookup and the loss, let go before the layers' backward where the weights part gathers again
for it: `peak`) and the activations come on top.
Local sizes here are exact (from the parameter declarations and the mesh). Activations: with one layer's
residuals read off the traced step (run.lower, schedules.stage.Stage.residual_bytes: the shapes and dtypes AD keeps
on a device), n_layers x the saved set + one layer's set without remat (held while that layer's backward runs);
without a trace (the planner, the preflight check), a per-token estimate
(activation_elements_per_token, below), divided over `tensor` except, under the all-reduce (Megatron)
contraction, the residual stream it keeps whole (`_replicated_per_token`). The loss holds the logits in the
compute dtype and their float32 softmax (then cotangent) where the backward starts: 8 bytes per local logit in
float32, 6 in bfloat16 (the H100 compiler's figure for llama3_8b's 128256-word vocabulary at 8K-32K tokens per
device: 6.1 bytes per logit, experiments/context/README.md).

Context parallelism (mesh.context=C, schedules/context.py) splits every activation's sequence: a device holds
L/C tokens of each of its sequences, so every activation term, the logits' included, is per local token and
falls as 1/C (the traced residuals are the local shapes already). What attention keeps per local token depends on
the strategy: all_gather's plain attention its probabilities against the whole sequence ([B, H, L/C, L]: 2 H L per
local token, as the plain formula counts with T = L), Ulysses the model's own kernel on H/C heads over the whole
sequence (the same per local token as without context), the ring its custom VJP's local q, k, v, output and
log-sum-exp (the blockwise kernel's set). Weights a layout shards over `context` too (`embed -> [fsdp, context]`,
torchtitan's dp_shard_cp) are counted on their shard.

What it leaves out (experiments/validate/README.md measures it against the compilers' `memory_analysis()`: within
10% on every explicit preset, for the transformer and the FFN-only model, with the trace; 20-38% short without it
on a 4x2 mesh): XLA's buffer reuse and fusion (it may keep less than AD saves, or a bfloat16 copy of the logits),
the rings' chunk buffers, the other transients of one layer's backward beyond its weight gradient and the rings'
partial ones (`layer_gradient`), and the GPU compiler's split-K partials: a weight-gradient GEMM with a small
output (below about a million elements, e.g. [512, 1024] per device) is split along its token dimension into
float32 partial products (4 x the output at [512, 1024]); the model presets' weights are far larger.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax

from shardlab import params as PM
from shardlab.composition import Composition
from shardlab.pipeline_tables import Plan, table_of


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(name: str) -> int:
  if name not in DTYPE_BYTES:
    raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}")
  return DTYPE_BYTES[name]


REMAT_POLICIES = ("none", "full", "save_matmuls", "save_qkv_proj", "save_qkv_attn_out", "save_matmuls_attn_out")


def activation_elements_per_token(model, remat: str) -> int:
  """Elements one layer saves for backward, per token, before TP sharding: what JAX's AD keeps for shardlab's
  layer (tests/test_attention.py checks every policy against the residuals of one layer's jax.vjp). An
  estimate of memory still: dtypes differ (norm statistics and softmax are float32) and XLA may fuse.

  Q = H K query features (D where the head width K is D / H; Qwen3's K = 128 makes it 2D), KV = 2 G K
  key/value features (G = model.kv_heads: grouped-query attention); the formulas below write Q as D.
  transformer, remat=none: each RMSNorm its input, normalized and scaled outputs and 2 statistics (3D + 2, twice),
    Q and KV after RoPE, the attention output D and its softmax state S, SwiGLU 6F (gate and up, the sigmoid, the
    SiLU, the product, the down-projection's input) -> 8D + KV + 6F + 4 + S, where S is
    - plain: 2 H T + 2 H (the [B, H, T, T] probabilities, in float32 for the softmax's VJP and in the compute
      dtype for the PV matmul's: the only T^2 terms; the causal mask is an additive bias, which no VJP keeps), and
    - blockwise: H (the log-sum-exp; O(T) memory), dot_product: H (cuDNN flash attention's statistics; on CPU
      XLA's implementation keeps the scores like plain).
  save_matmuls: layer input D and the projections' outputs (Q D, KV, out-proj D, in-proj 2F) -> 3D + KV + 2F.
  save_qkv_proj: layer input D, Q D and KV -> 2D + KV.
  save_qkv_attn_out: save_qkv_proj + the attention output D (+ H for blockwise, its log-sum-exp).
  save_matmuls_attn_out: save_matmuls + the attention output D (+ H for blockwise).
  remat=full: the layer input D only (one layer's full set is recomputed at a time; see `breakdown`).
  ffn: input D and hidden F (the book's "checkpoint after the big matmuls"), D with remat=full.
  """
  d, f = model.d_model, model.d_ff
  if remat not in REMAT_POLICIES:
    raise ValueError(f"unknown schedule.remat {remat!r}; expected {' | '.join(REMAT_POLICIES)}")
  if model.kind == "ffn":
    return d if remat == "full" else d + f
  h = model.n_heads
  hd = getattr(model, "head_dim", 0) or d // h       # a head's width (Qwen3's 128 beside d / h = 64)
  q = h * hd                                         # the queries' and the attention output's features
  kv = 2 * (getattr(model, "n_kv_heads", 0) or h) * hd
  attention = getattr(model, "attention", "plain")
  if attention not in ("plain", "blockwise", "dot_product"):
    raise ValueError(f"unknown model.attention {attention!r}; expected plain | blockwise | dot_product")
  stats = 2 * h * model.seq_len + 2 * h if attention == "plain" else h
  lse = h if attention == "blockwise" else 0        # kept with the attention output (a named residual)
  return {"none": 6 * d + 2 * q + kv + 6 * f + 4 + stats, "save_matmuls": 2 * d + q + kv + 2 * f,
          "save_qkv_proj": d + q + kv, "save_qkv_attn_out": d + 2 * q + kv + lse,
          "save_matmuls_attn_out": 2 * d + 2 * q + kv + 2 * f + lse, "full": d}[remat]


def breakdown(c: Composition, residuals: dict | None = None) -> dict:
  """Bytes per device: master_params, grads, optimizer, compute_params, gathered_weights, activations, total.

  `residuals`: one layer's residual bytes per device from the traced program (schedules.explicit.
  Stage.residual_bytes: `saved` under the remat policy, `unremat` without it; `held`, what a zero-bubble
  B leaves for its W, per layer). With them, activations are exact
  shapes and dtypes: n_layers x saved + one layer's unremat (the layer whose backward runs holds its whole
  set, recomputed or saved, beside its cotangents' first buffers); without them, the per-token estimate (also
  what a GPU target with model.attention=dot_product gets: the trace sees XLA's attention, the GPU runs cuDNN's
  fused kernel, which keeps only its output and log-sum-exp), n_layers x saved, without that layer's set: the
  estimate already lies above the H100 compiler's peaks where the planner is checked against them (llama3_70b on
  64 H100s, remat=full: 66.2 GB against 59.5 compiled, experiments/plan/search_vs_compiled.md), and the set
  would put it 25% above (74.1 GB)."""
  m, s = c.model, c.schedule
  sizes, layout, names = c.sizes, c.layout, c.names
  leaves = _declared(c)                          # (elements, mesh axes, top-level name) of every parameter
  weight = layout.rule("embed", names)           # the axes a layer's weights are gathered over

  def local(d, gathered=False):      # elements of one device's shard (gathered: the embed dim whole)
    n, axes, _ = d
    return n // math.prod(sizes[a] for a in axes if not (gathered and a in weight))

  pb, cb = dtype_bytes(c.precision.param_dtype), dtype_bytes(c.precision.compute_dtype)
  P = c.stages
  layers_here = m.n_layers // P                  # the layers this device stores (its stage's)
  shard = sum(local(d) for d in leaves)
  per_layer = sum(local(d, True) for d in leaves if d[2] == "layers") // layers_here
  layer_shard = sum(local(d) for d in leaves if d[2] == "layers") // layers_here
  top = sum(local(d, True) for d in leaves if d[2] != "layers")
  wp = c.weights                                 # the weights part's terms (schedules/weights.py)
  deferred = wp.once_per_step
  step_gather = P > 1 and c.pipeline.gather == "step"
  live = layers_here if step_gather else wp.live_layers(layers_here)
  gb = wp.element_bytes(c.precision)             # a layer's whole gradient, before its reduction
  tokens = c.local_tokens
  t = c.mesh.tensor
  tp = c.tp
  per_token = activation_elements_per_token(attention_kept(c), s.remat) + _context_kept(c)
  rep = 0 if tp.seq_sharded else _replicated_per_token(m, s.remat)
  traced = "saved" in (residuals or {})
  per_device = lambda per, rep: tokens * ((per - rep) // t + rep) * cb     # elements per token -> bytes per device
  saved = residuals["saved"] if traced else per_device(per_token, rep)
  unremat = residuals["unremat"] if traced else saved
  if P > 1:     # the stage's buffers, as the executor allocates them from the table (pipeline_buffers)
    buf = pipeline_buffers(c)
    x = tokens * m.d_model // (t if t > 1 and tp.seq_sharded else 1) * (4 if m.kind == "ffn" else cb)
    k = m.n_layers // (P * c.pipeline.virtual_stages)
    # what a waiting zero-bubble W holds per layer (Stage.held, traced); untraced, the layer's whole set without
    # remat bounds it (W reads matmul inputs and output gradients, each the size of an activation of that set)
    whole = activation_elements_per_token(attention_kept(c), "none") + _context_kept(c)
    held = (residuals or {}).get("held") or per_device(whole, 0 if tp.seq_sharded else _replicated_per_token(m, "none"))
    # + a B slot's own output: its k layers' held values, made beside the buffer they are then written into
    acts = buf["res"] * k * saved + unremat + buf["x"] * x + (buf["w"] + 1 if buf["w"] else 0) * k * held
  else:
    acts = m.n_layers * saved + unremat if traced else m.n_layers * saved
  acts += moe_layer_bytes(c, tokens // (t if t > 1 and tp.seq_sharded else 1), cb)
  # the logits in the compute dtype and their float32 softmax (the FFN-only model has none: its loss is on
  # [B, L, D])
  logits = tokens * m.vocab_size // t * (cb + 4) if m.kind != "ffn" else 0
  acts += logits
  micro = c.microbatches
  accum = 0 if micro == 1 or P > 1 else (per_layer * m.n_layers + top if deferred else shard) * pb
  out = {
      "master_params": shard * pb,
      # + the accumulator of microbatched gradients; a pipeline accumulates into the gradients themselves, and
      # holds the weights outside its layers' gradients (gathered, compute dtype) and, gathering its layers once
      # per step, their gathered gradients until the step's reduce-scatter
      "grads": shard * pb + accum + (top * cb + (layers_here * per_layer * cb if step_gather else 0) if P > 1 else 0),
      "optimizer": 2 * shard * pb,                                # Adam mu and nu
      "compute_params": shard * wp.cast_bytes(c.precision),     # the cast shard
      "gathered_weights": (live * per_layer + top) * cb,          # + embed/unembed (let go for backward: peak)
      # One layer's whole weight gradient W[D, N_tp], produced by its backward before the reduce-scatter over
      # fsdp takes its shard (in the gather's dtype); deferred reduction holds the stack instead (in grads).
      # A collective-matmul ring's backward makes one partial weight gradient per ring step (in the compute
      # dtype) and XLA fuses their sum, so every partial is live at once: partial_products - 1 more copies.
      # A pipeline slot's backward returns its chunk's k layers of gradient shards at once (the stage unit's
      # stacked dW), which it adds into the gradients.
      "layer_gradient": ((0 if deferred or step_gather else per_layer * gb)
                         + (getattr(tp, "partial_products", lambda t: 1)(t) - 1) * per_layer * cb
                         + (m.n_layers // (P * c.pipeline.virtual_stages) * layer_shard * pb if P > 1 else 0)),
      # The largest weight outside the layers (the embedding or the unembedding, [V, D]): its whole gradient,
      # made in backward before the reduce-scatter over fsdp takes its shard, as a layer's is (layer_gradient).
      "top_gradient": max((local(d, True) for d in leaves if d[2] != "layers"), default=0)
                      * gb,
      "activations": acts,
  }
  # the embedding and the head gathered serve the forward's lookup and the loss; a weights part that gathers again
  # for backward lets them go before the layers' backward (llama3_8b at 8 layers on 4x2 with fsdp_prefetch: the
  # H100 compiler gives the head's float32 gradient their buffer; kept in the estimate, the peak was 13% high)
  gone = top * cb if wp.regathers and not wp.once_per_step and math.prod(sizes[a] for a in weight) > 1 else 0
  out["total"] = peak(out, logits, P == 1 and micro == 1, gone)
  return out


def moe_layer_bytes(c: Composition, tokens: int, cb: int) -> int:
  """What one MoE layer's backward holds beyond its residuals, asked of its dispatcher (schedules/expert.py): the
  expert GEMMs' activations on the rows it holds (gate and up [rows, 2 F_e], their product [rows, F_e]) and their
  cotangents, and its dispatch buffers (buffer_bytes). 0 for a dense model, or a dispatcher without the terms.
  Against the compilers' memory (experiments/moe/README.md): within 8% for every Mixtral-8x7B case on the H100
  targets, for all_to_all and ragged on v5p and for Qwen3-30B-A3B on 8 H100s; 13-15% off for two Qwen3 cases on
  64 H100s, and a third high for all_gather on v5p (libtpu holds less). Each expert's width is counted whole
  (expert tensor parallelism would divide it)."""
  m, d = c.model, c.dispatcher
  if d is None or not (hasattr(d, "rows_held") and hasattr(d, "buffer_bytes")):
    return 0
  from shardlab.schedules import expert as EP
  sizes = c.sizes
  axes = c.layout.rule("experts", c.names)
  r = EP.Route(T=int(tokens), k=m.top_k, E=m.n_experts, N=math.prod(sizes[a] for a in axes), D=m.d_model, e=cb,
               split=tuple(sizes[a] for a in axes) if len(axes) > 1 else ())
  try:
    held = 2 * d.rows_held(r) * 3 * m.expert_ff * cb + d.buffer_bytes(r)
    # XLA's GPU compiler runs a grouped GEMM (jax.lax.ragged_dot) as one dot over its rows expanded per local
    # expert ([rows, E/N, D] and [rows, E/N, F_e]: experiments/moe/README.md); a dispatcher whose expert rows grow
    # when groups run densely holds E/N - 1 more copies of both, and their cotangents, in a CUDA program
    if c.compile_for == "target" and c.hardware.target_platform == "cuda" and \
        d.expert_rows(r, True) > d.expert_rows(r, False):
      held += 2 * d.rows_held(r) * (m.n_experts // r.N - 1) * (m.d_model + m.expert_ff) * cb
  except NotImplementedError:    # a user's Dispatcher subclass that states none of these terms (the base's raise)
    return 0
  return held


def peak(parts: dict, logits: int, one_pass: bool, top_gone: int = 0) -> int:
  """The peak of `parts` (breakdown's). In one forward and backward pass (no pipeline, one microbatch) the
  gradients and a layer's weight gradient do not exist until the backward runs, and the logits and their softmax
  are gone before the layers' backward starts: the peak is the larger of the loss (every residual, the logits)
  and the backward (every residual, the gradients, the larger of a layer's and the top weight's whole
  gradient; without `top_gone`, the gathered embedding and head when the weights part gathers again for
  backward); the H100 compiler gives the layers' stacked float32 gradients the logits' buffer (llama3_8b at 32K
  tokens: experiments/context/README.md). Microbatches and pipeline stages accumulate the gradients through the
  step, so there the logits and the gradients are live at once."""
  state = parts["master_params"] + parts["optimizer"]
  common = parts["compute_params"] + parts["gathered_weights"] + parts["activations"] - logits
  # a layer's whole weight gradient and the top weight's are made at different times of the backward
  backward = parts["grads"] + max(parts["layer_gradient"], parts["top_gradient"])
  if one_pass:
    return state + common + max(logits, backward - top_gone)
  return state + common + logits + backward


def pipeline_buffers(c: Composition) -> dict:
  """What a pipeline stage holds, in units, from the executor's own allocation of its table (schedules/
  pipeline.py: Plan): `res`, microbatch-chunks of residuals (each k layers'
  saved set); `x`, residual-stream blocks of one microbatch (every microbatch's embedding and its input
  gradient, the received activations and output gradients, the two sends); `w`, microbatch-chunks of what
  each layer's B leaves for its split-off weight gradient W (zero-bubble; schedules/stage.py: Stage.held)."""
  P, p = c.stages, c.pipeline
  return _buffers(p.impl, p.table, P, p.count(P), p.virtual_stages, p.consecutive)


@functools.lru_cache(maxsize=None)
def _buffers(impl: str, csv_table: str, P: int, M: int, V: int, consecutive: int = 0) -> dict:
  return Plan(table_of(impl, csv_table, P, M, V, consecutive), M, V).buffers()


def attention_kept(c: Composition):
  """The model as its attention keeps residuals under context parallelism (module doc): the strategy's
  `kept_attention` (a ring keeps the blockwise kernel's set whatever model.attention says)."""
  kept = getattr(c.cp, "kept_attention", None)     # (a strategy that states no cost terms: the model's own)
  if c.mesh.context > 1 and c.model.kind != "ffn" and kept is not None:
    return dataclasses.replace(c.model, attention=kept())
  return c.model


def _context_kept(c: Composition) -> int:
  """Elements per local token per layer the context strategy keeps beyond the remat policy's set (its
  `kept_per_token`: Ulysses' head-sharded attention output under a policy that saves it)."""
  kept = getattr(c.cp, "kept_per_token", None)
  if c.mesh.context > 1 and c.model.kind != "ffn" and kept is not None:
    return kept(c.schedule.remat)
  return 0


def _replicated_per_token(model, remat: str) -> int:
  """Of a layer's saved elements per token (activation_elements_per_token), those of the residual
  stream, which the all-reduce contraction keeps whole on every `tensor` device: the RMSNorms' inputs, outputs
  and statistics (remat=none), the layer input and, when saved, the output projections' results (after the
  all-reduce)."""
  d = model.d_model
  if model.kind == "ffn":
    return d
  return {"none": 6 * d + 4, "save_matmuls": 2 * d, "save_qkv_proj": d, "save_qkv_attn_out": d,
          "save_matmuls_attn_out": 2 * d, "full": d}[remat]


_DECLARED: dict = {}


def _declared(c: Composition) -> list[tuple[int, tuple[str, ...], str]]:
  """(elements, the mesh axes it is sharded over, its top-level name) of every parameter params.declare gives
  c's model on its mesh's axes, kept by what they depend on (the model's fields, the tensor size, the layout,
  the axis names): the planner prices thousands of compositions that differ only in sizes."""
  key = (repr(c.model), c.mesh.tensor, c.layout, c.names)
  if key not in _DECLARED:
    decls = PM.declare(c.model, c.mesh.tensor, c.layout, c.names)
    _DECLARED[key] = [(math.prod(d.shape), d.mesh_axes(), k) for k, v in decls.items() for d in _leaves(v)]
  return _DECLARED[key]


def _leaves(tree) -> list:
  return jax.tree.leaves(tree, is_leaf=PM.is_param)


def compare(c: Composition, compiled: dict, residuals: dict | None = None, gemm_workspace: int = 0) -> dict:
  """{"analytic": breakdown, "compiled_over_analytic": compiled peak / analytic total, "components": per part,
  the analytic and compiled bytes and the error (analytic / compiled - 1)}. The parts a compiler reports:
  `state` (the arguments less the token batch: fp32 weights and Adam moments), `working` (its temporaries:
  gradients, gathered weights, saved activations, the logits) and `peak`. `gemm_workspace`: the scratch the
  program's own GEMM calls declare (`gemm_workspace_bytes`), the compiler's choice, added to the working memory.
  Where the compiler's buffer assignment was read (`compiled["allocated"]`), `allocated`: the total against the
  device memory that assignment holds (on TPU the figure to trust: memory_analysis() reports more than libtpu
  assigns, experiments/predict/README.md)."""
  a = breakdown(c, residuals)
  total = a["total"] + gemm_workspace
  state = a["master_params"] + a["optimizer"]
  seq = c.model.seq_len // c.split("length")
  batch = (2 * c.train.batch_size // c.split("batch") * seq + seq) * 4   # int32 inputs, targets, positions
  parts = {"state": (state, compiled["argument"] - batch), "working": (total - state, compiled["temp"]),
           "peak": (total, compiled["peak"])}
  if compiled.get("allocated"):
    parts["allocated"] = (total, compiled["allocated"]["total"])
  traced = "saved" in (residuals or {})
  return {"analytic": a, "activations_from": "traced residuals" if traced else "per-token estimate",
          "gemm_workspace": gemm_workspace, "compiled_over_analytic": compiled["peak"] / total if total else 0.0,
          "components": {k: {"analytic": an, "compiled": co, "error": an / co - 1 if co else None}
                         for k, (an, co) in parts.items()}}


def gemm_workspace_bytes(hlo_text: str) -> int:
  """The scratch the GPU program's cuBLAS calls declare: the s8 workspace a `__cublas$lt$matmul` custom call
  returns beside its result (4 MiB where the compiler picked a split-K algorithm for a small weight gradient:
  the small transformer under a prefetching schedule, experiments/validate/README.md), summed over the calls (an
  upper bound: the compiler may let calls share one)."""
  return sum(int(n) for n in re.findall(r"= \(\w+\[[\d,]*\]\{[\d,]*\}, s8\[(\d+)\]\{0\}\) custom-call\(", hlo_text))
