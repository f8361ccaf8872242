"""The compiled program communicates only the way the code placed: every collective kind in the optimized
HLO is one the traced program placed (XLA added no resharding of its own)."""
import re

import pytest

from conftest import compiled_grads, load_preset, preset_names
from shardlab.composition import resolve
from shardlab.testing import placed_batch

PLACED_TO_HLO = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "psum": "all-reduce",
                 "psum_invariant": "all-reduce", "pmax": "all-reduce", "ppermute": "collective-permute",
                 "all_to_all": "all-to-all"}
HLO_COLLECTIVE = re.compile(r"= \S+ (all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all|"
                            r"collective-broadcast|ragged-all-to-all)(?:-start)?\(")


def hlo_kinds(compiled) -> set:
  return set(HLO_COLLECTIVE.findall(compiled.as_text()))


def placed_kinds(compiled_fn_jaxpr: str) -> set:
  prims = re.findall(r"\b(" + "|".join(PLACED_TO_HLO) + r")\[", compiled_fn_jaxpr)
  return {PLACED_TO_HLO[p] for p in prims}


@pytest.mark.slow
@pytest.mark.parametrize("preset", preset_names())
def test_hlo_collectives_are_the_placed_ones(preset):
  import jax
  from conftest import batch, mesh_of, tiny_config
  from shardlab import params as PM, schedules, train as T
  import jax.numpy as jnp
  knobs = {k: v for k, v in load_preset(preset).items() if k != "name"}
  compiled, _ = compiled_grads((2, 4), tuple(sorted(knobs.items())))
  if knobs["impl"] == "gspmd":
    pytest.skip("gspmd leaves every collective to the compiler (test_gspmd_collectives_are_all_unplanned)")
  cfg = tiny_config(**knobs)
  decls = PM.declare(cfg.model)
  mesh = mesh_of(2, 4)
  fn = T.make_grad_fn(resolve(cfg), schedules.build(cfg.schedule, cfg.model, jnp.float32), decls, mesh)
  placed = placed_kinds(str(jax.make_jaxpr(fn)(PM.init_sharded(0, decls, cfg.model, mesh), placed_batch(batch(), mesh))))
  found = hlo_kinds(compiled)
  assert found, "no collectives at all in a 2x4 program"
  assert found <= placed, f"{preset}: the compiler added {found - placed} (placed: {sorted(placed)})"
  ring = knobs.get("tp", "allgather").startswith("ring")
  assert ("collective-permute" in found) == ring, f"{preset}: collective-permute present={not ring}"


def test_audit_rule_is_the_collectives_scope_prefix():
  """One rule: hlo's prefix is collectives.py's; any name under it is planned, nothing else is."""
  from shardlab import collectives as C
  from shardlab.analysis import hlo
  assert hlo.SCOPE_PREFIX == C.SCOPE_PREFIX
  assert hlo.scope_of("jit(step)/shard_map/transpose(jvp(shardlab.my_new_contraction))/all_gather") == \
      "my_new_contraction"
  assert hlo.scope_of("jit(step)/shard_map/shardlab.ag_matmul_ring/shardlab.ring_shift/ppermute") == "ring_shift"
  assert not hlo.planned("jit(step)/shard_map/fsdp_all_gather/all_gather")   # a bare scope: not through C


def test_gspmd_collectives_are_all_unplanned():
  """The audit's negative control: under plain jit every collective is the compiler's, and flagged."""
  import numpy as np
  from conftest import mesh_of
  from shardlab.analysis import hlo
  from shardlab.analysis.program import audit
  knobs = {k: v for k, v in load_preset("gspmd").items() if k != "name"}
  compiled, _ = compiled_grads((2, 4), tuple(sorted(knobs.items())))
  colls = hlo.collectives(compiled.as_text(), mesh_of(2, 4))
  assert colls and len(audit(colls)["unplanned"]) == len(colls)
  # Every group is read (XLA's partitioner writes them as `mesh[..] {axes}`), and the layout's activation hints
  # shard heads and d_ff, not head_dim: the only resharding left is the embedding lookup's (a token gather).
  assert all(c.axis in ("fsdp", "tensor", "fsdp+tensor") for c in colls)
  assert {c.axis for c in colls if c.kind != "all-reduce"} == {"fsdp", "tensor"}   # (read as one group: fsdp+tensor)
  assert not [c.op_name for c in colls if c.kind in ("all-to-all", "collective-permute") and "_take" not in c.op_name]


