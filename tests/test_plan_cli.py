"""`python -m shardlab.plan model=M hardware=H devices=N`: the first screen is the answer (a table of the best
layouts and the best one's batch window), the JSON behind it agrees with it, and the remat and microbatches each
layout runs at are the ones the stated rule picks. Pure Python (no JAX compile): a few seconds."""
from __future__ import annotations

import json

import pytest

from shardlab.analysis import planner
from shardlab.composition import resolve
from shardlab.outputs import human_seconds
from shardlab.plan import compose, main

pytestmark = pytest.mark.slow   # not in the quick subset (pytest -m "not slow"): docs/testing.md

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
  cfg = resolve(compose([a for a in argv if not a.startswith("devices=")]))
  _, out = _plan(capsys, argv)
  assert {l["remat"] for l in out["layouts"]} - {"none"}, "the budget must need recomputation somewhere"
  for l in out["layouts"]:
    best, least = None, None
    local = 32 // (l["data"] * l["fsdp"])
    for remat in planner.REMAT_BY_RECOMPUTE:
      for k in [d for d in range(1, local + 1) if local % d == 0]:
        c = cfg.replace(schedule={"remat": remat, "microbatches": k})
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
  # the time model: the first two layouts differ, and the screen says by what (recomputed, waited for)
  second = out["layouts"][1]
  assert best["step_time_s"] < second["step_time_s"] and "step_model" in best
  head = text.splitlines()[2]
  assert "recompute" in head and "exposed comm" in head
  sm = best["step_model"]
  assert f"{human_seconds(sm['t_recompute_s'])}  " in text.splitlines()[3]
  assert human_seconds(sm["t_exposed_comm_s"]) in text.splitlines()[3]


@pytest.mark.parametrize("bad", ["devices=abc", "devices=0", "json=", "model=nope"])
def test_bad_input_is_one_line_and_exit_2(bad, capsys):
  assert main([*TINY[:2], bad]) == 2
  out, err = capsys.readouterr()
  assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("shardlab.plan: error:")


def test_pipeline_search_adds_pipeline_rows_and_columns(capsys):
  """pipeline_search=true: the pipeline layouts (tiny's 2 layers: P = 2, every named schedule but the chunked ones,
  interleaved, looped_bfs, zb_v and dualpipev, which need 4) are ranked with the others, and the table gains P, schedule and
  bubble; without it, neither."""
  text, out = _plan(capsys, [*TINY, "pipeline_search=true", "rows=40"])
  lines = text.splitlines()
  head = lines[2].split()
  assert head[:3] == ["#", "P", "schedule"] and "bubble" in head and "micro" in head
  pp = [l for l in out["layouts"] if "pipeline" in l]
  from shardlab.pipeline_tables import SCHEDULES, chunks_per_stage
  assert {(l["pipeline"], l["schedule"]) for l in pp} == {(2, s) for s in SCHEDULES if chunks_per_stage(s) == 1}
  assert out["answer"]["considered"] == 10 + len(pp)
  rows = [l.split() for l in lines[3:3 + min(40, len(out["layouts"]))]]
  for r, l in zip(rows, out["layouts"]):
    assert r[1] == str(l.get("pipeline", 1)) and r[2] == l.get("schedule", "-")
    assert (int(r[3]), int(r[5]), int(r[7])) == (l["data"], l["fsdp"], l["tensor"])
  plain, _ = _plan(capsys, TINY)
  assert "schedule" not in plain.splitlines()[2] and "bubble" not in plain


