"""Pipeline schedules as tables (shardlab/schedules/pipeline.py): placed on ticks, checked, replayed, drawn.
Pure Python: no devices, no compile."""
import pytest

from shardlab.mesh import ConfigError
from shardlab import pipeline_tables as PL
from shardlab.analysis import pipeline_replay as PR
from shardlab.pipeline_tables import Action


@pytest.mark.parametrize("P,M", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16)])
def test_bubble_of_uniform_stages_on_free_links_is_the_closed_form(P, M):
  """gpipe and 1f1b: (P-1)/(M+P-1); interleaved and looped_bfs (V=2): (P-1)/(V M+P-1), each within 10% (here:
  exact; looped_bfs in the executor's ticks too);
  zb_h1 (W split off and deferred) below 1f1b's."""
  for name, V in (("gpipe", 1), ("1f1b", 1), ("eager_1f1b", 1), ("interleaved", 2), ("looped_bfs", 2)):
    got = PR.replay(PL.build(name, P, M, V), t_f=1.0, t_b=2.0, sync=False)["bubble"]
    want = PL.closed_form_bubble(name, P, M, V)
    assert abs(got - want) <= 0.1 * want, (name, P, M, V, got, want)
    if name in ("gpipe", "eager_1f1b", "looped_bfs"):   # the executor's ticks (neighbour-synchronised): the same
      assert abs(PR.replay(PL.build(name, P, M, V), t_f=1.0, t_b=2.0)["bubble"] - want) <= 0.1 * want
  bubble = lambda name, sync: PR.replay(PL.build(name, P, M), 1.0, 1.0, 1.0, sync=sync)["bubble"]
  assert bubble("zb_h1", False) <= bubble("1f1b", False), (P, M)
  if P > 2 or M > 2:    # in the executor's ticks, W fills what would be bubble
    assert bubble("zb_h1", True) < bubble("1f1b", True), (P, M)


def test_stages_that_hold_fewer_layers_take_less_time():
  """replay(layers=...): a virtual stage's F and B scale with the layers it holds, the head's time does not; one
  layer fewer on the first and the last stage (Llama 3's balance) shortens a step whose last stage runs a head."""
  P, M, V = 4, 8, 2
  ticks = PL.build("interleaved", P, M, V)
  even = PR.replay(ticks, 1.0, 2.0, sync=False, t_head=1.0)
  assert PR.replay(ticks, 1.0, 2.0, sync=False, t_head=1.0, layers=[1.0] * (V * P)) == even
  ends = [0.5] + [1.0] * (V * P - 2) + [0.5]
  for sync in (False, True):
    fewer = PR.replay(ticks, 1.0, 2.0, sync=sync, t_head=1.0, layers=ends)
    busy = PR.replay(ticks, 1.0, 2.0, sync=sync, t_head=1.0)["busy_s"]
    assert fewer["busy_s"][0] == busy[0] - M * 3.0 * 0.5               # chunk 0 of stage 0: half its F and B
    assert fewer["busy_s"][P - 1] == busy[P - 1] - M * 3.0 * 0.5       # the last chunk: half, its head whole
    assert fewer["step_s"] < PR.replay(ticks, 1.0, 2.0, sync=sync, t_head=1.0)["step_s"]
  with pytest.raises(ValueError, match="virtual stages"):
    PR.replay(ticks, 1.0, 2.0, layers=[1.0] * P)
  # in a V both ends are chunks of stage 0; W scales with its layers too
  v = PL.build("zb_v", P, M, 2)
  busy = PR.replay(v, 1.0, 2.0, 1.0, sync=False)["busy_s"]
  assert PR.replay(v, 1.0, 2.0, 1.0, sync=False, layers=ends)["busy_s"] == [busy[0] - 2 * M * 4.0 * 0.5, *busy[1:]]


def test_one_program_pays_each_hop_a_tick():
  """In the executor's neighbour-synchronised ticks a 1F1B warm-up and cool-down cost whole ticks (F + B) per
  hop: its bubble is above the closed form and above GPipe's, which keeps the closed form there."""
  P, M = 4, 8
  got = PR.replay(PL.build("1f1b", P, M), t_f=1.0, t_b=2.0)["bubble"]
  assert PL.closed_form_bubble("1f1b", P, M) < got
  assert got > PR.replay(PL.build("gpipe", P, M), t_f=1.0, t_b=2.0)["bubble"]


