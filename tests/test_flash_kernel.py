"""The ring's fused per-step kernel (shardlab/flash_kernel.py, Pallas): run by Pallas's interpreter on this CPU
against plain attention, forward and backward, for any placement of query and key positions; the ring built of it
(context.kernel=pallas) the same training as the unsharded reference; its stated FLOPs the causal count."""
import numpy as np
import pytest

from conftest import reference_loss_and_grads
from shardlab import testing
from shardlab.testing import assert_trees_close


def _attention(q, k, v, pq, pk):
  """Plain attention of q[B, Lq, H, K] over k, v[B, Lk, G, K] where pq >= pk: the output and log-sum-exp."""
  import jax
  import jax.numpy as jnp
  R = q.shape[2] // k.shape[2]
  kk, vv = jnp.repeat(k, R, axis=2), jnp.repeat(v, R, axis=2)
  s = jnp.einsum("blhk,bmhk->bhlm", q, kk) / np.sqrt(q.shape[-1])
  mask = pq[:, None] >= pk[None, :]
  lse = jax.nn.logsumexp(jnp.where(mask, s, -jnp.inf), axis=-1)
  p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
  return jnp.einsum("bhlm,bmhk->blhk", p, vv), lse


def test_the_kernel_is_attention_forward_and_backward_for_any_positions():
  """Grouped heads (4 query heads over 2 K/V heads), 32 queries against 48 keys in blocks of 16, at positions
  drawn from 0..63 (queries) and 8..63 (keys): a query block that sees no key of a key block skips it, a query
  before every key sees nothing (lse -inf, output 0); backward from the final log-sum-exp equals autodiff of plain
  attention."""
  import jax
  import jax.numpy as jnp
  from shardlab import flash_kernel as F
  B, Lq, Lk, H, G, K = 2, 32, 48, 4, 2, 16
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (B, Lq, H, K))
  k, v = (jax.random.normal(x, (B, Lk, G, K)) for x in keys[1:3])
  pq = jnp.asarray(np.sort(np.random.RandomState(0).permutation(64)[:Lq]))
  pk = jnp.asarray(8 + np.sort(np.random.RandomState(1).permutation(56)[:Lk]))
  assert F.pair_counts(pq, pk, 16, 16) < 2 * 3          # some block pairs are skipped
  o, lse = F.block_attention(q, k, v, pq, pk, block_q=16, block_k=16, interpret=True)
  o_ref, lse_ref = _attention(q, k, v, pq, pk)
  assert bool(jnp.any(jnp.isinf(lse_ref)))            # the case of a query with nothing to see is exercised
  np.testing.assert_allclose(o, o_ref, atol=2e-6)
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
  np.testing.assert_allclose(np.where(np.isinf(lse_ref), 0, lse), np.where(np.isinf(lse_ref), 0, lse_ref), atol=2e-6)
  do = jax.random.normal(keys[3], o.shape)
  grads = jax.grad(lambda q, k, v: jnp.sum(_attention(q, k, v, pq, pk)[0] * do), (0, 1, 2))(q, k, v)
  delta = jnp.einsum("blhk,blhk->bhl", do, o_ref)
  got = F.block_attention_bwd(q, k, v, pq, pk, jnp.where(jnp.isinf(lse_ref), 0.0, lse_ref), do, delta,
                              block_q=16, block_k=16, interpret=True)
  for name, a, b in zip("q k v".split(), got, grads):
    np.testing.assert_allclose(a, b, atol=5e-6, err_msg=f"d{name}")


