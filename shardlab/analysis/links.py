"""What the cost models know of the links under each mesh axis, in one place: the torus a TPU slice is laid out
on and the physical axes each mesh axis spans (Scaling Book, tpus.md and sharding.md), the GPU switch's NVLink
inside a node and the nodes' NICs across them (gpus.md), and from those a mesh axis's bytes/s. The planner
(closed forms), the peak-rate and calibrated replays, the pipeline and the context cost models all read these.
"""
from __future__ import annotations

import math

from shardlab.axes import CLASSIC, names


# Torus rank of the TPU presets (Scaling Book, tpus.md: v4 and v5p are 3D tori, v5e and v6e 2D).
TORUS_RANK = {"tpu_v4": 3, "tpu_v5p": 3, "tpu_v5e": 2, "tpu_v6e": 2}


def default_torus(hw, n: int) -> tuple[int, ...]:
  """The most nearly cubic torus of n chips with the preset's rank: 4096 -> 16x16x16 on v5p, 256 -> 16x16 on
  v5e (prime factors, largest first, each onto the smallest axis so far)."""
  dims, left, f = [1] * TORUS_RANK.get(hw.name, 3), n, 2
  factors = []
  while left > 1:
    while left % f == 0:
      factors.append(f)
      left //= f
    f += 1
  for f in sorted(factors, reverse=True):
    dims[dims.index(min(dims))] *= f
  return tuple(sorted(dims, reverse=True))


def torus_axes(sizes: list[int], dims: tuple[int, ...], wraps=None) -> list[tuple[float, float]] | None:
  """(M, hops) of each mesh axis (sizes innermost first) laid out in order over the torus. M: the whole torus
  axes (wraparound rings) it covers, at least 1; tensor 4, fsdp 1024 on 16x16x16: tensor takes 4 of the first
  axis (M_Y = 1), fsdp the other 4 of it and the two other axes (M_X = 2), the book's M_X M_Y = 2 for X = 1024,
  Y = 4. hops: the latency of one collective, a ring per physical axis spanned, the sum of their sizes / 2.
  `wraps(n)`: whether a whole slice axis of n chips has its wraparound (HardwareConfig.wraps; default every
  one); a whole axis that does not is a line: half a ring's bandwidth (M += 0.5) and n - 1 hops (tpus.md,
  sharding.md). A part of an axis counts as the book counts it (M at least 1, n / 2 hops). None when the sizes
  do not tile the dims."""
  wraps = wraps or (lambda n: True)
  left, out = list(dims), []
  for size in sizes:
    need, rings, lines, part, hops = size, 0, 0, False, 0.0
    for i, r in enumerate(left):
      g = math.gcd(need, r)
      if g > 1:
        if g == dims[i] and not wraps(g):
          lines += 1
          hops += g - 1
        else:
          rings += g == dims[i]
          part |= g != dims[i]
          hops += g / 2
        left[i] //= g
        need //= g
    if need != 1:
      return None
    out.append((max(rings + lines / 2, 1 if part or not (rings or lines) else 0), hops))
  return out


