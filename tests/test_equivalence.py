"""Every schedule is the same training as the unsharded reference: loss and every gradient, float32, on
every mesh shape. New presets in conf/schedule/ are picked up by themselves."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MESHES, compiled_grads, load_preset, preset_names, reference_loss_and_grads, tiny_config
from shardlab.composition import resolve
from shardlab.testing import assert_trees_close, placed_batch

# float32 sums in a different order on each mesh: ~1e-7 relative per op, a few e-6 after a backward pass.
RTOL, ATOL = 2e-5, 2e-5


def _check(mesh_shape, knobs, label):
  loss, grads = compiled_grads(mesh_shape, tuple(sorted(knobs.items())))[1]
  ref_loss, ref_grads = reference_loss_and_grads()
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6, err_msg=label)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=label)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("preset", preset_names())
def test_preset_matches_reference(preset, mesh_shape):
  knobs = {k: v for k, v in load_preset(preset).items() if k != "name"}
  _check(mesh_shape, knobs, f"{preset} on {mesh_shape}: ")


# Knob combinations beyond the presets, each knob against the others; meshes alternate between the two 2D
# shapes (the presets already cover every shape).
MATRIX = [
    ((2, 4), dict(prefetch=1, tp="ring", remat="full")),
    ((4, 2), dict(prefetch=2, reshard_after_forward=False, tp="ring_bidi")),
    ((2, 4), dict(prefetch=1, tp="allreduce", microbatches=2)),
    ((4, 2), dict(prefetch=2, remat="save_matmuls", microbatches=2, tp="ring")),
    ((2, 4), dict(reshard_after_forward=False, remat="full", tp="allreduce")),
    ((4, 2), dict(grad_reduce="deferred", microbatches=2, tp="ring_bidi", remat="save_matmuls")),
    ((2, 4), dict(gather_dtype="compute", prefetch=1, reshard_after_forward=False, microbatches=2)),
    ((4, 2), dict(grad_reduce="next_layer", prefetch=2, tp="ring", remat="full")),
    ((2, 4), dict(grad_reduce="next_layer", reshard_after_forward=False, microbatches=2, tp="allreduce")),
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,knobs", MATRIX,
                         ids=[f"{m[0]}x{m[1]}-" + ",".join(f"{a}={b}" for a, b in k.items()) for m, k in MATRIX])
def test_knob_matrix_matches_reference(mesh_shape, knobs):
  _check(mesh_shape, knobs, f"{knobs} on {mesh_shape}: ")


# HSDP: a `data` axis in front (weights replicated over it, sharded over fsdp; gradients reduce-scattered over
# fsdp, then all-reduced over data). 1x2x4 is not here: it is the 2D 2x4 mesh (a data axis of 1 is none, the test
# below), which test_preset_matches_reference covers.
HSDP_MESHES = [(2, 2, 2), (2, 1, 4)]


def test_a_data_axis_of_one_is_the_2d_mesh():
  from shardlab.testing import named_shape
  assert named_shape((1, 2, 4)) == named_shape((2, 4)) == {"fsdp": 2, "tensor": 4}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", HSDP_MESHES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("preset", preset_names())
def test_preset_matches_reference_with_a_data_axis(preset, mesh_shape):
  knobs = {k: v for k, v in load_preset(preset).items() if k != "name"}
  _check(mesh_shape, knobs, f"{preset} on {mesh_shape}: ")


# The FFN-only model (model.kind=ffn: the Scaling Book's blocks on fixed token codes) is the same training as its
# reference too: every preset on one mesh each (cycling through every 2D shape and 2x2x2), baseline on the rest.
FFN = {"kind": "ffn"}
FFN_MESHES = [*MESHES, (2, 2, 2), (1, 1)]
FFN_CASES = [(p, FFN_MESHES[i % (len(FFN_MESHES) - 1)]) for i, p in enumerate(preset_names())]
FFN_CASES += [("baseline", m) for m in FFN_MESHES if ("baseline", m) not in FFN_CASES]


@pytest.mark.parametrize("preset,mesh_shape", FFN_CASES, ids=[f"{p}-{'x'.join(map(str, m))}" for p, m in FFN_CASES])
def test_ffn_model_matches_reference(preset, mesh_shape):
  from shardlab.testing import compile_schedule
  knobs = {k: v for k, v in load_preset(preset).items() if k != "name"}
  loss, grads = compile_schedule(knobs, mesh_shape, FFN)[1]
  ref_loss, ref_grads = reference_loss_and_grads(FFN)
  label = f"ffn, {preset} on {mesh_shape}: "
  assert set(grads["layers"]) == {"wi", "wd"}, label
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6, err_msg=label)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=label)


def test_one_device_mesh_matches_reference():
  _check((1, 1), {}, "1x1: ")


@pytest.mark.slow
def test_one_optimizer_step_matches_reference():
  """One full step (clip, AdamW) on the sharded state equals optax on the unsharded params."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from conftest import batch, mesh_of
  from shardlab import params as PM, reference as R, schedules, train as T
  import dataclasses
  # Adam's first update is lr * g / (|g| + eps): with eps = 1e-8 an element whose |g| is ~1e-8 turns a
  # float32 rounding in g into an O(lr) change. A larger eps makes the update smooth in g (its slope in g is at
  # most lr / eps), so the step can be held to the same tight tolerance as the gradients; lr 3e-3 keeps that
  # slope where the tolerance was set (the default lr, 2e-2, multiplies it by 7).
  cfg = tiny_config(prefetch=1, tp="ring")
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, adam_eps=1e-4, lr=3e-3))
  mesh = mesh_of(2, 4)
  decls = PM.declare(cfg.model)
  opt = T.make_optimizer(cfg.train, decls)
  state = T.init_state(PM.init_sharded(0, decls, cfg.model, mesh), opt, decls, mesh)
  step = T.make_train_step(resolve(cfg), schedules.build(cfg.schedule, cfg.model, jnp.float32), decls, opt, mesh)
  b = batch()
  state, met = step(state, placed_batch(b, mesh))
  p0 = PM.init(jax.random.key(0), decls, cfg.model)
  ropt = R.optimizer(cfg.train, p0)
  p1, _, rloss, rnorm = jax.jit(lambda p, o, b: R.train_step(p, o, b, cfg.model, ropt))(p0, ropt.init(p0), b)
  np.testing.assert_allclose(float(met["loss"]), float(rloss), rtol=1e-6)
  np.testing.assert_allclose(float(met["grad_norm"]), float(rnorm), rtol=1e-5)
  assert_trees_close(state["params"], p1, rtol=1e-6, atol=1e-6, label="params after one step: ")
  assert int(state["step"]) == 1