def test_the_ranged_loop_is_attention_for_any_positions():
  """The Triton kernels' loop over each cell's span of visible blocks (flash_kernel.spans, `ranged=True`: the GPU's
  default, no branch per block), run by the interpreter: plain attention's output, log-sum-exp and gradients for
  ascending positions with whole key blocks unseen, for positions in no order (a span then holds invisible blocks,
  which the mask makes add nothing), and for keys that all follow some queries (empty spans)."""
  import jax
  import jax.numpy as jnp
  from shardlab import flash_kernel as F
  B, Lq, Lk, H, G, K = 1, 32, 48, 4, 2, 16
  keys = jax.random.split(jax.random.PRNGKey(2), 4)
  q = jax.random.normal(keys[0], (B, Lq, H, K))
  k, v = (jax.random.normal(x, (B, Lk, G, K)) for x in keys[1:3])
  rs = np.random.RandomState
  cases = {"ascending": (np.sort(rs(0).permutation(64)[:Lq]), 8 + np.sort(rs(1).permutation(56)[:Lk])),
           "no order": (rs(2).permutation(64)[:Lq], rs(3).permutation(64)[:Lk]),
           "late keys": (np.arange(Lq), 20 + np.arange(Lk))}
  for name, (pq, pk) in cases.items():
    pq, pk = jnp.asarray(pq), jnp.asarray(pk)
    o_ref, lse_ref = _attention(q, k, v, pq, pk)
    seen = np.isfinite(lse_ref)
    o, lse = F.block_attention(q, k, v, pq, pk, block_q=16, block_k=16, interpret=True, ranged=True)
    np.testing.assert_allclose(o, o_ref, atol=2e-6, err_msg=name)
    np.testing.assert_array_equal(np.isinf(lse), ~seen, err_msg=name)
    np.testing.assert_allclose(np.where(seen, lse, 0), np.where(seen, lse_ref, 0), atol=2e-6, err_msg=name)
    do = jax.random.normal(keys[3], o.shape)
    grads = jax.grad(lambda q, k, v: jnp.sum(_attention(q, k, v, pq, pk)[0] * do), (0, 1, 2))(q, k, v)
    delta = jnp.einsum("blhk,blhk->bhl", do, o_ref)
    got = F.block_attention_bwd(q, k, v, pq, pk, jnp.where(seen, lse_ref, 0.0), do, delta, block_q=16, block_k=16,
                                interpret=True, ranged=True)
    for d, a, b in zip("qkv", got, grads):
      np.testing.assert_allclose(a, b, atol=5e-6, err_msg=f"{name}: d{d}")
  # the spans of the late keys: query block 0 (positions 0..15) sees no key (keys start at 20), block 1 sees key
  # block 0 (keys 20..35) alone; key blocks 1 and 2 (keys 36 on) follow every query
  (first, end), (kfirst, kend) = F.spans(jnp.arange(Lq), 20 + jnp.arange(Lk), 16, 16)
  assert first.tolist() == [0, 0] and end.tolist() == [0, 1]
  assert kfirst.tolist() == [1, 0, 0] and kend.tolist() == [2, 0, 0]


def test_the_tpu_kernel_is_attention_forward_and_backward():
  """The Mosaic kernels (flash_kernel.block_attention_tpu, block_attention_bwd_tpu: a grid over key blocks with
  the online softmax in scratch, 128-token blocks, the blocks' extreme positions in scalar memory), interpreted:
  plain attention's output, log-sum-exp and gradients, 2 query heads over 1 K/V head, 256 queries against 384 keys
  at positions where some block pairs and some queries see nothing."""
  import jax
  import jax.numpy as jnp
  from shardlab import flash_kernel as F
  keys = jax.random.split(jax.random.PRNGKey(2), 4)
  q = jax.random.normal(keys[0], (1, 256, 2, 64))
  k, v = (jax.random.normal(x, (1, 384, 1, 64)) for x in keys[1:3])
  pq = jnp.asarray(np.sort(np.random.RandomState(0).permutation(1024)[:256]))
  pk = jnp.asarray(100 + np.sort(np.random.RandomState(1).permutation(900)[:384]))
  assert F.pair_counts(pq, pk, 128, 128) < 2 * 3
  o, lse = F.block_attention_tpu(q, k, v, pq, pk, interpret=True)
  o_ref, lse_ref = _attention(q, k, v, pq, pk)
  assert bool(jnp.any(jnp.isinf(lse_ref)))
  np.testing.assert_allclose(o, o_ref, atol=2e-6)
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
  np.testing.assert_allclose(np.where(np.isinf(lse_ref), 0, lse), np.where(np.isinf(lse_ref), 0, lse_ref), atol=2e-6)
  do = jax.random.normal(keys[3], o.shape)
  grads = jax.grad(lambda q, k, v: jnp.sum(_attention(q, k, v, pq, pk)[0] * do), (0, 1, 2))(q, k, v)
  got = F.block_attention_bwd_tpu(q, k, v, pq, pk, jnp.where(jnp.isinf(lse_ref), 0.0, lse_ref), do,
                                  jnp.einsum("blhk,blhk->bhl", do, o_ref), interpret=True)
  for name, a, b in zip("q k v".split(), got, grads):
    np.testing.assert_allclose(a, b, atol=5e-6, err_msg=f"d{name}")


