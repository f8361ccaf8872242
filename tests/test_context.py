"""Context parallelism (mesh.context, schedules/context.py): the sequence of every activation split over
`context`, attention by all-gathered K/V or by Ulysses' all-to-alls. The same training as the unsharded
reference, loss and every gradient in float32, on context meshes of 8 devices; the bytes over `context` against a
hand count."""
import pytest

from conftest import reference_loss_and_grads
from shardlab import testing
from shardlab.testing import assert_trees_close

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md

RTOL = ATOL = 2e-5
MESHES = [{"context": 8}, {"fsdp": 2, "context": 4}, {"fsdp": 2, "context": 2, "tensor": 2}]


@pytest.mark.parametrize("strategy", ["all_gather", "ring", "ulysses"])
@pytest.mark.parametrize("shape", MESHES, ids=[testing.mesh_id({"fsdp": 1, "tensor": 1, **m}) for m in MESHES])
def test_context_strategies_match_the_reference(shape, strategy):
  shape = {"fsdp": 1, "tensor": 1, **shape}
  _, (loss, grads) = testing.compile_schedule(None, shape, context=strategy)
  ref_loss, ref_grads = reference_loss_and_grads()
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=f"context {testing.mesh_id(shape)}: ")


def test_gqa_and_a_prefetching_ring_schedule_under_context():
  """Grouped-query attention (2 K/V heads) on fsdp 2 x context 2 x tensor 2 with FSDP prefetch and the
  collective-matmul ring: K/V heads sharded over tensor, gathered over context."""
  model = {"n_kv_heads": 2}
  shape = {"fsdp": 2, "context": 2, "tensor": 2}
  _, (loss, grads) = testing.compile_schedule({"prefetch": 1, "tp": "ring"}, shape, model)
  ref_loss, ref_grads = reference_loss_and_grads(model)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label="GQA, context 2: ")


def test_bytes_over_context_are_the_kv_gathers_and_their_transposes():
  """Per layer and device, forward: K and V [B/fsdp, L, G, K] gathered over context, (C-1)/C of them each;
  backward: the same bytes reduce-scattered (dK, dV), plus the gradient all-reduce of the weights replicated over
  context. Tiny model, float32, context 8: hand count of the compiled program's all-gathers."""
  from shardlab.analysis import hlo
  shape = {"fsdp": 1, "context": 8, "tensor": 1}
  compiled, _ = testing.compile_schedule(None, shape)
  cfg = testing.tiny_config()
  m, C = cfg.model, 8
  B, L, G, K, NL = cfg.train.batch_size, m.seq_len, m.kv_heads, m.head_dim, m.n_layers
  kv_full = 2 * B * L * G * K * 4                     # K and V of the whole sequence, float32
  led = hlo.ledger(hlo.collectives(compiled.as_text(), testing.mesh_of(shape)))
  gathered = led["all-gather"]["context"]["bytes"]
  positions = L * 4 * (C - 1) // C                  # the positions (int32): the same in every layer, so XLA
  assert gathered == NL * kv_full * (C - 1) // C + positions, led["all-gather"]["context"]   # gathers them once
  assert led["all-gather"]["context"]["count"] == 2 * NL + 1
  assert led["reduce-scatter"]["context"]["bytes"] == NL * kv_full * (C - 1) // C, led["reduce-scatter"]


def test_ulysses_with_gqa_and_blockwise_attention():
  """Ulysses runs the model's own kernel on the whole sequence (blockwise here) with 4 K/V heads for 8 query
  heads, split 4 ways over context."""
  model = {"n_kv_heads": 4, "attention": "blockwise", "attention_block": 8}
  _, (loss, grads) = testing.compile_schedule(None, {"fsdp": 2, "context": 4, "tensor": 1}, model, context="ulysses")
  ref_loss, ref_grads = reference_loss_and_grads(model)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label="ulysses, GQA, blockwise: ")


