"""The cost model and the timeline: collective costs as NCCL tests and the Scaling Book state them, the replay's scheduling rules on
hand-made graphs, and on compiled tiny programs: bounds, matmul FLOPs counted by hand, FSDP prefetch hiding the
gathers that the baseline leaves exposed, the Chrome trace and the chart, the analytic memory breakdown."""
import json

import pytest

from conftest import compiled_grads, load_preset, mesh_of, tiny_config
from shardlab.composition import resolve
from shardlab.hardware import HardwareConfig

H100 = HardwareConfig()   # the h100 preset's numbers (conf/hardware/h100.yaml)
V5P = HardwareConfig(name="tpu_v5p", peak_flops=4.59e14, ici_bandwidth=1.8e11, hop_latency_s=1e-6, torus=True)


def knobs(preset):
  return tuple(sorted((k, v) for k, v in load_preset(preset).items() if k != "name"))


def test_collective_costs_follow_anchors():
  """NCCL tests / Scaling Book: AllGather/ReduceScatter V (n-1)/n / W, AllReduce twice that, latency floor T_hop n / 2; a ring
  ppermute uses one direction of a torus link (W/2); a mesh axis over M torus axes gets M W_ici. At peak rates
  (the ceiling's replay); at achieved rates the same formula adds NCCL's launch latency and divides W by the
  link efficiency and the message-size ramp (the calibrated replay, the pipeline and context models)."""
  from shardlab.analysis.links import collective_seconds
  t = lambda kind, b, n, axis, hw, ici: collective_seconds(kind, b, n, axis, hw.peak(), ici)
  V = 1e9
  h = H100
  ramp = V / (V + h.link_half_bytes)
  assert collective_seconds("all-gather", V, 8, "fsdp", h, {}) == pytest.approx(
      h.collective_latency_s + V / (4.5e11 * h.link_efficiency * ramp))
  assert t("all-gather", V * 7 / 8, 8, "fsdp", H100, {}) == pytest.approx(V * 7 / 8 / 4.5e11)
  assert t("reduce-scatter", V * 7 / 8, 8, "fsdp", H100, {}) == pytest.approx(V * 7 / 8 / 4.5e11)
  assert t("all-reduce", 2 * V * 7 / 8, 8, "fsdp", H100, {}) == pytest.approx(2 * V * 7 / 8 / 4.5e11)
  assert t("all-gather", 100, 8, "fsdp", H100, {}) == pytest.approx(8 / 2 * 1e-6)        # latency-bound
  assert t("all-reduce", 100, 8, "fsdp", H100, {}) == pytest.approx(8 * 1e-6)
  assert t("collective-permute", V / 4, 4, "tensor", H100, {}) == pytest.approx(V / 4 / 4.5e11)   # switch egress
  assert t("collective-permute", V / 4, 4, "tensor", V5P, {}) == pytest.approx(V / 4 / 0.9e11)    # one direction
  assert t("all-gather", V * 3 / 4, 4, "fsdp", V5P, {"fsdp": 2}) == pytest.approx(V * 3 / 4 / 3.6e11)
  assert t("all-gather", V, 1, "fsdp", H100, {}) == 0.0


def test_a_collective_is_charted_by_its_mesh_axis_whatever_placed_it():
  """A user's TP class names its own scopes (docs/schedules.md): its collectives over `tensor` are tensor
  communication in the timeline as much as the built-in ones; FSDP's gathers and reductions keep their classes."""
  from shardlab.analysis import timeline as TL
  from shardlab.analysis.hlo import Collective
  from shardlab.axes import CONTEXT, FSDP, TENSOR
  cat = lambda kind, axis, scope: TL.category(TL.Task("comm", [], coll=Collective(kind, axis, "bf16", 2, 2, 1, 1,
                                                                                       scope, "c", "x")))
  assert cat("all-gather", TENSOR, "my_own_gather") == cat("all-gather", TENSOR, "tp_all_gather") == TENSOR
  assert cat("collective-permute", CONTEXT, "ring_kv") == CONTEXT
  assert cat("all-gather", FSDP, "anything") == "fsdp all-gather" and cat("all-reduce", FSDP, "x") == FSDP
  assert cat("all-reduce", f"{FSDP}+{TENSOR}", "loss_sum") == "other comm"