def test_activations_in_flight():
  """GPipe holds every microbatch; 1f1b and zb_h1 at most P - s on stage s (stage 0: P) until the backward, zb_h1
  at most P on any stage until its W."""
  P, M = 4, 16
  assert PL.in_flight(PL.build("gpipe", P, M)) == [M] * P
  assert PL.in_flight(PL.build("1f1b", P, M)) == [P - s for s in range(P)]
  assert PL.in_flight(PL.build("zb_h1", P, M)) == [P - s for s in range(P)]
  # eager_1f1b: 2 (P - 1 - s) warm-up forwards, so that the executor's ticks reach the closed form
  assert PL.in_flight(PL.build("eager_1f1b", P, M)) == [2 * (P - s) - 1 for s in range(P)]
  # zb_h1 holds a microbatch's residuals until its W: never more than 1f1b's peak, P (ZB-H1 keeps 1F1B's memory)
  for P, M in ((2, 8), (4, 4), (4, 16), (8, 32)):
    assert max(PL.in_flight(PL.build("zb_h1", P, M), until="W")) == P, (P, M)


def test_the_1f1b_table_is_warmup_steady_state_cooldown():
  t = PL.build("1f1b", 2, 3)
  assert [[",".join(map(str, cell)) or "." for cell in row] for row in t] == [
      ["F0", "."], ["F1", "F0,B0"], ["B0", "F1,B1"], ["F2,B1", "."], [".", "F2,B2"], ["B2", "."]]


def test_a_table_that_reads_before_it_was_sent_never_runs_a_backward_or_deadlocks_is_one_line():
  t = PL.build("gpipe", 2, 2)
  early = [list(r) for r in t]
  early[1][1], early[2][1] = early[2][1], early[1][1]   # stage 1 runs F1 before stage 0 sent it
  with pytest.raises(ConfigError, match=r"^pipeline table: stage 1 runs F\d at tick \d+, but its input F\d from "
                                        r"stage 0 is made at tick \d+: it reads an activation before it was sent$"):
    PL.check(early, 2)
  no_backward = [[tuple(a for a in c if not (s == 0 and a.kind == "B")) for s, c in enumerate(r)] for r in t]
  with pytest.raises(ConfigError, match=r"^pipeline table: stage 0 never runs a backward: B0 is missing"):
    PL.check(no_backward, 2)
  with pytest.raises(ConfigError, match=r"^pipeline table deadlocks at tick 0: stage 0 waits to run B0; "
                                        r"stage 1 waits to run B0$"):
    PL.table([[Action("B", 0), Action("F", 0)], [Action("B", 0), Action("F", 0)]])
  with pytest.raises(ConfigError, match=r"^pipeline.microbatches=6 is not a multiple of mesh.pipeline=4"):
    PL.build("interleaved", 4, 6, 2)
  with pytest.raises(ConfigError, match=r"^pipeline=zigzag: unknown"):
    PL.build("zigzag", 4, 8)


def test_interleaved_sends_v_times_the_messages():
  """Each boundary between virtual stages is a send: V P - 1 of them per microbatch and direction."""
  P, M, V = 4, 8, 2
  sends = lambda t, v: sum(1 for row in t for s, c in enumerate(row) for a in c if a.kind == "F"
                           and PL.vstage(s, a.chunk, P) < v * P - 1)
  assert sends(PL.build("1f1b", P, M), 1) == M * (P - 1)
  assert sends(PL.build("interleaved", P, M, V), V) == M * (V * P - 1)


def test_the_picture(tmp_path):
  for name, V in (("1f1b", 1), ("interleaved", 2)):
    r = PR.replay(PL.build(name, 4, 8, V), t_f=1.0, t_b=2.0)
    PR.draw(r, tmp_path / f"{name}.png", title=f"{name}, P=4, M=8{', V=2' if V > 1 else ''}: ", unit="T_F")
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000


ASSETS = __import__("pathlib").Path(__file__).parent / "assets"


@pytest.mark.parametrize("name,V", [("gpipe", 1), ("1f1b", 1), ("eager_1f1b", 1), ("interleaved", 2), ("zb_h1", 1),
                                    ("zb_h2", 1), ("zb_v", 2), ("dualpipev", 2), ("looped_bfs", 2)])
def test_every_table_written_as_torch_csv_loads_back_identically(name, V, tmp_path):
  """write_csv (torch.distributed.pipelining's format: a row per rank, cells {stage}{F|I|W|B}{microbatch}) and
  read_csv: the same orders and placement (a V: stages r and 2P - 1 - r on rank r, torch's style "v"), placed on
  the same ticks as the named table; a split backward is written as I."""
  v_shape = name in PL.V_SHAPED
  PL.write_csv(PL.orders(name, 4, 8, V), tmp_path / "t.csv", v_shape)
  orders, P, V2, M, v2 = PL.read_csv(tmp_path / "t.csv")
  assert (P, V2, M, v2) == (4, V, 8, v_shape) and orders == PL.orders(name, 4, 8, V)
  assert PL.table(orders, V, v2) == PL.build(name, 4, 8, V)
  assert PL.table_of("none", str(tmp_path / "t.csv"), 4, 8, V).v_shape == v_shape
  cells = (tmp_path / "t.csv").read_text().split()[0].split(",")
  split = name in ("zb_h1", "zb_h2", "zb_v", "dualpipev")
  assert cells[0] == "0F0" and ("0I0" in cells and "0W0" in cells if split else "0B0" in cells)
  assert ("7F0" in cells) == v_shape     # rank 0 holds stage 2P - 1 = 7 in a V