@pytest.mark.slow
def test_gather_dtype_compute_is_exact_in_fp32():
  """gather_dtype=compute in float32 is the same program's numbers (the cast is the identity)."""
  a = compiled_grads((4, 2), tuple(sorted(dict(gather_dtype="compute").items())))[1]
  b = compiled_grads((4, 2), ())[1]
  assert_trees_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_bfloat16_compute_trains_the_same_model_and_gathers_half_the_bytes():
  """precision.compute_dtype=bfloat16: bf16 matmuls and, with gather_dtype=compute, bf16 FSDP gathers (half
  the bytes of fp32 in the traced program); loss and gradients stay close to the fp32 reference."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from conftest import batch, mesh_of
  from shardlab import params as PM, schedules, train as T
  from shardlab.analysis import ledger
  cfg = tiny_config(gather_dtype="compute", prefetch=1)
  mesh = mesh_of(2, 4)
  decls = PM.declare(cfg.model)
  params = PM.init_sharded(0, decls, cfg.model, mesh)
  b = placed_batch(batch(), mesh)
  fn = T.make_grad_fn(resolve(cfg), schedules.build(cfg.schedule, cfg.model, jnp.bfloat16), decls, mesh)
  loss, grads = fn(params, b)
  ref_loss, ref_grads = reference_loss_and_grads()
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-2)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))      # master gradients stay fp32
  cos = lambda a, e: float(np.vdot(a, e) / (np.linalg.norm(a) * np.linalg.norm(e) + 1e-30))
  for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
    assert cos(np.asarray(g, np.float64).ravel(), np.asarray(r, np.float64).ravel()) > 0.99, path
  gathers = ledger.nested(ledger.from_program(jax.make_jaxpr(fn)(params, b)))["all-gather"]["fsdp"]
  assert set(gathers) == {"bf16"}, gathers


def test_layout_rule_change_changes_the_sharding_and_still_matches_reference():
  """The layout rule embed -> none: weights replicated over fsdp (plain data parallelism) instead of sharded
  (ZeRO-3), a value passed to the declarations and the schedule (no global). The compiled program changes (no
  FSDP gathers; gradients all-reduced over fsdp) and the training is still the reference's. A rule the schedule
  cannot honour, or that collides in one array, fails with one line before compiling."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from conftest import batch, mesh_of
  from shardlab import params as PM, schedules, train as T
  from shardlab.analysis import hlo
  from shardlab.layout import DEFAULT_RULES, Layout
  from shardlab.mesh import ConfigError
  cfg, mesh = tiny_config(), mesh_of(2, 4)
  layout = Layout.of({**DEFAULT_RULES, "embed": None})
  decls = PM.declare(cfg.model, layout=layout, axis_names=mesh.axis_names)
  assert decls["layers"]["wi"].spec() == P(None, None, None, "tensor")
  fn = T.make_grad_fn(resolve(cfg), schedules.build(cfg.schedule, cfg.model, jnp.float32, layout), decls, mesh)
  params = PM.init_sharded(0, decls, cfg.model, mesh)
  compiled = fn.lower(params, placed_batch(batch(), mesh)).compile()
  loss, grads = compiled(params, placed_batch(batch(), mesh))
  ref_loss, ref_grads = reference_loss_and_grads()
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label="layout embed -> none: ")
  ledger = hlo.ledger(hlo.collectives(compiled.as_text(), mesh))
  assert "fsdp" not in ledger.get("all-gather", {}) and "fsdp" not in ledger.get("reduce-scatter", {}), ledger
  assert ledger["all-reduce"]["fsdp"]["bytes"] > 1000, ledger   # gradients all-reduced, not reduce-scattered
  bad = Layout.of({**DEFAULT_RULES, "mlp": None})
  with pytest.raises(ConfigError, match=r"^layout rule mlp -> none \(replicated\): the ExplicitSchedule schedule "
                                        r"cannot honour it on this mesh; it takes tensor$"):
    T.make_grad_fn(resolve(cfg), schedules.build(cfg.schedule, cfg.model, jnp.float32, bad), decls, mesh)
  with pytest.raises(ConfigError, match=r"^layout rules vocab -> tensor and embed -> tensor collide in embed "):
    PM.declare(cfg.model, layout=Layout.of({**DEFAULT_RULES, "embed": "tensor"}), axis_names=mesh.axis_names)
  with pytest.raises(ConfigError, match=r"^layout rule embed -> tensor: the tensor axis does not shard embed"):
    Layout.of({**DEFAULT_RULES, "embed": "tensor"}).check()
