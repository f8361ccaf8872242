"""Axes as declarations: a new mesh axis is one declaration and one layout rule, in this file alone."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from conftest import batch, tiny_config
from shardlab.composition import resolve
from shardlab import axes as X, params as PM, reference as R, schedules, testing, train as T
from shardlab.layout import DEFAULT_RULES, Layout
from shardlab.mesh import ConfigError
from shardlab.testing import assert_trees_close

# A toy axis: batch only, weights replicated over it (HSDP's shape under another name), outside fsdp.
TOY = X.declare(X.Axis("replica", ("batch",), link="slow", short="r", doc="a test's replica axis"), before=X.FSDP)
TOY_LAYOUT = Layout.of({**DEFAULT_RULES, "batch": ("replica", X.FSDP)}, "toy")


@pytest.mark.slow
def test_a_declared_toy_axis_trains_a_step_as_the_reference():
  """mesh replica 2 x fsdp 2 x tensor 2 with the rule batch -> (replica, fsdp): one optimizer step equals the
  unsharded reference's (loss, gradient norm, every parameter), and the gradients of the replicated weights are
  summed over the toy axis (an all-reduce over it in the compiled program)."""
  from shardlab.analysis import hlo
  cfg = tiny_config()
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, adam_eps=1e-4, lr=3e-3))
  mesh = testing.mesh_of({"replica": 2, X.FSDP: 2, X.TENSOR: 2})
  assert mesh.axis_names == ("replica", X.FSDP, X.TENSOR) and testing.mesh_id(mesh) == "r2xf2xt2"
  decls = PM.declare(cfg.model, 2, TOY_LAYOUT, mesh.axis_names)
  opt = T.make_optimizer(cfg.train, decls)
  state = T.init_state(PM.init_sharded(0, decls, cfg.model, mesh), opt, decls, mesh)
  sched = schedules.build(cfg.schedule, cfg.model, jnp.float32, TOY_LAYOUT)
  step = T.make_train_step(resolve(cfg), sched, decls, opt, mesh)
  b = testing.placed_batch(batch(), mesh, TOY_LAYOUT)
  lowered = step.lower(state, b)
  state, met = lowered.compile()(state, b)
  p0 = PM.init(jax.random.key(0), PM.declare(cfg.model), cfg.model)
  ropt = R.optimizer(cfg.train, p0)
  p1, _, rloss, rnorm = jax.jit(lambda p, o, b: R.train_step(p, o, b, cfg.model, ropt))(p0, ropt.init(p0), batch())
  np.testing.assert_allclose(float(met["loss"]), float(rloss), rtol=1e-6)
  np.testing.assert_allclose(float(met["grad_norm"]), float(rnorm), rtol=1e-5)
  assert_trees_close(state["params"], p1, rtol=1e-6, atol=1e-6, label="toy axis, params after one step: ")
  ledger = hlo.ledger(hlo.collectives(lowered.compile().as_text(), mesh))
  assert ledger["all-reduce"]["replica"]["bytes"] > 0, ledger


def test_toy_axis_labels_and_sizes():
  assert X.shape_of({"replica": 2, X.FSDP: 2, X.TENSOR: 2}) == {"replica": 2, X.FSDP: 2, X.TENSOR: 2}
  assert X.shape_of({"replica": 1, X.FSDP: 4, X.TENSOR: 2}) == {X.FSDP: 4, X.TENSOR: 2}   # size 1: no axis
  assert X.parse_label("r2xf2xt2") == {"replica": 2, X.FSDP: 2, X.TENSOR: 2}
  assert X.names().index("replica") == X.names().index(X.FSDP) - 1


def test_layout_rules_are_checked_in_one_line():
  """An undeclared axis, an axis that may not shard the dim, and a rule the schedule cannot honour on the mesh."""
  with pytest.raises(ConfigError, match=r"^layout rule batch -> nowhere: no mesh axis 'nowhere' is declared"):
    Layout.of({"batch": "nowhere"}).check()
  with pytest.raises(ConfigError, match=r"^layout rule mlp -> replica: the replica axis does not shard mlp"):
    Layout.of({**DEFAULT_RULES, "mlp": "replica"}).check()
  sched = schedules.build(tiny_config().schedule, tiny_config().model, jnp.float32,
                          Layout.of({**DEFAULT_RULES, "batch": ("replica",)}))
  with pytest.raises(ConfigError, match=r"^layout rule batch -> replica: .* cannot honour it on this mesh"):
    sched.bind(testing.mesh_of({"replica": 2, X.FSDP: 2, X.TENSOR: 2}))


def test_divisibility_is_derived_from_declarations_rules_and_sizes():
  """params.requirements: every dim against the product of the axes its rule shards it over, named by rule."""
  m = tiny_config().model
  shape = {"replica": 2, X.FSDP: 4, X.TENSOR: 2}
  needs = {(n.setting, n.axes): n.size for n in PM.requirements(m, TOY_LAYOUT, shape, batch_size=16,
                                                                  microbatches=2, seq_parallel=True)}
  assert needs[("model.d_model", (X.FSDP,))] == 4 and needs[("model.d_ff", (X.TENSOR,))] == 2
  assert needs[("train.batch_size", ("replica", X.FSDP))] == 8
  assert needs[("train.batch_size", ("replica", X.FSDP, "schedule.microbatches"))] == 16
  assert needs[("model.seq_len", (X.TENSOR,))] == 2
  bad = PM.problems(dataclasses.replace(m, d_ff=100), TOY_LAYOUT, {**shape, X.TENSOR: 8})
  assert [n.message() for n in bad][0].startswith("model.d_ff=100 is not divisible by mesh.tensor=8 (layout rule "
                                                  "mlp -> tensor: layers/wd dim 1)")
