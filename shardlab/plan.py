"""Which layout and which batch, predicted without devices: `python -m shardlab.plan`.

  python -m shardlab.plan model=llama3_70b hardware=h100 devices=64 precision=bf16 train.global_batch_tokens=4194304
  python -m shardlab.plan                                              # the configured mesh (tiny, h100, 4x2)

With devices=N (or search=true) every data x fsdp x tensor layout of N devices is evaluated at the remat policy and
microbatch count that fit it fastest, and the first screen is a table of the best layouts (mesh, remat,
microbatches, memory per device and fit, step time, MFU, binding axis and critical batch) and the best one's batch
window; without, a summary of the configured mesh (with mesh.pipeline > 1 and a schedule: that pipeline,
planner.given_pipeline: its microbatches, bubble, the stage's memory and step). `--json` prints the JSON instead (keys and formulas:
shardlab/analysis/planner.py; searching, its top level is the plan of the best layout), `json=PATH` writes it.
Takes the same Hydra overrides as `python -m shardlab`; schedule.remat and schedule.microbatches written on the
command line are kept, not searched. A bad override, a setting out of range or a mesh axis that does not divide
the dimensions it shards prints one line to stderr and exits with status 2.

Options of the planner itself (also as plan.NAME=VALUE; docs/planning.md):
  devices=N          search every layout of N devices (default: plan the configured mesh only)
  search=true        search the configured mesh's device count
  rows=K             show K layouts in the table (default 5)
  pipeline_search=true  search pipeline layouts too: P stages (divisors of N that divide the layers) x every
                     pipeline schedule x M microbatches (P, 2P, 4P, 8P) x data x fsdp x tensor of N / P, costed by
                     replaying the schedule's table (planner.evaluate_pipeline); the table gains P, schedule, M
                     and bubble columns, and one line says which P were costed, or why none applies (one
                     layer, layers no P divides, one device, a batch too small for whole-sequence microbatches)
                     and the setting to change: the JSON's answer.pipeline. Implies search=true
  context_search=true  which context-parallel strategy and degree for this model and sequence on N devices
                     (devices=N, default the configured mesh's): all_gather, ring and ulysses at every degree
                     that divides N / tensor, fsdp the rest, each predicted (step, attention, exposed transfers,
                     memory) or excluded with its reason (analysis/context_cost.py: choose); the answer is the
                     JSON's `context` and a table after the plan; when no split is chosen, one line
                     (`why_no_split`) says why none pays for its communication
  expert_search=true  which dispatcher, expert-parallel degree and capacity for a mixture of experts (model.n_experts
                     > 0) on N devices (devices=N, default the configured mesh's): every dispatcher at every degree
                     dividing the experts and N, fsdp the rest, each predicted (step, experts, exposed dispatch,
                     expert weights over fsdp, memory) by its own cost terms, or excluded with its reason
                     (analysis/expert_cost.py: choose); the JSON's `expert` and a table. A MoE model is planned
                     only this way
  top=K              keep the K best layouts in the JSON (implies search=true) and compile them for the target:
                     each gains `target` (compiled memory per device, calibrated step time, beside the closed
                     forms; needs the hardware preset's extra: pip install "shardlab[cuda12]" or "shardlab[tpu]")
  torus=16x16x16     the TPU slice's torus (default: the most nearly cubic one of the preset's rank)
  plot=PATH.png      the efficiency curve: step time and MFU against per-device batch, for the configured mesh
                     or, with search, the best (top, default 3) layouts
  plot_layouts=1x1024x4,1x4096x1   plot these data x fsdp x tensor layouts instead (implies search=true)
  confirm=false      with top=K: list the K best by the closed forms only, compile nothing
  confirm=true       compile the best (top, default 3) layouts for the target (the default with top=K)
  confirm_batch=true confirm the batch window by compiling for the target: `batch_window.target`
                     (the largest batch that fits by the compiled peaks, compiled at it and at one more sequence)
  --json, json=PATH  the JSON: on the terminal instead of the table, or into a file beside it (an existing file is
                     refused unless overwrite=true)
"""
from __future__ import annotations

import json
import sys
import textwrap

from shardlab.axes import CONTEXT, DATA, EXPERT, FSDP, PIPELINE, TENSOR
from shardlab.analysis.confirm import confirm_batch_window, confirm_layouts
from shardlab.composition import resolve
from shardlab.outputs import human_bytes, human_seconds
from shardlab.trainer import build


def compose(overrides: list[str]):
  """conf/ + overrides -> typed `Config` (Hydra validates every override against the schemas)."""
  from shardlab.config import compose as config_compose
  return config_compose(overrides, "plan")