@pytest.mark.parametrize("text,groups", [
    ("mesh['axis_0'=4,'axis_1'=2,'axis_2'=1] {'axis_1'}, dimensions={1}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}", [list(range(8))]),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_0':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_0':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("mesh['x'=2,'y'=2], device_ids=(3,2,1,0) {'y'}", [[3, 2], [1, 0]]),
    ("mesh['x'=2,'y'=2] {}", [[0], [1], [2], [3]])])
def test_mesh_replica_groups_are_read(text, groups):
  """XLA's mesh form of replica groups (xla/hlo/ir/mesh_and_axis.cc): the devices on named axes (iota, a list,
  or an iota transposed), grouped along the braced axes or sub-axes `'x':(pre)size`."""
  from shardlab.analysis import hlo
  assert hlo.mesh_groups(text) == groups


@pytest.mark.parametrize("text", ["mesh['x'=2] ('x')", "mesh['x'=2] {'z'}", "mesh[] {}"])
def test_mesh_replica_groups_it_cannot_read_are_one_error(text):
  from shardlab.analysis import hlo
  with pytest.raises(ValueError, match="not a form shardlab reads"):
    hlo.mesh_groups(text)


@pytest.mark.parametrize("strides,padding,lhs_dilation,rhs_dilation", [
    ((1,), [(0, 0)], (1,), (1,)), ((2,), [(3, 1)], (1,), (1,)), ((1,), [(15, 15)], (1,), (1,)),
    ((3,), [(0, 2)], (4,), (1,)), ((1,), [(2, 2)], (1,), (2,))])
def test_convolution_flops_equal_xlas_count(strides, padding, lhs_dilation, rhs_dilation):
  """libtpu writes every matmul as a convolution (a batch dim as a padded, reversed window: one valid tap per
  output): its FLOPs, counted from the window's valid taps, equal XLA's own cost analysis for strides, padding
  and dilations, including the one-input-position window libtpu uses for a batch dim."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from shardlab.analysis import hlo
  checked = 0
  for length, window in ((16, 16), (1, 16), (10, 3)):
    f = jax.jit(lambda a, b: lax.conv_general_dilated(
        a, b, strides, padding, lhs_dilation, rhs_dilation, dimension_numbers=("NCH", "OIH", "NCH")))
    x, w = jax.ShapeDtypeStruct((2, 5, length), jnp.float32), jax.ShapeDtypeStruct((7, 5, window), jnp.float32)
    compiled = f.lower(x, w).compile()
    xla = compiled.cost_analysis().get("flops")
    if xla is None:     # a window longer than the padded input: an empty output, no convolution left
      continue
    comps, entry = hlo.parse(compiled.as_text())
    shapes, flops = {i.name: i.shape for i in comps[entry]}, hlo.flops_fn(comps)
    assert sum(flops(i, shapes) for i in comps[entry]) == xla > 0, (length, window)
    checked += 1
  assert checked >= 1


def test_cpu_programs_with_collectives_in_a_loop_and_outside_stay_out_of_the_persistent_cache():
  """jaxlib 0.10.2 restores a cached XLA:CPU program's collectives in order only within each computation
  (mesh.guard_persistent_cache): a psum in a scan's body and one outside it are two computations with
  collectives, so that program is not stored; a flat program with two psums is one computation and is stored."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  from shardlab.analysis.hlo import collective_computations
  from shardlab.axes import FSDP
  from shardlab.testing import mesh_of
  mesh = mesh_of(8, 1)

  def looped(x):
    y = jax.lax.scan(lambda c, _: (c + jax.lax.psum(c, FSDP), None), x, None, length=3)[0]
    return jax.lax.psum(y * 2.0, FSDP)

  def flat(x):
    return jax.lax.psum(jax.lax.psum(x, FSDP) * 2.0, FSDP)

  texts = {f.__name__: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(FSDP), out_specs=P())).lower(
      jnp.ones((8, 4))).compile().as_text() for f in (looped, flat)}
  assert len(collective_computations(texts["looped"])) == 2 and len(collective_computations(texts["flat"])) == 1
  from shardlab.analysis.hlo import COLLECTIVES, parse
  for text in texts.values():                     # the text scan finds what the parser finds
    comps = parse(text)[0]
    assert collective_computations(text) == [c for c, ins in comps.items() if any(
        i.opcode.removesuffix("-start") in COLLECTIVES for i in ins)]
  from shardlab.jax_private import cache_write_refuser
  refuse = cache_write_refuser()                                  # installed by set_cpu_devices (conftest)
  assert refuse("cpu", texts["looped"]) and not refuse("cpu", texts["flat"]) and not refuse("gpu", texts["looped"])


