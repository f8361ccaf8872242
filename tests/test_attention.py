"""Grouped-query attention, the three attention implementations, the remat policies and the published presets.

- The model with G = 1, 2 key/value heads (H = 8) and each memory-efficient attention trains exactly like the
  unsharded reference (loss and every gradient, float32) on every mesh shape, through the testing kit's cached
  compiled steps (K/V heads sharded over tensor where it divides G, replicated where it does not); G = 8 with
  plain attention is the `baseline` of tests/test_equivalence.py; G = 3 of H = 6 on tensor = 2 (neither divides
  the other) picks a K/V head per query head.
- blockwise and dot_product equal plain, forward and gradients, at several block sizes; blockwise's compiled
  memory grows linearly in the sequence length (plain's, the control, quadratically).
- Each remat policy keeps what planner.activation_elements_per_token says, element for element.
- Each preset in conf/model/ has its published parameter count.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compose, reference_loss_and_grads
from shardlab import attention as A
from shardlab.testing import assert_trees_close, compile_schedule

RTOL, ATOL = 2e-5, 2e-5     # as tests/test_equivalence.py: float32 sums in a different order on each mesh

# (mesh, kv heads, attention, schedule knobs): on every mesh G = 1 and 2 and both memory-efficient attentions,
# with a knob each (TP contractions, the new remat policies, prefetch, deferred reduction, gspmd). G = 8 (= H)
# with plain attention on every mesh is the `baseline` preset of tests/test_equivalence.py.
CASES = [
    ((1, 8), 1, "blockwise", dict(remat="save_qkv_attn_out")),
    ((1, 8), 2, "dot_product", dict(tp="allreduce")),
    ((2, 4), 1, "dot_product", dict(tp="ring")),
    ((2, 4), 2, "blockwise", dict(remat="save_matmuls_attn_out", prefetch=1)),
    ((4, 2), 1, "blockwise", dict(tp="allreduce")),
    ((4, 2), 2, "dot_product", dict(impl="gspmd")),
    ((8, 1), 1, "dot_product", dict()),
    ((8, 1), 2, "blockwise", dict(grad_reduce="deferred", microbatches=2)),
    ((1, 1), 1, "blockwise", dict(remat="save_qkv_proj")),
    ((1, 1), 2, "dot_product", dict()),
]


def _model(kv, attention):
  """Two layers (the reference unrolls them; the schedules loop over them): half the reference's compile."""
  return {"n_layers": 2, "n_kv_heads": kv, "attention": attention,
          **({"attention_block": 8} if attention == "blockwise" else {})}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,kv,attention,knobs", CASES,
                         ids=[f"{m[0]}x{m[1]}-kv{g}-{a}" + "".join(f",{k}={v}" for k, v in s.items())
                              for m, g, a, s in CASES])
def test_gqa_and_attention_match_reference(mesh_shape, kv, attention, knobs):
  model = _model(kv, attention)
  loss, grads = compile_schedule(knobs, mesh_shape, model=model)[1]
  ref_loss, ref_grads = reference_loss_and_grads(model)
  label = f"kv={kv} {attention} {knobs} on {mesh_shape}: "
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6, err_msg=label)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=label)


@pytest.mark.slow
def test_kv_heads_replicated_and_not_aligned_to_devices():
  """H = 6, G = 3 on tensor = 2: neither divides the other; each device's 3 query heads read 2 of the 3
  replicated K/V heads (0, 0, 1 and 1, 2, 2), picked per query head."""
  model = {"d_model": 48, "n_heads": 6, "n_kv_heads": 3, "n_layers": 2}
  loss, grads = compile_schedule(None, (4, 2), model=model)[1]
  ref_loss, ref_grads = reference_loss_and_grads(model)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label="H=6 G=3 on 4x2: ")


def test_kv_weights_sharded_or_replicated_over_tensor():
  from shardlab import params as PM
  from shardlab.config import ModelConfig
  m = ModelConfig(n_kv_heads=2)
  spec = lambda tensor: tuple(PM.declare(m, tensor)["layers"]["wkv"].spec())
  assert spec(2) == (None, "fsdp", None, "tensor", None)
  assert spec(4) == (None, "fsdp", None, None, None) and PM.declare(m, 4)["layers"]["wkv"].tensor_replicated
  assert tuple(PM.declare(m, 4)["layers"]["wq"].spec()) == (None, "fsdp", "tensor", None)


