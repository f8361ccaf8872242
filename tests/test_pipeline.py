"""Pipeline parallelism (mesh.pipeline, schedules/pipeline.py): the layer stack split into stages over `pipeline`,
run by one executor from a schedule table. The same training as the unsharded reference, loss and every gradient
in float32, on pipeline meshes of 8 devices, with M = P and M = 2P microbatches and V = 2 for interleaved (and in a
V for zb_v and dualpipev); the
bytes over `pipeline` against a hand count; bad settings one line, before anything compiles."""
import pytest

from conftest import compose, reference_loss_and_grads
from shardlab import testing
from shardlab.mesh import ConfigError
from shardlab import pipeline_tables as PL
from shardlab.testing import assert_trees_close

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md

RTOL = ATOL = 2e-5
MODEL = {"n_layers": 8}     # divisible by P x V for every case below
P2F2T2 = {"pipeline": 2, "fsdp": 2, "tensor": 2}
P4F2 = {"pipeline": 4, "fsdp": 2, "tensor": 1}
P8 = {"pipeline": 8, "fsdp": 1, "tensor": 1}
P2D2T2 = {"pipeline": 2, "data": 2, "fsdp": 1, "tensor": 2}
# (schedule, mesh, M, V): every schedule with M = P and M = 2P, every mesh the issue names at least once.
CASES = [("gpipe", P2F2T2, 2, 1), ("gpipe", P8, 16, 1),
         ("1f1b", P4F2, 8, 1), ("1f1b", P2D2T2, 2, 1), ("eager_1f1b", P4F2, 8, 1),
         ("interleaved", P2F2T2, 4, 2), ("interleaved", P4F2, 4, 2),
         ("zb_h1", P2D2T2, 2, 1), ("zb_h1", P4F2, 8, 1), ("looped_bfs", P2F2T2, 2, 2),
         ("zb_h2", P4F2, 8, 1), ("zb_v", P2F2T2, 4, 2), ("zb_v", P4F2, 8, 2), ("dualpipev", P4F2, 8, 2)]


def _run(impl, shape, M, V, **pipe):
  return testing.compile_schedule(None, shape, MODEL, pipeline={"impl": impl, "microbatches": M,
                                                                "virtual_stages": V, **pipe})


@pytest.mark.parametrize("impl,shape,M,V", CASES, ids=[f"{c[0]}-{testing.mesh_id(c[1])}-M{c[2]}" for c in CASES])
def test_pipeline_schedules_match_the_reference(impl, shape, M, V):
  _, (loss, grads) = _run(impl, shape, M, V)
  ref_loss, ref_grads = reference_loss_and_grads(MODEL)
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss)), (float(loss), float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=f"{impl} {testing.mesh_id(shape)} M={M}: ")


def test_weights_gathered_once_per_step_and_prefetch_inside_the_stages():
  """pipeline.gather=step (each stage's FSDP weights gathered once, reduce-scattered once) with GQA, and
  per-microbatch gathers with prefetch and all-reduce TP inside each stage."""
  model = {**MODEL, "n_kv_heads": 2}
  _, (_, grads) = testing.compile_schedule(None, P2F2T2, model, pipeline={"impl": "1f1b", "microbatches": 4,
                                                                          "gather": "step"})
  assert_trees_close(grads, reference_loss_and_grads(model)[1], rtol=RTOL, atol=ATOL, label="gather=step: ")
  _, (_, grads) = testing.compile_schedule({"prefetch": 1, "tp": "allreduce"}, P2F2T2, MODEL,
                                           pipeline={"impl": "gpipe", "microbatches": 4})
  assert_trees_close(grads, reference_loss_and_grads(MODEL)[1], rtol=RTOL, atol=ATOL, label="prefetch: ")