def test_ulysses_bytes_are_four_all_to_alls_per_layer_each_way():
  """Per layer and device: q, k, v forward and o back ([B, L/C, heads, K] each), (C-1)/C of each; backward the
  same four the other way. Tiny model, float32, context 8 (the positions gathered once, as for all_gather)."""
  from shardlab.analysis import hlo
  shape = {"fsdp": 1, "context": 8, "tensor": 1}
  compiled, _ = testing.compile_schedule(None, shape, context="ulysses")
  cfg = testing.tiny_config()
  m, C = cfg.model, 8
  B, L, H, G, K, NL = cfg.train.batch_size, m.seq_len, m.n_heads, m.kv_heads, m.head_dim, m.n_layers
  local = lambda heads: B * (L // C) * heads * K * 4          # one of q, k, v, o on one device, float32
  per_layer = (local(H) + 2 * local(G) + local(H)) * (C - 1) // C
  led = hlo.ledger(hlo.collectives(compiled.as_text(), testing.mesh_of(shape)))
  assert led["all-to-all"]["context"]["bytes"] == 2 * NL * per_layer, led["all-to-all"]
  assert led["all-to-all"]["context"]["count"] == 2 * NL * 4


def test_ulysses_needs_heads_the_context_axis_divides():
  from shardlab.mesh import ConfigError
  with pytest.raises(ConfigError, match=r"^context=ulysses splits the heads over the context axes: "
                                        r"model.n_heads=8 and model.n_kv_heads=2 over tensor=1"):
    testing.compile_schedule(None, {"fsdp": 1, "context": 8, "tensor": 1}, {"n_kv_heads": 2}, context="ulysses")


@pytest.mark.parametrize("placement", [True, "striped"], ids=["zigzag", "striped"])
@pytest.mark.parametrize("strategy", ["all_gather", "ring", "ulysses"])
@pytest.mark.parametrize("shape", [{"context": 8}, {"fsdp": 2, "context": 2, "tensor": 2}],
                         ids=["c8", "f2xc2xt2"])
def test_causal_load_balancing_is_the_same_training(shape, strategy, placement):
  """context.load_balance=true (zigzag): each device holds chunks r and 2C-1-r of every sequence (data.zigzag);
  striped: tokens r, r+C, r+2C, ... (data.striped); the positions with them (RoPE and the causal mask read them):
  loss and every gradient as the reference's."""
  shape = {"fsdp": 1, "tensor": 1, **shape}
  _, (loss, grads) = testing.compile_schedule(None, shape, context=strategy, load_balance=placement)
  ref_loss, ref_grads = reference_loss_and_grads()
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=f"{strategy}, {placement}: ")


def test_striped_placement_is_even_at_every_ring_step():
  """data.striped: device r holds tokens r, r+C, ...; its positions rise along its local sequence, so the ring's
  block skipping works (ring_plan, kernel_pairs) and every step costs about half the blocks on every device,
  as zigzag's do, where contiguous chunks cost the last device every block after the first step."""
  import numpy as np
  from shardlab.data import striped
  from shardlab.schedules.context import kernel_pairs, ring_plan
  assert striped(8, 4).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
  C, local = 4, 64
  order = striped(C * local, C)
  pairs = kernel_pairs(C, local, order, 16, 16)
  assert max(pairs) - min(pairs) <= 1 and max(pairs) <= (4 * 5) // 2 + 4          # about the lower triangle
  assert kernel_pairs(C, local, None, 16, 16)[1:] == (16, 16, 16)                  # contiguous: whole blocks
  n, visible = ring_plan(C, local, 16, order)
  assert n == 16 and visible == pairs
  assert np.sort(order).tolist() == list(range(C * local))