# ------------------------------------------------------------------------- implementations against plain

def _qkv(B=2, L=32, H=8, G=2, K=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, L, H, K)), jax.random.normal(ks[1], (B, L, G, K)),
          jax.random.normal(ks[2], (B, L, G, K)))


@pytest.mark.parametrize("impl,block,G", [("blockwise", 8, 2), ("blockwise", 32, 8), ("blockwise", 16, 1),
                                          ("dot_product", 0, 2), ("dot_product", 0, 1)])
def test_attention_equals_plain_forward_and_gradients(impl, block, G):
  q, k, v = _qkv(G=G)
  ct = jax.random.normal(jax.random.key(1), q.shape)   # a cotangent that weighs every output differently
  run = lambda f: jax.jit(lambda q, k, v: jax.vjp(f, q, k, v))(q, k, v)
  (o, vjp), (o_ref, vjp_ref) = run(lambda *a: A.attend(impl, *a, block)), run(A.plain)
  assert_trees_close(o, o_ref, rtol=1e-5, atol=1e-5, label=f"{impl} output: ")
  assert_trees_close(jax.jit(vjp)(ct), jax.jit(vjp_ref)(ct), rtol=1e-5, atol=1e-5, label=f"{impl} dq, dk, dv: ")


def test_plain_attention_is_causal_grouped_attention():
  """The reference of the references: plain against a per-head loop in numpy (q head h reads K/V head h // R)."""
  q, k, v = (np.asarray(a, np.float64) for a in _qkv(B=1, L=6, H=4, G=2, K=4))
  want = np.zeros_like(q)
  for h in range(4):
    s = q[0, :, h] @ k[0, :, h // 2].T / 2.0
    s = np.where(np.tril(np.ones((6, 6), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want[0, :, h] = (p / p.sum(-1, keepdims=True)) @ v[0, :, h // 2]
  np.testing.assert_allclose(np.asarray(A.plain(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)))), want,
                             rtol=1e-5, atol=1e-6)


def _temp_bytes(impl, L):
  q, k, v = (jnp.zeros((1, L, h, 16)) for h in (2, 1, 1))
  f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(A.attend(impl, q, k, v, 32)), argnums=(0, 1, 2)))
  return f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_in_sequence_length():
  """Forward and backward compiled together, at L = 256, 512, 1024: blockwise's temporaries are a + b L (each
  doubling of L adds twice what the one before added: O(L)); plain's hold [B, H, L, L] and quadruple."""
  t = [_temp_bytes("blockwise", L) for L in (256, 512, 1024)]
  growth = (t[2] - t[1]) / (t[1] - t[0])
  assert 1.7 < growth < 2.3 and t[2] / t[1] < 2.1, t
  plain = _temp_bytes("plain", 512) / _temp_bytes("plain", 256)
  assert plain > 3.5, plain


def test_blockwise_computes_only_the_causal_block_pairs():
  """8 blocks of 128: forward and backward each run the nb(nb+1)/2 = 36 (query, key) block pairs on or below the
  diagonal, not all 64 (the wholly masked ones are skipped: about half the score FLOPs of a long sequence), in
  loops whose trip count is static (the HLO ledger and cost model read it)."""
  from shardlab.analysis import hlo
  x = jax.ShapeDtypeStruct((1, 1024, 4, 64), jnp.float32)
  g = jax.jit(jax.grad(lambda q, k, v: A.blockwise(q, k, v, 128).sum(), argnums=(0, 1, 2)))
  comps, entry = hlo.parse(g.lower(x, x, x).compile().as_text())
  assert sorted(hlo.trip_count(i, c, comps) for c, ins in comps.items() for i in ins if i.opcode == "while") == [36, 36]


def test_blockwise_rejects_a_block_that_does_not_divide_the_sequence():
  with pytest.raises(ValueError, match="not a multiple of the block size 12"):
    A.blockwise(*_qkv(L=32), 12)


# ------------------------------------------------------------------------------------------ remat policies

@pytest.mark.parametrize("attention,head_size", [("plain", 0), ("blockwise", 0), ("plain", 12)])
def test_remat_policies_keep_what_the_activation_estimate_counts(attention, head_size):
  """One layer's jax.vjp residuals, per token, for every policy (traced, not run): exactly
  planner.activation_elements_per_token. Per-token arrays are those with the batch dim (B = 16, a size no
  weight has); per-sequence tables (RoPE's cos/sin, norm scales) and the weights are left out. Heads wider than
  d_model / n_heads (head_size 12 beside 64 / 8, as Qwen3's 128 beside 2048 / 32) count their own width."""
  import math
  from shardlab import model as M, params as PM
  from shardlab.analysis.memory_model import activation_elements_per_token
  from shardlab.config import ModelConfig
  from shardlab.schedules.explicit import KNOBS, remat_policy
  from shardlab.schedules.parallel import Parallel, attention as model_attention
  from shardlab.schedules.tp import IdentityOps
  m = ModelConfig(d_model=64, d_ff=128, n_heads=8, n_kv_heads=2, seq_len=32, attention=attention,
                  attention_block=8, head_size=head_size)
  w = {k: jax.ShapeDtypeStruct(d.per_layer().shape, jnp.float32) for k, d in PM.declare(m)["layers"].items()}
  B = 16
  x = jax.ShapeDtypeStruct((B, m.seq_len, m.d_model), jnp.float32)
  ctx = Parallel(IdentityOps(), None, None, model_attention(m))
  f = lambda x, w: M.layer(ctx, m, x, w, jnp.arange(m.seq_len))
  for remat in KNOBS["remat"]:
    policy = remat_policy(remat)
    g = f if policy is None else jax.checkpoint(f, policy=policy)
    saved = jax.tree.leaves(jax.eval_shape(lambda x, w: jax.vjp(g, x, w)[1], x, w))
    got = sum(math.prod(a.shape) for a in saved if B in a.shape) / (B * m.seq_len)
    assert got == activation_elements_per_token(m, remat), (attention, head_size, remat, got)


# ----------------------------------------------------------------------------------------------- presets

PUBLISHED = {"llama2_7b": 6.74e9, "llama2_13b": 13.0e9, "llama3_8b": 8.03e9, "llama3_70b": 70.6e9}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_count_is_the_published_one(preset):
  from shardlab import params as PM
  from shardlab.config import to_config
  m = to_config(compose(f"model={preset}")).model
  n = PM.count(PM.declare(m))
  assert abs(n / PUBLISHED[preset] - 1) < 0.005, f"{preset}: {n:.4g} parameters, published {PUBLISHED[preset]:.4g}"
  assert m.attention in ("blockwise", "dot_product")   # O(L) attention: real sequence lengths fit


# ------------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("overrides,message", [
    (dict(n_heads=8, n_kv_heads=3), "model.n_heads=8 is not a multiple of model.n_kv_heads=3"),
    (dict(attention="flash"), "model.attention=flash: unknown; choose one of plain, blockwise, dot_product"),
    (dict(attention="blockwise", attention_block=12), "model.seq_len=32 is not a multiple of model.attention_block=12"),
    (dict(n_kv_heads=-1), "model.n_kv_heads=-1: must be >= 1"),
])
def test_bad_attention_settings_fail_in_one_line(overrides, message):
  import dataclasses
  from shardlab.config import Config, ModelConfig
  from shardlab.mesh import ConfigError
  from shardlab.validate import validate
  cfg = dataclasses.replace(Config(), model=ModelConfig(**overrides))
  with pytest.raises(ConfigError) as e:
    validate(cfg, 8)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_blockwise_matmuls_run_in_the_compute_dtype():
  """A bf16 run's blockwise attention does every matmul, forward and backward, on bf16 operands with float32
  accumulation (P and dS cast down first, as FlashAttention-2's backward): none in float32, which a GPU runs at
  a fraction of the bf16 rate."""
  import jax
  import jax.numpy as jnp
  from jax.extend.core import jaxprs_in_params
  from shardlab import attention as A
  x = jax.ShapeDtypeStruct((1, 64, 2, 8), jnp.bfloat16)
  grad = jax.grad(lambda q, k, v: A.blockwise(q, k, v, 16).astype(jnp.float32).sum(), argnums=(0, 1, 2))

  def dots(j):
    for e in j.eqns:
      if e.primitive.name == "dot_general":
        yield tuple(str(v.aval.dtype) for v in e.invars)
      for sub in jaxprs_in_params(e.params):
        yield from dots(sub)
  found = list(dots(jax.make_jaxpr(grad)(x, x, x).jaxpr))
  assert len(found) >= 6 and set(found) == {("bfloat16", "bfloat16")}, found