def test_pipeline_sends_are_a_hand_count():
  """Every tick each stage sends its forward output to the next stage and its input gradient to the previous one
  (ppermute over `pipeline`, the same shape whatever the tick ran: one program): 2 T ppermutes of one microbatch's
  residual stream [B / (fsdp M), L / tensor (sequence-parallel), D], f32, each its whole operand. Of the 2 T
  sends per device, 2 M V carry a microbatch on a stage with both neighbours, the rest are the bubble's (the
  useful bytes over the axis: 2 M (V P - 1) boundary crossings of one microbatch, test_pipeline_tables)."""
  from shardlab.analysis import hlo
  cfg = testing.tiny_config()
  for impl, shape, M, V in (("1f1b", P4F2, 8, 1), ("interleaved", P2F2T2, 4, 2)):
    compiled, _ = _run(impl, shape, M, V)
    P = shape["pipeline"]
    T = len(PL.build(impl, P, M, V))
    seq = cfg.model.seq_len // shape["tensor"]                      # the baseline schedule is sequence-parallel
    act = cfg.train.batch_size // shape["fsdp"] // M * seq * cfg.model.d_model * 4
    led = hlo.ledger(hlo.collectives(compiled.as_text(), testing.mesh_of(shape)))
    sends = led["collective-permute"]["pipeline"]
    assert sends["count"] == 2 * T, (impl, sends)
    assert sends["bytes"] == 2 * T * act, (impl, sends, act)
    assert set(led["collective-permute"]) == {"pipeline"}


def test_one_f_one_b_holds_p_microbatches_and_gpipe_m():
  """The executor's buffers hold what the table has in flight: residual slots for P microbatches in 1f1b, M in
  gpipe (stage 0, the busiest); zb_h1 keeps its W's output gradients besides."""
  P, M = 4, 8
  assert PL.Plan(PL.build("1f1b", P, M), M, 1).slots["res"] == P
  assert PL.Plan(PL.build("gpipe", P, M), M, 1).slots["res"] == M
  table = PL.build("zb_h1", P, M)
  zb = PL.Plan(table, M, 1)
  assert zb.slots["res"] == max(PL.in_flight(table, until="W"))
  waiting = [0] * P     # per stage, the most microbatches between their B and their W
  for s in range(P):
    live = 0
    for row in table:
      for a in row[s]:
        live += {"B": 1, "W": -1}.get(a.kind, 0)
        waiting[s] = max(waiting[s], live)
  assert zb.slots["w"] == max(waiting) and PL.Plan(PL.build("1f1b", P, M), M, 1).slots["w"] == 0


