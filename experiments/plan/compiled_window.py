"""The analytic memory model against XLA:CPU's compiled memory, on the tiny model (4x2 mesh of 8 fake CPU devices):
the batch-independent bytes and the bytes per sequence of each fsdp shard's batch, and the batch window each
gives for the same budget.

  python experiments/plan/compiled_window.py        # about a minute on 2 cores (8 compiles)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's shardlab

from shardlab.mesh import set_cpu_devices  # noqa: E402

set_cpu_devices(8)

from shardlab.analysis import planner  # noqa: E402
from shardlab.analysis.program import memory  # noqa: E402
from shardlab.composition import resolve  # noqa: E402
from shardlab.config import Config, MeshConfig, ScheduleConfig, TrainConfig  # noqa: E402
from shardlab.run import build  # noqa: E402

SEQS = (1, 2, 4, 8)


def main() -> None:
  print("| schedule.remat | compiled peak MiB at 1 / 2 / 4 / 8 seqs per shard | fixed MiB: analytic / compiled "
        "| per sequence KiB: analytic / compiled (ratio) | budget MiB | max seqs per shard in it: analytic / "
        "compiled |\n|---|---|---|---|---|---|")
  for remat in ("none", "full"):
    cfg = resolve(Config(mesh=MeshConfig(fsdp=4, tensor=2), schedule=ScheduleConfig(remat=remat)))
    peaks = {}
    for s in SEQS:
      c = cfg.replace(train={"batch_size": 4 * s})
      b = build(c)
      peaks[s] = memory(b["step_fn"].lower(b["abstract_state"], b["abstract_batch"]).compile())["peak"]
    fixed_a, per_a = planner.memory_affine(cfg)
    slope = (peaks[8] - peaks[1]) / 7
    fixed_c = peaks[1] - slope
    budget = cfg.replace(hardware={"hbm_bytes": fixed_c + 16.5 * slope})   # 16 seqs on the compile's line
    win_a = planner.batch_window(budget)["max_sequences_per_fsdp_shard"]
    win_c = planner.calibrated_batch_window(budget, peaks)["max_sequences_per_fsdp_shard"]
    mib = lambda v: f"{v / 2**20:.2f}"
    print(f"| {remat} | {' / '.join(mib(peaks[s]) for s in SEQS)} | {mib(fixed_a)} / {mib(fixed_c)} | "
          f"{per_a / 1024:.0f} / {slope / 1024:.0f} ({slope / per_a:.2f}x) | {mib(budget.hardware.hbm_bytes)} | "
          f"{win_a} / {win_c} |")


if __name__ == "__main__":
  main()