def test_replay_overlaps_independent_work_and_serializes_dependencies():
  from shardlab.analysis import timeline as TL
  from shardlab.analysis.hlo import Collective
  c = Collective("all-gather", "fsdp", "f32", 2, 2, 1, 1, "fsdp_all_gather", "c", "ag")
  # 0: gather (1 s), 1: matmul on other data (1 s), 2: matmul needing the gather (1 s), 3: end
  tasks = [TL.Task("comm", [], coll=c), TL.Task("compute", []), TL.Task("compute", [0]), TL.Task("", [1, 2])]
  r = TL.replay(tasks, [1.0, 1.0, 1.0, 0.0], [("link",), ("compute",), ("compute",), ()])
  assert r.makespan == 2.0 and r.start[2] == 1.0          # the gather runs behind matmul 1
  serial = TL.replay(tasks, [1.0, 1.0, 1.0, 0.0], [("one",)] * 3 + [()])
  assert serial.makespan == 3.0
  # two ready gathers: the one feeding the longer chain goes first (critical path)
  tasks = [TL.Task("comm", [], coll=c), TL.Task("comm", [], coll=c), TL.Task("compute", [1]), TL.Task("", [0, 2])]
  r = TL.replay(tasks, [1.0, 1.0, 5.0, 0.0], [("link",), ("link",), ("compute",), ()])
  assert r.start[1] == 0.0 and r.makespan == 6.0
  assert TL.critical_path(tasks, r) == [2, 1]            # the matmul, after the gather it waited for
  # a matmul waiting for a gather queued behind another on the same link: both gathers are on the path
  tasks = [TL.Task("comm", [], coll=c), TL.Task("comm", [], coll=c), TL.Task("compute", [1]), TL.Task("", [0, 2])]
  r = TL.replay(tasks, [3.0, 1.0, 1.0, 0.0], [("link",), ("link",), ("compute",), ()])
  assert r.makespan == 5.0 and TL.critical_path(tasks, r) == [2, 1, 0]