def one_line(e: BaseException) -> str:
  """An exception and its causes, whitespace collapsed onto one line; OmegaConf's trailer (full_key, reference
  and object types) left out, a bad override pointed at the list of settings."""
  name, parts, hydra = type(e).__name__, [], False
  while e is not None:
    hydra = hydra or type(e).__module__.split(".")[0] in ("hydra", "omegaconf")
    text = " ".join(str(e).split("full_key:")[0].split("Config search path:")[0].split())
    if text and text not in parts and not any(text in p for p in parts):
      parts.append(text)
    e = e.__cause__
  out = ": ".join(parts) or name
  return out + (" (`python -m shardlab --help` lists every group, option and setting)" if hydra else "")


# The planner's own options: not part of conf/, so they are taken out of argv before Hydra sees it.
OPTIONS = {"search": "bool", "top": "int", "rows": "int", "devices": "int", "torus": "dims", "plot": "path",
           "confirm": "bool", "pipeline_search": "bool", "context_search": "bool", "expert_search": "bool",
           "confirm_batch": "bool", "plot_layouts": "layouts"}


def split_options(argv: list[str]) -> tuple[dict, list[str]]:
  """(planner options, the Hydra overrides left). `search=true` and `plan.search=true` are the same."""
  opts = {"search": False, "top": 0, "rows": 0, "devices": 0, "torus": None, "plot": None, "confirm": None,
          "plot_layouts": [], "pipeline_search": False, "context_search": False, "expert_search": False,
          "confirm_batch": False}
  rest = []
  for arg in argv:
    key, eq, value = arg.partition("=")
    name = key.removeprefix("plan.")
    if not eq or name not in OPTIONS:
      rest.append(arg)
      continue
    kind = OPTIONS[name]
    if kind == "bool":
      if value.lower() not in ("true", "false"):
        raise ValueError(f"{arg}: {name} must be true or false")
      opts[name] = value.lower() == "true"
    elif kind == "int":
      if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{arg}: {name} must be a positive integer")
      opts[name] = int(value)
    elif kind == "dims":
      dims = value.lower().split("x")
      if not all(d.isdigit() and int(d) >= 1 for d in dims):
        raise ValueError(f"{arg}: torus must look like 16x16x16")
      opts[name] = tuple(int(d) for d in dims)
    elif kind == "layouts":
      shapes = [v.lower().split("x") for v in value.split(",")]
      if not all(len(d) == 3 and all(n.isdigit() and int(n) >= 1 for n in d) for d in shapes):
        raise ValueError(f"{arg}: plot_layouts must look like 1x1024x4,1x4096x1 (data x fsdp x tensor)")
      opts[name] = [tuple(int(n) for n in d) for d in shapes]
    else:
      if not value:
        raise ValueError(f"{arg}: {name} needs a file name")
      opts[name] = value
  if opts["confirm"] is None:            # top=K compiles the K best unless confirm=false
    opts["confirm"] = bool(opts["top"])
  opts["search"] = (opts["search"] or bool(opts["devices"]) or bool(opts["top"]) or opts["confirm"]
                    or bool(opts["plot_layouts"]) or opts["pipeline_search"])
  return opts, rest


def fixed_schedule(overrides: list[str]) -> dict:
  """The schedule settings the search keeps as given: schedule.remat and schedule.microbatches written on the
  command line ({"remat": ..., "microbatches": ...}, each present only when written); the others it chooses."""
  out = {}
  for o in overrides:
    key, _, value = o.lstrip("+").partition("=")
    if key == "schedule.remat":
      out["remat"] = value
    elif key == "schedule.microbatches" and value.isdigit():
      out["microbatches"] = int(value)
  return out


def _at_layout(c, layout: dict):
  """The composition c at a searched layout: its mesh and its remat and microbatches (planner.answer's choice).
  A pipeline layout: one stage's data x fsdp x tensor mesh with every layer at one microbatch (its pipeline,
  schedule and M are in its row): the closed forms of `planner.plan` know no stages."""
  return c.replace(mesh={DATA: layout[DATA], FSDP: layout[FSDP], TENSOR: layout[TENSOR],
                         "fsdp_ici_axes": layout["ici_axes"][FSDP], "tensor_ici_axes": layout["ici_axes"][TENSOR]},
                   schedule={"remat": layout["remat"],
                             "microbatches": 1 if PIPELINE in layout else layout["microbatches"]})


def run(argv: list[str]) -> dict:
  """The plan of argv (options and overrides), with `answer` and `layouts` when searching; writes the figure if
  asked. Searching, the top level is the plan of the best layout (its mesh, remat and microbatches)."""
  return _run(argv)[0]