@pytest.mark.parametrize("placement", [True, "striped"], ids=["zigzag", "striped"])
def test_ulysses_balanced_runs_its_kernel_in_index_order(placement):
  """Ulysses with the blockwise kernel and load balancing (zigzag or striped): the gathered sequence is put back
  in index order for the kernel's own causal mask, and the output back in the data's order."""
  model = {"attention": "blockwise", "attention_block": 8}
  _, (loss, grads) = testing.compile_schedule(None, {"fsdp": 2, "context": 4, "tensor": 1}, model,
                                              context="ulysses", load_balance=placement)
  ref_loss, ref_grads = reference_loss_and_grads(model)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=f"ulysses, blockwise, {placement}: ")


def test_zigzag_order():
  import numpy as np
  from shardlab.data import zigzag
  assert zigzag(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]      # device 0: chunks 0 and 3; device 1: 1 and 2
  assert sorted(zigzag(32, 4).tolist()) == list(range(32)) and np.asarray(zigzag(32, 1)).tolist() == list(range(32))


def test_ring_moves_kv_blocks_by_ppermute_and_keeps_only_local_residuals():
  """Per layer and device: forward C-1 shifts of the K/V block (K and V as one array); backward the same and C
  shifts of the dK/dV block (the last takes them home), C-2 of them in one collective with a K/V shift; no K/V
  all-gathered over context, only the token positions
  (int32, once per layer at most: XLA hoists it out of the layer loop). GQA (2 K/V heads) on context 8, each
  device's 4 tokens in sub-blocks of 2 (the step's flash kernel with more than one sub-block pair)."""
  from shardlab.analysis import hlo
  model = {"n_kv_heads": 2, "attention_block": 2}
  shape = {"fsdp": 1, "context": 8, "tensor": 1}
  compiled, (loss, grads) = testing.compile_schedule(None, shape, model, context="ring")
  ref_loss, ref_grads = reference_loss_and_grads(model)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label="ring, GQA: ")
  cfg = testing.tiny_config(model)
  m, C = cfg.model, 8
  B, L, G, K, NL = cfg.train.batch_size, m.seq_len, m.kv_heads, m.head_dim, m.n_layers
  kv_block, pos_block = B * (L // C) * G * K * 4, (L // C) * 4
  colls = hlo.collectives(compiled.as_text(), testing.mesh_of(shape))
  gathers = [c for c in colls if c.kind == "all-gather" and c.axis == "context"]
  assert {c.dtype for c in gathers} == {"s32"} and 0 < sum(c.total_bytes for c in gathers) <= NL * pos_block * (C - 1)
  shifts = [c for c in colls if c.kind == "collective-permute" and c.axis == "context"]
  assert {c.dtype for c in shifts} == {"f32"}
  assert sorted({(c.scope, c.bytes_full) for c in shifts}) == [
      ("cp_ring", 2 * kv_block), ("cp_ring_grad", 2 * kv_block), ("cp_ring_home", 2 * kv_block),
      ("cp_ring_kv_grad", 4 * kv_block)]
  assert sum(c.total_bytes for c in shifts) == NL * (2 * (C - 1) * 2 * kv_block + C * 2 * kv_block)
  assert sum(c.count for c in shifts if c.scope == "cp_ring_kv_grad") == NL * (C - 2)


def test_ring_skips_the_sub_blocks_the_causal_mask_hides():
  """ring_plan: per ring step, the sub-block pairs the busiest device computes. A contiguous ring's busiest device
  does every pair of the C - 1 earlier blocks and the causal half of its own, (nb + 1) / (2 nb) of it; zigzag does
  half of every other block and C/2 + 1/(4m) in all (m sub-blocks per chunk). The compiled programs (tiny model,
  context 8, 4 tokens per device) run exactly those pairs: the ring's attention matmul FLOPs, balanced over
  contiguous, are 17 pairs of 2 x 2 against 8 of 4 x 4."""
  import re
  from shardlab.analysis import hlo
  from shardlab.analysis.program import Program
  from shardlab.data import zigzag
  from shardlab.schedules.context import ring_plan
  for C in (2, 4, 8):
    for nb in (1, 2, 4):
      n, visible = ring_plan(C, 4 * nb, 4, None)
      assert n == 4 and sum(visible) / nb ** 2 == pytest.approx(C - 1 + (nb + 1) / (2 * nb))
      n, visible = ring_plan(C, 4 * nb, 2, zigzag(4 * nb * C, C))   # chunks of 2 nb tokens: nb sub-blocks of 2
      assert n == 2 and visible[1:] == (2 * nb * nb,) * (C - 1)
      assert sum(visible) / (2 * nb) ** 2 == pytest.approx(C / 2 + 1 / (4 * nb))
  shape = {"fsdp": 1, "context": 8, "tensor": 1}
  mesh = testing.mesh_of(shape)

  def ring_flops(balanced):
    compiled, _ = testing.compile_schedule(None, shape, context="ring", load_balance=balanced)
    prog = Program(compiled.as_text(), mesh.device_ids, tuple(mesh.axis_names))
    f = hlo.flops_fn(prog.comps)
    return sum(f(i, {x.name: x.shape for x in instrs}) * prog.mult.get(c, 0)
               for c, instrs in prog.comps.items() for i in instrs
               if re.search(r"ring_(fwd|bwd)_step", i.op_name) and i.opcode not in ("while", "call", "conditional"))
  assert ring_flops(True) / ring_flops(False) == 17 * 2 * 2 / (8 * 4 * 4)


# ---- analysis: shardlab/analysis/context_cost.py and the memory model under context ----


def _config(*overrides):
  from hydra import compose, initialize_config_dir
  from shardlab.composition import resolve
  from shardlab.config import CONF_DIR, register_configs, to_config
  register_configs()
  with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
    return resolve(to_config(compose("config", overrides=list(overrides))))


def test_causal_work_contiguous_is_about_twice_the_average_and_zigzag_is_even():
  """A block-skipping kernel: contiguous chunks give the last device C - 1/2 blocks against an average of C/2;
  zigzag gives every device C/2, and the same half block at every ring step. A ring with free transfers then
  takes C - 1/2 blocks (plain) against C/2 (zigzag): 8/15 of ideal at C = 8."""
  from shardlab.analysis import context_cost as CC
  for C in (2, 4, 8):
    assert CC.imbalance(C, False) == pytest.approx((2 * C - 1) / C)
    assert CC.imbalance(C, True) == pytest.approx(1.0)
    assert all(w == pytest.approx(0.5) for row in CC.causal_work(C, True) for w in row)
  assert CC.ring_makespan(CC.causal_work(8, False), 0.0) == pytest.approx(7.5)
  assert CC.ring_makespan(CC.causal_work(8, True), 0.0) == pytest.approx(4.0)
  # a transfer longer than a step's work shows: each of the C-1 shifts waits for the one before
  assert CC.ring_makespan(CC.causal_work(8, True), 2.0) == pytest.approx(7 * 2.0 + 0.5)


@pytest.mark.parametrize("strategy", ["all_gather", "ring", "ulysses"])
def test_bytes_per_layer_model_is_the_compiled_ledger(strategy):
  """context_cost.bytes_per_layer (the cost model's hand count), forward + backward, x layers, equals what the
  compiled program moves over `context` for each strategy (tiny model, float32, context 8, GQA where it can;
  the positions' int32 moves left out, as the model leaves them out)."""
  from shardlab.analysis import context_cost as CC, hlo
  model = {} if strategy == "ulysses" else {"n_kv_heads": 2}    # ulysses at context 8: 8 K/V heads
  shape = {"fsdp": 1, "context": 8, "tensor": 1}
  compiled, _ = testing.compile_schedule(None, shape, model, context=strategy)
  m = testing.tiny_config(model).model
  a = CC.attn_of(m, testing.tiny_config(model).train.batch_size, 8, 1, e=4)
  want = m.n_layers * sum(CC.bytes_per_layer(strategy, a).values())
  colls = [c for c in hlo.collectives(compiled.as_text(), testing.mesh_of(shape))
           if c.axis == "context" and c.dtype == "f32" and c.kind != "all-reduce"]   # all-reduce: weight gradients
  assert sum(c.total_bytes for c in colls) == want, {(c.kind, c.scope): c.total_bytes for c in colls}


def test_activations_per_device_fall_as_one_over_context():
  """memory_model.breakdown: at a fixed global sequence, activations per device (the logits included) at
  context 4 are a quarter of context 1's; the training state is the same when weights stay sharded over fsdp."""
  from shardlab.analysis import memory_model as MM
  base = ["model=llama3_8b", "model.n_layers=2", "model.seq_len=32768", "train.batch_size=2", "mesh.fsdp=2",
          "mesh.tensor=1", "precision=bf16", "model.attention=dot_product", "context=ulysses"]
  one, four = (MM.breakdown(_config(*base, f"mesh.context={c}")) for c in (1, 4))
  assert one["activations"] == 4 * four["activations"]
  assert one["master_params"] == four["master_params"] and _config(*base, "mesh.context=4").local_tokens == 8192


@pytest.mark.parametrize("strategy, balanced", [("ring", True), ("ulysses", False), ("all_gather", False)])
def test_weights_sharded_over_fsdp_and_context_train_like_the_reference(strategy, balanced):
  """layout.rules.embed=[fsdp,context] (the training state split over every device, torchtitan's dp_shard_cp) on
  fsdp 2 x context 2 x tensor 2, with each context strategy: loss and every gradient against the plain
  reference; the weights are gathered over both axes and their gradients reduce-scattered over both."""
  from shardlab.layout import DEFAULT_RULES
  rules = {**{k: list(v) for k, v in DEFAULT_RULES.items()}, "embed": ["fsdp", "context"]}
  compiled, (loss, grads) = testing.compile_schedule(None, {"fsdp": 2, "context": 2, "tensor": 2}, layout=rules,
                                                     context=strategy, load_balance=balanced)
  ref_loss, ref_grads = reference_loss_and_grads()
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=2e-5, atol=2e-5, label=f"{strategy}: ")
  from shardlab.analysis import hlo
  axes = {c.axis for c in hlo.collectives(compiled.as_text(), testing.mesh_of({"fsdp": 2, "context": 2, "tensor": 2}))
          if c.kind in ("all-gather", "reduce-scatter")}
  assert "fsdp+context" in axes, axes


