from shardlab import fewer_gc_passes

fewer_gc_passes()   # before the imports: they, Hydra's compose and the trace allocate most of a run's objects

from shardlab.run import cli  # noqa: E402

cli()