def _run(argv: list[str]) -> tuple[dict, object, dict]:
  """(run's result, the composed config, the planner's options)."""
  from shardlab.analysis import planner
  opts, overrides = split_options(argv)
  cfg = compose(overrides)
  from shardlab.validate import validate_plan
  if opts["expert_search"]:      # a mixture of experts: its own search, nothing else
    from shardlab.validate import RANGES, check_ranges, validate_experts
    if cfg.model.n_experts <= 0:
      raise ValueError(f"expert_search=true: model={cfg.model.name} has no experts (model.n_experts=0); pick a MoE "
                       f"model (e.g. model=mixtral_8x7b) or drop expert_search")
    check_ranges(cfg, [r for r in RANGES if r[0].split(".")[0] not in ("checkpoint", "distributed", "profile")])
    validate_experts(cfg)
    return {EXPERT: expert_answer(resolve(cfg), opts["devices"] or None)}, cfg, opts
  validate_plan(cfg)   # the same ranges as a run, and every sharded dim divisible by its mesh axis
  c = resolve(cfg)     # what the planner reads below: the composition, never the whole config
  chosen = None
  if not opts["search"]:
    result = {**planner.plan(c), "layout": planner.this_layout(c)}
    if c.mesh.sizes.get(PIPELINE, 1) > 1:
      result.update(given_pipeline(c, result["warnings"]))
    if opts["confirm_batch"]:
      result["batch_window"]["target"] = confirm_batch_window(c, build)
  else:
    fixed = fixed_schedule(overrides)
    ans = planner.answer(c, opts["devices"] or None, opts["torus"], fixed.get("remat"), fixed.get("microbatches"),
                         pipeline=opts["pipeline_search"])
    layouts = ans.pop("layouts")
    best = _at_layout(c, layouts[0])
    result = {"answer": ans, **planner.plan(best)}
    if PIPELINE in layouts[0]:     # plan() knows no stages: its memory is every layer's, not the stage's
      result["warnings"] = [w for w in result["warnings"] if "exceeds HBM" not in w] + [
          f"the best layout is a pipeline of {layouts[0][PIPELINE]} stages ({layouts[0]['schedule']}): the top-level "
          "closed forms describe one stage's data x fsdp x tensor mesh holding every layer; its row in `layouts` "
          "has the pipeline's step time, bubble and per-stage memory"]
    flat = [l for l in layouts if PIPELINE not in l]      # what confirm and plot take: no pipeline stages
    result["search"] = {k: ans[k] for k in ("devices", "considered", "qualifying")}
    result["layouts"] = layouts[:opts["top"]] if opts["top"] else layouts
    if opts["confirm_batch"]:
      result["batch_window"]["target"] = confirm_batch_window(best, build)
    if opts["confirm"]:
      confirmed = [r for l in layouts[:opts["top"] or 3]
                   for r in ([l] if PIPELINE in l else confirm_layouts([l], _at_layout(c, l), 1, build))]
      result["layouts"] = confirmed + result["layouts"][len(confirmed):]
    chosen = flat[:opts["top"] or 3]
    if opts["plot_layouts"]:
      by_shape = {(l[DATA], l[FSDP], l[TENSOR]): l for l in flat}
      missing = [s for s in opts["plot_layouts"] if s not in by_shape]
      if missing:
        raise ValueError(f"plot_layouts: {'x'.join(map(str, missing[0]))} is not a data x fsdp x tensor layout of "
                         f"the {result['search']['devices']} devices searched")
      chosen = [by_shape[s] for s in opts["plot_layouts"]]
  if opts["context_search"]:
    result[CONTEXT] = context_answer(c, opts["devices"] or None)
  if opts["plot"]:
    from shardlab.analysis.plan_figure import efficiency_curve
    result["plot"] = str(efficiency_curve(c, opts["plot"], chosen))
  return result, cfg, opts


def expert_answer(c, devices: int | None = None) -> dict:
  """expert_cost.choose for summary.json-style output: MODEL PREDICTIONS."""
  from shardlab.analysis import expert_cost
  got = expert_cost.choose(c, devices)
  return {**got, "model": c.model.name, "note": "model predictions (analysis/expert_cost.py); activations left out "
          "of memory; tensor parallelism not searched"}