@pytest.mark.parametrize("asset,P,V,M", [("torchtitan-2-rank.csv", 2, 2, 8), ("torchtitan-4-rank.csv", 4, 2, 6)])
def test_torchtitans_schedule_csvs_load(asset, P, V, M):
  """The CSVs torchtitan keeps among its test assets (tests/assets/README.md): two stages per rank, I and W
  actions; read, placed on ticks and checked; each (stage, microbatch) forward, input and weight gradient once."""
  orders, P2, V2, M2, v_shape = PL.read_csv(ASSETS / asset)
  assert (P2, V2, M2, v_shape) == (P, V, M, False)
  ticks = PL.table(orders, V)
  PL.check(ticks, M, V)
  kinds = [a.kind for row in ticks for cell in row for a in cell]
  assert kinds.count("F") == kinds.count("B") == kinds.count("W") == P * V * M


def test_communication_actions_in_a_csv_are_checked_and_a_bad_csv_is_one_line(tmp_path):
  """SEND/RECV and UNSHARD/RESHARD (torchtitan's example.csv has them) are shardlab's to place: checked where
  present, then left out; a cell that is no action, a stage on the wrong rank (neither looped nor a V), a send before
  its action, an action twice or missing, a table that deadlocks: one line each, naming the file."""
  good = ("0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0RESHARD\n"
          "1RECV_F0,1F0,1RECV_F1,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n")
  (tmp_path / "g.csv").write_text(good)
  orders, P, V, M, _ = PL.read_csv(tmp_path / "g.csv")
  assert PL.table(orders, V) == PL.build("gpipe", 2, 2)
  bad = {"0F0,0X0\n1F0\n": "'0X0' is not an action",
         "0F0,1F0\n1F1\n": "rank 0 runs stage 1 (1F0): a rank runs stages s with s mod P = its rank",
         "0F0,3F0,2F0\n1F0\n": "rank 0 runs stage 3 (3F0): a rank runs stages s with s mod P = its rank (torch's "
                                "looped placement) or, in a V, stages r and 2P - 1 - r; here stage 3 belongs on rank 1",
         "0SEND_F0,0F0,0B0\n1F0,1B0\n": "0SEND_F0: sends before 0F0 ran on this rank",
         "0F0,0F0,0B0\n1F0,1B0\n": "rank 0 runs 0F0 twice",
         "0F0,0B0\n1F0\n": "rank 1 never runs 1B0",
         "0B0,0F0\n1F0,1B0\n": "deadlock"}
  for i, (text, why) in enumerate(bad.items()):
    path = tmp_path / f"b{i}.csv"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
      _, P, V, M, _ = PL.read_csv(path)
      PL.table_of("none", str(path), P, M, V)
    assert str(e.value).startswith(f"pipeline.table={path}: ") and why in str(e.value) and "\n" not in str(e.value), \
        (text, str(e.value))
  with pytest.raises(ConfigError, match="cannot read it"):
    PL.read_csv(tmp_path / "missing.csv")


