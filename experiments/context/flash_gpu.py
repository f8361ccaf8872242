"""shardlab's fused flash kernel (shardlab/flash_kernel.py: Pallas lowered to Triton) MEASURED on a GPU, beside
cuDNN's fused attention (what `model.attention=dot_product` runs), XLA's pure-JAX blockwise attention (the kernel's
readable reference) and JAX's own Pallas flash attention (jax.experimental.pallas.ops.gpu.attention.mha), each
beside the calibrated cost model's PREDICTION of the same compiled program with the stock preset of the device.

    python experiments/context/flash_gpu.py [out=DIR] [deadline_s=S] [smoke=true] [fast=true] [tiles=N]

Three shapes, bf16, causal: the calibration's 4 x 4096 tokens x 16 heads of 128 (experiments/calibrate), one
device's share of llama3_8b's 64K tokens over a ring of 8 (8192 tokens, 32 query heads over 8 K/V heads), and one
ring step of that run (the zigzag ring's local 8192 queries against another device's 8192 keys: half the block
pairs visible, flash_kernel.block_attention and block_attention_bwd called as schedules/context.py calls them).
shardlab's kernel is run at several tiles (block_q x block_k, Triton warps and pipeline stages), the default first,
and at the default tile once more with a branch per block instead of each cell's loop over its span of visible
blocks (flash_kernel.spans; `fast=true`: cuDNN and shardlab's kernels only; `tiles=N`: the first N of TILES).
Each implementation's output and gradients are checked against plain attention in float32 (max |error| over max
|reference|). `smoke=true`: tiny shapes, a few seconds, any platform (on a CPU every kernel falls back to its
pure-JAX path or is skipped: a check of this script, not a measurement). Writes DIR/flash_gpu.json and
DIR/flash_gpu.md (DIR defaults to experiments/context/results_<device>).
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# (label, B, L, H, G, K)
SHAPES = [("calibration shape: 4 x 4096, 16 heads", 4, 4096, 16, 16, 128),
          ("llama3_8b, 64K over 8: 8192 tokens, 32 heads / 8 K/V", 1, 8192, 32, 8, 128)]
RING = ("llama3_8b ring step (zigzag, C=8, device 3 <- 1)", 1, 8192, 32, 8, 128, 8, 3, 1)
SMOKE = [("smoke", 1, 256, 4, 2, 32)]
RING_SMOKE = ("smoke ring step", 1, 256, 4, 2, 32, 4, 2, 0)
# (block_q, block_k, warps, stages): shardlab's default first
TILES = [(64, 64, 4, 2), (64, 64, 4, 2, False), (128, 64, 4, 2), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2)]


def set_tile(tile):
  """Run shardlab's Triton kernels at this tile (module constants read when a program is traced); a fifth entry
  False: each cell visits every block under a branch (`ranged=False`) instead of looping over its span."""
  from shardlab import flash_kernel as F
  bq, bk, warps, stages, *ranged = tile
  F.WARPS, F.STAGES = warps, stages
  r = ranged[0] if ranged else None
  F.KERNELS["triton"] = (functools.partial(F.block_attention, block_q=bq, block_k=bk, ranged=r),
                         functools.partial(F.block_attention_bwd, block_q=bq, block_k=bk, ranged=r), (bq, bk))


def tile_name(t) -> str:
  return f"shardlab Pallas {t[0]}x{t[1]} w{t[2]} s{t[3]}" + (", a branch per block" if t[4:] == (False,) else "")


def reference(q, k, v, pq, pk, do):
  """Plain attention in float32 where pq >= pk: the output and the gradients of sum(o * do)."""
  import jax
  import jax.numpy as jnp
  f32 = lambda x: x.astype(jnp.float32)

  def attend(q, k, v):
    R = q.shape[2] // k.shape[2]
    kk, vv = jnp.repeat(k, R, axis=2), jnp.repeat(v, R, axis=2)
    s = jnp.einsum("blhk,bmhk->bhlm", q, kk) / math.sqrt(q.shape[-1])
    s = jnp.where(pq[:, None] >= pk[None, :], s, -jnp.inf)
    return jnp.einsum("bhlm,bmhk->blhk", jax.nn.softmax(s, axis=-1), vv)
  o, vjp = jax.vjp(attend, f32(q), f32(k), f32(v))
  return (o, *vjp(f32(do)))


def rel_error(got, want) -> float:
  import jax.numpy as jnp
  return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))


def measure(fn, args, hw, flops):
  """{"s", "spread", "predicted_s", "error", "tflops"}: fn compiled alone, timed (calibrate.timed: warm-up, the
  median of repeats) and replayed by the calibrated cost model on `hw`."""
  from shardlab import calibrate as CAL
  c, prog = CAL.compiled(fn, *args)
  r = CAL.timed(c, args, warmup=2, repeats=5)
  pred = CAL.replayed(prog, hw)
  triton = sum(1 for instrs in prog.comps.values() for i in instrs
               if i.opcode == "custom-call" and "triton" in i.attrs)
  return {"s": r["s"], "spread": r["spread"], "predicted_s": pred, "error": pred / r["s"] - 1,
          "tflops": flops / r["s"] / 1e12, "triton_calls": triton}, c


def attention_rows(shape, hw, tiles, deadline, start, fast: bool):
  import jax
  import jax.numpy as jnp
  from shardlab import attention as A
  from shardlab import calibrate as CAL
  label, B, L, H, G, K = shape
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (B, L, H, K), jnp.float32).astype(jnp.bfloat16)
  k, v = (jax.random.normal(s, (B, L, G, K), jnp.float32).astype(jnp.bfloat16) for s in ks[1:3])
  do = jax.random.normal(ks[3], (B, L, H, K), jnp.float32).astype(jnp.bfloat16)
  pos = jnp.arange(L)
  want = reference(q, k, v, pos, pos, do)
  R = H // G

  def mha(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention as JPA
    return JPA.mha(q, jnp.repeat(k, R, axis=2), jnp.repeat(v, R, axis=2), None, sm_scale=1 / math.sqrt(K),
                   causal=True)
  impls = [("cuDNN (jax.nn.dot_product_attention)", None, A.dot_product)]
  impls += [(tile_name(t), t, lambda q, k, v: A.blockwise(q, k, v, 512)) for t in tiles]
  if not fast:
    impls += [("pure-JAX blockwise (XLA, blocks of 512)", None, lambda q, k, v: A._flash(min(512, L), (), q, k, v)),
              ("JAX's Pallas mha (128x128 fwd, 32 bwd)", None, mha)]
  rows = []
  for name, tile, f in impls:
    if time.perf_counter() - start > deadline:
      rows.append({"shape": label, "impl": name, "skipped": "deadline"})
      continue
    if tile is not None:
      set_tile(tile)
    try:
      grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)),
                      argnums=(0, 1, 2))
      fwd, cf = measure(f, (q, k, v), hw, CAL.attention_flops(B, L, L, H, K, True, False))
      both, cb = measure(grad, (q, k, v), hw, CAL.attention_flops(B, L, L, H, K, True, True))
      got = (cf(q, k, v), *cb(q, k, v))
      errs = {n: rel_error(g, w) for n, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
      rows.append({"shape": label, "impl": name, "tile": tile, "fwd": fwd, "fwd_bwd": both, "rel_error": errs})
    except Exception as e:  # noqa: BLE001  (an implementation that does not compile here: its row says why)
      rows.append({"shape": label, "impl": name, "tile": tile, "failed": f"{type(e).__name__}: "
                   f"{' '.join(str(e).split())[:240]}"})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def ring_rows(ring, hw, tiles, deadline, start):
  """One zigzag ring step, forward kernel and backward kernels, as schedules/context.py calls them."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from shardlab import flash_kernel as F
  label, B, L, H, G, K, C, me, src = ring
  interpret = jax.devices()[0].platform == "cpu"     # smoke: Pallas's interpreter on a CPU
  half = L // 2                       # zigzag: device d holds chunks d and 2C - 1 - d of the sequence
  zig = lambda d: jnp.asarray(np.concatenate([np.arange(d * half, (d + 1) * half),
                                              np.arange((2 * C - 1 - d) * half, (2 * C - d) * half)]), jnp.int32)
  pq, pk = zig(me), zig(src)
  ks = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(ks[0], (B, L, H, K), jnp.float32).astype(jnp.bfloat16)
  k, v = (jax.random.normal(s, (B, L, G, K), jnp.float32).astype(jnp.bfloat16) for s in ks[1:3])
  do = jax.random.normal(ks[3], (B, L, H, K), jnp.float32).astype(jnp.bfloat16)
  o_w, dq_w, dk_w, dv_w = reference(q, k, v, pq, pk, do)
  visible = float(np.mean(np.asarray(pq)[:, None] >= np.asarray(pk)[None, :]))
  rows = []
  for tile in tiles:
    if time.perf_counter() - start > deadline:
      rows.append({"shape": label, "impl": f"tile {tile}", "skipped": "deadline"})
      continue
    set_tile(tile)
    bq, bk = tile[:2]
    pairs = F.pair_counts(np.asarray(pq), np.asarray(pk), bq, bk)
    fwd_k, bwd_k, _ = F.KERNELS["triton"]
    name = tile_name(tile)
    try:
      fwd = lambda q, k, v: fwd_k(q, k, v, pq, pk, pairs=pairs, interpret=interpret)
      flops = 4.0 * B * H * L * L * K * visible
      f_row, cf = measure(fwd, (q, k, v), hw, flops)
      o, lse = cf(q, k, v)
      delta = jnp.einsum("blhk,blhk->bhl", do.astype(jnp.float32), o)
      bwd = lambda q, k, v, lse, do, delta: bwd_k(q, k, v, pq, pk, lse, do, delta, pairs=pairs, interpret=interpret)
      args = (q, k, v, lse, do, delta)
      b_row, cb = measure(bwd, args, hw, 2.5 * flops)
      dq, dk, dv = cb(*args)
      errs = {"o": rel_error(o, o_w), "dq": rel_error(dq, dq_w), "dk": rel_error(dk, dk_w),
              "dv": rel_error(dv, dv_w)}
      rows.append({"shape": label, "impl": name, "tile": tile, "visible": visible, "pairs": pairs,
                   "fwd": f_row, "bwd": b_row, "rel_error": errs})
    except Exception as e:  # noqa: BLE001
      rows.append({"shape": label, "impl": name, "tile": tile,
                   "failed": f"{type(e).__name__}: {' '.join(str(e).split())[:240]}"})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def markdown(res: dict) -> str:
  from shardlab.outputs import human_seconds as hs
  d = res["device"]
  out = [f"# shardlab's Pallas flash kernel measured: {d['kind']} ({d['platform']}), {res['date']}", "",
         f"`{res['command']}` (jax {d['jax']}). **Measured**: the median of 5 timed samples after warm-up, each "
         "kernel compiled alone. **Predicted**: shardlab's calibrated replay of the same compiled program with "
         f"the stock `{res['preset']}` preset (a Triton call priced from the FLOPs it states at the preset's "
         "attention efficiency). TFLOP/s counts the causal matmul FLOPs (forward 2 B H L^2 K, backward 2.5 times "
         "that). Error: max |output - plain float32 attention| / max |reference|, bf16 inputs.", ""]
  for title, rows, passes in (("Causal attention, forward and forward + backward", res["attention"],
                               ("fwd", "fwd_bwd")),
                              ("One ring step: the forward kernel and the backward kernels", res["ring"],
                               ("fwd", "bwd"))):
    out += [f"## {title}", "",
            f"| shape | implementation | {passes[0]} measured | predicted | error | TFLOP/s | {passes[1]} measured "
            "| predicted | error | TFLOP/s | max rel. error (o, dq, dk, dv) |", "|---|---|" + "---:|" * 9]
    for r in rows:
      if "fwd" not in r:
        out.append(f"| {r['shape']} | {r['impl']} | {r.get('failed') or r.get('skipped')} |" + " |" * 8)
        continue
      cells = []
      for p in passes:
        m = r[p]
        cells += [hs(m["s"]), hs(m["predicted_s"]), f"{m['error']:+.0%}", f"{m['tflops']:.3g}"]
      errs = ", ".join(f"{r['rel_error'][n]:.1e}" for n in ("o", "dq", "dk", "dv"))
      out.append(f"| {r['shape']} | {r['impl']} | " + " | ".join(cells) + f" | {errs} |")
    out.append("")
  return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
  opts = dict(a.split("=", 1) for a in argv if "=" in a)
  smoke = opts.get("smoke", "false") == "true"
  from shardlab import mesh as M
  M.set_cpu_devices(1)
  import jax
  from shardlab.plan import compose
  dev = jax.devices()[0]
  sys.path.insert(0, str(ROOT / "experiments" / "calibrate"))
  from study import stock_name                 # the stock preset of this device, as the step study picks it
  preset = stock_name(dev.platform, dev.device_kind)
  hw = compose([f"hardware={preset}"]).hardware
  out = Path(opts.get("out", ROOT / "experiments" / "context" / f"results_{dev.device_kind.replace(' ', '_')}"))
  out.mkdir(parents=True, exist_ok=True)
  deadline = float(opts.get("deadline_s", 1e9))
  tiles = TILES[:3] if smoke else TILES[:int(opts.get("tiles", len(TILES)))]
  res = {"device": {"platform": dev.platform, "kind": dev.device_kind, "jax": jax.__version__},
         "date": datetime.date.today().isoformat(),
         "command": "python experiments/context/flash_gpu.py " + " ".join(argv), "preset": preset,
         "attention": [], "ring": []}
  start = time.perf_counter()
  for shape in SMOKE if smoke else SHAPES:
    res["attention"] += attention_rows(shape, hw, tiles, deadline, start, opts.get("fast", "false") == "true")
  res["ring"] = ring_rows(RING_SMOKE if smoke else RING, hw, tiles, deadline, start)
  (out / "flash_gpu.json").write_text(json.dumps(res, indent=1) + "\n")
  (out / "flash_gpu.md").write_text(markdown(res))
  print(markdown(res))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
