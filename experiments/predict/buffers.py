"""What a target compiler's buffer assignment holds per device, read off its dump: the bytes of each memory space
(parameters, one preallocated temporary block, thread-local and constants), beside what `memory_analysis()`
reports for the same program. Measurement of the compiler's own assignment, not a prediction.

  python -m shardlab dry_run=true compile_for=target hardware=tpu_v5p model=llama3_8b model.seq_len=2048 \
      precision=bf16 train.batch_size=4 schedule=fsdp_prefetch mesh=4x2 +xla.flags.xla_dump_to=/tmp/v5p_dump \
      hydra.run.dir=/tmp/v5p_run
  python experiments/predict/buffers.py /tmp/v5p_dump /tmp/v5p_run/summary.json

The dump's `*jit_step*buffer-assignment.txt` lists every allocation with its size and kind (XLA's
BufferAssignment::ToString); its `memory-usage-report.txt` totals the default memory space (HBM).
"""
from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path


def allocations(dump: Path) -> dict:
  """{(kind, memory space color): bytes} of the train step's buffer assignment in `dump`."""
  files = sorted(dump.glob("*jit_step*after_optimizations-buffer-assignment.txt"))
  if not files:
    raise SystemExit(f"buffers.py: no *jit_step*after_optimizations-buffer-assignment.txt in {dump}")
  out = collections.Counter()
  for m in re.finditer(r"^allocation \d+: size (\d+), (.*?):$", files[-1].read_text(), re.M):
    attrs = m.group(2)
    kind = next((k for k in ("parameter", "thread-local", "constant", "preallocated-temp") if k in attrs), "temp")
    color = re.search(r"color (\d+)", attrs)
    out[(kind, int(color.group(1)) if color else 0)] += int(m.group(1))
  return dict(out)


def main(dump: str, summary: str | None = None) -> None:
  alloc = allocations(Path(dump))
  hbm = {k: v for (k, c), v in alloc.items() if c == 0}
  print("buffer assignment, default memory space (HBM), bytes per device:")
  for k, v in sorted(hbm.items(), key=lambda kv: -kv[1]):
    print(f"  {k:18s} {v / 1e9:8.3f} GB")
  print(f"  {'total':18s} {sum(hbm.values()) / 1e9:8.3f} GB")
  if summary:
    mem = json.loads(Path(summary).read_text())["memory"]
    print(f"memory_analysis(): argument {mem['argument'] / 1e9:.3f} GB, temp {mem['temp'] / 1e9:.3f} GB, "
          f"peak {mem['peak'] / 1e9:.3f} GB; analytic {mem['analytic']['total'] / 1e9:.3f} GB")
    print(f"analytic / buffer assignment: {mem['analytic']['total'] / sum(hbm.values()) - 1:+.2%}; "
          f"analytic / memory_analysis peak: {mem['analytic']['total'] / mem['peak'] - 1:+.2%}")


if __name__ == "__main__":
  main(*sys.argv[1:3])
