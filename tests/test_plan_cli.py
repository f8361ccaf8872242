"""`python -m shardlab.plan model=M hardware=H devices=N`: the first screen is the answer (a table of the best
layouts and the best one's batch window), the JSON behind it agrees with it, and the remat and microbatches each
layout runs at are the ones the stated rule picks. Pure Python (no JAX compile): a few seconds."""
from __future__ import annotations

import json

import pytest

from shardlab.analysis import planner
from shardlab.plan import compose, main

TINY = ["model=tiny", "hardware=h100", "devices=8"]


def _plan(capsys, argv: list[str]) -> tuple[str, dict]:
  """(the terminal text, the JSON) of one question."""
  assert main(argv) == 0
  text = capsys.readouterr().out
  assert main([*argv, "--json"]) == 0
  return text, json.loads(capsys.readouterr().out)


def test_the_first_screen_is_a_table_that_agrees_with_the_json(capsys):
  text, out = _plan(capsys, TINY)
  lines = text.splitlines()
  assert lines[0].startswith("tiny on 8 x h100, global batch 512 tokens (16 sequences)")
  assert "10 layouts" in lines[0]                  # every data x fsdp x tensor factorization of 8
  head = lines[2].split()
  assert head[:5] == ["#", "data", "x", "fsdp", "x"] and "remat" in head and "MFU" in head and "verdict" in head
  rows = [l.split() for l in lines[3:8]]
  assert [r[0] for r in rows] == ["1", "2", "3", "4", "5"]
  for r, l in zip(rows, out["layouts"]):          # each row is the JSON's layout of that rank
    assert (int(r[1]), int(r[3]), int(r[5])) == (l["data"], l["fsdp"], l["tensor"])
    assert r[6] == l["remat"] and int(r[7]) == l["microbatches"]
  assert "... 5 more (rows=K shows K" in lines[8]
  assert any(l.startswith("Batch window of #1") for l in lines)
  assert any("compute-bound from" in l for l in lines) and any("one pass fits up to" in l for l in lines)
  assert any(l.startswith("Ties (equal predicted step time)") for l in lines)
  assert text.count("prediction") >= 1 and len(lines) < 25       # one screen
  w = out["answer"]["batch_window"]
  crit = out["layouts"][0]["critical_batch_per_device"]["this_mesh"]
  b = out["layouts"][0]
  shards = b["data"] * b["fsdp"]
  assert w["compute_bound_from_tokens"] % (shards * 32) == 0          # whole sequences per batch shard
  assert w["compute_bound_from_tokens"] / 8 >= crit > (w["compute_bound_from_tokens"] - shards * 32) / 8
  # Searching, the top level is the plan of the best layout, not the configured 4x2 mesh.
  assert out["mesh"]["fsdp"] == b["fsdp"] and out["mesh"]["tensor"] == b["tensor"]
  assert out["search"] == {"devices": 8, "considered": 10, "qualifying": out["answer"]["qualifying"]}


def _order(l):
  return (float(f"{l['step_time_s']:.6g}"), planner.REMAT_BY_RECOMPUTE.index(l["remat"]), l["microbatches"])


def test_remat_and_microbatches_are_chosen_where_memory_needs_them(capsys):
  """A 1.2 MB HBM budget: without recomputation or microbatches the 1 x 4 x 2 layout does not fit; the search
  runs each layout at the fitting (remat, microbatches) with the shortest step time, then the least
  recomputation, then the fewest microbatches (a layout nothing fits at its least memory): checked against every
  combination."""
  argv = [*TINY, "hardware.hbm_bytes=1200000", "model.seq_len=128", "train.batch_size=32"]
  cfg = compose([a for a in argv if not a.startswith("devices=")])
  _, out = _plan(capsys, argv)
  assert {l["remat"] for l in out["layouts"]} - {"none"}, "the budget must need recomputation somewhere"
  for l in out["layouts"]:
    best, least = None, None
    local = 32 // (l["data"] * l["fsdp"])
    for remat in planner.REMAT_BY_RECOMPUTE:
      for k in [d for d in range(1, local + 1) if local % d == 0]:
        c = planner.override(cfg, schedule={"remat": remat, "microbatches": k})
        e = planner.evaluate_layout(c, l["data"], l["fsdp"], l["tensor"], l["axis_bandwidth"], l["ici_axes"])
        if e["fits"] and (best is None or _order(e) < _order(best)):
          best = e
        if least is None or e["memory_per_device_bytes"] < least["memory_per_device_bytes"]:
          least = e
    if best is None:                                  # nothing fits: shown at its least memory
      assert not l["fits"] and l["memory_per_device_bytes"] == least["memory_per_device_bytes"]
    else:
      assert l["fits"] and (l["remat"], l["microbatches"]) == (best["remat"], best["microbatches"]), l
  ok = [l for l in out["layouts"] if not l["rejected_because"]]
  assert all(_order(a) <= _order(b) for a, b in zip(ok, ok[1:]))


