"""Predicted step time of every schedule preset (shardlab/conf/schedule/) for the exact LLaMA-3 8B preset (grouped-query
attention, 8.03e9 parameters) at 4 x 4096 tokens per device on an H100 node (compiled for the target: the H100
compiler's program, memory and the calibrated prediction) and a TPU v5p slice (compiled by XLA:CPU on fake
devices, the peak-rate model); and the memory of MaxText's one-node Llama-2-7B configuration on 8 x H100,
compiled against analytic. MODEL PREDICTIONS from dry runs (compile and analyze, nothing allocated, no step run),
not measurements. Writes results.md and results.json here and copies some timeline charts to img/.

  python experiments/predict/predict.py          # every dry run, one after another
  python experiments/predict/predict.py --table  # only rebuild the tables from outputs/predict/
  python experiments/predict/predict.py gspmd    # only these presets (then the tables)
  python experiments/predict/predict.py --machine=h100   # only this machine's runs
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from shardlab.config import CONF_DIR  # noqa: E402
RUNS = ROOT / "outputs" / "predict"
# 4 sequences of 4096 tokens per device; MaxText's remat "minimal_flash" (every projection and the attention
# output kept, the rest recomputed) is shardlab's save_matmuls_attn_out; the preset's blockwise attention.
COMMON = ["dry_run=true", "progress=false", "model=llama3_8b", "model.seq_len=4096", "precision=bf16",
          "schedule.remat=save_matmuls_attn_out"]
MACHINES = {
    "h100": ["compile_for=target", "hardware=h100", "cpu_devices=8", "mesh.fsdp=4", "mesh.tensor=2",
             "train.batch_size=32"],
    "tpu_v5p": ["hardware=tpu_v5p", "cpu_devices=64", "mesh.fsdp=16", "mesh.tensor=4", "mesh.fsdp_ici_axes=2",
                "train.batch_size=256"],
}
VARIANTS = {"fsdp_prefetch+bf16_gather": ["schedule=fsdp_prefetch", "schedule.gather_dtype=compute"]}
OVERRIDES: dict = {}
CHARTS = ("baseline", "fsdp_prefetch", "collective_matmul_bidi")
# MaxText's one-node H100 configuration (configs/a3/llama_2_7b/1vm.sh: ici_fsdp_parallelism=8,
# per_device_batch_size=4, max_target_length=4096, attention=cudnn_flash_te, remat_policy=minimal_flash).
LLAMA2_7B = ["dry_run=true", "progress=false", "model=llama2_7b", "mesh=8x1", "precision=bf16",
             "train.batch_size=32", "model.seq_len=4096", "compile_for=target", "hardware=h100"]
LLAMA2_7B_RUNS = {
    "blockwise, save_matmuls_attn_out": ["model.attention=blockwise", "schedule.remat=save_matmuls_attn_out"],
    "dot_product, save_matmuls_attn_out": ["model.attention=dot_product", "schedule.remat=save_matmuls_attn_out"],
    "blockwise, save_qkv_attn_out": ["model.attention=blockwise", "schedule.remat=save_qkv_attn_out"],
    "blockwise, full": ["model.attention=blockwise", "schedule.remat=full"],
}


def presets() -> dict:
  names = sorted(p.stem for p in (CONF_DIR / "schedule").glob("*.yaml"))
  return {**{n: [f"schedule={n}"] for n in names}, **VARIANTS}


def run_all(only: list[str], machines: list[str]) -> None:
  jobs = [(RUNS / m / name, [*COMMON, *args, *extra, *OVERRIDES.get((m, name), [])])
          for m, args in MACHINES.items() for name, extra in presets().items()
          if (not only or name in only) and (not machines or m in machines)]
  if not only and (not machines or "llama2_7b" in machines):
    jobs += [(RUNS / "llama2_7b" / slug(name), [*LLAMA2_7B, *extra]) for name, extra in LLAMA2_7B_RUNS.items()]
  for out, args in jobs:
    cmd = [sys.executable, "-m", "shardlab", *args, f"hydra.run.dir={out}"]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=False, stdout=subprocess.DEVNULL)


def slug(name: str) -> str:
  return name.replace(", ", "_")


def row(name: str, s: dict) -> dict:
  # bytes of the traced program (XLA:CPU widens bf16 collectives); gspmd places none, so its compiled ones (+)
  comm = s["ledger"]["program"] or s["ledger"]["compiled"]
  p = s["prediction"]
  moved = lambda axis: sum(t["bytes"] for a in comm.values() for t in a.get(axis, {}).values()) / 1e9
  if not s["ledger"]["program"]:
    name += " (+)"
  ceiling = p.get("ceiling", p)                  # calibrated (target) runs keep the peak-rate replay as ceiling
  return {"schedule": name, "t_compute_ms": p["t_compute_s"] * 1e3, "t_gemm_ms": p.get("t_gemm_s", 0) * 1e3,
          "t_comm_fsdp_ms": p["t_comm_s"].get("fsdp", 0) * 1e3,
          "t_comm_tensor_ms": p["t_comm_s"].get("tensor", 0) * 1e3,
          "t_serial_ms": p["t_serial_s"] * 1e3, "t_overlapped_ms": p["t_overlapped_s"] * 1e3,
          "exposed_comm_ms": p["exposed_comm_s"] * 1e3, "mfu": p["mfu"],
          "ceiling_ms": ceiling["t_overlapped_s"] * 1e3, "ceiling_mfu": ceiling["mfu"],
          "critical_ms": {k: v * 1e3 for k, v in ceiling["critical_path_s"].items()}, "gb_fsdp": moved("fsdp"),
          "gb_tensor": moved("tensor"), "peak_gb": s["memory"]["peak"] / 1e9, "fits": s["memory"].get("fits"),
          "compiled_by": s["memory"].get("compiled_by", "cpu"), "model": p.get("model", "peak-rate"),
          "analytic_gb": s["memory"]["analytic"]["total"] / 1e9, "compile_s": s["compile_time_s"]}


def replot(run: Path, summary: dict, png: Path) -> None:
  """timeline.png again from the run's timeline.json (the chart code may have changed since the run)."""
  from shardlab.analysis import costmodel, timeline as TL
  from shardlab.config import to_config
  trace = json.loads((run / "timeline.json").read_text())
  rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
  evs = [{"name": e["name"], "cat": e["cat"], "row": rows[e["tid"]], "start": e["ts"] / 1e6, "dur": e["dur"] / 1e6,
          "args": e["args"]} for e in trace["traceEvents"] if e["ph"] == "X"]
  TL.plot(evs, png, costmodel.title(to_config(summary["config"]), summary["prediction"]))


