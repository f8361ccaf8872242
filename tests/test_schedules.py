"""What each schedule claims beyond equal numbers: the overlap it promises is possible in the program's
dependency structure, and prefetch / reshard change compiled memory the way theory says."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import compiled_grads, load_preset, mesh_of, preset_params
from shardlab.composition import resolve
from shardlab.analysis import hlo
from shardlab.analysis.program import memory
from shardlab.testing import abstract_batch


def _knobs(preset):
  return {k: v for k, v in load_preset(preset).items() if k != "name"}


@pytest.mark.parametrize("preset", preset_params())
def test_claimed_overlap_is_structurally_possible(preset):
  """On CPU nothing overlaps in time; what a GPU scheduler needs is that the transfer does not wait on the
  compute it should hide behind. Prefetched FSDP gathers: independent of every matmul of the layer loop
  body they run in. Ring steps: each ppermute independent of at least one matmul (its step's)."""
  knobs = _knobs(preset)
  if knobs["impl"] != "explicit":
    pytest.skip("claims no hand-placed overlap")
  rows = hlo.overlap_structure(compiled_grads((2, 4), tuple(sorted(knobs.items())))[0].as_text())
  gathers = [r for r in rows if r.in_loop and r.kind == "all-gather" and r.scope == "fsdp_all_gather"]
  if knobs.get("prefetch", 0) > 0:
    assert gathers and all(r.independent_matmuls == r.matmuls for r in gathers), \
        [(r.collective, r.independent_matmuls, r.matmuls) for r in gathers]
  elif knobs.get("grad_reduce") != "deferred":
    # Negative control: gathering on demand, the layer's matmuls wait for the gather.
    assert any(r.independent_matmuls < r.matmuls for r in gathers)
  # Gradient reduce-scatters in the backward loop: one layer late, each is independent of every matmul of the
  # iteration it runs in (the next layer's backward); in its own layer's iteration it waits for that layer's.
  scatters = [r for r in rows if r.in_loop and r.kind == "reduce-scatter" and r.scope == "fsdp_all_gather"]
  if knobs.get("grad_reduce") == "next_layer":
    assert scatters and all(r.independent_matmuls == r.matmuls for r in scatters), \
        [(r.collective, r.independent_matmuls, r.matmuls) for r in scatters]
  elif knobs.get("grad_reduce") != "deferred":
    assert any(r.independent_matmuls < r.matmuls for r in scatters)
  permutes = [r for r in rows if r.kind == "collective-permute"]
  if knobs.get("tp", "allgather").startswith("ring"):
    assert permutes and all(r.independent_matmuls >= 1 for r in permutes), \
        [(r.collective, r.independent_matmuls) for r in permutes if r.independent_matmuls < 1]
  else:
    assert not permutes


# Weights-dominated model for memory: per-layer gathered weights G are large next to activations.
D, F, H, NL = 128, 512, 8, 4


def _temp_bytes(**knobs):
  from shardlab.config import Config, ModelConfig, ScheduleConfig, TrainConfig
  from shardlab import params as PM, schedules, train as T
  m = ModelConfig(d_model=D, d_ff=F, n_layers=NL, n_heads=H, seq_len=16)
  cfg = Config(model=m, schedule=ScheduleConfig(**knobs), train=TrainConfig(batch_size=8))
  mesh = mesh_of(8, 1)
  decls = PM.declare(m)
  p = jax.tree.map(lambda d: jax.ShapeDtypeStruct(d.shape, jnp.float32, sharding=NamedSharding(mesh, d.spec())),
                   decls, is_leaf=PM.is_param)
  b = abstract_batch(8, 16, mesh)
  fn = T.make_grad_fn(resolve(cfg), schedules.build(cfg.schedule, m, jnp.float32), decls, mesh)
  return memory(fn.lower(p, b).compile())["temp"]


@pytest.mark.slow
def test_prefetch_and_reshard_change_memory_as_theory_says():
  """G = one layer's gathered weights. Theory (ZeRO-3 / FSDP2):
  - keep gathered weights for backward: all NL layers stay gathered until their backward, (NL-1) G more
    than re-gathering each layer when its backward comes; measured within [NL-1, NL] G.
  - prefetch depth k: k more gathered layers in flight (in the loop carry); measured within k +- G/2.
  On this model and mesh 8x1 the measured deltas are 0.94 G (k=1), 2.19 G (k=2) and 3.62 G (keep).
  """
  K = D // H
  G = 4 * (D * 3 * H * K + H * K * D + D * 2 * F + F * D + 2 * D)    # mesh 8x1: nothing sharded by tensor
  base = _temp_bytes()
  delta = {k: (_temp_bytes(prefetch=k) - base) / G for k in (1, 2)}
  keep = (_temp_bytes(reshard_after_forward=False) - base) / G
  assert NL - 1 <= keep <= NL, keep
  assert abs(delta[1] - 1) <= 0.5 and abs(delta[2] - 2) <= 0.5, delta


def test_stage_unit_runs_forward_and_backward_for_different_microbatches():
  """The stage unit's forward and backward are plain functions: forward of microbatch 0 and 1, then backward of
  1 and 0 (a pipeline's order, not the stack's) give each microbatch the gradients AD gives the stack (the
  custom_vjp made of the same two), with FSDP prefetch and the gradient reduced one layer late."""
  import numpy as np
  from jax.sharding import PartitionSpec as P
  from conftest import tiny_config
  from shardlab import model as M, params as PM
  from shardlab.axes import FSDP, TENSOR
  from shardlab.schedules.explicit import ExplicitSchedule
  from shardlab.testing import assert_trees_close
  cfg = tiny_config({"kind": "ffn"}, prefetch=1, grad_reduce="next_layer")
  sched, mesh = ExplicitSchedule(cfg.schedule, cfg.model), mesh_of(2, 4)
  decls = PM.declare(cfg.model)["layers"]
  stacked = PM.init_sharded(0, {"layers": decls}, cfg.model, mesh)["layers"]
  B, L, D = 4, cfg.model.seq_len, cfg.model.d_model
  xs = jax.random.normal(jax.random.key(1), (3, B, L, D))
  x_spec, w_spec = P(FSDP, TENSOR), {k: d.spec() for k, d in decls.items()}

  def run(stacked, x0, x1, dy):
    sched.bind(mesh)
    stage = sched.stage(lambda x, w: M.ffn_layer(sched.ops, x, w))
    y0, r0 = stage.forward(x0, stacked)
    y1, r1 = stage.forward(x1, stacked)
    dx1, dw1 = stage.backward(r1, dy)
    dx0, dw0 = stage.backward(r0, dy)
    ref_y0, vjp = jax.vjp(stage, x0, stacked)
    ref_dx0, ref_dw0 = vjp(dy)
    return (y0, dx0, dw0, dx1, dw1), (ref_y0, ref_dx0, ref_dw0, jax.vjp(stage, x1, stacked)[1](dy))

  out_specs = ((x_spec, x_spec, w_spec, x_spec, w_spec), (x_spec, x_spec, w_spec, (x_spec, w_spec)))
  got, ref = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(w_spec, x_spec, x_spec, x_spec),
                                   out_specs=out_specs))(stacked, xs[0], xs[1], xs[2])
  assert_trees_close(got[0], ref[0], rtol=1e-6, atol=1e-6, label="stage forward: ")
  assert_trees_close((got[1], got[2]), (ref[1], ref[2]), rtol=1e-6, atol=1e-6, label="microbatch 0 backward: ")
  assert_trees_close((got[3], got[4]), ref[3], rtol=1e-6, atol=1e-6, label="microbatch 1 backward: ")
  assert float(np.abs(np.asarray(got[2]["wi"])).sum()) > 0


LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"


@pytest.mark.parametrize("overrides,want", [
    (["context=ring", "hardware=h100"], {LIMIT: 2}),
    (["context=usp", "context.ulysses=1", "hardware=h100"], {LIMIT: 2}),
    (["context=usp", "context.ulysses=2", "hardware=h100"], {}),     # U = C: a ring of one, no shift
    (["context=a2a_p2p", "hardware=h100"], {}),                      # the node's ranks hold the whole context
    (["context=ring", "hardware=tpu_v5p"], {}),
    (["context=ulysses", "hardware=h100"], {}),
    (["context.impl=user_parts:RingCopy", "hardware=h100"], {LIMIT: 2}),    # a user's subclass asks as the ring
    (["context.impl=user_parts:ProtocolCP", "hardware=h100"], {}),          # from the protocol alone: nothing
    (["context=ring", "hardware=h100", f"+xla.flags.{LIMIT}=1"], {LIMIT: 1}),
])
def test_a_compile_takes_the_options_the_context_part_asks_for_under_the_runs_own(overrides, want, monkeypatch):
  """The ring (and the strategies built on it, where their ring has two ranks or more) asks for two collectives
  in flight on a GPU (Ring.compiler_options: at XLA's default of one, another collective took its last dK/dV
  shift's slot); where the sequence is not split, the ring is of one, or the platform is not a GPU, nothing is
  asked; a run's own xla.flags win. What trainer (target and local compiles) and the planner's top-K pass to the
  compiler (Composition.target_flags)."""
  from conftest import ROOT, compose
  from shardlab.composition import resolve
  from shardlab.config import to_config
  monkeypatch.syspath_prepend(str(ROOT / "tests"))
  split = ["mesh.context=2", "mesh.fsdp=4", "mesh.tensor=1"]
  cfg = to_config(compose(*split, *overrides))
  c = resolve(cfg)
  assert c.target_flags(cfg.xla.flags) == want
  assert c.target_flags(cfg.xla.flags, "cpu") == {k: v for k, v in want.items() if v == 1}   # local CPU: none
  cfg = to_config(compose(*overrides))            # context 1: the sequence whole, nothing asked
  assert resolve(cfg).target_flags(cfg.xla.flags) == {k: v for k, v in want.items() if v == 1}


def test_a_users_compiler_options_that_are_not_a_dict_are_one_line(monkeypatch):
  from conftest import ROOT, compose
  from shardlab.composition import resolve
  from shardlab.config import to_config
  from shardlab.errors import ConfigError
  monkeypatch.syspath_prepend(str(ROOT / "tests"))
  cfg = to_config(compose("mesh.context=2", "mesh.fsdp=4", "mesh.tensor=1", "hardware=h100",
                          "context.impl=user_parts:OptionsNotADict"))
  with pytest.raises(ConfigError, match=r"^context.impl=user_parts:OptionsNotADict: compiler_options\(platform, "
                                        r"shape\) returned NoneType, not a dict"):
    resolve(cfg).target_flags({})
