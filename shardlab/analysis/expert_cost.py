"""The planner's expert search (`python -m shardlab.plan expert_search=true`): which dispatcher, expert-parallel
degree and capacity for a mixture of experts on N devices, and why. Every figure is a MODEL PREDICTION.

A candidate is a dispatcher (schedules/expert.py) on a mesh of expert = n, fsdp = N / n (tensor 1), priced by the
dispatcher's own cost terms at a `Route` (never by its name):
  experts    its `expert_rows` x 3 SwiGLU matmuls x 2 D F_e FLOPs, forward and backward (x 3), at the preset's GEMM
             rate; a grouped GEMM on a CUDA target runs densely over the local experts (XLA's rewrite of
             jax.lax.ragged_dot, measured on an H200: experiments/moe/README.md); elsewhere over its groups' rows
             (an assumption: not measured)
  dispatch   its `expected_bytes` (bytes_per_layer under balanced routing), forward and backward, over the
             links the expert axis rides (inside a node
             while n <= devices per host, else the slower of that and the data-centre network; hierarchical's outer
             step across nodes, its inner inside), exposed (the tokens wait for it)
  fsdp       each device's E / n experts and the layer's other weights gathered over fsdp in forward and again
             in backward, their gradients reduce-scattered, in the weights part's dtype (schedule.gather_dtype)
             over the fsdp axis's links (links.mesh_links, as every cost model): exposed beyond the layer's
             compute (prefetch hides the rest)
  the rest   attention, norms and the dense layers: 6 x their parameters x tokens at the GEMM rate (the same for
             every candidate)
  memory     16 B per parameter over its shards (experts over every device, the rest over fsdp only) and the
             dispatcher's `buffer_bytes`; activations are left out (the same for every candidate)
Left out: the all-reduce over `expert` of the other weights' gradient shards, expert.chunks and microbatches
(per-chunk capacity), tensor parallelism, and routing imbalance (every candidate is priced balanced).
"""
from __future__ import annotations

from shardlab import axes as X
from shardlab import params as PM
from shardlab.analysis.links import mesh_links
from shardlab.composition import Composition
from shardlab.config import ExpertConfig
from shardlab.layout import Layout
from shardlab.schedules import expert as EP

CANDIDATES = (("all_to_all", 1.25), ("all_to_all", 0.0), ("hierarchical", 1.25), ("all_gather", 0.0),
              ("ragged", 0.0))


def _bandwidth(hw, spans_nodes: bool) -> float:
  inside = hw.ici_bandwidth * (hw.link_efficiency or 1.0)
  return min(inside, hw.dcn_bandwidth) if spans_nodes and hw.dcn_bandwidth else inside