@pytest.mark.slow
@pytest.mark.parametrize("mesh, model, extra", [
    ({"pipeline": 2, "fsdp": 2, "context": 2}, None, {"pipeline": {"impl": "1f1b", "microbatches": 2}}),
    ({"expert": 2, "fsdp": 2, "context": 2},
     {"n_experts": 8, "top_k": 2, "expert_d_ff": 32, "router_z_loss": 1e-3, "n_layers": 2},
     {"expert": {"impl": "all_to_all"}}),
    ({"pipeline": 2, "fsdp": 2, "context": 2}, None,
     {"pipeline": {"impl": "1f1b", "microbatches": 2}, "load_balance": "striped"}),
    ({"expert": 2, "fsdp": 2, "context": 2},
     {"n_experts": 8, "top_k": 2, "expert_d_ff": 32, "router_z_loss": 1e-3, "n_layers": 2},
     {"expert": {"impl": "all_to_all"}, "load_balance": "striped"})],
    ids=["pipeline", "experts", "pipeline-striped", "experts-striped"])
def test_weights_over_fsdp_and_context_with_a_pipeline_or_experts(mesh, model, extra):
  """The weights over fsdp x context beside the parts that can run with a context split: 1f1b stages
  (p2 x f2 x c2) and an expert dispatcher (e2 x f2 x c2), with Ulysses, the tokens in index order and striped:
  loss and every gradient against the plain reference."""
  from shardlab.layout import DEFAULT_RULES
  rules = {**{k: list(v) for k, v in DEFAULT_RULES.items()}, "embed": ["fsdp", "context"]}
  _, (loss, grads) = testing.compile_schedule(None, mesh, model, layout=rules, context="ulysses", **extra)
  ref_loss, ref_grads = reference_loss_and_grads(model)
  assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=1e-4, atol=2e-6, label=f"{sorted(mesh)}: ")


