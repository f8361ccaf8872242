"""The batch window of a mesh: the largest batch that fits in HBM by the memory model (memory_model.breakdown),
or by a line through compiled peaks (calibrated_batch_window), and the fewest microbatches that fit a batch."""
from __future__ import annotations

from shardlab.analysis import memory_model as MM
from shardlab.analysis.closed_forms import divisors
from shardlab.composition import Composition


def at_tokens(c: Composition, tokens: float):
  """c with a global batch of `tokens` (0 too: train.global_batch_tokens=0 alone would mean batch_size x L)."""
  return c.replace(train={"global_batch_tokens": tokens, "batch_size": 0})


def at_sequences(c: Composition, seqs: float):
  """c with `seqs` sequences on every batch shard (data x fsdp, as its layout splits the batch)."""
  return at_tokens(c, seqs * c.split("batch") * c.model.seq_len)


def memory_affine(c: Composition) -> tuple[float, float]:
  """(fixed bytes per device, bytes per sequence of a batch shard): the line through memory_model.breakdown at
  one and two sequences per shard at the configured schedule, as a line through compiled peaks is drawn
  (calibrated_batch_window). The model's peak is the larger of two lines (the logits, or the gradients being
  made) in one pass: batch_window searches the model itself."""
  one, two = (MM.breakdown(at_sequences(c, s))["total"] for s in (1, 2))
  return 2 * one - two, two - one


def batch_window(c: Composition, affine: tuple[float, float] | None = None) -> dict[str, float]:
  """The largest batch that fits in HBM on c.mesh: whole sequences per fsdp shard, a multiple of
  schedule.microbatches, by memory_model.breakdown (or, given `affine`, the line fixed + per_sequence * s).
  max_batch_per_device_tokens = sequences * L / Y (B / N, the book's per-device batch); 0 when not one sequence
  per shard fits. `..._tokens_unrounded`: the same limit in tokens, as the book counts a batch (interpolated
  between the last whole sequence that fits and the next; a shard holding part of a sequence needs sequence
  sharding, which shardlab does not do)."""
  m, mesh, mb, hbm = c.model, c.mesh, max(1, c.schedule.microbatches), c.hardware.hbm_bytes
  fixed, per_seq = affine or memory_affine(c)
  total = ((lambda s: fixed + s * per_seq) if affine else (lambda s: MM.breakdown(at_sequences(c, s))["total"]))
  whole = last_fitting(total, hbm, 1)                 # memory grows with the batch: the boundary by bisection
  seqs = whole - whole % mb
  step = total(whole + 1) - total(whole)
  unrounded = whole + (hbm - total(whole)) / step if whole or total(0) <= hbm else 0.0
  return {"max_batch_per_device_tokens": seqs * m.seq_len / mesh.tensor,
          "max_batch_per_device_tokens_unrounded": max(0.0, unrounded) * m.seq_len / mesh.tensor if step > 0 else 0.0,
          "max_sequences_per_fsdp_shard": seqs,
          "max_global_batch_tokens": seqs * mesh.fsdp * m.seq_len, "fixed_bytes": fixed,
          "bytes_per_local_sequence": per_seq}


def last_fitting(total, budget: float, lo: int) -> int:
  """The largest s >= 0 with total(s) <= budget (0 when total(lo) does not fit); total grows with s."""
  if total(lo) > budget:
    return 0
  hi = 2 * lo
  while total(hi) <= budget:
    lo, hi = hi, 2 * hi
    if hi > 1 << 40:
      return lo
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
  return lo


def calibrated_batch_window(c: Composition, peaks: dict[int, float]) -> dict[str, float]:
  """batch_window from measured memory instead of the analytic model: `peaks` maps sequences per fsdp shard to
  the compiled peak bytes per device (`compiled.memory_analysis()`, two or more batch sizes); the least-squares
  line through them gives the fixed and per-sequence bytes. How a compile confirms the window."""
  if len(peaks) < 2:
    raise ValueError("calibrated_batch_window needs compiled peaks at two or more batch sizes")
  xs, ys = list(peaks), list(peaks.values())
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
  return batch_window(c, (my - slope * mx, slope))


def microbatches_to_fit(c: Composition) -> int | None:
  """Fewest microbatches (dividing each fsdp shard's sequences) with which the configured global batch fits in
  HBM; None when even one sequence at a time does not (or a shard holds less than one whole sequence and does
  not fit)."""
  local = c.global_tokens / c.mesh.fsdp / c.model.seq_len
  whole = local >= 1 and local == int(local)
  for k in (divisors(int(local)) if whole else [1]):
    if MM.breakdown(c.replace(schedule={"microbatches": k}))["total"] <= c.hardware.hbm_bytes:
      return k
  return None
