"""The user schedule of user_schedule.py, checked with shardlab's testing kit: the same loss and gradients as
`baseline` on two meshes, no more bytes, and no collective the audit would call unplanned.

    pytest examples/            # shardlab's pytest plugin sets up 8 fake CPU devices; no conftest needed
"""

from shardlab import testing

from user_schedule import ExplicitReduce


def test_user_schedule_matches_baseline_and_is_all_planned():
  out = testing.assert_schedule_matches_baseline(ExplicitReduce, mesh_shapes=["2x4", "4x2", "2x2x2"], comm="baseline",
                                                 tp="user_schedule:NamedAllGatherTP")
  for ledgers in out.values():   # the same collectives, byte for byte, under the user's scope names
    assert ledgers["ledger"] == ledgers["baseline"]


def test_user_names_are_planned_collectives():
  """The audit's rule: any name under shardlab.collectives is planned; the user's names show in the ledger."""
  from shardlab.analysis import hlo
  compiled, _ = testing.compile_schedule(ExplicitReduce, (2, 4), tp="user_schedule:NamedAllGatherTP")
  mesh = testing.mesh_of(2, 4)
  colls, unplanned = testing.collectives_of(compiled, mesh=mesh)
  assert unplanned == []
  scopes = {c.scope for c in colls}
  assert {"user_seq_gather", "user_seq_scatter", "user_grad_reduce_scatter", "user_grad_psum"} <= scopes, scopes