def switch_bandwidths(hw, sizes: list[int]) -> list[float]:
  """Bytes/s of each mesh axis (innermost first) on a GPU switch: inside a node every axis gets the GPU's NVLink
  egress (ici_bandwidth); an axis that crosses nodes gets the NICs of its g members in each node, g x
  dcn_bandwidth (gpus.md: 8 x 400 Gbps = 400 GB/s per node, so the data axis of one GPU per node gets 50 GB/s).
  Presets without a node size (domain_devices 0) or NICs give every axis ici_bandwidth."""
  dom, inner, out = hw.domain_devices, 1, []
  for size in sizes:
    if size == 1 or not dom or not hw.dcn_bandwidth or inner * size <= dom:
      out.append(hw.ici_bandwidth)
    else:
      out.append(min(hw.ici_bandwidth, max(1, dom // inner) * hw.dcn_bandwidth))
    inner *= size
  return out


def slice_dims(hw, n: int) -> tuple[int, ...]:
  """The shape of a TPU slice of n chips: hardware.topology where it names one of n chips ("4x4x4" or
  "v5p:4x4x4"), else the most nearly cubic torus of the preset's rank (default_torus)."""
  named = hw.topology.rpartition(":")[2]
  if named:
    dims = tuple(int(d) for d in named.split("x"))
    if math.prod(dims) == n:
      return tuple(sorted(dims, reverse=True))
  return default_torus(hw, n)


def mesh_links(c) -> tuple[dict[str, float], dict[str, float]]:
  """({axis: physical interconnect axes it spans (mesh.<axis>_ici_axes)}, {axis: bytes/s}) for every axis of
  c.mesh's classic three and any other it has (> 1), innermost first: on a switch each axis gets
  switch_bandwidths' share (an outer axis the nodes' NICs once it spans nodes), on a torus its links
  (hardware.axis_bandwidth). On a torus preset that says which slice axes close into rings (hardware.torus_wrap)
  and a mesh that sets no `*_ici_axes`, each axis's M is read off the slice as built: the mesh's axes laid
  innermost first over slice_dims (torus_axes), a whole axis without wraparound a line (0.5)."""
  mesh, hw = c.mesh, c.hardware
  sizes = {**{a: 1 for a in CLASSIC}, **mesh.shape}
  inner_first = [a for a in reversed(names()) if a in sizes]
  ici = {a: mesh.ici_axes(a) for a in inner_first}
  if hw.torus:
    if hw.torus_wrap and all(m == 1 for m in ici.values()):
      placed = torus_axes([sizes[a] for a in inner_first], slice_dims(hw, mesh.n_devices), hw.wraps)
      if placed:
        ici = {a: m for a, (m, _) in zip(inner_first, placed)}
    return ici, {a: hw.axis_bandwidth(n) for a, n in ici.items()}
  return ici, dict(zip(inner_first, switch_bandwidths(hw, [sizes[a] for a in inner_first])))


def link_axes(c) -> dict:
  """What the cost model knows of each mesh axis of c.mesh: the physical interconnect axes it spans (a torus's
  M_X, M_Y; mesh.*_ici_axes) and, on a switch (GPU nodes), its bytes/s: NVLink inside a node, the nodes' NICs
  for an axis that spans nodes (mesh_links; axes laid out tensor innermost, then fsdp, data). On a torus
  the bandwidth follows from the axes spanned (axis_bandwidth: they add up for a combined axis)."""
  ici, bws = mesh_links(c)
  return ici if c.hardware.torus else {**ici, "bytes_per_s": bws}


def transfer_seconds(nbytes: float, bandwidth: float, hw, hops: float = 1) -> float:
  """The one collective-cost formula, every cost model's (the replays, the pipeline's and the context
  strategies'): NCCL's launch latency, then the larger of the hop floor (hops x T_hop) and the bytes one device
  sends at achieved bus bandwidth, W link_efficiency r(S), r(S) = S / (S + link_half_bytes) the ramp of bus
  bandwidth with message size (NCCL tests doc/PERFORMANCE.md). At peak rates (HardwareConfig.peak: efficiency 1,
  no ramp, no launch latency) it is the Scaling Book's max(T_hop hops, bytes / W) (sharding.md)."""
  if nbytes <= 0:
    return 0.0
  ramp = nbytes / (nbytes + hw.link_half_bytes) if hw.link_half_bytes else 1.0
  return hw.collective_latency_s + max(hw.hop_latency_s * hops, nbytes / (bandwidth * hw.link_efficiency * ramp))


def collective_seconds(kind: str, nbytes: float, n: int, axis: str, hw, ici_axes: dict) -> float:
  """One collective among n devices over mesh `axis`, `nbytes` sent per device (ledger.py's bytes: V (n-1)/n
  for an all-gather or reduce-scatter of V, twice that for an all-reduce): a bidirectional ring's hop floor
  n / 2 hops (an all-reduce's two phases: n), n - 1 on a torus line without wraparound (M = 0.5: torus_axes); a
  ppermute one hop, over one direction of a torus link (W / 2, on a line as on a ring; on a switch the device's
  egress, W, and once the axis crosses nodes the one NIC a crossing hop has, dcn_bandwidth: the node's NICs are
  shared by a collective's members, but a ring's step is as slow as its slowest hop).
  transfer_seconds does the rest."""
  if n <= 1:
    return 0.0
  w = axis_bandwidth(axis, hw, ici_axes)
  line = hw.torus and not ici_axes.get("bytes_per_s") and sum(ici_axes.get(a, 1) for a in axis.split("+")) < 1
  if kind == "collective-permute":   # one direction of one link, a line's as a ring's
    if not hw.torus and hw.dcn_bandwidth and w < hw.ici_bandwidth:
      w = min(w, hw.dcn_bandwidth)  # across nodes: a ring's step waits for its hops that cross on one GPU's NIC
    return transfer_seconds(nbytes, (hw.ici_bandwidth if line else w) / 2 if hw.torus else w, hw, 1)
  return transfer_seconds(nbytes, w, hw, (n - 1 if line else n / 2) * (2 if kind == "all-reduce" else 1))


def axis_bandwidth(axis: str, hw, ici_axes: dict) -> float:
  """Bytes/s of a mesh axis ('fsdp', 'tensor', or 'fsdp+tensor': the physical axes add up on a torus). On a
  switched GPU fabric `ici_axes["bytes_per_s"]` (link_axes) gives each axis its own: an axis that crosses nodes
  (HSDP's data axis, typically) gets the nodes' NICs, not NVLink; an axis made of several takes the slowest."""
  over = ici_axes.get("bytes_per_s")
  if over:
    return min(over.get(a, hw.ici_bandwidth) for a in axis.split("+"))
  return hw.axis_bandwidth(sum(ici_axes.get(a, 1) for a in axis.split("+")))
