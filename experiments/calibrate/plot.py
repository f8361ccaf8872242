"""measured_vs_predicted.png: every study case's MEASURED step against its two PREDICTIONS (stock and measured
preset), one panel per device, with the y = x line and +-20% bands.

    python experiments/calibrate/plot.py      # reads results/*/study.json, writes results/measured_vs_predicted.png
"""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

HERE = Path(__file__).resolve().parent / "results"
RUNS = [("h100_stock_corrected", "NVIDIA H100 (jax 0.11.2)"), ("h200_stock_corrected", "NVIDIA H200 (jax 0.11.2)"),
        ("cpu", "this 2-core CPU VM (jax 0.10.2)")]


def main() -> None:
  fig, axes = plt.subplots(1, len(RUNS), figsize=(6 * len(RUNS), 5.2))
  for ax, (run, title) in zip(axes, RUNS):
    res = json.loads((HERE / run / "study.json").read_text())
    rows = [r for r in res["rows"] if "measured_s" in r]
    ms = [r["measured_s"] * 1e3 for r in rows]
    lo, hi = min(ms) * 0.6, max(ms) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="prediction = measurement")
    ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="0.9", label="within 20%")
    ax.scatter(ms, [r["stock_predicted_s"] * 1e3 for r in rows], marker="o", s=45,
               label=f"stock preset ({rows[0]['stock_preset']})")
    ax.scatter(ms, [r["calibrated_predicted_s"] * 1e3 for r in rows], marker="^", s=45,
               label="preset measured by shardlab.calibrate")
    for i, (r, m) in enumerate(sorted(zip(rows, ms), key=lambda x: x[1])):
      ax.annotate(r["case"], (m, r["stock_predicted_s"] * 1e3), fontsize=7, xytext=(6, -12 - 9 * (i % 3)),
                  textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step (ms, median)",
           ylabel="predicted step (ms)", title=f"{title}, {res['date']}")
    for axis in (ax.xaxis, ax.yaxis):
      axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
      axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
    ax.legend(fontsize=8, loc="upper left")
  fig.suptitle("Single-device training steps: MEASURED (x) against the cost model's PREDICTIONS (y)")
  fig.tight_layout()
  fig.savefig(HERE / "measured_vs_predicted.png", dpi=110)


if __name__ == "__main__":
  main()
