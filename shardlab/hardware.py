"""Hardware presets (conf/hardware/*.yaml): peak rates for the closed-form planner, the achieved rates the
calibrated cost model uses, and the description of the real target that `compile_for=target` compiles for.

Bandwidth of one mesh axis (what the planner divides bytes by), `axis_bandwidth(m)`:

  * TPU (`torus: true`): `ici_bandwidth` is W_ici, the bidirectional bandwidth of one ICI link (both directions of
    a wraparound ring). A mesh axis laid over m physical torus axes uses m such rings at once, so it gets
    W_ici * m. This is the Scaling Book's M_X / M_Y (training.md: "T_comms is reduced by a factor of M_Y").
    A slice's axis closes into a ring only where the slice is long enough (`torus_wrap`; tpus.md: "on inference
    chips when we have a full 16 axis, or on training chips (v*p) when we have an axis which is a multiple of
    4"); a shorter one is a line, whose collectives move data one way at a time (sharding.md's pop quiz 2: a
    4-chip v5e axis, 3 hops of the shard at the one-way bandwidth), so it counts as half a ring: m = 0.5.
  * GPU (`torus: false`): `ici_bandwidth` is the per-GPU egress bandwidth of the switched fabric (NVLink within a
    node; the node's NIC egress beyond it). Every GPU reaches every other through the switch at that rate, however
    the mesh axis is laid out, so the axis gets `ici_bandwidth` and m is ignored (Scaling Book gpus.md).

All bandwidths are bytes/s, all FLOP/s are dense bf16 peaks (C). The `*_efficiency` fields are achieved fractions
of those peaks (1.0: the peak-rate ceiling); each preset's YAML gives the source of every number.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def jax_platform(name: str | None) -> str | None:
  """A platform as JAX names its devices ('gpu' for a preset's target_platform 'cuda' or 'rocm')."""
  return {"cuda": "gpu", "rocm": "gpu"}.get(name, name)


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
  torus_wrap: int = 0               # a slice axis of a multiple of this many chips closes into a ring (wraparound):
                                    # 4 on v4/v5p, 16 on v5e/v6e (only a full axis); 0: every axis (idealised)
  source: str = ""
  domain_devices: int = 0           # devices that share the fast interconnect (8: one NVLink node; 0: no limit)
  note: str = ""                    # caveat printed by the planner (e.g. "nominal numbers")
  # ---- the real target (compile_for=target; shardlab/target.py) ----
  target_platform: str = ""         # cuda | tpu | "" (no target: compile_for=target refuses this preset)
  target_config: str = ""           # cuda: GpuTargetConfig text file in shardlab/targets/
  tpu_type: str = ""                # tpu: the topology name's prefix, as libtpu 0.0.42 names it (v5p, v5e)
  devices_per_host: int = 8         # GPUs per node / TPU chips per host: how a device count becomes hosts
  topology: str = ""                # "" derive from the mesh; else as get_topology_desc takes it ("1x8x8", "4x4x4")
  # ---- achieved rates (the calibrated cost model; 1.0 everywhere = the peak-rate ceiling) ----
  gemm_efficiency: float = 1.0      # fraction of peak_flops a large, well-shaped GEMM reaches
  gemm_tile: int = 128              # GEMM output tile edge (a tile is gemm_tile x 2 gemm_tile): wave quantization
  compute_units: int = 0            # SMs (GPU) / cores: tiles run in waves of this many (0: no quantization)
  attention_efficiency: float = 1.0  # fraction of peak_flops a fused (flash) attention kernel reaches
  flash_kernel_efficiency: float = 0.0  # that of shardlab's own Pallas kernel (flash_kernel.py), forward +
                                    # backward over the FLOPs it states, where measured; 0: attention_efficiency
  hbm_efficiency: float = 1.0       # fraction of hbm_bandwidth a memory-bound kernel reaches
  link_efficiency: float = 1.0      # achieved collective bus bandwidth / ici_bandwidth for large messages
  link_half_bytes: float = 0.0      # message size at which a collective reaches half its bus bandwidth
  collective_latency_s: float = 0.0  # fixed cost of one collective (launch, synchronization)
  kernel_launch_s: float = 0.0      # fixed cost of one compute kernel
  gemm_flops_by_dtype: dict[str, float] = field(default_factory=dict)  # achieved FLOP/s of a large GEMM by its
                                    # operands' dtype ("bfloat16", "float32"), where measured; else peak x efficiency
  # ---- a preset measured by `python -m shardlab.calibrate` (shardlab/calibrate.py) ----
  measured_on: str = ""             # the platform its rates were measured on (cpu | gpu | tpu); "" for a stock one
  provenance: dict[str, str] = field(default_factory=dict)  # {figure: where it came from (measured when, where, how)}
  file: str = ""                    # hardware.file=PATH.yaml: take every figure from that preset file (to_config)

  def gemm_rate(self, dtype: str = "") -> float:
    """Achieved FLOP/s of a large GEMM whose narrowest operand is `dtype`: the measured rate where the preset has
    one, else peak_flops x gemm_efficiency (the published bf16 peak's fraction)."""
    return self.gemm_flops_by_dtype.get(dtype) or self.peak_flops * self.gemm_efficiency

  def attention_rate(self, pallas: bool = False) -> float:
    """Achieved FLOP/s of a fused attention kernel: shardlab's Pallas kernel (`pallas`) at flash_kernel_efficiency
    where the preset has one, any other (cuDNN's) at attention_efficiency."""
    eff = self.flash_kernel_efficiency if pallas and self.flash_kernel_efficiency else self.attention_efficiency
    return self.peak_flops * eff

  def describes(self, platform: str) -> bool:
    """Its rates were measured on devices of `platform` (a local program there is replayed at them)."""
    return bool(self.measured_on) and jax_platform(platform) == jax_platform(self.measured_on)

  def axis_bandwidth(self, physical_axes: float = 1) -> float:
    """Bytes/s one device moves on a mesh axis spanning `physical_axes` interconnect axes (see module doc; a
    line without wraparound counts 0.5)."""
    return self.ici_bandwidth * self.physical_axes(physical_axes)

  def physical_axes(self, physical_axes: float) -> float:
    """The M the Scaling Book's formulas should see: the mesh config's value on a torus (at least one line,
    0.5; 0 or unset: 1), 1 on a switch."""
    return max(0.5, physical_axes or 1) if self.torus else 1

  def wraps(self, chips: int) -> bool:
    """Whether a slice axis of `chips` chips has its wraparound link, i.e. is a ring (torus_wrap)."""
    return not self.torus_wrap or chips % self.torus_wrap == 0

  def peak(self) -> "HardwareConfig":
    """This preset with every achieved rate at its peak: the ceiling the calibrated model is compared with."""
    import dataclasses
    return dataclasses.replace(self, gemm_efficiency=1.0, compute_units=0, attention_efficiency=1.0,
                               flash_kernel_efficiency=0.0,
                               hbm_efficiency=1.0, link_efficiency=1.0,
                               link_half_bytes=0.0, collective_latency_s=0.0, kernel_launch_s=0.0,
                               gemm_flops_by_dtype={})