def candidate(comp: Composition, N: int, name: str, cf: float, n: int) -> dict:
  """One dispatcher on expert n x fsdp N / n: the predicted step and its parts, or {"why": ...} if it cannot run."""
  m, hw = comp.model, comp.hardware
  label = f"{name}{f' cf {cf:g}' if cf else ''}, EP {n}"
  d = EP.DISPATCHERS[name](m, Layout(), ExpertConfig(name=name, impl=name, capacity_factor=cf))
  d.platform = {"cuda": "gpu", "tpu": "tpu"}.get(hw.target_platform, "cpu")
  dph = hw.devices_per_host or N
  split = ()
  if getattr(d, "levels", 1) == 2:
    if n <= dph or n % dph:
      return {"label": label, "why": f"two levels need the experts across nodes: EP {n} fits in one host of {dph}"}
    split = (n // dph, dph)
  e = 2 if "16" in comp.precision.compute_dtype else 4
  tokens = comp.global_tokens / N
  r = EP.Route(T=int(tokens), k=m.top_k, E=m.n_experts, N=n, D=m.d_model, e=e, split=split)
  L, F = m.n_layers, m.expert_ff
  rate = hw.gemm_rate(comp.precision.compute_dtype) if hasattr(hw, "gemm_rate") else hw.peak_flops
  dense = hw.target_platform == "cuda"
  t_experts = L * 3 * d.expert_rows(r, dense) * 3 * 2 * m.d_model * F / rate
  expert_params = L * m.n_experts * 3 * m.d_model * F
  active = PM.count_active(m)
  t_rest = 6 * (active - L * m.top_k * 3 * m.d_model * F) * tokens / rate
  if split:
    b = {"forward": 0, "backward": 0}
    t_dispatch = 0.0
    for size, across in ((split[0], True), (split[1], False)):
      one = d.expected_bytes(EP.Route(r.T, r.k, r.E, n, r.D, r.e, split=(size,)))
      b = {k: b[k] + one[k] for k in b}
      t_dispatch += L * (one["forward"] + one["backward"]) / _bandwidth(hw, across)
  else:
    b = d.expected_bytes(r)
    t_dispatch = L * (b["forward"] + b["backward"]) / _bandwidth(hw, n > dph)
  f = N // n
  dense_params = PM.count(PM.declare(m)) - expert_params
  layer_dense = (dense_params - 2 * m.vocab_size * m.d_model) / L           # a layer's weights beside its experts
  # gathered in the weights part's dtype (schedule.gather_dtype), over the fsdp axis's links as every other cost
  # model prices them (links.mesh_links: on GPU nodes, the NICs of its members in each node once it spans nodes)
  at = comp.replace(mesh={X.EXPERT: n, X.FSDP: f, X.TENSOR: 1, X.CONTEXT: 1, X.DATA: 1, X.PIPELINE: 1})
  local = (m.n_experts // n * 3 * m.d_model * F + layer_dense) * comp.weights.element_bytes(comp.precision)
  t_fsdp = L * 3 * local * (f - 1) / f / (mesh_links(at)[1][X.FSDP] * (hw.link_efficiency or 1.0))
  compute = t_experts + t_rest
  memory = 16 * (expert_params / N + dense_params / f) + d.buffer_bytes(r)
  out = {"label": label, "dispatcher": name, X.EXPERT: n, X.FSDP: f, "capacity_factor": cf,
         "t_step_s": compute + t_dispatch + max(0.0, t_fsdp - compute), "t_experts_s": t_experts,
         "t_dispatch_s": t_dispatch, "t_fsdp_s": t_fsdp, "t_rest_s": t_rest,
         "dispatch_bytes_per_layer": b, "memory_bytes": memory, "drops": d.drops and cf > 0}
  if memory > hw.hbm_bytes:
    out["why"] = f"{memory / 1e9:.0f} GB per device (weights, optimizer and dispatch buffers) exceeds HBM"
  return out


def choose(comp: Composition, devices: int | None = None) -> dict:
  """Every dispatcher and expert-parallel degree on `devices` (default: the mesh's), fastest predicted first; the
  excluded with why; the reason for the first."""
  m = comp.model
  N = devices or comp.mesh.n_devices
  sequences = comp.global_tokens / m.seq_len
  if sequences != int(sequences) or int(sequences) % N:     # expert x fsdp are the batch's axes (tensor 1)
    return {"devices": N, "best": None, "candidates": [], "excluded": {},
            "reason": f"no candidate runs on these devices: the batch's {sequences:g} sequences do not split into "
                      f"whole sequences over {N} devices (expert x fsdp hold the batch); choose train.batch_size a "
                      f"multiple of {N}"}
  degrees = [n for n in range(1, min(m.n_experts, N) + 1) if m.n_experts % n == 0 and N % n == 0]
  cands, excluded = [], {}
  seen = set()
  for n in degrees:
    for name, cf in CANDIDATES:
      c = candidate(comp, N, name, cf, n)
      if "why" in c:
        excluded[c["label"]] = c["why"]
        continue
      same = (n, c["t_experts_s"], c["t_step_s"])   # EP 1 dispatches nothing: dispatchers that price the same
      if n == 1 and same in seen:                   # local experts the same are one candidate
        continue
      seen.add(same)
      cands.append(c)
  cands.sort(key=lambda c: c["t_step_s"])
  reason = "no candidate runs on these devices" if not cands else _reason(cands)
  return {"devices": N, "best": cands[0]["label"] if cands else None, "reason": reason, "candidates": cands,
          "excluded": excluded}


def _reason(cands: list[dict]) -> str:
  from shardlab.outputs import human_seconds as hs
  best = cands[0]
  say = lambda c: (f"{c['label']}: predicted step {hs(c['t_step_s'])} (experts {hs(c['t_experts_s'])}, dispatch "
                   f"{hs(c['t_dispatch_s'])} exposed, expert weights over fsdp {hs(c['t_fsdp_s'])})")
  if len(cands) == 1:
    return f"{say(best)}; the only candidate"
  # against the best that keeps every token when the best drops some, else the best of another dispatcher
  other = next((c for c in cands[1:] if not c["drops"]), None) if best["drops"] else None
  other = other or next((c for c in cands[1:] if c["dispatcher"] != best["dispatcher"]), cands[1])
  drop = ("; it drops the assignments over its capacity (priced with balanced routing)" if best["drops"] else "")
  return f"{say(best)}, {other['t_step_s'] / best['t_step_s']:.1f}x faster than {say(other)}{drop}"
