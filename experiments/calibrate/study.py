"""Measured beside predicted: single-device training steps (several widths, attention kernels, remat policies,
precisions), each MEASURED here (median of its steps after the first) and PREDICTED by shardlab's cost model for
the same compiled program twice: with the stock preset of this device and with a preset that
`python -m shardlab.calibrate` measured on it.

    python -m shardlab.calibrate out=experiments/calibrate/cpu.yaml
    python experiments/calibrate/study.py calibrated=experiments/calibrate/cpu.yaml [out=DIR] [steps=N]
        [deadline_s=S] [set=dense|moe] [only='LABEL;LABEL']

Writes DIR/study.json and DIR/study.md (DIR defaults to experiments/calibrate/results/<device>). One process
compiles each case once (trainer.build + the local compile, as `python -m shardlab` does), trains `steps` steps on
the Markov data, and replays that one program with both presets (analysis/costmodel.predict: the calibrated
replay where the preset describes the device, the peak-rate replay for a stock CPU preset, which has no
measured rates). `deadline_s`: start no case after this many seconds (a lent GPU's minutes are counted).
`only`: the cases of these labels alone.
`set=moe`: mixture-of-experts steps instead (experiments/moe/README.md): the grouped GEMM of the dropless
dispatchers (expert=ragged: on one device every expert is local) against all_to_all's capacity buffers, with the
dense model of the same active parameters beside them.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# (label, overrides); the common ones per platform first. Each case changes one thing from the first.
COMMON = {
    "cpu": ["model.n_layers=4", "model.seq_len=128", "train.batch_size=8", "model.vocab_size=256", "mesh=1x1",
            "model.n_heads=8"],
    "gpu": ["model.n_layers=4", "model.seq_len=2048", "train.batch_size=8", "model.vocab_size=32000", "mesh=1x1",
            "precision=bf16", "model.attention=dot_product"],
}
MOE = lambda E, k, F: [f"model.n_experts={E}", f"model.top_k={k}", f"model.expert_d_ff={F}"]
COMMON["cpu_moe"] = ["model.n_layers=2", "model.seq_len=128", "train.batch_size=8", "model.vocab_size=256",
                     "mesh=1x1", "model.n_heads=8", "model.d_model=256"]
COMMON["gpu_moe"] = ["model.n_layers=4", "model.seq_len=2048", "train.batch_size=8", "model.vocab_size=32000",
                     "mesh=1x1", "precision=bf16", "model.attention=dot_product", "model.d_model=2048",
                     "model.n_heads=16"]
CASES = {
    "cpu_moe": [("E8 k2 grouped (expert=ragged)", MOE(8, 2, 512) + ["expert=ragged"]),
                ("E8 k2 capacity 1.25 (all_to_all)", MOE(8, 2, 512) + ["expert.capacity_factor=1.25"]),
                ("E32 k4 grouped (expert=ragged)", MOE(32, 4, 128) + ["expert=ragged"]),
                ("E32 k4 capacity 1.25 (all_to_all)", MOE(32, 4, 128) + ["expert.capacity_factor=1.25"]),
                ("dense, the same active width", ["model.d_ff=1024"])],
    "gpu_moe": [("E16 k2 grouped (expert=ragged)", MOE(16, 2, 4096) + ["expert=ragged"]),
                ("E16 k2 capacity 1.25 (all_to_all)", MOE(16, 2, 4096) + ["expert.capacity_factor=1.25"]),
                ("dense, the same active width", ["model.d_ff=8192"]),
                ("E64 k8 grouped (expert=ragged)", MOE(64, 8, 1024) + ["expert=ragged"]),
                ("E64 k8 capacity 1.25 (all_to_all)", MOE(64, 8, 1024) + ["expert.capacity_factor=1.25"])],
    "cpu": [("d512", ["model.d_model=512", "model.d_ff=2048"]),
            ("d256", ["model.d_model=256", "model.d_ff=1024"]),
            ("d1024", ["model.d_model=1024", "model.d_ff=4096"]),
            ("d512 blockwise", ["model.d_model=512", "model.d_ff=2048", "model.attention=blockwise",
                                "model.attention_block=64"]),
            ("d512 dot_product", ["model.d_model=512", "model.d_ff=2048", "model.attention=dot_product"]),
            ("d512 remat=full", ["model.d_model=512", "model.d_ff=2048", "schedule.remat=full"]),
            ("d512 bf16", ["model.d_model=512", "model.d_ff=2048", "precision=bf16"])],
    "gpu": [("d2048", ["model.d_model=2048", "model.d_ff=8192", "model.n_heads=16"]),
            ("d1024", ["model.d_model=1024", "model.d_ff=4096", "model.n_heads=8"]),
            ("d4096", ["model.d_model=4096", "model.d_ff=14336", "model.n_heads=32"]),
            ("d2048 remat=full", ["model.d_model=2048", "model.d_ff=8192", "model.n_heads=16", "schedule.remat=full"]),
            ("d2048 blockwise", ["model.d_model=2048", "model.d_ff=8192", "model.n_heads=16",
                                 "model.attention=blockwise"]),
            ("d2048 fp32", ["model.d_model=2048", "model.d_ff=8192", "model.n_heads=16", "precision=fp32",
                            "model.attention=plain"]),
            ("d2048 plain", ["model.d_model=2048", "model.d_ff=8192", "model.n_heads=16", "model.attention=plain"])],
}


def stock_name(platform: str, kind: str) -> str:
  kind = kind.lower()
  return "cpu" if platform == "cpu" else "h200" if "h200" in kind else "h100"


def one(label: str, overrides: list[str], calibrated: str, stock: str, steps: int) -> dict:
  """Compile one case, train it `steps` steps, predict it with both presets."""
  import jax
  from shardlab import params as PM, train as T
  from shardlab import target as TG
  from shardlab.analysis import costmodel
  from shardlab.analysis.links import link_axes
  from shardlab.analysis.program import Program
  from shardlab.data import MarkovData
  from shardlab.plan import compose
  from shardlab.trainer import build, lower
  cfg = compose([*overrides, f"hardware.file={calibrated}"])
  stock_hw = compose([*overrides, f"hardware={stock}"]).hardware
  b = build(cfg)
  t0 = time.perf_counter()
  compiled = TG.compile_with(lower(b), cfg.xla.flags)
  compile_s = time.perf_counter() - t0
  mesh = b["mesh"]
  prog = Program.of(compiled, mesh)
  tokens = cfg.train.batch_size * cfg.model.seq_len
  n_params = PM.count_active(cfg.model)          # a MoE token computes with its top k experts only
  model_flops = 6 * n_params * tokens
  preds = {}
  for name, hw in (("calibrated", cfg.hardware), ("stock", stock_hw)):
    p, _ = costmodel.predict(prog, mesh, hw, link_axes(cfg), model_flops)
    preds[name] = {"s": p["t_overlapped_s"], "model": p["model"].split(":")[0], "preset": hw.name}
  params = PM.init_sharded(cfg.train.seed, b["decls"], cfg.model, mesh)
  state = T.init_state(params, b["opt"], b["decls"], mesh)
  data = MarkovData(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size,
                    cfg.data.branching, jax.tree.map(lambda a: a.sharding, b["abstract_batch"]),
                    b["schedule"].data_order(dict(mesh.shape)))
  times, losses = [], []
  for step in range(steps):
    batch = data.batch(step)
    t = time.perf_counter()
    state, met = compiled(state, batch)
    losses.append(float(met["loss"]))               # waits for the step
    times.append(time.perf_counter() - t)
  measured = statistics.median(times[1:])
  del state, params
  row = {"case": label, "overrides": overrides, "measured_s": measured, "steps": steps, "compile_s": compile_s,
         "loss_first_last": [losses[0], losses[-1]], "model_flops": model_flops,
         "achieved_model_flops_per_s": model_flops / measured}
  for name, p in preds.items():
    row[f"{name}_predicted_s"] = p["s"]
    row[f"{name}_model"] = p["model"]
    row[f"{name}_preset"] = p["preset"]
    row[f"{name}_error"] = p["s"] / measured - 1
  return row


def markdown(res: dict) -> str:
  from shardlab.outputs import human_seconds
  d = res["device"]
  out = [f"# Measured beside predicted: {d['kind']} ({d['platform']}), {res['date']}", "",
         f"Command: `{res['command']}` (jax {d['jax']}). \"measured\" is a **measurement** (median step, after the "
         f"first, of {res['steps']} steps); the other columns are **predictions** of shardlab's cost model for the "
         f"same compiled program, with the preset `{res['calibrated']}` measured by `python -m shardlab.calibrate` "
         f"on this device and with the stock preset `{res['stock']}`.", "",
         "| case | measured | predicted (calibrated) | error | predicted (stock) | error | stock model |",
         "|---|---:|---:|---:|---:|---:|---|"]
  for r in res["rows"]:
    if "error" in r:
      out.append(f"| {r['case']} | failed: {r['error']} | | | | | |")
      continue
    out.append(f"| {r['case']} | {human_seconds(r['measured_s'])} | {human_seconds(r['calibrated_predicted_s'])} | "
               f"{r['calibrated_error']:+.0%} | {human_seconds(r['stock_predicted_s'])} | {r['stock_error']:+.0%} | "
               f"{r['stock_model']} |")
  ok = [r for r in res["rows"] if "measured_s" in r]
  if ok:
    med = lambda k: statistics.median(abs(r[k]) for r in ok)
    out += ["", f"Median |error| over {len(ok)} cases: {med('calibrated_error'):.0%} with the calibrated preset, "
            f"{med('stock_error'):.0%} with the stock one."]
  return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
  opts = dict(a.split("=", 1) for a in argv if "=" in a)
  if "calibrated" not in opts:
    print("study.py: error: calibrated=PATH.yaml (a preset from python -m shardlab.calibrate)", file=sys.stderr)
    return 2
  from shardlab import mesh as M
  M.set_cpu_devices(1)
  import jax
  dev = jax.devices()[0]
  platform = "cpu" if dev.platform == "cpu" else "gpu"
  steps = int(opts.get("steps", 10 if platform == "cpu" else 20))
  deadline = float(opts.get("deadline_s", 1e9))
  kind = platform if opts.get("set", "dense") == "dense" else f"{platform}_moe"
  where = ROOT / "experiments" / ("calibrate" if kind == platform else "moe") / "results"
  out = Path(opts.get("out", where / dev.device_kind.replace(" ", "_")))
  out.mkdir(parents=True, exist_ok=True)
  import datetime
  res = {"device": {"platform": dev.platform, "kind": dev.device_kind, "jax": jax.__version__},
         "date": datetime.date.today().isoformat(), "command": "python experiments/calibrate/study.py " + " ".join(argv),
         "calibrated": opts["calibrated"], "stock": stock_name(dev.platform, dev.device_kind), "steps": steps,
         "rows": []}
  start = time.perf_counter()
  only = opts["only"].split(";") if opts.get("only") else None
  for label, extra in CASES[kind]:
    if only is not None and label not in only:
      continue
    if time.perf_counter() - start > deadline:
      print(f"study: deadline reached, {label} and later cases not run", flush=True)
      break
    try:
      row = one(label, COMMON[kind] + extra, opts["calibrated"], res["stock"], steps)
    except Exception as e:  # noqa: BLE001  (a case that does not fit or compile: its row says why)
      row = {"case": label, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    res["rows"].append(row)
    print(json.dumps(row), flush=True)
    (out / "study.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "study.md").write_text(markdown(res))
  print(markdown(res))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
