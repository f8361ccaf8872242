"""The efficiency curve of `python -m shardlab.plan plot=PATH.png`: predicted step time and MFU against the
per-device batch B / N for chosen layouts, each marked with its critical batch (below it communication binds)
and its memory limit (above it the batch does not fit). Predictions of shardlab/analysis/planner.py only."""
from __future__ import annotations

from pathlib import Path

from shardlab.analysis import planner
from shardlab.axes import DATA, FSDP, TENSOR
from shardlab.composition import Composition


def configured_layout(c: Composition) -> dict:
  """The configured mesh as a layout (data x fsdp x tensor, the configured physical axes): planner.this_layout."""
  return planner.this_layout(c)


def curve(c: Composition, layout: dict, batches) -> tuple[list[float], list[float]]:
  """(step time s, MFU) of `layout` at each per-device batch in `batches` (tokens), at the layout's remat and
  microbatches (a searched layout's choice; the configured ones otherwise)."""
  n = layout[DATA] * layout[FSDP] * layout[TENSOR]
  c = c.replace(schedule={"remat": layout.get("remat", c.schedule.remat),
                          "microbatches": layout.get("microbatches", c.schedule.microbatches)})
  out = [planner.evaluate_layout(c.replace(train={"global_batch_tokens": b * n}), layout[DATA],
                                 layout[FSDP], layout[TENSOR], layout["axis_bandwidth"], layout["ici_axes"],
                                 layout.get("latency_hops")) for b in batches]
  return [o["step_time_s"] for o in out], [o["mfu"] for o in out]


def efficiency_curve(c: Composition, path, layouts: list[dict] | None = None) -> Path:
  """Write the figure for `layouts` (default: the configured mesh) to `path`; returns the path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  layouts = layouts or [configured_layout(c)]
  marks = [l["critical_batch_per_device"]["this_mesh"] or 0 for l in layouts]
  limits = [l["max_batch_per_device_tokens_unrounded"] for l in layouts]
  now = layouts[0]["batch_per_device_tokens"]
  lo = min([m for m in marks if m > 0] + [now]) / 8
  hi = max(marks + [l for l in limits if l > 0] + [now]) * 2
  batches = np.geomspace(max(lo, 1e-3), hi, 96)

  fig, (ax_t, ax_e) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True)
  top = 100 * c.train.mfu
  for i, (l, crit, limit) in enumerate(zip(layouts, marks, limits)):
    color = f"C{i}"
    steps, mfus = curve(c, l, batches)
    top = max(top, 100 * max(mfus))
    fits = batches <= limit
    label = f"data {l[DATA]} x fsdp {l[FSDP]} x tensor {l[TENSOR]}, remat {l['remat']}" + (
        f", {l['microbatches']} microbatches" if l["microbatches"] > 1 else "")
    for ax, ys in ((ax_t, steps), (ax_e, [100 * m for m in mfus])):
      ys = np.asarray(ys)
      ax.plot(batches[fits], ys[fits], color=color, label=label if ax is ax_t else None)
      ax.plot(batches[~fits], ys[~fits], color=color, ls=":", alpha=0.6)
      if crit:
        ax.axvline(crit, color=color, ls="--", lw=1)
      if limit > 0:
        ax.axvline(limit, color=color, ls="-.", lw=1)
    ax_t.plot([l["batch_per_device_tokens"]], [l["step_time_s"]], "o", color=color)
    ax_e.plot([l["batch_per_device_tokens"]], [100 * l["mfu"]], "o", color=color)
  ax_t.set(xscale="log", yscale="log", ylabel="predicted step time (s)",
           title=f"{c.model.label} on {layouts[0][DATA] * layouts[0][FSDP] * layouts[0][TENSOR]} x "
                 f"{c.hardware.name} (predicted" + (f"; MFU when compute-bound: {c.train.mfu:.0%})" if c.train.mfu
                                                     else ": the time model)"))
  ax_e.set(xscale="log", xlabel="batch per device B / N (tokens)", ylabel="predicted MFU (%)",
           ylim=(0, top * 1.15))
  ax_t.plot([], [], "k--", lw=1, label="critical batch (below: comm-bound)")
  ax_t.plot([], [], "k-.", lw=1, label="memory limit (dotted beyond: does not fit)")
  ax_t.plot([], [], "ko", label="the configured global batch")
  ax_t.legend(fontsize=8, loc="upper left")
  for ax in (ax_t, ax_e):
    ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  path = Path(path)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