def test_flexible_interleave_groups_of_n():
  """pipeline.consecutive=N (Llama 3's flexible interleave): interleaved with microbatches in groups of N instead
  of P. Its bubble on free links stays (P-1)/(V M+P-1) for any N >= P dividing M, and the microbatches in flight
  grow with N ((V-1) N + 2 (P-1-s) + 1 on stage s: the warm-up forwards of torch's ScheduleInterleaved1F1B and the
  one beside the first backward); N = P is Megatron's interleaved table itself. N below P, or not dividing M, is
  one line; and so is N for a schedule that runs no groups."""
  P, V = 4, 2
  assert PL.build("interleaved", P, 8, V, 4) == PL.build("interleaved", P, 8, V)
  for M, N in ((8, 8), (12, 6), (16, 8)):
    ticks = PL.build("interleaved", P, M, V, N)
    got = PR.replay(ticks, t_f=1.0, t_b=2.0, sync=False)["bubble"]
    assert abs(got - PL.closed_form_bubble("interleaved", P, M, V)) <= 1e-9, (M, N, got)
    assert PL.in_flight(ticks) == [(V - 1) * N + 2 * (P - 1 - s) + 1 for s in range(P)], (M, N)
  for N, M, why in ((2, 8, r"groups of at least mesh.pipeline=4"), (6, 8, r"not a multiple of pipeline.consecutive=6")):
    with pytest.raises(ConfigError, match=rf"^pipeline\.(consecutive|microbatches)=\d+: .*{why}|{why}"):
      PL.build("interleaved", P, M, V, N)
  with pytest.raises(ConfigError, match=r"^pipeline.consecutive=8: only pipeline=interleaved"):
    PL.build("1f1b", P, 8, 1, 8)


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_zero_bubble_tables_reach_their_closed_forms_in_their_memory(P):
  """With T_F = T_B = T_W (a chunk of half a stage: half of each), in the executor's ticks (one action per tick)
  and on free links alike: zb_h1 and zb_h2 idle (P-1)/(3M+P-1), only the first forward's walk to the last stage
  (Qi et al.'s ZB-H1), zb_h1 for 1F1B's P microbatches in flight until W, zb_h2 for up to 2P - 1; zb_v and
  dualpipev (P-1)/(6M+P-1), the same walk over half stages, for 2P and 2P + 1 half-stage chunks (1F1B's P
  microbatches; DualPipeV's P + 1/2). With W cheaper than F, zb_h2's longer wait for its W's pays: below zb_h1."""
  for M in (P, 2 * P, 4 * P):
    for name, V in (("zb_h1", 1), ("zb_h2", 1), ("zb_v", 2), ("dualpipev", 2)):
      if name == "dualpipev" and M < 2 * P:
        continue
      ticks = PL.build(name, P, M, V)
      for sync in (True, False):
        got = PR.replay(ticks, 1 / V, 1 / V, 1 / V, sync=sync)["bubble"]
        assert got == pytest.approx(PL.closed_form_bubble(name, P, M, V), abs=1e-12), (name, P, M, sync)
    assert max(PL.in_flight(PL.build("zb_h1", P, M), "W")) == P
    assert max(PL.in_flight(PL.build("zb_h2", P, M), "W")) == min(2 * P - 1, M)
    assert max(PL.in_flight(PL.build("zb_v", P, M, 2), "W")) == 2 * P
    assert M < 2 * P or max(PL.in_flight(PL.build("dualpipev", P, M, 2), "W")) == 2 * P + 1
  if P > 2:
    bubble = lambda name: PR.replay(PL.build(name, P, 4 * P), 1.0, 0.75, 0.75)["bubble"]
    assert bubble("zb_h2") < bubble("zb_h1") < PR.replay(PL.build("eager_1f1b", P, 4 * P), 1.0, 1.5)["bubble"]


def test_a_v_places_chunk_one_back_up_the_stages():
  """In a V (zb_v, dualpipev) stage s holds model stages s and 2P - 1 - s: the forward turns on the last stage
  (from its chunk 0 to its chunk 1, no send) and the head runs on stage 0; the stored layers run in that order
  (depth_order); the executor files what a stage sends itself at the turn, and what comes from the other side.
  A V needs two chunks, and DualPipeV 2P microbatches: one line each."""
  P = 4
  assert [PL.vstage(s, c, P, True) for c in (0, 1) for s in range(P)] == [0, 1, 2, 3, 7, 6, 5, 4]
  assert PL.depth_order(8, P, 2, v_shape=True) == [0, 2, 4, 6, 7, 5, 3, 1]
  ticks = PL.build("zb_v", P, 8, 2)
  assert ticks.v_shape and PL.Plan(ticks, 8, 2).sends() == PL.Plan(PL.build("1f1b", P, 8), 8, 1).sends()
  head = [s for row in ticks for s, cell in enumerate(row) for a in cell if a.kind == "F" and a.chunk == 1 and a.mb == 0]
  assert head == [3, 2, 1, 0]
  arr = PL.Plan(ticks, 8, 2).arrays
  idle = lambda f: arr[f] == PL.Plan(ticks, 8, 2).slots["in" if "in" in f else "dy"]
  assert (~idle("r_in_own"))[:, :P - 1].sum() == 0 and (~idle("r_in_own"))[:, P - 1].sum() == 8   # the turn
  assert (~idle("r_in_up")).sum() == 8 * (P - 1) and (~idle("r_dy_down")).sum() == 8 * (P - 1)
  with pytest.raises(ConfigError, match=r"^pipeline=zb_v runs two chunks per stage in a V .*virtual_stages=2, not 1$"):
    PL.build("zb_v", P, 8, 1)
  with pytest.raises(ConfigError, match=r"^pipeline=dualpipev needs at least 2 x mesh.pipeline = 8 microbatches"):
    PL.build("dualpipev", P, 4, 2)
