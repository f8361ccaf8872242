from shardlab.run import cli

cli()
