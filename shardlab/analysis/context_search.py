"""The context search: a step per context strategy, degree and token placement (the time model, step_model.py,
with each strategy's own attention terms, context_cost.py), and the choice among them for a model, a sequence and
a cluster (`python -m shardlab.plan context_search=true`). Every time here is a MODEL PREDICTION."""
from __future__ import annotations

import math

from shardlab import axes as AX
from shardlab.analysis import closed_forms as PL
from shardlab.analysis.closed_forms import divisors
from shardlab.analysis.context_cost import STRATEGIES, Attn, attn_of, layer_time, own_kernel_skips, strategy_of
from shardlab.analysis.memory_model import dtype_bytes
from shardlab.analysis.links import mesh_links
from shardlab.axes import CONTEXT, FSDP
from shardlab.config import placement_of
from shardlab.composition import Composition
from shardlab.layout import Layout


# ------------------------------------------------------------------------------------------ a step, a choice

def with_context(c: Composition, C: int, strategy: str, balanced: bool | None = None, fsdp: int | None = None,
                 shard_weights: bool = True, ulysses: int | None = None) -> Composition:
  """c with mesh.context=C (and mesh.fsdp=fsdp), context.impl=strategy, load balancing as given (None: kept), the
  Ulysses degree of a strategy that has one (context.ulysses; None: kept) and the hardware's node size where the
  config gives none (context.node_devices: a2a_p2p's groups); `shard_weights`: every weight's embed dim over
  (fsdp, context) as well (torchtitan's dp_shard_cp), so that the training state is split over every device."""
  layout = c.layout
  if shard_weights and C > 1:
    embed = tuple(dict.fromkeys([*layout.rule("embed"), FSDP, CONTEXT]))
    layout = Layout.of({**layout.rules, "embed": embed}, f"{layout.name}+embed_context")
  return c.replace(mesh={AX.CONTEXT: C, **({} if fsdp is None else {AX.FSDP: fsdp})}, layout=layout,
                   context={"impl": strategy, "name": strategy,
                            "load_balance": c.context.load_balance if balanced is None else balanced,
                            "ulysses": c.context.ulysses if ulysses is None else ulysses,
                            "node_devices": c.context.node_devices or c.hardware.domain_devices})