def test_choose_names_the_strategy_and_flips_with_heads_and_kernel():
  """context_search.choose at C = 8 on 8 H100s, a 4-layer llama3_8b at 32K tokens, one sequence (its weights fit
  replicated over context, which the run's schedule keeps them): with shardlab's kernels Ulysses (cuDNN inside,
  masked blocks skipped) beats the ring (its sub-blocks skipped too, but its merges run outside a fused kernel);
  all_gather, which runs the plain attention, is excluded with the line the run itself would refuse it with (it
  used to be priced); with 12 query heads Ulysses cannot split them 8 ways and is excluded with that reason, and
  the choice flips."""
  from shardlab.analysis import context_search as CS
  base = ["model=llama3_8b", "model.n_layers=4", "model.seq_len=32768", "train.batch_size=1", "mesh.tensor=1",
          "precision=bf16", "model.attention=dot_product", "schedule.remat=save_qkv_attn_out", "hardware=h100",
          "context.load_balance=true"]
  got = CS.choose(_config(*base), devices=8, degrees=(8,))
  assert got["best"]["label"] == "ulysses zigzag C=8" and got["reason"].startswith("ulysses zigzag C=8: predicted")
  assert got["excluded"]["all_gather zigzag C=8"].startswith(
      "model.attention=dot_product: context=all_gather runs the plain attention")
  flipped = CS.choose(_config(*base, "model.n_heads=12", "model.n_kv_heads=4", "model.d_model=1536"), devices=8,
                      degrees=(8,))
  assert flipped["excluded"]["ulysses zigzag C=8"].startswith("ulysses splits the heads: 12 query and 4 K/V heads")
  assert flipped["best"]["strategy"] != "ulysses"