def hand_matmul_flops(mesh_shape) -> int:
  """Matmul FLOPs per device of one tiny grad step: forward 2 x tokens x (weights per device) per projection,
  attention 2 x 2 x b H L L K; backward twice the forward (dgrad and wgrad)."""
  m, B = tiny_config().model, tiny_config().train.batch_size
  X, Y = mesh_shape
  D, F, H, K, V, L = m.d_model, m.d_ff, m.n_heads, m.head_dim, m.vocab_size, m.seq_len
  b = B // X
  T = b * L
  layer = 2 * T * (D * 3 * H * K + H * K * D + D * 2 * F + F * D) // Y + 2 * 2 * b * (H // Y) * L * L * K
  return 3 * (m.n_layers * layer + 2 * T * D * V // Y)


@pytest.mark.slow
@pytest.mark.parametrize("preset,mesh_shape", [("baseline", (2, 4)), ("collective_matmul_bidi", (2, 4))])
def test_prediction_bounds_and_flops(preset, mesh_shape):
  from shardlab.analysis import costmodel
  pred, evs = costmodel.predict(compiled_grads(mesh_shape, knobs(preset))[0].as_text(), mesh_of(*mesh_shape), H100)
  assert {"hardware", "t_compute_s", "t_comm_s", "t_serial_s", "t_overlapped_s", "mfu"} <= pred.keys()
  assert {"fsdp", "tensor"} <= pred["t_comm_s"].keys()
  assert pred["matmul_flops_per_device"] == hand_matmul_flops(mesh_shape)     # rings split matmuls, not FLOPs
  assert pred["t_compute_s"] == pytest.approx(pred["matmul_flops_per_device"] / H100.peak_flops)
  assert pred["t_serial_s"] == pytest.approx(pred["t_compute_s"] + sum(pred["t_comm_s"].values()))
  assert pred["t_bound_s"] <= pred["t_overlapped_s"] * (1 + 1e-9) <= pred["t_serial_s"] * (1 + 1e-9)
  assert sum(e["dur"] for e in evs if e["row"] == "compute") == pytest.approx(pred["t_compute_s"])
  assert sum(pred["critical_path_s"].values()) == pytest.approx(pred["t_overlapped_s"])


@pytest.mark.slow
def test_prefetch_hides_the_fsdp_gathers_and_baseline_does_not():
  """Pure FSDP (8x1), on hardware where a layer's gathers take about half its matmuls. Baseline: each forward
  layer starts with gathers nothing can hide (its first matmul needs them). Prefetch 1: layer l+1's gathers run
  behind layer l's matmuls, in forward and backward. The latency floor is small enough (0.2 us a hop) that the
  tiny model's gathers are bandwidth-bound, as a real model's are: at 1 us, seven latency-bound collectives a
  layer (q and k/v are two weights) make the re-gather before backward, which waits for the loss gradient,
  longer than the matmul it would hide behind."""
  from shardlab.analysis import costmodel, timeline as TL
  hw = HardwareConfig(name="test", peak_flops=1e11, ici_bandwidth=1e10, hop_latency_s=2e-7)
  out = {}
  for preset in ("baseline", "fsdp_prefetch"):
    pred, evs = costmodel.predict(compiled_grads((8, 1), knobs(preset))[0].as_text(), mesh_of(8, 1), hw)
    busy = TL.union((e["start"], e["start"] + e["dur"]) for e in evs if e["row"] == "compute")
    exposed = {tuple(e["args"]["iteration"]) for e in evs if e["cat"] == "fsdp all-gather" and e["args"]["iteration"]
               and TL.overlap([(e["start"], e["start"] + e["dur"])], busy) == 0}
    out[preset] = pred["fsdp_gather_hidden_fraction"], exposed, pred
  (base, base_exposed, base_pred), (pre, pre_exposed, pre_pred) = out["baseline"], out["fsdp_prefetch"]
  assert pre["forward_layer_loop"] > 0.99 and pre["backward_layer_loop"] > 0.99 and not pre_exposed
  assert base["forward_layer_loop"] < 0.8 and len(base_exposed) >= tiny_config().model.n_layers - 1
  assert pre_pred["critical_path_s"]["fsdp"] < base_pred["critical_path_s"]["fsdp"]


def test_run_writes_prediction_timeline_and_memory(tmp_path):
  """What run.py adds to a run: summary `prediction` and `memory.analytic`, timeline.json (trace events) and
  timeline.png."""
  from shardlab.analysis import costmodel, program
  compiled = compiled_grads((2, 4), knobs("fsdp_prefetch"))[0]
  cfg = tiny_config(**dict(knobs("fsdp_prefetch")))
  got = costmodel.predict_run(compiled, mesh_of(2, 4), resolve(cfg), tmp_path, {"memory": program.memory(compiled)})
  assert got["prediction"]["hardware"] == "h100" and got["prediction"]["t_overlapped_s"] > 0
  assert got["memory"]["analytic"]["total"] > 0 and got["memory"]["compiled_over_analytic"] > 0
  assert got["ledger"]["compiled"]["all-gather"]["fsdp"]["f32"]["forward_bytes"] > 0
  trace = json.loads((tmp_path / "timeline.json").read_text())
  spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
  assert {"compute", "comm fsdp", "comm tensor"} <= names and all(e["dur"] >= 0 <= e["ts"] for e in spans)
  assert len(spans) == got["prediction"]["matmuls"] + got["prediction"]["collectives"]
  assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_memory_breakdown_by_hand():
  """ZeRO (arXiv:1910.02054): fp32 master + grads + 2 Adam moments = 16 B per local parameter; gathered weights W[D, N_tp]
  for prefetch+1 layers plus the embedding, unembedding and final norm, which the layers' backward does without."""
  from shardlab.analysis.memory_model import breakdown
  cfg = tiny_config(prefetch=1)
  cfg.mesh.fsdp, cfg.mesh.tensor = X, Y = 4, 2
  m = cfg.model
  D, F, H, K, V, NL = m.d_model, m.d_ff, m.n_heads, m.head_dim, m.vocab_size, m.n_layers
  mats = D * 3 * H * K + H * K * D + D * 2 * F + F * D
  local = NL * (2 * D // X + mats // (X * Y)) + 2 * V * D // (X * Y) + D // X
  got = breakdown(resolve(cfg))
  assert (got["master_params"], got["grads"], got["optimizer"]) == (4 * local, 4 * local, 8 * local)
  assert got["gathered_weights"] == 4 * (2 * (2 * D + mats // Y) + 2 * V * D // Y + D)
  assert got["layer_gradient"] == 4 * (2 * D + mats // Y)          # one layer's W[D, N_tp] gradient, fp32
  assert got["top_gradient"] == 4 * V * D // Y                      # the [V, D] embedding's (or head's), fp32
  # one pass: the gradients come after the loss's logits (fp32 logits and softmax: 8 B each) are gone, and so are
  # the gathered embedding, head and final norm (the forward's lookup and the loss read them; baseline gathers
  # every layer again for backward)
  logits = cfg.train.batch_size // X * m.seq_len * V // Y * 8
  top = 4 * (2 * V * D // Y + D)
  state = got["master_params"] + got["optimizer"]
  common = got["gathered_weights"] + got["activations"] - logits
  assert got["total"] == state + common + max(logits, got["grads"] + max(got["layer_gradient"], got["top_gradient"])
                                              - top)


def test_widened_collectives_are_costed_at_the_program_bytes():
  """XLA:CPU widens bf16 collectives to f32 (it has no bf16 collectives): the ledger of a bf16 program's HLO
  shows twice its bytes, and the cost model scales those collectives back to the program's."""
  from shardlab.analysis.ledger import Row, dtype_scale
  row = lambda dtype, scope, full: Row("all-gather", "fsdp", dtype, scope, False, 4, 1, 3, full, full * 3 // 4)
  program = [row("bf16", "fsdp_all_gather", 4096), row("f32", "vocab_max", 64)]
  compiled = [row("f32", "fsdp_all_gather", 8192), row("f32", "vocab_max", 64)]
  assert dtype_scale(program, compiled) == {("all-gather", "fsdp", "fsdp_all_gather"): 0.5}


def test_data_axis_across_nodes_is_costed_at_the_nodes_nics():
  """HSDP over 8 nodes of 8 H100 (data 8 x fsdp 8): fsdp stays inside a node (NVLink, ici_bandwidth); the data
  axis joins one GPU per node, so it gets that GPU's NIC share (dcn_bandwidth, 50 GB/s: Scaling Book gpus.md).
  On one node (2x2x2) every axis is NVLink; on a TPU torus the data axis uses ICI like the others."""
  from conftest import compose
  from shardlab.analysis.links import axis_bandwidth
  from shardlab.analysis.links import link_axes
  from shardlab.config import to_config
  cfg = to_config(compose("hardware=h100", "mesh.data=8", "mesh.fsdp=8", "mesh.tensor=1"))
  links, hw = link_axes(cfg), cfg.hardware
  assert axis_bandwidth("fsdp", hw, links) == hw.ici_bandwidth
  assert axis_bandwidth("data", hw, links) == hw.dcn_bandwidth < hw.ici_bandwidth
  assert axis_bandwidth("data+fsdp", hw, links) == hw.dcn_bandwidth
  one_node = to_config(compose("hardware=h100", "mesh=2x2x2"))
  assert axis_bandwidth("data", one_node.hardware, link_axes(one_node)) == one_node.hardware.ici_bandwidth
  tpu = to_config(compose("hardware=tpu_v5p", "mesh=2x2x2", "mesh.data_ici_axes=2"))
  assert axis_bandwidth("data", tpu.hardware, link_axes(tpu)) == 2 * tpu.hardware.ici_bandwidth


def test_a_kernel_reads_only_the_slices_it_takes():
  """calibrated.kernel_bytes: a fused parameter read through dynamic-slices counts the slices, also where a layout
  change or a transpose sits between them (libtpu's gspmd program changes a stacked [36, ...] attention mask's
  layout in a nested fusion, then takes one block per loop trip: 1/36 of it, not all of it, per trip); a parameter
  that any op reads whole counts whole (w: also sliced, but negated whole), and so does one whose nested fusion is
  not one to one (v: reversed before its slice)."""
  import pytest
  from shardlab.analysis import calibrated, hlo
  text = """HloModule m

%relayout_body (a: pred[36,8,128]) -> pred[36,8,128] {
  %a = pred[36,8,128]{2,1,0} parameter(0)
  ROOT %c = pred[36,8,128]{1,2,0} copy(%a)
}

%reverse_body (b: f32[36,8,128]) -> f32[36,8,128] {
  %b = f32[36,8,128]{2,1,0} parameter(0)
  ROOT %r = f32[36,8,128]{2,1,0} reverse(%b), dimensions={0}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused (p0: pred[36,8,128], p1: s32[], p2: f32[36,8,128], p3: f32[4,8,128]) -> f32[8,128] {
  %p0 = pred[36,8,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[36,8,128]{2,1,0} parameter(2)
  %p3 = f32[4,8,128]{2,1,0} parameter(3)
  %z = s32[] constant(0)
  %relayout = pred[36,8,128]{1,2,0} fusion(%p0), kind=kLoop, calls=%relayout_body
  %tr = pred[36,128,8]{2,1,0} transpose(%relayout), dimensions={0,2,1}
  %ds = pred[1,128,8]{2,1,0} dynamic-slice(%tr, %p1, %z, %z), dynamic_slice_sizes={1,128,8}
  %block = pred[128,8]{1,0} bitcast(%ds)
  %mask = pred[8,128]{1,0} transpose(%block), dimensions={1,0}
  %reversed = f32[36,8,128]{2,1,0} fusion(%p2), kind=kLoop, calls=%reverse_body
  %vs = f32[1,8,128]{2,1,0} dynamic-slice(%reversed, %p1, %z, %z), dynamic_slice_sizes={1,8,128}
  %v = f32[8,128]{1,0} bitcast(%vs)
  %ws = f32[1,8,128]{2,1,0} dynamic-slice(%p3, %p1, %z, %z), dynamic_slice_sizes={1,8,128}
  %w1 = f32[8,128]{1,0} bitcast(%ws)
  %neg = f32[4,8,128]{2,1,0} negate(%p3)
  %zero = f32[] constant(0)
  %sum = f32[8,128]{1,0} reduce(%neg, %zero), dimensions={0}, to_apply=%add
  %vw = f32[8,128]{1,0} add(%v, %w1)
  ROOT %out = f32[8,128]{1,0} select(%mask, %vw, %sum)
}

ENTRY %main (x: pred[36,8,128], i: s32[], y: f32[36,8,128], w: f32[4,8,128]) -> f32[8,128] {
  %x = pred[36,8,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %y = f32[36,8,128]{2,1,0} parameter(2)
  %w = f32[4,8,128]{2,1,0} parameter(3)
  ROOT %f = f32[8,128]{1,0} fusion(%x, %i, %y, %w), kind=kLoop, calls=%fused
}
"""
  comps, entry = hlo.parse(text)
  ins = next(i for i in comps[entry] if i.opcode == "fusion")
  shapes = {i.name: i.shape for i in comps[entry]}
  mask_block, index, v_whole, w_whole, out = 8 * 128, 4, 36 * 8 * 128 * 4, 4 * 8 * 128 * 4, 8 * 128 * 4
  assert calibrated.kernel_bytes(ins, shapes, comps) == pytest.approx(mask_block + index + v_whole + w_whole + out)


ASYNC_FUSION = """HloModule m, is_scheduled=true

%start_body (p0: bf16[256,1024]) -> (bf16[256,1024], bf16[1024,1024]) {
  %p0 = bf16[256,1024]{1,0} parameter(0)
  %ag0 = bf16[1024,1024]{1,0} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true, frontend_attributes={chain_id="0"}
  ROOT %cs = (bf16[256,1024]{1,0}, bf16[1024,1024]{1,0}) custom-call(%ag0), custom_call_target="AsyncCollectiveStart"
}

%cont_body (p0: bf16[256,1024], p1: bf16[1024,1024], x: bf16[2048,2048], w: bf16[2048,2048]) -> (bf16[2048,2048], bf16[256,1024], bf16[1024,1024]) {
  %x = bf16[2048,2048]{1,0} parameter(2)
  %w = bf16[2048,2048]{1,0} parameter(3)
  %y = bf16[2048,2048]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %p0 = bf16[256,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  %ag1 = bf16[1024,1024]{1,0} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true, frontend_attributes={chain_id="0"}
  ROOT %t = (bf16[2048,2048]{1,0}, bf16[256,1024]{1,0}, bf16[1024,1024]{1,0}) tuple(%y, %p0, %p1)
}

%done_body (p0: bf16[256,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[256,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  %ag2 = bf16[1024,1024]{1,0} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true, frontend_attributes={chain_id="0"}
  ROOT %cd = bf16[1024,1024]{1,0} custom-call(%p0, %p1, %ag2), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (w0: bf16[256,1024], x: bf16[2048,2048], w: bf16[2048,2048]) -> (bf16[2048,2048], bf16[1024,1024]) {
  %w0 = bf16[256,1024]{1,0} parameter(0)
  %x = bf16[2048,2048]{1,0} parameter(1)
  %w = bf16[2048,2048]{1,0} parameter(2)
  %s = (bf16[256,1024]{1,0}, bf16[1024,1024]{1,0}) fusion(%w0), kind=kCustom, calls=%start_body
  %s0 = bf16[256,1024]{1,0} get-tuple-element(%s), index=0
  %s1 = bf16[1024,1024]{1,0} get-tuple-element(%s), index=1
  %c = (bf16[2048,2048]{1,0}, bf16[256,1024]{1,0}, bf16[1024,1024]{1,0}) fusion(%s0, %s1, %x, %w), kind=kOutput, calls=%cont_body
  %y = bf16[2048,2048]{1,0} get-tuple-element(%c), index=0
  %c1 = bf16[256,1024]{1,0} get-tuple-element(%c), index=1
  %c2 = bf16[1024,1024]{1,0} get-tuple-element(%c), index=2
  %g = bf16[1024,1024]{1,0} fusion(%c1, %c2), kind=kCustom, calls=%done_body
  ROOT %out = (bf16[2048,2048]{1,0}, bf16[1024,1024]{1,0}) tuple(%y, %g)
}
"""


def test_libtpu_async_collective_fusion_runs_beside_the_kernels_it_continues_in():
  """libtpu's async collective fusion (conf/xla/maxtext_v5p.yaml's flags) splits one all-gather over a start
  fusion, a compute fusion it continues in and a done fusion, each with a copy of it under one chain_id: the ledger
  counts one collective, and the replay starts its transfer at the start, runs the matmul fusion beside it (at the
  matmul's own bytes, not the gather's buffers it carries) and waits at the done: exposed is what the matmul does
  not cover; the overlap report pairs its start and done around the matmul. The same program with the gather
  synchronous waits for all of it."""
  import numpy as np
  import pytest
  from shardlab.analysis import calibrated, hlo
  from shardlab.analysis.links import collective_seconds
  from shardlab.analysis.program import Program
  from conftest import compose
  from shardlab.config import to_config
  hw = to_config(compose("hardware=tpu_v5p")).hardware
  prog = Program(ASYNC_FUSION, np.arange(4), ("fsdp",), "tpu")
  assert [(c.kind, c.axis, c.bytes_full) for c in prog.collectives] == [("all-gather", "fsdp", 1024 * 1024 * 2)]
  roles = [hlo.async_fusion(i, prog.comps) for i in prog.comps[prog.entry] if i.opcode == "fusion"]
  assert [r[0] for r in roles] == ["start", "continuation", "done"] and len({r[1] for r in roles}) == 1
  pairs = prog.async_pairs()                                # summary.json's `overlap` reads these
  assert [(p.coll.kind, p.gemms, p.kernels) for p in pairs] == [("all-gather", 1, 1)]
  c = prog.collectives[0]
  comm = collective_seconds(c.kind, c.bytes_moved, c.group_size, c.axis, hw, {})
  matmul_bytes = 3 * 2048 * 2048 * 2                          # x, w and y: not the gather's 0.5 + 2 + 2 MiB
  kernel = calibrated.gemm_seconds(2 * 2048 ** 3, [2048, 2048], matmul_bytes, hw, "bfloat16") + hw.kernel_launch_s
  r = calibrated.replay(prog, hw)
  assert r.t_comm_s == {"fsdp": pytest.approx(comm)} and r.kernels == 1
  assert r.t_compute_s == pytest.approx(kernel)
  assert r.t_exposed_comm_s == pytest.approx(max(0.0, comm - kernel))
  assert r.t_total_s == pytest.approx(max(comm, kernel))
  sync = ASYNC_FUSION.replace('frontend_attributes={chain_id="0"}', "")
  s = calibrated.replay(Program(sync, np.arange(4), ("fsdp",), "tpu"), hw)
  assert s.t_total_s > r.t_total_s