def _screen(cols: list[str], body: list[list[str]], ans: dict) -> list[str]:
  """A search's screen below its title: the columns (the first left-aligned), the excluded with why, the choice."""
  width = [max(len(r[i]) for r in [cols, *body]) for i in range(len(cols))]
  out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width))).rstrip()
         for r in [cols, *body]]
  out += [f"  excluded: {k}: {v}" for k, v in ans["excluded"].items()]
  return out + ["", textwrap.fill(f"Chosen: {ans['reason']}" if ans["best"] else ans["reason"], 118)]


def expert_table(ans: dict) -> str:
  """expert_search's screen: the candidates fastest first, the excluded with why, the reason."""
  n = ans["devices"]
  out = [f"Expert parallelism for {ans['model']} on {n} devices (predictions, fastest first):", ""]
  cols = ["dispatcher, EP", FSDP, "step", "experts", "dispatch", "fsdp gathers", "memory/device"]
  body = [[c["label"], str(c[FSDP]), _secs(c["t_step_s"]), _secs(c["t_experts_s"]), _secs(c["t_dispatch_s"]),
           _secs(c["t_fsdp_s"]), human_bytes(c["memory_bytes"])] for c in ans["candidates"]]
  out += _screen(cols, body, ans)
  return "\n".join(out)


def context_answer(c, devices: int | None = None) -> dict:
  """summary.json-style answer of context_search.choose: the best strategy and degree, the reason, every candidate
  in brief (predicted step, attention, exposed context transfers, bytes over context, memory) and the excluded
  ones with why; `why_no_split` says, when no context split is chosen though some were costed, why none pays.
  MODEL PREDICTIONS."""
  from shardlab.analysis import context_search as CS
  got = CS.choose(c, devices)
  brief = lambda p: {"label": p["label"], "strategy": p["strategy"], CONTEXT: p[CONTEXT], FSDP: p[FSDP],
                     "load_balance": p["load_balance"], "remat": p["remat"], "microbatches": p["microbatches"],
                     "weights_over_context": p["weights_over_context"], "overrides": p["overrides"],
                     "t_step_s": p["t_step_s"],
                     "t_attention_s": p["t_attention_s"], "exposed_comm_s": p["exposed_comm_s"],
                     "context_bytes_per_layer": p["bytes_per_layer"], "memory_bytes": p["memory_bytes"]}
  cands = [brief(p) for p in got["candidates"]]
  n = devices or c.mesh.n_devices
  return {"devices": n, "tokens_per_sequence": c.model.seq_len,
          "best": got["best"]["label"] if got["best"] else None,
          "reason": context_reason(cands, c, n) if cands else got["reason"],
          "why_no_split": why_no_split(cands, c),
          "candidates": cands, "excluded": got["excluded"],
          "note": "model predictions (analysis/context_cost.py); the ring's inner kernel (also usp's and "
                  "a2a_p2p's) timed as a fused flash kernel, which shardlab's Pallas kernel is on GPU and TPU "
                  "targets (experiments/context/README.md, sections 4 and 5: the compiled programs)"}


def _secs(t: float) -> str:
  """human_seconds, with a zero written as 0 (not '0 ns', which reads as a rounded measurement)."""
  return human_seconds(t) if t else "0"


def _said(c: dict) -> str:
  """One candidate in the words of the reason: its predicted step and what it is made of."""
  return (f"{c['label']}: predicted step {_secs(c['t_step_s'])} (attention {_secs(c['t_attention_s'])}, exposed "
          f"context comm {_secs(c['exposed_comm_s'])}; {human_bytes(c['context_bytes_per_layer']['forward'])} per "
          "layer forward over context)")


def _versus(best: dict, other: dict, floor_s: float) -> str:
  """How the best compares with the runner-up. A ratio only when the best's predicted step is above `floor_s` (one
  kernel launch, 1 us where the preset has none): the closed forms leave fixed per-kernel costs out, so a step
  below it is no basis to divide by (tiny's 55 ns step read '391491% faster' than a 214 us one); below it, the
  difference in time."""
  a, b = best["t_step_s"], other["t_step_s"]
  if human_seconds(a) == human_seconds(b):
    return f"predicted the same step as {_said(other)}"
  if a < floor_s:
    return f"{human_seconds(b - a)} shorter than {_said(other)}"
  return f"{b / a - 1:.0%} faster than {_said(other)}"


