"""Print a study's markdown table from a sweep directory (one row per job, from each job's summary.json).

  python experiments/tabulate.py multirun/.../SWEEP_DIR
"""
import json
import sys
from pathlib import Path


def main(d: Path) -> None:
  jobs = sorted((p for p in d.iterdir() if (p / "summary.json").exists()), key=lambda p: int(p.name.split("_")[0]))
  cols = ["schedule", "final loss", "all-gather MiB (fsdp / tensor)", "reduce-scatter MiB (fsdp / tensor)",
          "all-reduce MiB", "ppermute MiB", "all-to-all MiB", "peak MiB", "CPU ms/step (CPU only)",
          "predicted ms, overlapped / serial"]
  print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
  mib = lambda b: f"{b / 2**20:.2f}"
  for p in jobs:
    s = json.loads((p / "summary.json").read_text())
    if s.get("status") != "ok":
      print(f"| {p.name} | {s.get('status')}: {s.get('error')} |")
      continue
    c, pred = s["comm"], s.get("prediction") or {}
    by = lambda kind, axis: sum(r["bytes"] for a, r in c.get(kind, {}).items() if axis in a.split("+"))
    total = lambda kind: sum(r["bytes"] for r in c.get(kind, {}).values())
    row = [s["schedule"], f"{s['final_loss']:.5f}", f"{mib(by('all-gather', 'fsdp'))} / {mib(by('all-gather', 'tensor'))}",
           f"{mib(by('reduce-scatter', 'fsdp'))} / {mib(by('reduce-scatter', 'tensor'))}", mib(total("all-reduce")),
           mib(total("collective-permute")), mib(total("all-to-all")), mib(s["memory"]["peak"]),
           f"{1e3 * s['step_time_s_median']:.1f}",
           f"{1e3 * pred.get('t_overlapped_s', 0):.3f} / {1e3 * pred.get('t_serial_s', 0):.3f}" if pred else ""]
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
  main(Path(sys.argv[1]))
