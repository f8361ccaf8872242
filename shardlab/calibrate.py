"""python -m shardlab.calibrate out=PATH.yaml: measure the machine at hand and write a hardware preset for it.

    python -m shardlab.calibrate out=my_cpu.yaml                      # this CPU (one device)
    python -m shardlab.calibrate out=h200_measured.yaml hardware=h200  # a GPU, starting from the stock preset
    python -m shardlab hardware.file=my_cpu.yaml ...                  # predict with it

Options (shardlab.calibrate's own): out=PATH.yaml (required; an existing file is refused unless overwrite=true),
grid=full|quick (quick: a few shapes, for tests), repeats=N (timed samples per figure, default 7), warmup=N (2),
name=NAME (the preset's name; default the out file's stem). Everything else is a Hydra override of shardlab's
config: `hardware=NAME` or `hardware.file=PATH` picks the preset to start from (default: the stock preset of this
device kind, `cpu` on a CPU), `cpu_devices=N` the fake CPU devices (default 1; collectives need 2 or more).

What it MEASURES on the local devices (every figure the median of `repeats` timed samples after `warmup` runs;
each sample as many back-to-back calls as fill 20 ms, so dispatch hides behind the device):
  dispatch      one tiny jitted call, per call (host overhead; what a kernel shorter than it cannot show)
  launch        a program of 256 tiny kernels that cannot fuse (optimization_barrier between them) against one
                of 1: the cost of one kernel inside a program            -> kernel_launch_s
  gemm          squares (m = n = k) per dtype, and in the first dtype a layer's shapes, each also transposed as
                backward runs it: the efficiency curve; the median rate of its larger half per dtype
                                                                         -> gemm_flops_by_dtype, gemm_efficiency
  memory        the memory-bound kernels of a step (an affine y = 1.5 x + 0.5, a row softmax, a row norm) over
                arrays of several sizes (bytes read + written): the median rate of the larger sizes
                                                                         -> hbm_bandwidth x hbm_efficiency
  attention     the kernels shardlab runs, forward and forward+backward: plain, blockwise, jax.nn's
                dot_product (cuDNN's fused kernel on a GPU in bf16) and one off-diagonal step of the ring
                (a query block against a key block, no mask)         -> attention_efficiency (cuDNN's, GPU),
                blockwise on a GPU runs shardlab's Pallas kernel      -> flash_kernel_efficiency (its stated FLOPs)
  collectives   all-gather, reduce-scatter, all-reduce and a ring ppermute over every local device, by message
                size; a line t = latency + bytes / bus bandwidth through them (one device: none, said so)
                                                                         -> link_efficiency, collective_latency_s

Rates go into the preset in its own terms (shardlab/hardware.py): a base preset with published peaks keeps them
and gets measured efficiencies (measured / peak); a NOMINAL base (the `cpu` preset: no published peak) gets the
measured rates as its peaks and efficiencies of 1. Every figure gets a line of provenance (measured, date,
device, command; or kept from the base, and why). Each measured kernel is also compiled and replayed by the
calibrated cost model (analysis/calibrated.py) with the new preset and the base one: the table printed at the
end, and PATH's sidecar PATH.json (every sample), show measured against both PREDICTIONS.
"""
from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from pathlib import Path

# Shapes measured, per platform and grid. GEMMs (m, n, k): squares for the curve, then the shapes a transformer
# layer runs (tokens x d_model x d_ff). Memory: elements (f32). Attention: (B, L, H, K).
GRIDS = {
    ("gpu", "full"): {"gemm": [(s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192)],
                      "layer": [(8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336), (16384, 8192, 8192),
                                (4096, 1024, 1024), (16384, 2048, 8192)],
                      "dtypes": ("bfloat16", "float32"), "memory": [2 ** p for p in (20, 23, 25, 27, 28)],
                      "attention": (4, 4096, 16, 128), "attn_dtype": "bfloat16",
                      "collective": [2 ** p for p in (16, 20, 24, 27)]},
    ("cpu", "full"): {"gemm": [(s, s, s) for s in (64, 128, 256, 512, 1024)],
                      "layer": [(1024, 512, 2048), (1024, 2048, 512), (1024, 512, 512), (2048, 256, 256)],
                      "dtypes": ("float32", "bfloat16"), "memory": [2 ** p for p in (14, 18, 21, 24)],
                      "attention": (2, 512, 8, 64), "attn_dtype": "float32",
                      "collective": [2 ** p for p in (12, 16, 20, 22)]},
    ("any", "quick"): {"gemm": [(64, 64, 64), (256, 256, 256)], "layer": [(256, 128, 64)], "dtypes": ("float32",),
                       "memory": [2 ** 14, 2 ** 20], "attention": (1, 128, 4, 32), "attn_dtype": "float32",
                       "collective": [2 ** 12, 2 ** 16]},
}
GRIDS[("tpu", "full")] = GRIDS[("gpu", "full")]
def _softmax(a):
  import jax
  return jax.nn.softmax(a, axis=-1)