@pytest.mark.parametrize("overrides,message", [
    (["mesh.pipeline=2", "mesh.fsdp=2"], r"^layout rule layers -> pipeline: .* pipeline=gpipe, 1f1b"),
    (["mesh.pipeline=4", "mesh.fsdp=2", "mesh.tensor=1", "pipeline=1f1b", "model.n_layers=6"],
     r"^model.n_layers=6 is not divisible by mesh.pipeline"),
    (["mesh.pipeline=4", "mesh.fsdp=2", "mesh.tensor=1", "pipeline=interleaved", "model.n_layers=8",
      "pipeline.microbatches=2"], r"^pipeline.microbatches=2 is not a multiple of mesh.pipeline=4"),
    (["mesh.pipeline=2", "mesh.fsdp=2", "pipeline=1f1b", "model.n_layers=4", "pipeline.microbatches=3"],
     r"^train.batch_size=16 is not divisible by mesh.fsdp \* pipeline.microbatches=6"),
    (["mesh.pipeline=2", "mesh.fsdp=2", "pipeline=zigzag"], r"pipeline"),
    (["pipeline=1f1b", "model.n_layers=4"], r"^pipeline=1f1b needs stages: set mesh.pipeline to 2 or more"),
    (["mesh.pipeline=2", "mesh.fsdp=2", "pipeline=1f1b", "model.n_layers=4", "schedule=collective_matmul"],
     r"^pipeline=1f1b with schedule.tp=ring.*: its layer places ppermutes .*inside a pipeline slot"),
    (["mesh.pipeline=2", "mesh.fsdp=2", "pipeline=1f1b", "model.n_layers=4", "schedule.microbatches=2"],
     r"^pipeline=1f1b splits the batch into pipeline.microbatches"),
])
def test_bad_pipeline_settings_are_one_line(overrides, message):
  import re
  from shardlab.config import to_config
  from shardlab.validate import validate
  try:
    cfg = to_config(compose(*overrides))
  except Exception as e:          # Hydra refuses an unknown preset itself
    assert "pipeline" in str(e)
    return
  with pytest.raises(ConfigError) as e:
    validate(cfg, 8)
  assert re.search(message, str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_a_users_table_is_checked_before_anything_compiles(tmp_path, monkeypatch):
  """pipeline.impl=module:Name: a user's orders (placed on ticks, checked) or table; one that deadlocks is one
  line."""
  (tmp_path / "my_pipe.py").write_text(
      "from shardlab.schedules.pipeline import Action\n"
      "class Backwards:\n"
      "  def orders(self, P, M, V):\n"
      "    return [[Action('B', m) for m in range(M)] + [Action('F', m) for m in range(M)] for _ in range(P)]\n"
      "class Mine:\n"
      "  def orders(self, P, M, V):\n"
      "    return [[Action(k, m) for k in 'FB' for m in range(M)] for _ in range(P)]\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ConfigError, match=r"^pipeline table deadlocks at tick 0"):
    PL.load_table("my_pipe:Backwards", 2, 2, 1)
  assert PL.load_table("my_pipe:Mine", 2, 4, 1) == PL.build("gpipe", 2, 4)


def test_check_slots_reads_the_one_trace_for_a_ppermute_inside_a_slot():
  """A pipeline slot (a lax.cond in a `runs` scope) whose branch places a ppermute over an axis of more than one
  device is refused from the step's one trace (trainer.lower), whoever wrote the part; over an axis of one device,
  or outside a slot, it is not."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P
  from shardlab import collectives as C
  from shardlab.axes import PIPELINE, TENSOR
  from shardlab.errors import ConfigError
  from shardlab.pipeline_tables import runs
  from shardlab.schedules.pipeline import check_slots
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), (PIPELINE, TENSOR))

  def step(axis, in_slot):
    def body(x):
      send = lambda x: C.ppermute(x, axis, [(0, 1), (1, 0)] if axis == PIPELINE else [(0, 0)])
      if not in_slot:
        return send(x)
      with jax.named_scope(runs("B", 4, 8)):
        return jax.lax.cond(x.sum() > 0, send, lambda x: x, x)
    f = jax.shard_map(body, mesh=mesh, in_specs=P(PIPELINE), out_specs=P(PIPELINE), check_vma=False)
    return jax.jit(f).trace(jnp.ones((2, 4))).jaxpr

  with pytest.raises(ConfigError, match="the B slot places a ppermute over pipeline"):
    check_slots(step(PIPELINE, True))
  check_slots(step(TENSOR, True))        # an axis of one device: no message crosses stages
  check_slots(step(PIPELINE, False))     # the pipeline's own sends, outside the slots


@pytest.mark.slow
@pytest.mark.parametrize("asset,shape,batch", [("torchtitan-2-rank.csv", P2F2T2, None),
                                               ("torchtitan-4-rank.csv", {"pipeline": 4, "fsdp": 1, "tensor": 2}, 12)])
def test_a_schedule_csv_from_torchtitan_trains_like_the_reference(asset, shape, batch):
  """pipeline.table=PATH.csv: torchtitan's schedules (tests/assets: two stages per rank, I and W actions; 8
  microbatches on 2 ranks, 6 on 4: the file fixes P, V and M) train equal to the plain reference, the 4-rank one
  on a batch of 12 sequences (6 microbatches of 2)."""
  from pathlib import Path
  path = str(Path(__file__).parent / "assets" / asset)
  _, (loss, grads) = testing.compile_schedule(None, shape, MODEL, pipeline={"table": path}, batch_size=batch)
  ref_loss, ref_grads = reference_loss_and_grads(MODEL, batch)
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss)), (float(loss), float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=f"torchtitan {asset}: ")


@pytest.mark.parametrize("remat", ["full", "save_matmuls"])
def test_zero_bubble_under_remat_equals_the_reference(remat):
  """zb_h1's B and W split each layer's backward once (schedules/split.py); under remat W reads what B
  recomputed, from buffers that vary over `pipeline` where the layer's trace did not."""
  _, (loss, grads) = testing.compile_schedule({"remat": remat}, P2D2T2, MODEL,
                                              pipeline={"impl": "zb_h1", "microbatches": 4})
  ref_loss, ref_grads = reference_loss_and_grads(MODEL)
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss)), (float(loss), float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label=f"zb_h1 remat={remat}: ")


def test_flexible_interleave_matches_the_reference():
  """pipeline=interleaved pipeline.consecutive=4 on p2 x f2 x t2 (8 microbatches, 2 chunks per stage): groups of
  4 back to back instead of Megatron's groups of P = 2, the same training as the plain reference."""
  _, (loss, grads) = _run("interleaved", P2F2T2, 8, 2, consecutive=4)
  ref_loss, ref_grads = reference_loss_and_grads(MODEL)
  assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss)), (float(loss), float(ref_loss))
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL, label="interleaved, consecutive=4: ")