def context_reason(cands: list[dict], c, devices: int) -> str:
  """Why the first of `cands` (fastest predicted first): against the first of another degree or strategy, or
  why it is the only one. Replaces context_cost.reason's 'ms with no decimals' (a 55 ns step read '0 ms')."""
  best = cands[0]
  other = cands[1] if len(cands) > 1 else None       # labels are unique: another strategy or degree
  if other is None:
    room = devices // c.mesh.tensor
    why = (f"devices / mesh.tensor = {devices} / {c.mesh.tensor} = 1: no context degree above 1 to try (devices=N "
           "searches more)" if room == 1 else "every other strategy and degree is excluded (below)")
    return f"{_said(best)}; the only candidate: {why}"
  floor_s = max(c.hardware.kernel_launch_s, 1e-6)
  # a candidate predicted the same (a2a_p2p with every rank in one node is Ulysses) is named, and the comparison
  # made with the first that differs
  ties = [p["label"] for p in cands[1:] if human_seconds(p["t_step_s"]) == human_seconds(best["t_step_s"])]
  other = next((p for p in cands[1:] if p["label"] not in ties), None)
  tied = f" (the same predicted step: {', '.join(ties)})" if ties else ""
  if other is None:
    return _said(best) + tied
  return (f"{_said(best)}{tied}, {_versus(best, other, floor_s)}; memory {human_bytes(best['memory_bytes'])} vs "
          f"{human_bytes(other['memory_bytes'])} per device")


def why_no_split(cands: list[dict], c) -> str | None:
  """When the best predicted candidate splits no sequence but some split was costed: one line on why none pays.
  A split keeps each device's tokens (the batch goes over fsdp, the sequence over context: C x fsdp is fixed), so
  it saves no attention work and only adds exposed communication; it buys room (a batch smaller than the devices,
  activations that do not fit), which this configuration does not need. None otherwise."""
  splits = [p for p in cands if p[CONTEXT] > 1]
  if not cands or cands[0][CONTEXT] > 1 or not splits:
    return None
  one, least = cands[0], min(splits, key=lambda p: p["exposed_comm_s"])
  seqs = c.global_tokens / c.model.seq_len
  share = one["t_attention_s"] / one["t_step_s"] if one["t_step_s"] else 0.0
  return (f"No context split pays for its communication at model.seq_len={c.model.seq_len}: attention is "
          f"{share:.0%} of the predicted step ({_secs(one['t_attention_s'])} of {_secs(one['t_step_s'])}), the "
          f"batch of {seqs:,.0f} sequences already divides over fsdp {one[FSDP]} and fits "
          f"({human_bytes(one['memory_bytes'])} per device); a split keeps each device's tokens, so it saves no "
          f"work and adds exposed communication: at least {_secs(least['exposed_comm_s'])} ({least['label']}).")


def context_table(ans: dict) -> str:
  """context_search's screen: the candidates fastest first, the excluded with why, the reason (and why no split
  pays, when none is chosen)."""
  n = ans["devices"]
  out = [f"Context parallelism for {ans['tokens_per_sequence']:,} tokens per sequence on {n} device"
         f"{'s' if n > 1 else ''} (predictions, fastest first):", ""]
  cols = ["strategy, C", FSDP, "remat", "micro", "step", "attention", "exposed comm", "memory/device"]
  body = [[c["label"], str(c[FSDP]), c["remat"], str(c["microbatches"]), _secs(c["t_step_s"]),
           _secs(c["t_attention_s"]), _secs(c["exposed_comm_s"]), human_bytes(c["memory_bytes"])]
          for c in ans["candidates"]]
  out += _screen(cols, body, ans)
  if ans.get("why_no_split"):
    out += [textwrap.fill(ans["why_no_split"], 118)]
  if ans["candidates"]:
    out += ["", "The chosen layout's settings (with this command's model, hardware and batch, for `python -m "
            "shardlab`): " + " ".join(ans["candidates"][0]["overrides"])]
  return "\n".join(out)


# ------------------------------------------------------------------------------------------- what the terminal shows

def _tokens(t: float | None, seq_len: int) -> str:
  if t is None:
    return "none (tensor binds at any batch)"
  seqs = t / seq_len
  return f"{t:,.0f} tokens ({seqs:,.0f} sequences)" if seqs == int(seqs) else f"{t:,.0f} tokens ({seqs:,.1f} sequences)"


def _verdict(l: dict) -> str:
  """'ok', or the layout's problems in brief: 'memory', 'sharding', 'comm: tensor 1.42x'."""
  out = []
  for r in l["rejected_because"]:
    kind = r.split(":")[0]
    if kind == "communication":
      axis = r.split(":")[1].strip()
      out.append(f"comm: {axis} {l['comm_to_math'][axis]:.2f}x")
    elif kind not in out:
      out.append(kind)
  return ", ".join(out) or "ok"


def _critical(l: dict) -> str:
  c = l["critical_batch_per_device"]
  return f"{c['binding_axis']} at any batch" if c["this_mesh"] is None else f"{c['binding_axis']} {c['this_mesh']:,.0f}"