def test_a_remat_written_on_the_command_line_is_kept(capsys):
  _, out = _plan(capsys, [*TINY, "hardware.hbm_bytes=1200000", "schedule.remat=full"])
  assert {l["remat"] for l in out["layouts"]} == {"full"}
  _, out = _plan(capsys, [*TINY, "schedule.microbatches=2"])
  assert {l["microbatches"] for l in out["layouts"]} == {2}


def test_the_70b_question_in_one_command(capsys):
  """docs/planning.md's question: Llama 3 70B on 8 nodes of 8 H100 with a 4M-token batch."""
  text, out = _plan(capsys, ["model=llama3_70b", "hardware=h100", "devices=64", "precision=bf16",
                             "train.global_batch_tokens=4194304"])
  assert text.startswith("llama3_70b on 64 x h100 (8 nodes of 8), global batch 4,194,304 tokens (512 sequences)")
  best = out["layouts"][0]
  assert best["data"] * best["fsdp"] * best["tensor"] == 64 and best["fits"] and best["compute_bound"]
  assert out["answer"]["considered"] == 28 and out["answer"]["qualifying"] >= 1
  assert best["remat"] != "none" or best["microbatches"] > 1      # 70B at 64k tokens per GPU needs one of them
  assert out["warnings"] == []                                    # h100 is nodes of 8: cross-node axes are costed


@pytest.mark.parametrize("bad", ["devices=abc", "devices=0", "json=", "model=nope"])
def test_bad_input_is_one_line_and_exit_2(bad, capsys):
  assert main([*TINY[:2], bad]) == 2
  out, err = capsys.readouterr()
  assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("shardlab.plan: error:")


def test_pipeline_search_adds_pipeline_rows_and_columns(capsys):
  """pipeline_search=true: the pipeline layouts (tiny's 2 layers: P = 2, every named schedule but interleaved,
  which needs 4) are ranked with the others, and the table gains P, schedule and bubble; without it, neither."""
  text, out = _plan(capsys, [*TINY, "pipeline_search=true", "rows=40"])
  lines = text.splitlines()
  head = lines[2].split()
  assert head[:3] == ["#", "P", "schedule"] and "bubble" in head and "micro" in head
  pp = [l for l in out["layouts"] if "pipeline" in l]
  from shardlab.schedules.pipeline import SCHEDULES
  assert {(l["pipeline"], l["schedule"]) for l in pp} == {(2, s) for s in SCHEDULES if s != "interleaved"}
  assert out["answer"]["considered"] == 10 + len(pp)
  rows = [l.split() for l in lines[3:3 + min(40, len(out["layouts"]))]]
  for r, l in zip(rows, out["layouts"]):
    assert r[1] == str(l.get("pipeline", 1)) and r[2] == l.get("schedule", "-")
    assert (int(r[3]), int(r[5]), int(r[7])) == (l["data"], l["fsdp"], l["tensor"])
  plain, _ = _plan(capsys, TINY)
  assert "schedule" not in plain.splitlines()[2] and "bubble" not in plain


def test_context_search_answers_which_strategy_and_degree_and_why(capsys):
  """context_search=true: llama3_8b at 32K tokens on 8 H100s, one sequence: every strategy at every degree the
  batch allows, fastest first, Ulysses C=8 chosen with its reason and the screen saying so; with 12 query heads
  Ulysses cannot split them 8 ways, is excluded with that reason, and the choice flips to the ring."""
  base = ["model=llama3_8b", "model.seq_len=32768", "train.batch_size=1", "mesh.fsdp=8", "mesh.tensor=1",
          "precision=bf16", "model.attention=dot_product", "schedule.remat=save_qkv_attn_out", "hardware=h100",
          "context.load_balance=true", "context_search=true"]
  text, out = _plan(capsys, base)
  ctx = out["context"]
  assert ctx["best"] == "ulysses C=8" and ctx["reason"].startswith("ulysses C=8: predicted step")
  steps = [c["t_step_s"] for c in ctx["candidates"]]
  assert steps == sorted(steps) and {c["label"] for c in ctx["candidates"]} == {"ulysses C=8", "ring C=8",
                                                                                 "all_gather C=8"}
  assert ctx["excluded"]["ring C=4"] == "fsdp 2 does not divide the batch of 1 sequences"
  assert "Chosen: ulysses C=8" in text and "Context parallelism for 32,768 tokens" in text
  _, flipped = _plan(capsys, [*base, "model.n_heads=12", "model.n_kv_heads=4", "model.d_model=1536"])
  assert flipped["context"]["excluded"]["ulysses C=8"].startswith("ulysses splits the heads: 12 query")
  assert flipped["context"]["best"] == "ring C=8"