def test_context_search_answers_which_strategy_and_degree_and_why(capsys):
  """context_search=true: llama3_8b at 32K tokens on 8 H100s, 8 sequences, remat=full. No split (C = 1) is priced
  with the kernel the run uses (cuDNN's, which skips masked blocks) and is the fastest; the zigzag ring is a
  candidate beside the contiguous one; every candidate is one the run accepts (its settings pass the run's
  validation) at the least recomputation and fewest microbatches that fit, the weights sharded over fsdp x
  context where the sequence is split; all_gather, which runs the plain attention, is refused with the run's own
  line. With 12 query heads and 4 K/V heads Ulysses cannot split them 8 ways:
  excluded with that reason (before memory)."""
  from shardlab.validate import validate
  base = ["model=llama3_8b", "model.seq_len=32768", "train.batch_size=8", "mesh.fsdp=8", "mesh.tensor=1",
          "precision=bf16", "model.attention=dot_product", "schedule.remat=full", "hardware=h100"]
  text, out = _plan(capsys, [*base, "context_search=true"])
  ctx = out["context"]
  assert ctx["best"] == "no context (C=1)" and ctx["reason"].startswith("no context (C=1): predicted step 5.69 s")
  steps = [c["t_step_s"] for c in ctx["candidates"]]
  assert steps == sorted(steps) and steps[0] == min(steps)
  labels = {c["label"] for c in ctx["candidates"]}
  assert {"ring C=2", "ring zigzag C=2", "ulysses C=2"} <= labels and "ulysses zigzag C=2" not in labels  # the same
  assert ctx["excluded"]["all_gather C=2"].startswith("model.attention=dot_product: context=all_gather runs the plain")
  for c in ctx["candidates"]:        # what the screen offers runs: the run's own validation takes its settings
    assert c["remat"] == "full" and c["microbatches"] == 1 and c["weights_over_context"] == (c["context"] > 1)
    validate(compose([*base, *c["overrides"]]), 8)
  assert ("The chosen layout's settings (with this command's model, hardware and batch, for `python -m shardlab`): "
          "mesh.context=1 mesh.fsdp=8 mesh.tensor=1 schedule.remat=full schedule.microbatches=1") in text
  _, flipped = _plan(capsys, [*base, "model.n_heads=12", "model.n_kv_heads=4", "model.d_model=1536",
                              "context_search=true"])
  assert flipped["context"]["excluded"]["ulysses C=8"].startswith("ulysses splits the heads: 12 query")


def test_context_search_at_a_tiny_sequence_says_why_no_split_pays(capsys):
  """context_search=true on tiny's 32-token sequence: no split is chosen, and the screen says why in one line
  (attention's share of the predicted step, the batch already divides over fsdp, the least exposed transfer of any
  split) instead of 'predicted step 0 ms ... 391491% faster' (a ratio over a 55 ns predicted step, printed in ms;
  the time model now prices the whole step, 1.43 ms);
  at 32K tokens the chosen split and its percentage stay, with no such line."""
  import re
  text, out = _plan(capsys, ["context_search=true"])
  ctx, screen = out["context"], text.split("Context parallelism for")[1]
  assert ctx["best"] == "no context (C=1)"
  assert ctx["why_no_split"].startswith("No context split pays for its communication at model.seq_len=32: "
                                        "attention is 1% of the predicted step")
  assert "0 ms" not in screen and " 0 ns" not in screen
  assert all(int(p) <= 100 for p in re.findall(r"(\d+)%", screen)), screen
  assert "No context split pays for its communication at model.seq_len=32" in " ".join(screen.split())
  assert ctx["reason"].startswith("no context (C=1): predicted step 1.43 ms")
  assert "14% faster than all_gather C=2" in ctx["reason"]
  _, long = _plan(capsys, ["model=llama3_8b", "model.seq_len=32768", "train.batch_size=1", "mesh.fsdp=8",
                           "mesh.tensor=1", "precision=bf16", "model.attention=dot_product", "hardware=h100",
                           "context_search=true"])
  assert long["context"]["why_no_split"] is None
  # one node: a2a_p2p is Ulysses (all 8 ranks in the node) through the ring's kernel (a ring of one), usp at each
  # degree the heads allow: both run shardlab's Pallas kernel, priced at its measured rate (flash_kernel_efficiency
  # 0.40 against cuDNN's 0.44 for Ulysses' own kernel) and at the FLOPs its backward states (3.5 x the forward's,
  # its dQ kernel recomputing the scores, against FlashAttention-2's 2.5)
  assert re.match(r"ulysses C=8: predicted step 826 ms .*, 14% faster than a2a_p2p U=8 C=8: predicted step 943 ms",
                  long["context"]["reason"]), long["context"]["reason"]
  labels = [c["label"] for c in long["context"]["candidates"]]
  assert {"usp U=2 zigzag C=8", "usp U=4 zigzag C=8", "ring zigzag C=8"} <= set(labels)
  usp = next(c for c in long["context"]["candidates"] if c["label"] == "usp U=2 zigzag C=8")
  assert {"context.impl=usp", "context.ulysses=2", "context.load_balance=true"} <= set(usp["overrides"])
  assert long["context"]["excluded"]["usp C=2"].startswith("no Ulysses degree between 1 and C")
  best = long["context"]["candidates"][0]      # one sequence over 8 devices: the weights over fsdp x context
  assert best["weights_over_context"] and "layout.rules.embed=[fsdp,context]" in best["overrides"]


@pytest.mark.parametrize("setting, why", [
    (["model.n_layers=1"], "1 layer cannot be split into 2, 4 or 8 stages (the stage counts that divide 8 devices); "
                           "set model.n_layers to a multiple of 2"),
    (["model.n_layers=3"], "model.n_layers=3 does not split evenly into 2, 4 or 8 stages (the stage counts that "
                           "divide 8 devices); set model.n_layers to a multiple of 2, or devices=N to a multiple of 3"),
    (["devices=1"], "1 device: a pipeline needs at least 2 stages"),
    (["train.batch_size=1"], "the global batch of 1 sequences does not cut into 2, 4, 8 or 16 pipeline microbatches"),
    (["schedule.microbatches=3"], "schedule.microbatches=3 does not cut the global batch of 16 sequences")])