USP_CASES = [({"context": 8}, 4, False), ({"context": 8}, 2, True), ({"fsdp": 2, "context": 4}, 2, "striped"),
             ({"context": 4, "tensor": 2}, 2, True)]


@pytest.mark.parametrize("shape, ulysses, placement", USP_CASES,
                         ids=[f"{testing.mesh_id({'fsdp': 1, 'tensor': 1, **m})}-u{u}-{p}" for m, u, p in USP_CASES])
def test_usp_is_the_same_training(shape, ulysses, placement):
  """context=usp: Ulysses' all-to-alls among U consecutive context ranks and the ring across the C/U groups, on
  every split of a context axis of 8 devices (U = 4 and 2 of 8; 2 of 4 beside fsdp and beside tensor), the
  tokens in index order, zigzag and striped: loss and every gradient as the plain reference's."""
  shape = {"fsdp": 1, "tensor": 1, **shape}
  _, (loss, grads) = testing.compile_schedule(None, shape, context="usp", ulysses=ulysses, load_balance=placement)
  ref_loss, ref_grads = reference_loss_and_grads()
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=f"usp u{ulysses} {placement}: ")


@pytest.mark.parametrize("strategy", ["usp", "a2a_p2p"])
def test_usp_and_a2a_p2p_bytes_are_the_hand_count_and_train_like_the_reference(strategy):
  """usp with GQA (2 K/V heads) at context 8 chooses U = 2 (the most the heads allow), a ring of 4: per layer
  Ulysses' all-to-alls within pairs of ranks and the ring's shifts within rings of 4 (the ledger's group sizes),
  their bytes the cost model's hand count (context_cost via the strategy's bytes_per_layer). a2a_p2p with no node
  size puts every rank in one node: all-to-alls over 8 and a ring of one (no shift at all)."""
  from shardlab.analysis import context_cost as CC, hlo
  model = {"n_kv_heads": 2} if strategy == "usp" else {}
  shape = {"fsdp": 1, "context": 8, "tensor": 1}
  compiled, (loss, grads) = testing.compile_schedule(None, shape, model, context=strategy)
  ref_loss, ref_grads = reference_loss_and_grads(model)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=f"{strategy}: ")
  cfg = testing.tiny_config(model)
  a = CC.attn_of(cfg.model, cfg.train.batch_size, 8, 1, e=4)
  want = cfg.model.n_layers * sum(CC.bytes_per_layer(strategy, a).values())
  colls = [c for c in hlo.collectives(compiled.as_text(), testing.mesh_of(shape))
           if c.axis == "context" and c.dtype == "f32" and c.kind != "all-reduce"]
  assert sum(c.total_bytes for c in colls) == want, {(c.kind, c.scope): c.total_bytes for c in colls}
  sizes = {(c.kind, c.group_size) for c in colls}
  if strategy == "usp":
    assert sizes == {("all-to-all", 2), ("collective-permute", 4)}, sizes
  else:
    assert sizes == {("all-to-all", 8)}, sizes