def _norm(a):
  import jax.numpy as jnp
  mu = a.mean(-1, keepdims=True)
  return (a - mu) * (1.0 / jnp.sqrt(((a - mu) ** 2).mean(-1, keepdims=True) + 1e-6))


# The memory-bound kernels of a training step, each reading and writing its array once: an elementwise affine (the
# optimizer's updates), a row softmax (attention's probabilities), a row normalisation (a norm layer).
MEMORY_KERNELS = {"affine": lambda a: a * 1.5 + 0.5, "softmax": _softmax, "norm": _norm}
LAYOUTS = {"nn": lambda a, b: a @ b, "nt": lambda a, b: a @ b.T, "tn": lambda a, b: a.T @ b}
LAUNCH_CHAIN = 256          # tiny kernels in the launch-overhead program
SAMPLE_S = 0.02             # each timed sample lasts at least this long (back-to-back calls)

OPTIONS = {"out": "", "grid": "full", "repeats": "7", "warmup": "2", "name": "", "overwrite": "false"}


def split_options(argv: list[str]) -> tuple[dict, list[str]]:
  """(calibrate's options, the Hydra overrides left); bad values are a ValueError (one line)."""
  opts, rest = dict(OPTIONS), []
  for a in argv:
    key, eq, value = a.partition("=")
    key = key.removeprefix("calibrate.")
    if eq and key in OPTIONS:
      opts[key] = value
    else:
      rest.append(a)
  if not opts["out"]:
    raise ValueError("out=PATH.yaml: name the preset file to write")
  if not opts["out"].endswith((".yaml", ".yml")):
    raise ValueError(f"out={opts['out']}: a preset is a YAML file (PATH.yaml)")
  if opts["grid"] not in ("full", "quick"):
    raise ValueError(f"grid={opts['grid']}: full or quick")
  for k in ("repeats", "warmup"):
    if not opts[k].isdigit() or int(opts[k]) < (1 if k == "repeats" else 0):
      raise ValueError(f"{k}={opts[k]}: a whole number" + (" >= 1" if k == "repeats" else ""))
  out = Path(opts["out"])
  from shardlab.outputs import check_output_file    # the preset and its sidecar: neither is written over unasked
  check_output_file("out", out, opts["overwrite"], also=(out.with_suffix(".json"),))
  return opts, rest


# ------------------------------------------------------------------------------------------------- timing

def timed(fn, args, warmup: int, repeats: int, wait_each: bool = False) -> dict:
  """{"s": median seconds per call, "spread": (max - min) / median of the samples, "samples": [...]}: `fn(*args)`
  after `warmup` calls, in `repeats` samples of back-to-back calls (each sample at least SAMPLE_S long).
  `wait_each`: wait for every call before the next (collectives: XLA:CPU aborts with hundreds of collective
  programs in flight on its fake devices)."""
  import jax
  for _ in range(max(1, warmup)):
    jax.block_until_ready(fn(*args))
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  calls = max(1, min(2000, int(SAMPLE_S / max(time.perf_counter() - t, 1e-7))))
  samples = []
  for _ in range(repeats):
    t = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
      if wait_each:
        jax.block_until_ready(out)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t) / calls)
  med = statistics.median(samples)
  return {"s": med, "spread": (max(samples) - min(samples)) / med if med > 0 else 0.0, "samples": samples}


