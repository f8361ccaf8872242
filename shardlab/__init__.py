"""shardlab: hand-placed collectives for FSDP x TP training on JAX, and the tools to compare them."""