def test_usp_degrees_and_refusals():
  """The Ulysses degree: usp's default the largest proper divisor of C both head counts allow; a2a_p2p's the
  context ranks in one node (node_devices over the tensor axis), so on H100 nodes (8 GPUs) with tensor 2 and
  context 8 the all-to-alls run among 4 and the ring across 2 nodes. A degree that does not divide the heads or
  C is one line, before anything is compiled."""
  from shardlab.config import ContextConfig
  from shardlab.errors import ConfigError
  from shardlab.layout import Layout
  from shardlab.schedules import context as CP
  m = testing.tiny_config().model
  usp = CP.make(ContextConfig(impl="usp"), m, Layout())
  assert usp.ulysses_degree(8, 8, 8, 1) == 4 and usp.ulysses_degree(8, 8, 2, 1) == 2
  assert usp.ulysses_degree(2, 8, 8, 1) == 1 and usp.ulysses_degree(6, 9, 3, 1) == 3
  a2a = CP.make(ContextConfig(impl="a2a_p2p", node_devices=8), m, Layout())
  assert a2a.ulysses_degree(8, 8, 8, 2) == 4 and a2a.ulysses_degree(8, 8, 8, 1) == 8
  assert a2a.ulysses_degree(2, 8, 8, 8) == 1
  cfg = _config("context=a2a_p2p", "hardware=h100")
  assert cfg.context.node_devices == 8
  with pytest.raises(ConfigError, match=r"^context=usp splits the heads 4 ways \(context.ulysses=4\): 8 query "
                                        r"and 2 K/V heads per device"):
    testing.compile_schedule(None, {"fsdp": 1, "context": 8, "tensor": 1}, {"n_kv_heads": 2}, context="usp",
                             ulysses=4)
  with pytest.raises(ConfigError, match=r"^context.ulysses=3: context=usp needs a Ulysses degree that divides"):
    CP.make(ContextConfig(impl="usp", ulysses=3), m, Layout()).check({"fsdp": 1, "context": 8, "tensor": 1})


@pytest.mark.parametrize("strategy, ulysses, beside", [("usp", 2, "expert"), ("a2a_p2p", 0, "expert"),
                                                      ("a2a_p2p", 0, "data")])