def compiled(fn, *args):
  """(compiled executable, Program of its HLO) of a single-device jitted function."""
  import jax
  from shardlab.analysis.program import Program
  c = jax.jit(fn).lower(*args).compile()
  dev = jax.devices()[0]
  return c, Program(c.as_text(), [dev.id], ("device",), dev.platform)


def replayed(prog, hw) -> float:
  """The calibrated cost model's PREDICTION of a single-device program on preset `hw` (seconds)."""
  from shardlab.analysis import calibrated
  return calibrated.replay(prog, hw).t_total_s


# ------------------------------------------------------------------------------------------- measurements

def measure(grid: dict, warmup: int, repeats: int, bar=None) -> dict:
  """Every measurement of the module doc on the local devices: {"dispatch", "launch", "gemm", "memory",
  "attention", "collectives", "device"}. `bar`: a tqdm bar advanced once per figure."""
  import jax
  import jax.numpy as jnp
  tick = (lambda label: (bar.set_postfix_str(label), bar.update(1))) if bar is not None else (lambda label: None)
  dev = jax.devices()[0]
  out = {"device": {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count(),
                    "core_count": getattr(dev, "core_count", None), "jax": jax.__version__}}
  try:
    out["device"]["bytes_limit"] = (dev.memory_stats() or {}).get("bytes_limit")
  except Exception:  # noqa: BLE001  (memory_stats is not implemented on every backend)
    out["device"]["bytes_limit"] = None

  x = jnp.ones((8,), jnp.float32)
  out["dispatch"] = timed(jax.jit(lambda a: a + 1), (x,), warmup, repeats)
  tick("dispatch")

  def chain(n):
    def f(a):
      for _ in range(n):
        a = jax.lax.optimization_barrier(jnp.sin(a) + 1.0)
      return a
    return jax.jit(f)
  small = jnp.ones((8,), jnp.float32)
  one, many = timed(chain(1), (small,), warmup, repeats), timed(chain(LAUNCH_CHAIN + 1), (small,), warmup, repeats)
  out["launch"] = {"one_s": one["s"], "chain_s": many["s"], "kernels": LAUNCH_CHAIN,
                   "per_kernel_s": max(0.0, (many["s"] - one["s"]) / LAUNCH_CHAIN),
                   "spread": max(one["spread"], many["spread"])}
  tick("launch")

  key = jax.random.key(0)
  out["gemm"] = []
  for j, dt in enumerate(grid["dtypes"]):
    # the squares as a forward matmul (nn); in the first dtype also a layer's shapes, each as forward and as the
    # backward's two (nt: dx = dy w^T, tn: dw = x^T dy), which read one operand transposed
    for m, n, k in grid["gemm"] + (grid["layer"] if j == 0 else []):
      for layout in ("nn",) if (m, n, k) in grid["gemm"] else LAYOUTS:
        a = jax.random.normal(key, (k, m) if layout == "tn" else (m, k), jnp.float32).astype(dt)
        b = jax.random.normal(key, (n, k) if layout == "nt" else (k, n), jnp.float32).astype(dt)
        c, prog = compiled(LAYOUTS[layout], a, b)
        r = timed(c, (a, b), warmup, repeats)
        flops = 2.0 * m * n * k
        out["gemm"].append({"m": m, "n": n, "k": k, "layout": layout, "dtype": jnp.dtype(dt).name, "s": r["s"],
                            "spread": r["spread"], "flops": flops, "flops_per_s": flops / r["s"], "program": prog})
      tick(f"gemm {m}x{n}x{k} {jnp.dtype(dt).name}")

  out["memory"] = []
  for n in grid["memory"]:
    for name, f in MEMORY_KERNELS.items():
      a = jnp.ones((n // 1024, 1024), jnp.float32)
      c, prog = compiled(f, a)
      r = timed(c, (a,), warmup, repeats)
      out["memory"].append({"kernel": name, "elements": n, "bytes": 8.0 * n, "s": r["s"], "spread": r["spread"],
                            "bytes_per_s": 8.0 * n / r["s"], "program": prog})
    tick(f"memory {8 * n / 2 ** 20:.3g} MiB")

  out["attention"] = attention(grid, warmup, repeats, tick)
  out["collectives"] = collectives(grid, warmup, repeats, tick)
  return out


def attention_flops(B, Lq, Lk, H, K, causal: bool, backward: bool) -> float:
  """Matmul FLOPs of attention: 4 B H Lq Lk K forward (scores, probabilities x values), 2.5 times that more for
  the backward's five matmuls (FlashAttention-2, arXiv:2307.08691), half under a causal mask."""
  f = 4.0 * B * H * Lq * Lk * K * (3.5 if backward else 1.0)
  return f / 2 if causal else f


def attention(grid: dict, warmup: int, repeats: int, tick) -> list:
  """The attention kernels shardlab runs (module doc), forward and forward + backward."""
  import jax
  import jax.numpy as jnp
  from shardlab import attention as A
  B, L, H, K = grid["attention"]
  dt = grid["attn_dtype"]
  ks = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(s, (B, L, H, K), jnp.float32).astype(dt) for s in ks)
  blk = L // 4                                           # the ring's step: one block of L/4 against another
  full = jnp.ones((blk, blk), bool)
  kernels = {
      "plain": (lambda q, k, v: A.plain(q, k, v), (q, k, v), L, True),
      "blockwise": (lambda q, k, v: A.blockwise(q, k, v, min(512, L // 2)), (q, k, v), L, True),
      "dot_product": (lambda q, k, v: A.dot_product(q, k, v), (q, k, v), L, True),
      "ring_step": (lambda q, k, v: A.plain(q, k, v, full), (q[:, :blk], k[:, :blk], v[:, :blk]), blk, False),
  }
  rows = []
  for name, (f, args, n, causal) in kernels.items():
    for backward in (False, True):
      g = (jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)) if backward
           else f)
      c, prog = compiled(g, *args)
      r = timed(c, args, warmup, repeats)
      fl = attention_flops(B, n, n, H, K, causal, backward)
      calls = [i for instrs in prog.comps.values() for i in instrs if hlo_attention(i)]
      stated = sum(stated_flops(i) or 0.0 for i in calls)     # shardlab's Pallas kernel: the FLOPs it states
      rows.append({"kernel": name, "pass": "fwd+bwd" if backward else "fwd", "shape": [B, n, H, K],
                   "dtype": jnp.dtype(dt).name, "causal": causal, "s": r["s"], "spread": r["spread"], "flops": fl,
                   "flops_per_s": fl / r["s"], "fused_kernel": bool(calls) and not stated, "pallas_kernel": stated > 0,
                   "stated_flops": stated, "program": prog})
      tick(f"attention {name} {'fwd+bwd' if backward else 'fwd'}")
  return rows


def hlo_attention(ins) -> bool:
  from shardlab.analysis.hlo import is_attention_call
  return is_attention_call(ins)


def stated_flops(ins) -> float | None:
  from shardlab.analysis.hlo import stated_flops as stated
  return stated(ins)


def collectives(grid: dict, warmup: int, repeats: int, tick) -> list:
  """all-gather, reduce-scatter, all-reduce and a ring ppermute over every local device, by message size, with
  the bytes one device sends (ledger.py's convention: V (n-1)/n, twice that for an all-reduce, V for a ppermute
  of V). [] on one device."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from shardlab import collectives as C
  n = jax.device_count()
  if n < 2:
    return []
  mesh = Mesh(np.array(jax.devices()), ("x",))
  ring = [(i, (i + 1) % n) for i in range(n)]
  ops = {
      "all-gather": (lambda s: C.all_gather(s, "x", 0), lambda V: V * (n - 1) / n),
      "reduce-scatter": (lambda s: C.psum_scatter(s, "x", 0), lambda V: V * (n - 1) / n),
      "all-reduce": (lambda s: C.psum(s, "x"), lambda V: 2 * V * (n - 1) / n),
      "collective-permute": (lambda s: C.ppermute(s, "x", ring), lambda V: V),
  }
  rows = []
  for kind, (op, sent) in ops.items():
    for nbytes in grid["collective"]:
      per = max(n, nbytes // 4 // n * n)                 # f32 elements on each device, divisible by n
      # all-gather: V is the gathered array (n shards); the others: V is what each device holds
      x = jax.device_put(jnp.ones((n * per,), jnp.float32), NamedSharding(mesh, P("x")))
      spec_out = P("x") if kind != "all-gather" else P()
      f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=spec_out, check_vma=False))
      V = 4.0 * per * (n if kind == "all-gather" else 1)
      r = timed(f, (x,), warmup, repeats, wait_each=jax.devices()[0].platform == "cpu")
      rows.append({"kind": kind, "devices": n, "array_bytes": V, "bytes_sent": sent(V), "s": r["s"],
                   "spread": r["spread"], "bus_bytes_per_s": sent(V) / r["s"]})
      tick(f"{kind} {V / 2 ** 20:.3g} MiB")
  return rows


def count(grid: dict, devices: int) -> int:
  """Figures `measure` times (the progress bar's total)."""
  return (2 + len(grid["dtypes"]) * len(grid["gemm"]) + len(grid["layer"]) + len(grid["memory"]) + 8
          + (4 * len(grid["collective"]) if devices > 1 else 0))


# ------------------------------------------------------------------------------------------------ the preset

def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
  """(intercept, slope) of the least-squares line through (xs, ys)."""
  n = len(xs)
  mx, my = sum(xs) / n, sum(ys) / n
  sxx = sum((x - mx) ** 2 for x in xs)
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
  return my - slope * mx, slope


DISPATCH_BOUND = 2.0   # a call shorter than this many dispatches measures the host, not the kernel


def plateau(rows: list[dict], size: str, rate: str, floor: float) -> float:
  """The median `rate` of the larger half of `rows` by `size`, leaving out calls shorter than `floor` seconds
  (dispatch-bound); every row if none is longer."""
  kept = [r for r in rows if r["s"] >= floor] or rows
  sizes = sorted({r[size] for r in kept})
  big = [r[rate] for r in kept if r[size] >= sizes[len(sizes) // 2]]
  return statistics.median(big)


def preset(m: dict, base, name: str, command: str) -> tuple[dict, dict]:
  """(the preset's fields, {field: provenance}) from measurements `m` and the base preset `base`
  (a HardwareConfig). Module doc: measured rates in the base's terms; what was not measured is kept, and says so."""
  import dataclasses
  dev = m["device"]
  when = datetime.date.today().isoformat()
  where = f"{dev['kind']} ({dev['platform']}, jax {dev['jax']})"
  said = lambda what: f"measured {when} on {where}: {what}; `{command}`"
  kept = lambda why: f"kept from {base.name} ({why})"
  nominal = "nominal" in (base.source or "").lower()    # the base says it has no published peaks (conf/hardware)
  fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
  prov = {k: kept(base.source or "no source") for k in fields if k not in ("name", "source", "note", "provenance",
                                                                          "file", "measured_on")}
  fields.update(name=name, measured_on=dev["platform"], file="")

  def rate(peak: str, efficiency: str, measured: float, how: str) -> None:
    """A measured rate in the base's terms: a nominal base takes it as its peak (efficiency 1); a base with a
    published peak keeps it and gets measured / peak."""
    if nominal:
      fields.update({peak: float(f"{measured:.4g}"), efficiency: 1.0})
      prov[peak] = said(how + " (a nominal base has no published peak)")
      prov[efficiency] = said(f"1: {peak} is itself the measured rate")
    else:   # three significant figures: a far slower device's fraction must not round to 0, which no preset takes
      fields[efficiency] = float(f"{measured / getattr(base, peak):.3g}")
      prov[efficiency] = said(f"{how}, {measured:.4g}, over the published {peak} {getattr(base, peak):.4g}")

  floor = DISPATCH_BOUND * m["dispatch"]["s"]
  by_dtype: dict = {}
  for dt in dict.fromkeys(r["dtype"] for r in m["gemm"]):
    by_dtype[dt] = plateau([r for r in m["gemm"] if r["dtype"] == dt], "flops", "flops_per_s", floor)
  fields["gemm_flops_by_dtype"] = {k: float(f"{v:.4g}") for k, v in by_dtype.items()}
  how = "the median rate of the larger half (by FLOPs) of the GEMM grid, layouts nn, nt and tn"
  prov["gemm_flops_by_dtype"] = said(how + ", per operand dtype")
  # a published peak is bf16's (hardware.py); a nominal one becomes the fastest dtype measured
  best = max(by_dtype.values())
  rate("peak_flops", "gemm_efficiency", best if nominal else by_dtype.get("bfloat16", best),
       how + ("" if nominal else " in bf16, FLOP/s"))
  if dev.get("core_count") and dev["platform"] == "gpu":
    fields["compute_units"] = int(dev["core_count"])
    prov["compute_units"] = said("the device's multiprocessor count, as JAX reports it")

  rate("hbm_bandwidth", "hbm_efficiency", plateau(m["memory"], "bytes", "bytes_per_s", floor),
       "the median rate (bytes read + written) of the memory-bound kernels (affine, row softmax, row norm) at the "
       "larger half of the sizes, B/s")
  if dev.get("bytes_limit"):   # the allocator's share (XLA_PYTHON_CLIENT_MEM_FRACTION, 75% by default), not the HBM
    prov["hbm_bytes"] = kept(f"{base.source or 'no source'}; JAX's allocator may use {dev['bytes_limit']:.4g} B of "
                             "it here (memory_stats bytes_limit)")

  fields["kernel_launch_s"] = float(f"{m['launch']['per_kernel_s']:.3g}")
  prov["kernel_launch_s"] = said(f"a program of {m['launch']['kernels']} tiny unfusable kernels against one of 1, "
                                 "per kernel")

  fused = [r for r in m["attention"] if r["fused_kernel"] and r["pass"] == "fwd+bwd"]
  if fused:
    achieved = max(r["flops_per_s"] for r in fused)    # (not `rate`: the collectives below call rate())
    fields["attention_efficiency"] = float(f"{achieved / fields['peak_flops']:.3g}")
    prov["attention_efficiency"] = said(f"cuDNN's fused attention forward + backward, {achieved:.4g} FLOP/s "
                                        f"(shape {fused[0]['shape']}, causal), over peak_flops")
  else:
    prov["attention_efficiency"] = kept("no fused attention kernel on this device: nothing to measure")
  pallas = [r for r in m["attention"] if r.get("pallas_kernel") and r["pass"] == "fwd+bwd"]
  if pallas:
    achieved = max(r["stated_flops"] / r["s"] for r in pallas)
    fields["flash_kernel_efficiency"] = float(f"{achieved / fields['peak_flops']:.3g}")
    prov["flash_kernel_efficiency"] = said(f"shardlab's Pallas flash kernel ({pallas[0]['kernel']}) forward + "
                                           f"backward, {achieved:.4g} FLOP/s of the FLOPs it states "
                                           f"(shape {pallas[0]['shape']}, causal), over peak_flops")
  else:
    prov["flash_kernel_efficiency"] = kept("shardlab's Pallas kernel does not run on this device: nothing to measure")

  if m["collectives"]:
    lat, inv = fit_line([r["bytes_sent"] for r in m["collectives"]], [r["s"] for r in m["collectives"]])
    bus = 1.0 / inv if inv > 0 else max(r["bus_bytes_per_s"] for r in m["collectives"])
    n = m["collectives"][0]["devices"]
    what = (f"the line t = latency + bytes / bus bandwidth through {len(m['collectives'])} collectives over {n} "
            f"devices: {bus:.4g} B/s, {max(lat, 0.0) * 1e6:.3g} us"
            + (" (each call waited for: the latency holds the host's dispatch and sync)"
               if dev["platform"] == "cpu" else ""))
    rate("ici_bandwidth", "link_efficiency", bus, what)
    fields.update(collective_latency_s=float(f"{max(lat, 0.0):.3g}"), link_half_bytes=0.0)
    prov["collective_latency_s"] = said(what)
    prov["link_half_bytes"] = said("0: a line has no separate ramp (S / (W e r(S)) = S / (W e) + h / (W e): the "
                                   "ramp is a constant, counted in collective_latency_s)")
  else:
    why = "one device: no collective to measure"
    for k in ("ici_bandwidth", "link_efficiency", "collective_latency_s", "link_half_bytes"):
      prov[k] = kept(why)
  fields["source"] = f"python -m shardlab.calibrate on {where}, {when}; unmeasured figures from {base.name}"
  fields["note"] = f"measured on {dev['kind']}: rates of this machine, for runs on it and machines like it"
  fields["provenance"] = dict(sorted(prov.items()))
  return fields, prov


def to_yaml(fields: dict) -> str:
  """The preset as conf/hardware/*.yaml writes one (so it also works copied there, as `hardware=NAME`)."""
  import yaml
  body = {k: v for k, v in fields.items() if k not in ("file",)}
  head = ("# A hardware preset MEASURED by `python -m shardlab.calibrate` (docs/calibrate.md); `provenance` says\n"
          "# where each figure came from. Use it with `python -m shardlab hardware.file=THIS.yaml`, or copy it into\n"
          "# conf/hardware/ and pick it with `hardware=NAME`.\n")
  return head + yaml.safe_dump({"defaults": ["hardware_schema"], **body}, sort_keys=False, width=120)


def compare(m: dict, new, base) -> list[dict]:
  """Per measured kernel: measured seconds, and the calibrated replay's PREDICTION of its program with the new
  preset and the base one."""
  rows = []
  for group, label in (("gemm", lambda r: f"gemm {r['m']}x{r['n']}x{r['k']} {r['layout']} {r['dtype']}"),
                       ("memory", lambda r: f"{r['kernel']} {r['bytes'] / 2 ** 20:.3g} MiB"),
                       ("attention", lambda r: f"{r['kernel']} {r['pass']} {r['dtype']}")):
    for r in m[group]:
      rows.append({"figure": label(r), "measured_s": r["s"], "predicted_s": replayed(r["program"], new),
                   "base_predicted_s": replayed(r["program"], base),
                   "dispatch_bound": r["s"] < DISPATCH_BOUND * m["dispatch"]["s"]})
  for r in rows:
    r["error"] = r["predicted_s"] / r["measured_s"] - 1
    r["base_error"] = r["base_predicted_s"] / r["measured_s"] - 1
  return rows


def table(fields: dict, base, rows: list[dict], m: dict) -> str:
  """What the end of a calibration prints: the preset's figures measured against the base's, then every
  measured kernel against the PREDICTIONS of both."""
  from shardlab.outputs import human_seconds
  out = [f"shardlab.calibrate: {m['device']['kind']} ({m['device']['count']} x {m['device']['platform']}), "
         f"preset {fields['name']} against {base.name}:", f"  {'figure':<24}{'measured':>14}{base.name:>14}"]
  for k in ("peak_flops", "gemm_efficiency", "hbm_bandwidth", "hbm_efficiency", "attention_efficiency",
            "flash_kernel_efficiency", "kernel_launch_s", "ici_bandwidth", "link_efficiency", "collective_latency_s",
            "compute_units"):
    mark = "" if str(fields["provenance"].get(k, "")).startswith("measured") else "  (kept)"
    out.append(f"  {k:<24}{fields[k]:>14.4g}{getattr(base, k):>14.4g}{mark}")
  for dt, v in fields["gemm_flops_by_dtype"].items():
    out.append(f"  {'gemm FLOP/s ' + dt:<24}{v:>14.4g}{'':>14}")
  if not m["collectives"]:
    out.append("  collectives: not measured (one device)")
  out.append(f"  {'kernel':<30}{'measured':>11}{'predicted':>11}{'error':>8}{base.name + ' pred.':>14}{'error':>8}")
  for r in rows:
    out.append(f"  {r['figure']:<30}{human_seconds(r['measured_s']):>11}{human_seconds(r['predicted_s']):>11}"
               f"{r['error']:>+8.0%}{human_seconds(r['base_predicted_s']):>14}{r['base_error']:>+8.0%}"
               + ("  dispatch-bound" if r["dispatch_bound"] else ""))
  used = [r for r in rows if not r["dispatch_bound"]] or rows
  out.append(f"  median |error| of the PREDICTIONS over {len(used)} kernels (dispatch-bound ones left out): "
             f"{statistics.median(abs(r['error']) for r in used):.0%} with {fields['name']}, "
             f"{statistics.median(abs(r['base_error']) for r in used):.0%} with {base.name}")
  out.append(f"  dispatch {human_seconds(m['dispatch']['s'])} per call (host); a kernel measured shorter than "
             f"{DISPATCH_BOUND:g} dispatches is dispatch-bound")
  return "\n".join(out)


def one_line(e: BaseException) -> str:
  try:
    from shardlab.plan import one_line as plan_line
    return plan_line(e)
  except Exception:  # noqa: BLE001  (the training code does not import here: the message alone)
    return " ".join(str(e).split()) or type(e).__name__


def default_base(overrides: list[str]) -> list[str]:
  """The overrides with a base preset named: the user's `hardware=` / `hardware.file=`, else the stock preset
  of the local device kind (h100 / h200 by name, tpu_v5e / tpu_v5p, cpu)."""
  if any(o.startswith(("hardware=", "hardware.file=")) for o in overrides):
    return overrides
  import jax
  dev = jax.devices()[0]
  kind = dev.device_kind.lower()
  name = ("cpu" if dev.platform == "cpu" else "h200" if "h200" in kind else "tpu_v5p" if "v5p" in kind else
          "tpu_v5e" if "v5" in kind else "h100")
  return [*overrides, f"hardware={name}"]


def run(argv: list[str], progress: bool = True) -> dict:
  """Calibrate (module doc) the devices JAX has (main sets the CPU's before it starts): writes the preset and its
  sidecar; returns {"fields", "measurements", "rows", "path", "table"}."""
  import dataclasses
  from shardlab.outputs import write_atomic
  opts, overrides = split_options(argv)
  from shardlab.config import compose
  cfg = compose(default_base(overrides))
  bad = [k for k in ("peak_flops", "hbm_bandwidth", "ici_bandwidth") if not getattr(cfg.hardware, k) > 0]
  if bad:                                    # the measured rates are divided by these: say so before measuring
    raise ValueError(f"hardware {cfg.hardware.name}: {bad[0]}={getattr(cfg.hardware, bad[0])} must be > 0 in the "
                     f"base preset")
  import jax
  from tqdm import tqdm
  platform = jax.devices()[0].platform
  grid = GRIDS[("any", "quick")] if opts["grid"] == "quick" else GRIDS[(platform, "full")]
  out = Path(opts["out"])
  command = "python -m shardlab.calibrate " + " ".join(argv)
  with tqdm(total=count(grid, jax.device_count()), desc="calibrate", disable=not progress) as bar:
    m = measure(grid, int(opts["warmup"]), int(opts["repeats"]), bar)
  base = cfg.hardware
  fields, _ = preset(m, base, opts["name"] or out.stem, command)
  from shardlab.hardware import HardwareConfig
  new = HardwareConfig(**{k: v for k, v in fields.items() if k in {f.name for f in dataclasses.fields(HardwareConfig)}})
  rows = compare(m, new, base)
  text = table(fields, base, rows, m)
  plain = {k: [{kk: vv for kk, vv in r.items() if kk != "program"} for r in v] if isinstance(v, list) else v
           for k, v in m.items()}
  write_atomic(out.with_suffix(".json"), json.dumps({"command": command, "base": base.name, "preset": fields,
                                                     "measurements": plain, "compared": rows}, indent=1) + "\n")
  write_atomic(out, to_yaml(fields))
  return {"fields": fields, "measurements": plain, "rows": rows, "path": str(out), "table": text}


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    return 0
  try:
    _, overrides = split_options(argv)       # bad options: one line before JAX starts or anything is measured
    from shardlab import mesh as M
    M.set_cpu_devices(next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("cpu_devices=")
                            and o.split("=", 1)[1].isdigit()), 1))
    result = run(argv)
  except Exception as e:  # noqa: BLE001  (Hydra/OmegaConf errors, ConfigError, ValueError, OSError: one line, exit 2)
    print(f"shardlab.calibrate: error: {one_line(e)}", file=sys.stderr)
    return 2
  print(result["table"])
  print(f"shardlab.calibrate: wrote {result['path']} (and every sample in {Path(result['path']).with_suffix('.json')});"
        f" predict with it: python -m shardlab hardware.file={result['path']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