def test_the_stated_pairs_are_the_causal_work_of_the_busiest_device():
  """kernel_pairs: per ring step, the kernel's block pairs with a key at or before a query on the busiest
  device. With blocks of one token it is the exact causal count (brute force over the token pairs); a zigzag
  ring's steps are even, a contiguous ring's busiest device does every block."""
  from shardlab.data import zigzag
  from shardlab.schedules.context import kernel_pairs
  C, local = 4, 8
  zig = zigzag(C * local, C)
  for placed in (None, zig):
    order = np.asarray(np.arange(C * local) if placed is None else placed).reshape(C, local)
    exact = [max(int((order[r][:, None] >= order[(r - s) % C][None, :]).sum()) for r in range(C)) for s in range(C)]
    assert list(kernel_pairs(C, local, placed, 1, 1)) == exact
  assert kernel_pairs(C, local, None, 8, 8) == (1, 1, 1, 1)                  # every step a whole block
  assert kernel_pairs(C, local, zig, 4, 4) == (3, 2, 2, 2)                   # zigzag: diagonal, then halves
  assert sum(kernel_pairs(C, local, zig, 1, 1)) < sum(kernel_pairs(C, local, None, 1, 1))


def test_blockwise_by_the_kernel_is_blockwise():
  """model.attention=blockwise in a program lowered for a GPU runs the Pallas kernel (attention._fused_forward,
  _fused_backward): interpreted here, the same output, log-sum-exp (in blockwise's residual layout) and gradients
  as the pure-JAX blockwise kernel, grouped heads, 64 tokens in blocks of 16."""
  import jax
  from shardlab import attention as A
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  q = jax.random.normal(keys[0], (2, 64, 4, 16))
  k, v = (jax.random.normal(x, (2, 64, 2, 16)) for x in keys[1:3])
  o, lse = A._flash_forward(16, q, k, v)
  o_f, lse_f = A._fused_forward(16, q, k, v, interpret=True)
  np.testing.assert_allclose(o_f, o, atol=2e-6)
  np.testing.assert_allclose(lse_f, lse, atol=2e-6)
  do = jax.random.normal(keys[3], o.shape)
  res = (q, k, v, o, lse)
  for name, a, b in zip("q k v".split(), A._fused_backward(16, res, do, interpret=True), A._flash_backward(16, res, do)):
    np.testing.assert_allclose(a, b, atol=5e-6, err_msg=f"d{name}")


MESHES = [({"context": 8}, True, {}), ({"fsdp": 2, "context": 4}, False, {}),
          ({"fsdp": 2, "context": 2, "tensor": 2}, True, {"n_kv_heads": 2})]


@pytest.mark.slow
@pytest.mark.parametrize("shape, balanced, model", MESHES,
                         ids=[testing.mesh_id({"fsdp": 1, "tensor": 1, **m}) for m, _, _ in MESHES])
def test_the_pallas_ring_equals_the_reference(shape, balanced, model):
  """context=ring with context.kernel=pallas (the fused kernel per ring step, by Pallas's interpreter on this CPU):
  loss and every gradient as the unsharded reference's, contiguous and zigzag, with grouped K/V heads."""
  shape = {"fsdp": 1, "tensor": 1, **shape}
  _, (loss, grads) = testing.compile_schedule(None, shape, model, context="ring", load_balance=balanced,
                                              context_kernel="pallas")
  ref_loss, ref_grads = reference_loss_and_grads(model)
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=2e-5, atol=2e-5, label=f"pallas ring {testing.mesh_id(shape)}: ")


def test_forcing_the_kernel_where_its_tiles_do_not_fit_is_one_line():
  """context.kernel=pallas for a GPU target whose local lengths or head dimension the Triton tiles cannot take
  (here 8 tokens per device) is refused before anything is built; auto falls back to pure JAX. The strategy says
  what its ring steps run on (`step_tokens`)."""
  from shardlab.config import compose
  from shardlab.errors import ConfigError
  from shardlab.validate import validate
  base = ["compile_for=target", "hardware=h100", "mesh.context=8", "mesh.fsdp=1", "mesh.tensor=1", "context=ring"]
  with pytest.raises(ConfigError, match=r"context.kernel=pallas: the Pallas kernel's Triton tiles do not fit this "
                                        r"run \(8 queries and 8 keys do not cut into blocks of a power of two"):
    validate(compose(base + ["context.kernel=pallas", "model.seq_len=64"]))
  validate(compose(base + ["model.seq_len=64"]))
  # usp's ring runs on its group's U chunks (U L / C = 16 tokens here, tiles that fit), not on L / C
  usp = ["context=usp", "context.ulysses=2", "context.kernel=pallas", "model.seq_len=64", "model.n_heads=4"]
  validate(compose(base[:-1] + usp))
  with pytest.raises(ConfigError, match=r"\(8 queries and 8 keys"):     # the ring alone: L / C = 8 tokens
    validate(compose(base + ["context.kernel=pallas", "model.seq_len=64", "model.n_heads=4"]))