def predict(c: Composition, skips_masked: bool | None = None) -> dict:
  """A prediction of one training step per device for c's mesh and context strategy (c.context.impl,
  load_balance): the layout search's time model (step_model.predict: every kernel at the preset's calibrated
  rates, recomputation, the weights' and TP's exposed communication; each layer's attention and context
  transfers by the strategy's own terms, layer_time), bytes per mesh axis, memory (memory_model.breakdown).
  `skips_masked`: the inner kernel skips masked blocks (None: what the run's kernel does: the strategy's own
  `skips_masked` on a context split, the model's own kernel without one, own_kernel_skips). `exposed_comm_s`
  is the context transfers' part of the step's exposed communication (`step_model` has every axis's). Memory
  adds to the breakdown the scores an attention without a flash kernel holds while it runs
  (attention_transient_bytes)."""
  from shardlab.analysis import memory_model as MM
  m, hw, mesh, s = c.model, c.hardware, c.mesh, c.schedule
  C, T, X = mesh.context, mesh.tensor, mesh.fsdp
  strategy = strategy_of(c.cp) if C > 1 else None
  own = own_kernel_skips(m) if strategy is None else strategy.skips_masked()
  skips = own if skips_masked is None else skips_masked
  e = dtype_bytes(c.precision.compute_dtype)
  k = c.microbatches
  tokens = c.local_tokens                                   # of one microbatch
  a = attn_of(m, tokens // (m.seq_len // C), C, T, e)
  bw = mesh_links(c)[1].get(CONTEXT, hw.ici_bandwidth)
  lt = layer_time(strategy or c.cp, a, hw, bw, c.context.balanced, skips)
  from shardlab.analysis import step_model
  timed = step_model.predict(c, skips_masked=skips)       # the layout search's time model, for every candidate
  exposed = k * m.n_layers * lt.exposed_s
  gb = c.weights.element_bytes(c.precision)
  # the weights' gathers (forward, and a re-gather in backward) and gradient reduce-scatter, per microbatch or
  # (gathered once per step) per step: the weights part's terms
  passes = (1 if c.weights.once_per_step else k) * (2 + c.weights.regathers)
  layer_w = PL.layer_params(m) / T
  over = math.prod(c.sizes[x] for x in c.layout.rule("embed", c.names))    # the axes weights are sharded over
  replicas = C if CONTEXT not in c.layout.rule("embed", c.names) else 1   # gradient all-reduced over context
  mem = MM.breakdown(c)
  transient = attention_transient_bytes(strategy, a, m)
  return {
      "strategy": c.context.impl if C > 1 else "none", AX.CONTEXT: C, AX.FSDP: X, AX.TENSOR: T,
      "load_balance": c.context.load_balance, "remat": s.remat, "microbatches": k,
      "ulysses": c.context.ulysses if C > 1 else 0,
      "weights_over_context": C > 1 and replicas == 1,
      "skips_masked": skips, "tokens_per_device": k * tokens,
      "t_step_s": timed["t_step_s"], "t_matmul_s": timed["t_gemm_s"], "t_attention_s": timed["t_attention_s"],
      "exposed_comm_s": exposed, "context_comm_s": k * m.n_layers * lt.comm_s, "step_model": timed,
      "bytes_per_step": {CONTEXT: k * m.n_layers * (lt.bytes["forward"] + lt.bytes["backward"]),
                         FSDP: passes * m.n_layers * (over - 1) / over * layer_w * gb,
                         f"{CONTEXT} (gradient all-reduce)": 2 * (replicas - 1) / replicas * PL.param_count(m)
                         / (over * T) * 4},
      "bytes_per_layer": lt.bytes, "context_bandwidth": bw,
      "memory_bytes": mem["total"] + transient, "activation_bytes": mem["activations"],
      "attention_transient_bytes": transient, "fits": mem["total"] + transient <= hw.hbm_bytes,
      "note": "model prediction, not a measurement"}


def attention_transient_bytes(strategy, a: Attn, model) -> float:
  """Float32 scores and probabilities one layer's attention holds while it runs, beyond the memory model's
  residuals: the strategy's own `transient_bytes` (all_gather's plain attention [b, H, L/C, L], a plain kernel
  under Ulysses [b, H/C, L, L], the ring's sub-block pair [b, H, n, n]; none for a flash kernel). `strategy`
  None: no context split, the model's own attention ([b, H, L, L] when it is the plain one)."""
  if strategy is None:
    return 2 * 4.0 * a.b * a.H * a.L * a.L if model.attention == "plain" else 0.0
  return strategy_of(strategy, model).transient_bytes(a)


def why_not(c: Composition, C: int, strategy) -> str | None:
  """Why shardlab cannot run `strategy` at context C for c (one line), or None: a sequence that does not cut
  into the chunks, or what the strategy itself says it cannot split (its `why_not`: Ulysses' heads)."""
  m, chunks = c.model, 2 * C if c.context.placement == "zigzag" else C
  if m.seq_len % chunks:
    return f"the sequence ({m.seq_len}) does not cut into {chunks} chunks"
  if C == 1:
    return None
  shape = {**dict(c.mesh.shape), CONTEXT: C}
  return strategy_of(strategy, m, c.layout).why_not(shape)


def ulysses_degrees(c: Composition, C: int, strategy: str) -> tuple[int, ...]:
  """The Ulysses degrees (context.ulysses) to price `strategy` at at context C: what its class offers
  (`ulysses_choices`: usp every divisor of C between 1 and C the heads allow, a2a_p2p its node's; none: nothing
  the ring or Ulysses does not price already); (0,) for a strategy without one, or at C = 1."""
  if C == 1:
    return (0,)
  part = with_context(c, C, strategy, shard_weights=False, ulysses=0).cp
  choices = getattr(part, "ulysses_choices", None)
  if not callable(choices):
    return (0,)
  a = attn_of(c.model, 1, C, c.mesh.tensor)
  return tuple(choices(C, a.H, a.G, a.inside))


def runnable(c: Composition, C: int, strategy: str, balanced: bool, fsdp: int,
             ulysses: int = 0) -> tuple[Composition | None, str]:
  """(the composition of `strategy` at context C over fsdp, or None; why not): the training state split over
  every device (weights over fsdp x context, with_context) where the run's schedule honours that layout, else
  replicated over context; each asked of the schedule the run would build (Composition.why_not_run), so that
  only what the trainer accepts is offered."""
  why = ""
  for shard_weights in (True, False):
    sub = with_context(c, C, strategy, balanced, fsdp, shard_weights, ulysses)
    why = why_not(sub, C, strategy) or sub.why_not_run()
    if not why:
      return sub, ""
  return None, why


def placements(c: Composition, C: int) -> tuple[bool, ...]:
  """The token placements to price at context C: as given (context.load_balance) and the other (contiguous
  chunks, and zigzag where the sequence cuts into 2C); one at C = 1."""
  if C == 1:
    return (c.context.load_balance,)
  return (c.context.load_balance, not c.context.load_balance)


def fitting(c: Composition, skips_masked: bool | None, remats: tuple[str, ...]) -> dict:
  """predict(c) at the least recomputation (of `remats`, in order) and then the fewest microbatches (dividing
  each batch shard's sequences) that fit in HBM: the layout search's choice (layout_search.CHOICE); nothing
  fits: the configured setting's prediction."""
  shard = c.global_tokens / c.split("batch") / c.model.seq_len
  counts = divisors(int(shard)) if shard >= 1 and shard == int(shard) else [1]
  for remat in remats:
    for k in counts:
      p = predict(c.replace(schedule={"remat": remat, "microbatches": k}), skips_masked)
      if p["fits"]:
        return p
  return predict(c, skips_masked)


def choose(c: Composition, devices: int | None = None, degrees: tuple[int, ...] | None = None,
           skips_masked: bool | None = None, strategies: tuple[str, ...] = STRATEGIES,
           remats: tuple[str, ...] | None = None) -> dict:
  """The fastest predicted (strategy, context degree, token placement) that fits in HBM on `devices` (default:
  c's mesh) and that the run accepts (runnable), tensor as configured and fsdp the rest (it must divide the
  batch): {"best", "reason", "candidates", "excluded": {label: why}}. No context split (C = 1) is a candidate
  of its own, priced with the model's own kernel. Each candidate at the least recomputation and the fewest
  microbatches that fit (fitting; `remats`: the policies to try, default the configured one and then every one
  with more recomputation), its `overrides` the settings that run it. MODEL PREDICTIONS."""
  from shardlab.analysis.layout_search import REMAT_BY_RECOMPUTE
  T = c.mesh.tensor
  devices = devices or c.mesh.n_devices
  degrees = degrees or tuple(d for d in range(1, devices // T + 1) if (devices // T) % d == 0)
  if remats is None:
    order = REMAT_BY_RECOMPUTE
    remats = order[order.index(c.schedule.remat):] if c.schedule.remat in order else (c.schedule.remat,)
  cands, excluded, seen = [], {}, set()
  for C in degrees:
    X = devices // (T * C)
    tried = [(s, ulysses_degrees(c, C, s)) for s in (strategies if C > 1 else ("none",))]
    for strategy, _ in [t for t in tried if not t[1]]:
      excluded[f"{strategy} C={C}"] = ("no Ulysses degree between 1 and C that the heads allow (U = 1 is the ring, "
                                       "U = C Ulysses)")
    for strategy, u in [(s, u) for s, us in tried for u in us]:
      for balanced in placements(c, C):
        named = lambda p: ("" if not u else f" U={u}") + ("" if placement_of(p) == "none" else f" {placement_of(p)}")
        label = f"{strategy}{named(balanced)} C={C}" if C > 1 else "no context (C=1)"
        first = f"{strategy}{named(placements(c, C)[0])} C={C}"     # the placement priced first's label
        sub, why = None, f"fsdp {X} does not divide the batch of {c.train.batch_size} sequences"
        if X * T * C == devices and c.train.batch_size % X == 0:
          sub, why = runnable(c, C, c.context.impl if C == 1 else strategy, balanced, X, u)
        if sub is not None:
          p = fitting(sub, skips_masked, remats)
          why = "" if p["fits"] else (f"{p['memory_bytes'] / 1e9:.0f} GB per device does not fit "
                                      f"{c.hardware.hbm_bytes / 1e9:.0f} GB at any remat policy and microbatch count")
        if why:
          if excluded.get(first) != why:          # said once where both placements are out for one reason
            excluded[label] = why
          continue
        same = (strategy, u, C, p["t_step_s"], p["memory_bytes"])     # a placement that changes nothing: one
        if same in seen:
          continue
        seen.add(same)
        cands.append({**p, "label": label, "overrides": overrides(sub, p)})
  if not cands:
    return {"best": None, "reason": "nothing fits: " + "; ".join(f"{k}: {v}" for k, v in excluded.items()),
            "candidates": [], "excluded": excluded}
  cands.sort(key=lambda p: p["t_step_s"])
  return {"best": cands[0], "reason": reason(cands), "candidates": cands, "excluded": excluded}


def overrides(c: Composition, p: dict) -> list[str]:
  """The settings that run candidate `p` (of composition c) with `python -m shardlab`: the mesh, the strategy,
  its placement, the weights' layout rule where they are sharded over context, the remat and microbatches."""
  out = [f"mesh.{AX.CONTEXT}={p[AX.CONTEXT]}", f"mesh.{AX.FSDP}={p[AX.FSDP]}", f"mesh.{AX.TENSOR}={p[AX.TENSOR]}"]
  if p[AX.CONTEXT] > 1:
    out += [f"context.impl={c.context.impl}", f"context.load_balance={str(p['load_balance']).lower()}"]
    if p.get("ulysses"):
      out.append(f"context.ulysses={p['ulysses']}")
    if p["weights_over_context"]:
      out.append(f"layout.rules.embed=[{','.join(c.layout.rule('embed'))}]")
  return out + [f"schedule.remat={p['remat']}", f"schedule.microbatches={p['microbatches']}"]


def reason(cands: list[dict]) -> str:
  """Why the first of `cands` (sorted by predicted step) beats the first of another strategy or degree."""
  best = cands[0]
  differs = lambda p: p["strategy"] != best["strategy"] or p[AX.CONTEXT] != best[AX.CONTEXT]
  same = lambda p: abs(p["t_step_s"] - best["t_step_s"]) <= 1e-3 * best["t_step_s"]
  ties = [p["label"] for p in cands[1:] if differs(p) and same(p)]     # a2a_p2p in one node is Ulysses, say
  other = next((p for p in cands[1:] if differs(p) and not same(p)), None)
  tied = f" ({', '.join(ties)}: the same predicted step)" if ties else ""
  say = lambda p: (f"{p['label']}: predicted step {p['t_step_s'] * 1e3:.0f} ms (attention {p['t_attention_s'] * 1e3:.0f}, "
                   f"exposed context comm {p['exposed_comm_s'] * 1e3:.0f}; {p['bytes_per_layer']['forward'] / 1e6:.1f} MB"
                   f" per layer forward over context)")
  if other is None:
    return say(best) + tied + ("; the only candidate" if not ties else "")
  gain = other["t_step_s"] / best["t_step_s"] - 1
  pct = f"{gain:.1%}" if gain < 0.01 else f"{gain:.0%}"      # under 1%: one decimal, not "0% faster"
  return (f"{say(best)}{tied}, {pct} faster than {say(other)}; "
          f"memory {best['memory_bytes'] / 1e9:.0f} GB vs {other['memory_bytes'] / 1e9:.0f} GB per device")