def _cluster(hw, n: int) -> str:
  dom = hw.domain_devices
  nodes = f" ({n // dom} nodes of {dom})" if dom and n > dom and n % dom == 0 and not hw.torus else ""
  return f"{n} x {hw.name}{nodes}"


def given_pipeline(c, warnings: list[str]) -> dict:
  """The plan's pipeline fields for a mesh with stages: {"pipeline": planner.given_pipeline's row} (the stage's
  memory replaces the closed forms' every-layer figure in the warnings), or a warning saying why it has none."""
  from shardlab.analysis import planner
  P = c.mesh.sizes[PIPELINE]
  kept = [w for w in warnings if "exceeds HBM" not in w]    # the closed forms' every-layer memory: not a stage's
  if not c.pipeline.staged:
    return {"warnings": kept + [f"mesh.pipeline={P} without a pipeline schedule: pick one with pipeline=NAME "
                                    "(e.g. pipeline=1f1b) or pipeline.table=PATH.csv"]}
  row = planner.given_pipeline(c)
  if row is None:
    shards = c.mesh.data * c.mesh.fsdp
    seqs = c.global_tokens / shards / c.model.seq_len
    return {"warnings": kept + [
        f"mesh.pipeline={P}: the global batch gives {seqs:.3g} sequences to each of the {shards} data x fsdp "
        f"shards, too few for the pipeline's microbatches (each whole sequences); raise train.batch_size or "
        f"train.global_batch_tokens"]}
  if not row["fits"]:
    kept.append(f"{human_bytes(row['memory_per_device_bytes'])} per device on a pipeline stage exceeds HBM "
                f"({human_bytes(c.hardware.hbm_bytes)})")
  return {PIPELINE: row, "warnings": kept}


def _pipeline_line(pp: dict, cfg) -> str:
  """pipeline_search's one line under the table: why no pipeline layout applies (so that a table without P columns
  is not read as pipelines that lost), or which stage counts were costed and which the layers rule out."""
  if pp["none_because"]:
    return textwrap.fill(f"No pipeline layout: {pp['none_because']}.", 118)
  out = f"Pipeline layouts: {pp['layouts']} costed at P = {', '.join(map(str, pp['stages_tried']))}"
  if pp["stages_excluded"]:
    out += (f"; not at P = {', '.join(pp['stages_excluded'])} (model.n_layers={cfg.model.n_layers} is not a "
            "multiple of them)")
  return textwrap.fill(out, 118)


