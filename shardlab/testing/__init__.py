"""A kit for testing sharded code on fake CPU devices: shardlab's own tests use it, and so can yours. One module
per concern (devices, arrays, compare, programs, tiny); every name is here too.

With shardlab installed, its pytest plugin (shardlab/pytest_plugin.py) sets the fake CPU devices before JAX
starts and gives every test a `mesh` fixture; nothing else is needed in a test file.

Devices and meshes
  set_devices(n)                  n fake CPU devices, before JAX starts (the plugin calls it)
  mesh_shapes(n, rank=2)          every fsdp x tensor factorization of n (rank=3: data x fsdp x tensor)
  mesh_of(fsdp, tensor)           a cached mesh over the first fsdp*tensor devices (Auto axes);
  mesh_of(data, fsdp, tensor)     the same with an HSDP `data` axis in front (none when data is 1);
  mesh_of({axis: size})           any declared axes (shardlab/axes.py), e.g. {"pipeline": 2, "fsdp": 4}
Rank-coded inputs
  rank_coded(shape)               an array whose every value says where it came from (index i -> value i)
  where(x, shape)                 decode a rank-coded value back to its index in the original array
  origin(x, shape, spec, mesh)    ... and the device (and local index) that held it under `spec`
  assert_rank_coded_equal(..)     exact equality; a mismatch says which element (and shard) arrived instead
Comparisons
  per_device(fn, mesh, in_specs)  shard_map(fn) whose output out[f, t, ...] is device (f, t)'s local value
  assert_trees_close(a, b)        per-leaf comparison naming the leaf path and the first mismatching index
  assert_matches_reference(..)    a shard_map'd function against a plain one on every mesh: every device's
                                  output, and the gradients, optionally against finite differences too
  assert_collectives(..)          the compiled program's collectives (kind, mesh axis, bytes) against the
                                  expected ones, and no collective the compiler added on its own
  assert_schedule_matches_baseline(..)  a schedule's loss, gradients and bytes against `baseline` (or
                                  `against=` another schedule), tiny model; optional overlap claims
  assert_overlap(..)              collectives that can run behind matmuls (the compiled dependency graph)
The tiny model
  tiny_config, tiny_batch, reference_loss_and_grads, compile_schedule (cached; tests/conftest.py uses them)
  placed_batch(tokens, mesh)      tokens[B, L+1] -> data.Batch (inputs, targets, positions) placed on the mesh
  abstract_batch(B, L, mesh)      the same as ShapeDtypeStructs (for .lower)
"""
from __future__ import annotations

from shardlab.testing.meshes import (  # noqa: F401  (the kit's public names)
    DEFAULT_DEVICES, FAST_COMPILE, configured_devices, device_count, devices, mesh_id, mesh_of, mesh_shapes,
    meshes_for, named_shape, parse_mesh_shape, set_devices)
from shardlab.testing.arrays import (  # noqa: F401  (the kit's public names)
    assert_rank_coded_equal, block, coords, fmt, origin, owner, rank_coded, slices, where)
from shardlab.testing.compare import (  # noqa: F401  (the kit's public names)
    assert_matches_reference, assert_trees_close, per_device)
from shardlab.testing.programs import (  # noqa: F401  (the kit's public names)
    assert_collectives, assert_overlap, collectives_of, compiled_program, format_ledger)
from shardlab.testing.tiny import (  # noqa: F401  (the kit's public names)
    abstract_batch, assert_schedule_matches_baseline, compile_schedule, placed_batch, reference_loss_and_grads,
    tiny_batch, tiny_config)