def table() -> list[str]:
  results, lines = {}, []
  for machine in MACHINES:
    rows = []
    for name in presets():
      f = RUNS / machine / name / "summary.json"
      s = json.loads(f.read_text()) if f.exists() else {"status": "missing"}
      if s.get("status") != "ok":
        rows.append({"schedule": name, "error": s.get("error", s["status"])})
        continue
      rows.append(row(name + "*" * ((machine, name) in OVERRIDES), s))
      if name in CHARTS:
        (HERE / "img").mkdir(exist_ok=True)
        replot(f.parent, s, HERE / "img" / f"{machine}_{name}.png")
    results[machine] = rows
    ok = [r for r in rows if "error" not in r]
    by = ok[0]["compiled_by"] if ok else "?"
    lines += [f"### {machine}: " + " ".join(MACHINES[machine]), "",
              f"Compiled by {'the target (' + by + ')' if by != 'cpu' else 'XLA:CPU'}; prediction: "
              f"{ok[0]['model'] if ok else '?'}.", "",
              "| schedule | compute ms (matmuls) | fsdp comm ms | tensor comm ms | serial ms | **predicted ms** "
              "| exposed ms | MFU | peak-rate ms (MFU) | critical path at peak rate: compute / fsdp / tensor ms "
              "| GB fsdp | GB tensor | peak GB compiled | analytic GB | compile s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
      if "error" in r:
        lines.append(f"| {r['schedule']} | error: {r['error'][:80]} |" + " |" * 13)
        continue
      fits = "" if r["fits"] is None else (" (fits)" if r["fits"] else " (**over**)")
      lines.append(f"| {r['schedule']} | {r['t_compute_ms']:.0f} ({r['t_gemm_ms'] or r['t_compute_ms']:.0f}) "
                   f"| {r['t_comm_fsdp_ms']:.1f} | {r['t_comm_tensor_ms']:.1f} "
                   f"| {r['t_serial_ms']:.0f} | **{r['t_overlapped_ms']:.0f}** | {r['exposed_comm_ms']:.1f} "
                   f"| {r['mfu']:.0%} | {r['ceiling_ms']:.0f} ({r['ceiling_mfu']:.0%}) "
                   f"| {r['critical_ms']['compute']:.0f} / {r['critical_ms'].get('fsdp', 0):.0f} / "
                   f"{r['critical_ms'].get('tensor', 0):.0f} "
                   f"| {r['gb_fsdp']:.1f} | {r['gb_tensor']:.1f} | {r['peak_gb']:.1f}{fits} "
                   f"| {r['analytic_gb']:.1f} | {r['compile_s']:.0f} |")
    notes = [f"{n}: {' '.join(v)}" for (m, n), v in OVERRIDES.items() if m == machine]
    if any("(+)" in r["schedule"] for r in ok):
      notes.append("(+) compiler-placed: bytes as the compiler placed them" +
                   (" (XLA:CPU widens bf16 collectives to f32)" if by == "cpu" else ""))
    lines += [f"\\* {'; '.join(notes)}", ""] if notes else [""]
  lines += memory_table(results)
  (HERE / "results.json").write_text(json.dumps(results, indent=1))
  (HERE / "results.md").write_text("\n".join(lines))
  print("\n".join(lines))
  return lines


GB = 1e9


def memory_table(results: dict) -> list[str]:
  """MaxText's Llama-2-7B configuration on 8 x H100: the target compiler's memory per device against the analytic
  breakdown (shardlab/analysis/memory_model.py), per component."""
  out = ["### llama2_7b on 8 x H100 (MaxText's one-node configuration): " + " ".join(LLAMA2_7B), "",
         "| attention, remat | compiled: arguments / temp / peak GB | fits 80 GB | analytic: state (params + "
         "Adam) / grads / gathered weights / activations / total GB | compiled / analytic | target compile s "
         "| predicted step s (MFU) |",
         "|---|---|---|---|---:|---:|---|"]
  rows = {}
  for name in LLAMA2_7B_RUNS:
    f = RUNS / "llama2_7b" / slug(name) / "summary.json"
    s = json.loads(f.read_text()) if f.exists() else {"status": "missing"}
    if s.get("status") != "ok":
      out.append(f"| {name} | error: {str(s.get('error', s['status']))[:80]} | | | | | |")
      continue
    m, a, p = s["memory"], s["memory"]["analytic"], s["prediction"]
    rows[name] = {"memory": m, "compile_times_s": s["compile_times_s"], "t_overlapped_s": p["t_overlapped_s"],
                  "mfu": p["mfu"]}
    out.append(f"| {name} | {m['argument'] / GB:.1f} / {m['temp'] / GB:.1f} / **{m['peak'] / GB:.1f}** "
               f"| {'yes' if m['fits'] else '**no**'} ({m['headroom_bytes'] / GB:+.1f}) "
               f"| {(a['master_params'] + a['optimizer']) / GB:.1f} / {a['grads'] / GB:.1f} / "
               f"{(a['gathered_weights'] + a['compute_params']) / GB:.1f} / {a['activations'] / GB:.1f} / "
               f"**{a['total'] / GB:.1f}** | {m['compiled_over_analytic']:.2f} "
               f"| {s['compile_times_s'].get('target', 0):.0f} | {p['t_overlapped_s']:.2f} ({p['mfu']:.0%}) |")
  results["llama2_7b"] = rows
  return out + [""]


if __name__ == "__main__":
  machines = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--machine=")]
  if "--table" not in sys.argv:
    run_all([a for a in sys.argv[1:] if not a.startswith("-")], machines)
  table()