def test_usp_and_a2a_p2p_beside_experts_and_data_are_the_reference(strategy, ulysses, beside):
  """usp (U = 2, a ring of 2) and a2a_p2p (its own degree: with no node size every rank in one node, all-to-alls
  over the 4 context ranks and a ring of one) on expert 2 x context 4 with the all_to_all dispatcher's MoE layers,
  and a2a_p2p on data 2 x context 4 (dense): each part's collectives over its own axes, loss and every gradient
  against the plain reference."""
  model = {"n_experts": 8, "top_k": 2, "expert_d_ff": 32, "n_layers": 2} if beside == "expert" else {}
  _, (loss, grads) = testing.compile_schedule(None, {beside: 2, "fsdp": 1, "context": 4, "tensor": 1}, model,
                                              context=strategy, ulysses=ulysses,
                                              expert={"impl": "all_to_all"} if beside == "expert" else None)
  ref_loss, ref_grads = reference_loss_and_grads(model)
  assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=1e-4, atol=2e-6, label=f"{strategy} x {beside}: ")


def test_each_kernel_is_priced_at_its_own_measured_rate():
  """A layer's attention is priced at the rate of the kernel that runs it (HardwareConfig.attention_rate): the
  ring's steps (shardlab's Pallas kernel on a GPU target) at the preset's flash_kernel_efficiency, Ulysses with
  cuDNN's kernel (dot_product) at attention_efficiency, Ulysses with blockwise (the Pallas kernel again) and one
  device's blockwise at the Pallas rate (the kernels alone: a ring's merges run at HBM rate); a preset with no Pallas
  figure prices every kernel at attention_efficiency.
  On a TPU preset (no Pallas figure measured) nothing changes."""
  import dataclasses
  from shardlab.analysis import context_cost as CC
  from shardlab.config import ContextConfig
  from shardlab.layout import Layout
  from shardlab.schedules import context as CP
  cfg = _config("hardware=h100", "model=llama3_8b")
  hw = cfg.hardware
  assert hw.flash_kernel_efficiency and hw.flash_kernel_efficiency != hw.attention_efficiency
  cudnn_only = dataclasses.replace(hw, flash_kernel_efficiency=0.0)
  a = CC.Attn(b=1, L=65536, C=8, H=32, G=8, K=128)
  ratio = hw.attention_efficiency / hw.flash_kernel_efficiency

  def attention_s(impl, attention, hw, a=a):
    part = CP.make(ContextConfig(impl=impl, name=impl), dataclasses.replace(cfg.model, attention=attention), Layout())
    return CC.layer_time(part, a, hw, hw.ici_bandwidth, balanced=True, merge=False).attention_s   # kernels alone
  assert CP.make(ContextConfig(impl="ring"), cfg.model, Layout()).pallas_on(a) == ("cuda", "tpu")
  for impl, attention, pallas in (("ring", "dot_product", True), ("ulysses", "dot_product", False),
                                  ("ulysses", "blockwise", True)):
    got, base = attention_s(impl, attention, hw), attention_s(impl, attention, cudnn_only)
    assert got == pytest.approx(base * (ratio if pallas else 1.0), rel=1e-9), (impl, attention)
  one = dataclasses.replace(a, C=1, L=8192)
  assert attention_s("ulysses", "blockwise", hw, one) == pytest.approx(
      ratio * attention_s("ulysses", "blockwise", cudnn_only, one), rel=1e-9)
  assert attention_s("ulysses", "dot_product", hw, one) == attention_s("ulysses", "dot_product", cudnn_only, one)
  tpu = _config("hardware=tpu_v5p").hardware
  assert not tpu.flash_kernel_efficiency and tpu.attention_rate(True) == tpu.attention_rate(False)
  # and at the FLOPs it does: shardlab's kernel states 8 (dK/dV) + 6 (dQ) per block pair in backward against 4
  # forward (flash_kernel.py's names), FlashAttention-2 (cuDNN) 2.5 x the forward
  from shardlab import flash_kernel as F
  assert CC.bwd_over_fwd(True) == F.BWD_OVER_FWD == 3.5 and CC.bwd_over_fwd(False) == 2.5
  rates = lambda pallas: CC.Rates(a, hw, hw.ici_bandwidth, True, True, False, pallas=pallas).block_s
  assert rates(True)[1] / rates(True)[0] == 3.5 and rates(False)[1] / rates(False)[0] == 2.5