def test_pipeline_search_says_why_no_pipeline_applies(setting, why, capsys):
  """pipeline_search=true where no pipeline degree applies (one layer, layers no stage count divides, one device,
  a batch too small for whole-sequence microbatches, a microbatch count that does not divide it): the table has no
  pipeline row, and one line under it names the reason and the setting to change; the JSON's answer.pipeline
  says the same."""
  text, out = _plan(capsys, [*TINY, "pipeline_search=true", *setting])
  pp = out["answer"]["pipeline"]
  assert pp["layouts"] == 0 and not any("pipeline" in l for l in out["layouts"])
  assert pp["none_because"].startswith(why), pp["none_because"]
  line = text[text.index("\nNo pipeline layout: "):].split("\n\n")[0]      # under the table, wrapped
  assert " ".join(line.split()) == f"No pipeline layout: {pp['none_because']}."


def test_pipeline_search_names_the_stage_counts_it_costed(capsys):
  """tiny's 2 layers on 8 devices: pipelines of 2 stages costed, 4 and 8 ruled out by the layers, on one line."""
  text, out = _plan(capsys, [*TINY, "pipeline_search=true"])
  pp = out["answer"]["pipeline"]
  assert pp["stages_tried"] == [2] and set(pp["stages_excluded"]) == {"4", "8"} and pp["none_because"] is None
  assert pp["layouts"] == sum("pipeline" in l for l in out["layouts"]) > 0
  assert (f"Pipeline layouts: {pp['layouts']} costed at P = 2; not at P = 4, 8 (model.n_layers=2 is not a multiple "
          "of them)") in text


def test_a_given_pipeline_is_priced_as_one(capsys):
  """mesh.pipeline=P with a schedule: the plan prices that pipeline (planner.given_pipeline: the table replayed
  in shardlab's ticks, the stage's memory from the executor's buffers), with the microbatches that fit and are
  fastest, one memory figure (the stage's), the bubble beside its closed form; too small a batch, or no
  schedule, is a warning that says so."""
  base = ["model=llama3_70b", "hardware=h100", "mesh.pipeline=2", "mesh.data=48", "mesh.fsdp=1", "mesh.tensor=8",
          "precision=bf16", "pipeline=interleaved", "pipeline.virtual_stages=2"]
  text, out = _plan(capsys, [*base, "train.global_batch_tokens=6291456"])
  pp = out["pipeline"]
  assert (pp["pipeline"], pp["schedule"], pp["virtual_stages"]) == (2, "interleaved", 2)
  assert pp["microbatches"] % 2 == 0 and pp["bubble"] > 0 and pp["bubble_closed_form"] > 0
  assert pp == planner.given_pipeline(resolve(compose([*base, "train.global_batch_tokens=6291456"])))
  lines = text.splitlines()
  assert "microbatch," not in lines[0]          # schedule.microbatches: not what a pipeline runs
  assert lines[1].startswith("  pipeline            2 stages of 40 layers, interleaved, 2 chunks per stage, "
                             f"{pp['microbatches']} microbatches")
  memory = [l for l in lines if "GB" in l and ("memory" in l or "exceeds HBM" in l)]
  figure = f"{pp['memory_per_device_bytes'] / 1e9:.0f} GB"
  assert memory and all(figure in l for l in memory), memory       # one memory: the stage's
  assert f"bubble {100 * pp['bubble']:.1f}% in shardlab's ticks" in text
  # a batch of 16 sequences over 48 data shards: no microbatch of whole sequences
  text, out = _plan(capsys, base)
  assert "pipeline" not in out and any("too few for the pipeline's microbatches" in w for w in out["warnings"])
  text, out = _plan(capsys, [*base[:6], "precision=bf16", "train.global_batch_tokens=6291456"])
  assert any("without a pipeline schedule" in w for w in out["warnings"])


def test_a_configured_mesh_that_cannot_hold_whole_sequences_says_so(capsys):
  """The configured mesh's screen for a batch its batch shards split into parts of sequences: its numbers, and a
  note that shardlab does not run it as priced (it printed "fits" and a step time without one)."""
  text, out = _plan(capsys, ["model=tiny", "hardware=h100", "mesh.fsdp=8", "mesh.tensor=1", "train.batch_size=2"])
  assert "Note: shardlab does not run this mesh as configured: each batch shard holds 0.25 sequences" in text
  assert out["layout"]["notes"]