def table(result: dict, cfg, rows: int = 5) -> str:
  """The search's first screen: the best `rows` layouts, the best one's batch window, the rules."""
  ans, layouts, L = result["answer"], result["layouts"], cfg.model.seq_len
  head = (f"{cfg.model.name} on {_cluster(cfg.hardware, ans['devices'])}, global batch "
          f"{_tokens(ans['global_batch_tokens'], L)}, {cfg.precision.compute_dtype} compute: "
          f"{ans['considered']} layouts, {ans['qualifying']} qualify (fit, shard, compute-bound)")
  cols = ["#", "data x fsdp x tensor", "remat", "micro", "memory/device", "fits", "step", "MFU",
          "binding: critical B/N", "verdict"]
  body = [[str(i + 1), f"{l[DATA]} x {l[FSDP]} x {l[TENSOR]}", l["remat"], str(l["microbatches"]),
           human_bytes(l["memory_per_device_bytes"]), "yes" if l["fits"] else "NO",
           human_seconds(l["step_time_s"]),
           f"{100 * l['mfu']:.0f}%", _critical(l), _verdict(l)] for i, l in enumerate(layouts[:rows])]
  right = {"#", "micro", "memory/device", "step", "MFU"}
  if any("step_model" in l for l in layouts[:rows]):   # the time model's reasons: what it recomputes and waits for
    cols[8:8] = ["recompute", "exposed comm"]
    right |= {"recompute", "exposed comm"}
    for r, l in zip(body, layouts):
      sm = l.get("step_model")
      r[8:8] = [human_seconds(sm["t_recompute_s"]) if sm["t_recompute_s"] else "0",
                (human_seconds(sm["t_exposed_comm_s"]) + " " + "+".join(
                    a for a, v in sm["exposed_comm_s"].items() if v > 0.05 * sm["t_exposed_comm_s"])).rstrip()
                if sm["t_exposed_comm_s"] else "0"] if sm else ["-", "-"]
  if any(PIPELINE in l for l in layouts):      # pipeline_search: P and schedule before the mesh, bubble after M
    cols[1:1], cols[6:6] = ["P", "schedule"], ["bubble"]
    right |= {"P", "bubble"}
    for r, l in zip(body, layouts):
      pp = PIPELINE in l
      r[1:1] = [str(l[PIPELINE]) if pp else "1", (l["schedule"] + (f" V={l['virtual_stages']}"
                                                                   if l["virtual_stages"] > 1 else "")) if pp else "-"]
      r[6:6] = [f"{100 * l['bubble']:.0f}%" if pp else "-"]
  compiled = any("target" in l for l in layouts[:rows])
  if compiled:    # top=K: each layout compiled for the target, its calibrated replay beside the closed forms
    cols[-1:-1] = ["compiled: step", "step vs compiled", "compiled MFU", "compiled memory"]
    right |= {"compiled: step", "step vs compiled", "compiled MFU", "compiled memory"}
    for r, l in zip(body, layouts):
      t = l.get("target") or {}
      r[-1:-1] = ([human_seconds(t["step_time_s"]), f"{t['search_error']:+.0%}", f"{100 * t['mfu']:.0f}%",
                   human_bytes(t["memory_compiled_bytes"])] if t.get("compiled") else ["-", "-", "-", "-"])
  width = [max(len(r[i]) for r in [cols, *body]) for i in range(len(cols))]
  line = lambda r: "  ".join(c.rjust(w) if cols[i] in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, width))).rstrip()
  w = ans["batch_window"]
  best = layouts[0]
  out = [head, "", line(cols), *map(line, body)]
  if len(layouts) > rows:
    out.append(f"   ... {len(layouts) - rows} more (rows=K shows K; --json lists all)")
  if PIPELINE in ans:
    out.append(_pipeline_line(ans[PIPELINE], cfg))
  stages = (f"pipeline {best[PIPELINE]} {best['schedule']}, M {best['microbatches']}, " if PIPELINE in best else "")
  out += ["", f"Batch window of #1 ({stages}{best[DATA]} x {best[FSDP]} x {best[TENSOR]}, remat {w['remat']}):",
          f"  compute-bound from   {_tokens(w['compute_bound_from_tokens'], L)}"
          + (f": critical B/N {best['critical_batch_per_device']['this_mesh']:,.0f} tokens per device per pass"
             if w["compute_bound_from_tokens"] is not None else ""),
          f"  one pass fits up to  {_tokens(w['fits_per_pass_tokens'], L)}"
          + (f"; {ans['global_batch_tokens']:,.0f} runs as {w['microbatches']} microbatches"
             if w["microbatches"] > 1 and PIPELINE not in best else "")
          + (f" in {w['microbatches']} microbatches through the stages" if PIPELINE in best else ""),
          "", "Ties (equal predicted step time): the least recomputation, then the fewest microbatches, then the most "
          "slack (smallest worst comm/math), then the least memory.",
          "Each layout runs at the remat and microbatches that fit it fastest (a microbatch re-gathers the weights; "
          + ("recomputation is left to train.mfu, as in the book)." if cfg.train.mfu else
             "the step is the time model's: each layout's kernels at the preset's calibrated rates, recomputation "
             "and exposed communication included; `--json` has each one's `step_model` breakdown).")]
  out = [textwrap.fill(l, 118) if l.startswith(("Ties", "Each layout")) else l for l in out]   # the rules
  if result.get("warnings"):
    out += [f"Warning: {x}" for x in result["warnings"]]
  for i, l in enumerate(layouts[:rows]):
    if "target" in l and not l["target"].get("compiled"):
      out.append(f"#{i + 1} not compiled: {l['target'].get('why')}")
  out += ["Every number is a prediction of the closed forms (docs/planning.md)"
          + ("; the compiled columns are the calibrated replay of each layout compiled for the target (predictions "
             "too, not measurements), its memory the compiler's" if compiled else "")
          + "; --json prints the JSON, json=PATH writes it."]
  return "\n".join(out)


def _stage_lines(pp: dict, hbm: int) -> list[str]:
  """A pipeline's lines of the summary: its schedule and microbatches, the stage's memory, the step with its
  bubble (planner.evaluate_pipeline: the table replayed in shardlab's ticks)."""
  v = f", {pp['virtual_stages']} chunks per stage" if pp["virtual_stages"] > 1 else ""
  closed = "" if pp["bubble_closed_form"] is None else f", closed form {100 * pp['bubble_closed_form']:.1f}%"
  return [f"  pipeline            {pp[PIPELINE]} stages of {pp['stage_layers']} layers, {pp['schedule']}{v}, "
          f"{pp['microbatches']} microbatches, {pp['in_flight']} microbatch-chunks in flight on the busiest stage",
          f"  memory per device   {human_bytes(pp['memory_per_device_bytes'])} of {human_bytes(hbm)} on a stage: "
          + ("fits" if pp["fits"] else "does NOT fit")
          + ("" if pp["fits"] or not pp.get("fits_with") else
             " (fits with " + ", ".join(f"{k}={v}" for k, v in pp["fits_with"].items()) + ")"),
          f"  step time           {human_seconds(pp['step_time_s'])}, MFU {100 * pp['mfu']:.0f}%, bubble "
          f"{100 * pp['bubble']:.1f}% in shardlab's ticks{closed}"]


