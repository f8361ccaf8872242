"""`python -m shardlab.pipeline export schedule=NAME stages=P microbatches=M [virtual_stages=V] [consecutive=N]
out=PATH.csv`: a pipeline table written in torch.distributed.pipelining's CSV format (pipeline_tables.write_csv),
which torchtitan reads (`--parallelism.pipeline_parallel_schedule_csv`) and shardlab reads back
(`pipeline.table=PATH.csv`). `schedule` is a named table (gpipe, 1f1b, eager_1f1b, interleaved, zb_h1, zb_h2, zb_v,
dualpipev, looped_bfs; interleaved in groups of `consecutive` microbatches) or `module:Name` (your own,
docs/pipeline.md); an existing out= is refused unless overwrite=true. `python -m shardlab.pipeline show
table=PATH.csv` prints a CSV's stages, microbatches and ticks as shardlab places them, checked. A bad setting or
file is one line, exit 2."""
from __future__ import annotations

import sys

from shardlab.errors import ConfigError

USAGE = ("usage: python -m shardlab.pipeline export schedule=NAME stages=P microbatches=M [virtual_stages=V] "
         "[consecutive=N] out=PATH.csv [overwrite=true] | show table=PATH.csv")


def main(argv: list[str]) -> int:
  from shardlab import pipeline_tables as PT
  if not argv or argv[0] not in ("export", "show"):
    print(f"shardlab.pipeline: error: {USAGE}", file=sys.stderr)
    return 2
  try:
    opts = dict(a.split("=", 1) for a in argv[1:])
  except ValueError:
    print(f"shardlab.pipeline: error: settings are key=value; {USAGE}", file=sys.stderr)
    return 2
  known = {"export": {"schedule", "stages", "microbatches", "virtual_stages", "consecutive", "out", "overwrite"},
           "show": {"table"}}[argv[0]]
  try:
    unknown = sorted(set(opts) - known)
    if unknown:
      raise ConfigError(f"{unknown[0]}: no such setting for {argv[0]} (known: {', '.join(sorted(known))})")
    if argv[0] == "show":
      if "table" not in opts:
        raise ConfigError(f"show needs table=PATH.csv; {USAGE}")
      orders, P, V, M, v_shape = PT.read_csv(opts["table"])
      ticks = PT.table(orders, V, v_shape)
      PT.check(ticks, M, V)
      print(f"{opts['table']}: {P} stages, {V} chunk(s) per stage{' in a V' if v_shape else ''}, {M} microbatches, "
            f"{len(ticks)} ticks")
      for t, row in enumerate(ticks):
        print(f"  tick {t:3d}: " + " | ".join(" ".join(map(str, c)).ljust(10) for c in row))
      return 0
    missing = [k for k in ("schedule", "stages", "microbatches", "out") if k not in opts]
    if missing:
      raise ConfigError(f"export needs {', '.join(f'{k}=' for k in missing)}; {USAGE}")
    try:
      P, M, V = int(opts["stages"]), int(opts["microbatches"]), int(opts.get("virtual_stages", 1))
      N = int(opts.get("consecutive", 0))
    except ValueError:
      raise ConfigError("stages, microbatches, virtual_stages and consecutive are whole numbers") from None
    from shardlab.outputs import check_output_file
    check_output_file("out", opts["out"], opts.get("overwrite", "false"))
    orders, v_shape = PT.orders_of(opts["schedule"], P, M, V, N), opts["schedule"] in PT.V_SHAPED
    PT.check(PT.table(orders, V, v_shape), M, V)
    try:
      PT.write_csv(orders, opts["out"], v_shape)
    except OSError as e:
      raise ConfigError(f"out={opts['out']}: cannot write it ({e.strerror or e})") from None
    print(f"{opts['out']}: {opts['schedule']}, {P} stages, {M} microbatches, {V} chunk(s) per stage "
          f"(torch.distributed.pipelining's CSV format)")
    return 0
  except ConfigError as e:
    print(f"shardlab.pipeline: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
