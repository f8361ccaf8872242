"""Hardware presets for prediction (conf/hardware/*.yaml). Numbers and sources: ../shared/ANCHORS.md.

Bandwidth of one mesh axis (what the planner divides bytes by), `axis_bandwidth(m)`:

  * TPU (`torus: true`): `ici_bandwidth` is W_ici, the bidirectional bandwidth of one ICI link (both directions of
    a wraparound ring). A mesh axis laid over m physical torus axes uses m such rings at once, so it gets
    W_ici * m. This is the Scaling Book's M_X / M_Y (training.md: "T_comms is reduced by a factor of M_Y").
  * GPU (`torus: false`): `ici_bandwidth` is the per-GPU egress bandwidth of the switched fabric (NVLink within a
    node; the node's NIC egress beyond it). Every GPU reaches every other through the switch at that rate, however
    the mesh axis is laid out, so the axis gets `ici_bandwidth` and m is ignored (gpus.md, W_collective).

All bandwidths are bytes/s, all FLOP/s are dense bf16 peaks (C).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HardwareConfig:
  name: str = "h100"
  peak_flops: float = 9.9e14        # bf16 dense FLOP/s per device (C)
  ici_bandwidth: float = 4.5e11     # bytes/s a device can move on one mesh axis, per physical axis it spans (W_ici)
  dcn_bandwidth: float = 0.0        # bytes/s per device beyond the fast domain (0: not modeled)
  hop_latency_s: float = 1e-6       # latency floor of one collective hop
  hbm_bytes: float = 80e9           # memory per device
  hbm_bandwidth: float = 3.35e12    # bytes/s
  torus: bool = False               # TPU torus (bandwidth scales with the physical axes a mesh axis spans)
  source: str = ""
  domain_devices: int = 0           # devices that share the fast interconnect (8: one NVLink node; 0: no limit)
  note: str = ""                    # caveat printed by the planner (e.g. "nominal numbers")

  def axis_bandwidth(self, physical_axes: int = 1) -> float:
    """Bytes/s one device moves on a mesh axis spanning `physical_axes` interconnect axes (see module doc)."""
    return self.ici_bandwidth * (max(1, physical_axes) if self.torus else 1)

  def physical_axes(self, physical_axes: int) -> int:
    """The M the Scaling Book's formulas should see: the mesh config's value on a torus, 1 on a switch."""
    return max(1, physical_axes) if self.torus else 1