def summary(result: dict, cfg) -> str:
  """One configured mesh on one screen: memory and fit, step time and MFU (the layout's roofline, as the search
  ranks it), the critical batch, the window."""
  L, lay = cfg.model.seq_len, result["layout"]
  crit = lay["critical_batch_per_device"]
  micro = result["microbatches"]
  out = [f"{cfg.model.name} on {_cluster(cfg.hardware, cfg.mesh.n_devices)}, mesh {cfg.mesh.label} "
         f"(data {lay[DATA]} x fsdp {lay[FSDP]} x tensor {lay[TENSOR]}), remat {lay['remat']}, "
         f"{lay['microbatches']} microbatch{'es' if lay['microbatches'] > 1 else ''}, global batch "
         f"{_tokens(resolve(cfg).global_tokens, L)}:",
         f"  memory per device   {human_bytes(lay['memory_per_device_bytes'])} of {human_bytes(result['hbm_bytes'])}: "
         + ("fits" if lay["fits"] else "does NOT fit")
         + (f" (fits with schedule.microbatches={micro})" if not lay["fits"] and micro else ""),
         f"  step time           {human_seconds(lay['step_time_s'])}, MFU {100 * lay['mfu']:.0f}% ("
         + ("compute-bound" if lay["compute_bound"] else "communication-bound: " + _verdict(lay)) + ")",
         "  critical batch      " + (f"{crit['this_mesh']:,.0f} tokens per device ({crit['binding_axis']} binds "
                                     "below it)" if crit["this_mesh"] is not None else
                                     f"none: {crit['binding_axis']} binds at any batch"),
         f"  fits up to          {_tokens(result['batch_window']['max_global_batch_tokens'] * lay[DATA], L)}"]
  if result.get(PIPELINE):   # the stages' lines; the batch window is the closed forms' every-layer mesh's
    out = ([out[0].replace(f"{lay['microbatches']} microbatch{'es' if lay['microbatches'] > 1 else ''}, ", "")]
           + _stage_lines(result[PIPELINE], result["hbm_bytes"]) + out[3:4])
  out += [f"Warning: {x}" for x in result["warnings"]]
  # what keeps the configured mesh from running as priced (a batch shard of part of a sequence)
  out += [f"Note: shardlab does not run this mesh as configured: {x}" for x in lay.get("notes", [])]
  out += ["Every number is a prediction of the closed forms (docs/planning.md); devices=N searches every layout "
          "of N devices; --json prints the JSON, json=PATH writes it."]
  return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    return 0
  as_json = "--json" in argv
  argv = [a for a in argv if a != "--json"]
  try:
    path = next((a.split("=", 1)[1] for a in argv if a.startswith(("json=", "plan.json="))), None)
    if path == "":
      raise ValueError("json=: name a file to write the JSON to")
    overwrite = next((a.split("=", 1)[1] for a in argv if a.startswith(("overwrite=", "plan.overwrite="))), "false")
    argv = [a for a in argv if not a.startswith(("json=", "plan.json=", "overwrite=", "plan.overwrite="))]
    from shardlab.outputs import check_output_file, overwrite_setting
    check_output_file("json", path, overwrite) if path else overwrite_setting(overwrite)
    result, cfg, opts = _run(argv)
    text = json.dumps(result, indent=2)
    if path:
      with open(path, "w") as f:
        f.write(text + "\n")
  except Exception as e:  # Hydra/OmegaConf errors, planner.check's ValueError, ConfigError, OSError: one line, exit 2
    print(f"shardlab.plan: error: {one_line(e)}", file=sys.stderr)
    return 2
  if as_json:
    print(text)
    return 0
  if EXPERT in result:
    print(expert_table(result[EXPERT]))
    return 0
  print(table(result, cfg, opts["rows"] or opts["top"] or 5) if "answer" in result else summary(result, cfg))
  if CONTEXT in result:
    print("\n" + context_table(result[CONTEXT]))
  if path:
    print(f"JSON: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