def test_buffer_assignment_is_read_by_kind_in_device_memory_only():
  """hlo.allocations on lines as libtpu 0.0.42 dumps them: parameters (donated outputs among them), the one
  preallocated temporary block, constants and thread-local scratch in HBM; VMEM (color 1) left out."""
  from shardlab.analysis import hlo
  text = """BufferAssignment:
allocation 0: size 512, thread-local:
 value: <1 foo @0> (size=512,offset=0): f32[128]{0}
allocation 1: size 1879048192, parameter 27, shape |f32[32,1024,2,7168]| at ShapeIndex {}, maybe-live-out:
 value: <2 p27 @0> (size=1879048192,offset=0): f32[32,1024,2,7168]{3,2,1,0:T(2,128)}
allocation 2: size 4, parameter 0, shape |s32[]| at ShapeIndex {}:
allocation 3: size 48370176, color 1, preallocated-temp:
allocation 4: size 1024, constant:
allocation 5: size 16521019648, preallocated-temp:
allocation 6: size 8, maybe-live-out:
allocation 7: size 1536, color 7, thread-local:
"""
  assert hlo.allocations(text) == {"parameter": 1879048196, "temp": 16521019656, "other": 1536,
                                   "total": 1879048196 + 16521019656 + 1536}


RING_STEP_HLO = """HloModule step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (w: f32[64,64], kv: f32[2,16]) -> (f32[64,64], f32[2,16], f32[64,64]) {
  %w = f32[64,64]{1,0} parameter(0)
  %kv = f32[2,16]{1,0} parameter(1)
  %cp-start = (f32[2,16]{1,0}, f32[2,16]{1,0}) collective-permute-start(%kv), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, metadata={op_name="jit(step)/ring_bwd_step1/shardlab.cp_ring_grad/ppermute"}
  %cp-done = f32[2,16]{1,0} collective-permute-done(%cp-start), metadata={op_name="jit(step)/ring_bwd_step1/shardlab.cp_ring_grad/ppermute"}
  %ar-start = f32[64,64]{1,0} all-reduce-start(%w), channel_id=2, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(shardlab.replicated_weight))/psum_invariant"}
  %dot = f32[64,64]{1,0} dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/ring_bwd_step1/dot_general"}
  %ar-done = f32[64,64]{1,0} all-reduce-done(%ar-start), metadata={op_name="jit(step)/transpose(jvp(shardlab.replicated_weight))/psum_invariant"}
  ROOT %out = (f32[64,64]{1,0}, f32[2,16]{1,0}, f32[64,64]{1,0}) tuple(%ar-done, %cp-done, %dot)
}
"""


def test_a_ring_shift_not_hidden_names_the_collective_in_flight_instead():
  """overlap.ring_steps: a shift the compiler scheduled with nothing of its step between start and done, while
  another collective spans that step's attention (under XLA's GPU default of one collective in flight, the one
  that took the slot: at 64K tokens the layer's weight-gradient all-reduce over context), names that collective."""
  import numpy as np
  from shardlab.analysis.program import Program
  prog = Program(RING_STEP_HLO, np.arange(4), ("context",), "gpu")
  [row] = prog.overlap()["ring_steps"]
  assert (row["pass"], row["step"], row["shift"], row["hidden"]) == ("backward", 1, "dK/dV", False), row
  assert row["in_flight_instead"] == [{"name": "ar-start", "kind": "all-reduce", "axis": "context",
                                        "scope": "replicated_weight", "bytes": 64 * 64 * 4}], row
