"""Predicted step time of every schedule preset (conf/schedule/) for the exact LLaMA-3 8B preset (grouped-query
attention, 8.03e9 parameters) at 4 x 4096 tokens per device, on an H100 node and a TPU v5p slice; and the memory of
MaxText's one-node Llama-2-7B configuration on 8 x H100, compiled against analytic. MODEL PREDICTIONS from dry runs
(compile and analyze, nothing allocated, no step run), not measurements. Writes results.md and results.json here and
copies some timeline charts to img/. See README.md for what each table means.

  python experiments/predict/predict.py          # every dry run not yet done with these arguments, then the tables
  python experiments/predict/predict.py --force  # every dry run again
  python experiments/predict/predict.py --table  # only rebuild the tables from outputs/predict/
  python experiments/predict/predict.py gspmd    # only these presets (then the tables)
  python experiments/predict/predict.py --machine=h100   # only this machine's runs (h100, tpu_v5p, llama2_7b)

Each dry run writes outputs/predict/<machine>/<name>/: shardlab's summary.json (status ok, or error with the
exception) plus predict.json (the arguments, exit code, wall time, the last lines of stderr). A run that left no
summary.json (killed, interrupted) is a row saying so, and the script exits 1 while any row is in that state: the
tables are never silently built from a partial run.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from shardlab.config import CONF_DIR  # noqa: E402
RUNS = ROOT / "outputs" / "predict"
# 4 sequences of 4096 tokens per device; MaxText's remat "minimal_flash" (every projection and the attention
# output kept, the rest recomputed) is shardlab's save_matmuls_attn_out.
COMMON = ["dry_run=true", "progress=false", "model=llama3_8b", "model.seq_len=4096", "precision=bf16",
          "schedule.remat=save_matmuls_attn_out"]
MACHINES = {
    # GPU: compiled by the H100 compiler; dot_product lowers to cuDNN's fused flash attention there. The preset's
    # blockwise attention is a while loop of small kernels on a GPU (each block's scores through HBM): see the
    # llama2_7b table, where the two are compared on the same configuration.
    "h100": ["compile_for=target", "hardware=h100", "model.attention=dot_product", "cpu_devices=8", "mesh.fsdp=4",
             "mesh.tensor=2", "train.batch_size=32"],
    # TPU: jax.nn.dot_product_attention has no fused TPU implementation (XLA's materialises the [B, H, L, L]
    # scores), so the memory-efficient blockwise attention. Compiled by libtpu for a v5p slice of 64 chips
    # (4x4x4) and costed by the calibrated replay of libtpu's own order, as the H100 rows are.
    "tpu_v5p": ["compile_for=target", "hardware=tpu_v5p", "model.attention=blockwise", "mesh.fsdp=16",
                "mesh.tensor=4", "mesh.fsdp_ici_axes=2", "train.batch_size=256"],
}
VARIANTS = {"fsdp_prefetch+bf16_gather": ["schedule=fsdp_prefetch", "schedule.gather_dtype=compute"],
            # the compiler's baseline without sequence parallelism: Megatron's all-reduce TP, as megatron_allreduce
            "gspmd+tp_allreduce": ["schedule=gspmd", "schedule.tp=allreduce"]}
OVERRIDES: dict = {}
CHARTS = ("baseline", "fsdp_prefetch", "collective_matmul_bidi")
# MaxText's one-node H100 configuration (configs/a3/llama_2_7b/1vm.sh: ici_fsdp_parallelism=8,
# per_device_batch_size=4, max_target_length=4096, attention=cudnn_flash_te, remat_policy=minimal_flash). The first
# row is the configuration exactly as issue 11 states it (the presets' defaults: blockwise attention, schedule
# baseline, no remat), compiled for the H100 target.
LLAMA2_7B = ["dry_run=true", "progress=false", "model=llama2_7b", "mesh=8x1", "precision=bf16",
             "train.batch_size=32", "model.seq_len=4096", "compile_for=target", "hardware=h100"]
LLAMA2_7B_RUNS = {
    "defaults (blockwise, baseline, remat none)": [],
    "blockwise, save_matmuls_attn_out": ["model.attention=blockwise", "schedule.remat=save_matmuls_attn_out"],
    "blockwise, full remat": ["model.attention=blockwise", "schedule.remat=full"],
    "dot_product, save_matmuls_attn_out": ["model.attention=dot_product", "schedule.remat=save_matmuls_attn_out"],
    "dot_product, save_matmuls_attn_out, fsdp_prefetch, xla=maxtext_a3": [
        "model.attention=dot_product", "schedule.remat=save_matmuls_attn_out", "schedule=fsdp_prefetch",
        "xla=maxtext_a3"],
}
def presets() -> dict:
  names = sorted(p.stem for p in (CONF_DIR / "schedule").glob("*.yaml"))
  return {**{n: [f"schedule={n}"] for n in names}, **VARIANTS}


def slug(name: str) -> str:
  return re.sub(r"[^\w+.-]+", "_", name).strip("_")


def jobs(only: list[str], machines: list[str]) -> list[tuple[Path, list[str]]]:
  out = [(RUNS / m / name, [*COMMON, *args, *extra, *OVERRIDES.get((m, name), [])])
         for m, args in MACHINES.items() for name, extra in presets().items()
         if (not only or name in only) and (not machines or m in machines)]
  if not only and (not machines or "llama2_7b" in machines):
    out += [(RUNS / "llama2_7b" / slug(name), [*LLAMA2_7B, *extra]) for name, extra in LLAMA2_7B_RUNS.items()]
  return out


def done(out: Path, args: list[str]) -> bool:
  """This run already finished (ok or with shardlab's own error) with exactly these arguments."""
  try:
    meta = json.loads((out / "predict.json").read_text())
    return meta["args"] == args and (out / "summary.json").exists()
  except (OSError, ValueError, KeyError):
    return False


def run_all(only: list[str], machines: list[str], force: bool) -> None:
  for out, args in jobs(only, machines):
    if not force and done(out, args):
      print(f"done already: {out.relative_to(ROOT)}", flush=True)
      continue
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)        # never read a summary of other arguments
    cmd = [sys.executable, "-m", "shardlab", *args, f"hydra.run.dir={out}"]
    print(" ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    tail = [l for l in p.stderr.splitlines() if l.strip()][-5:]
    (out / "predict.json").write_text(json.dumps({"args": args, "rc": p.returncode, "wall_s": wall,
                                                  "stderr_tail": tail}, indent=1))
    print(f"  rc {p.returncode}, {wall:.0f} s" + (f": {tail[-1]}" if p.returncode and tail else ""), flush=True)


def load(f: Path) -> dict:
  """summary.json, or why there is none (the run's own record of how it ended)."""
  if f.exists():
    return json.loads(f.read_text())
  meta = f.parent / "predict.json"
  if meta.exists():
    m = json.loads(meta.read_text())
    why = m["stderr_tail"][-1] if m.get("stderr_tail") else ""
    return {"status": "not_run", "error": f"no summary.json: exit code {m['rc']}; {why}"}
  return {"status": "not_run", "error": "not run (no outputs/predict entry): run predict.py without --table"}


def row(name: str, s: dict) -> dict:
  # bytes per device per step over each axis: as the program placed them and as the target's program moves them
  # (ledger.per_axis, after the compiler's rewrites); gspmd places none (+), the compiler places them all
  per = s["ledger"]["per_axis"]
  p = s["prediction"]
  moved = lambda axis, side="compiled_bytes": per.get(axis, {}).get(side, 0) / 1e9
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
          "gb_tensor": moved("tensor"), "gb_fsdp_placed": moved("fsdp", "placed_bytes"),
          "gb_tensor_placed": moved("tensor", "placed_bytes"), "rewrites": s["ledger"]["rewrites"],
          "gb_other": sum(moved(a) for a in per if a not in ("fsdp", "tensor")),
          "differences": s["ledger"]["differences"], "peak_gb": s["memory"]["peak"] / 1e9,
          "allocated_gb": (s["memory"].get("allocated") or {}).get("total", float("nan")) / 1e9,
          "fits": s["memory"].get("fits"),
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


NOT_RUN: list[str] = []   # rows with no summary.json: the script exits 1


def one_line(err: str) -> str:
  """An error as one line: its first line, and the innermost exception of a traceback nested in it (JAX's
  custom_partitioner errors carry the Python one inside)."""
  lines = str(err).splitlines() or [""]
  inner = [l for l in lines[1:] if re.match(r"\w+(Error|Exception): ", l)]
  head = lines[0].removesuffix("Traceback (most recent call last):").strip()
  return f"{head} ... {inner[-1].strip()}" if inner else head


def error_row(name: str, s: dict, columns: int, key: str = "") -> str:
  if s["status"] == "not_run":
    NOT_RUN.append(key or name)
  return f"| {name} | {s['status']}: {one_line(s.get('error', ''))[:200]} |" + " |" * (columns - 2)


def table() -> list[str]:
  results, lines = {}, []
  for machine in MACHINES:
    rows = []
    for name in presets():
      f = RUNS / machine / name / "summary.json"
      s = load(f)
      if s.get("status") != "ok":
        rows.append({"schedule": name, "status": s["status"], "error": s.get("error", "")})
        continue
      rows.append(row(name + "*" * ((machine, name) in OVERRIDES), s))
      if name in CHARTS:
        (HERE / "img").mkdir(exist_ok=True)
        replot(f.parent, s, HERE / "img" / f"{machine}_{name}.png")
    results[machine] = rows
    ok = [r for r in rows if "error" not in r]
    by = ok[0]["compiled_by"] if ok else None
    lines += [f"### {machine}: " + " ".join(MACHINES[machine]), "",
              (f"Compiled by {'XLA:CPU (fake CPU devices)' if by == 'cpu' else 'the target compiler (' + by + ')'}; "
               f"prediction: {ok[0]['model']}." if ok else "No run finished."), "",
              "| schedule | compute ms (matmuls) | fsdp comm ms | tensor comm ms | serial ms | **predicted ms** "
              "| **/ gspmd** | exposed ms | MFU | peak-rate ms (MFU) "
              "| critical path at peak rate: compute / fsdp / tensor ms | GB fsdp placed -> moved "
              "| GB tensor placed -> moved | GB moved over both (fsdp+tensor) | ledger explained "
              "| peak GB compiled (memory_analysis) | GB in the buffer assignment | analytic GB | compile s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    gspmd = next((r for r in ok if r["schedule"] == "gspmd (+)"), None)
    for r in rows:
      if "error" in r:
        lines.append(error_row(r["schedule"], r, 20, f"{machine} {r['schedule']}"))
        continue
      fits = "" if r["fits"] is None else (" (fits)" if r["fits"] else " (**over**)")
      ratio = f"{r['t_overlapped_ms'] / gspmd['t_overlapped_ms']:.2f}" if gspmd else "n/a"
      placed = lambda axis: "-" if r["schedule"].endswith("(+)") else f"{r[f'gb_{axis}_placed']:.1f}"
      explained = "n/a (+)" if r["schedule"].endswith("(+)") else (
          "yes" if not r["differences"] else f"**{len(r['differences'])} unexplained**")
      lines.append(f"| {r['schedule']} | {r['t_compute_ms']:.0f} ({r['t_gemm_ms'] or r['t_compute_ms']:.0f}) "
                   f"| {r['t_comm_fsdp_ms']:.1f} | {r['t_comm_tensor_ms']:.1f} "
                   f"| {r['t_serial_ms']:.0f} | **{r['t_overlapped_ms']:.0f}** | **{ratio}** "
                   f"| {r['exposed_comm_ms']:.1f} "
                   f"| {r['mfu']:.0%} | {r['ceiling_ms']:.0f} ({r['ceiling_mfu']:.0%}) "
                   f"| {r['critical_ms']['compute']:.0f} / {r['critical_ms'].get('fsdp', 0):.0f} / "
                   f"{r['critical_ms'].get('tensor', 0):.0f} "
                   f"| {placed('fsdp')} -> {r['gb_fsdp']:.1f} | {placed('tensor')} -> {r['gb_tensor']:.1f} "
                   f"| {r['gb_other']:.1f} | {explained} | {r['peak_gb']:.1f}{fits} | {r['allocated_gb']:.1f} "
                   f"| {r['analytic_gb']:.1f} | {r['compile_s']:.0f} |")
    notes = [f"{n}: {' '.join(v)}" for (m, n), v in OVERRIDES.items() if m == machine]
    if any("(+)" in r["schedule"] for r in ok):
      notes.append("(+) compiler-placed: bytes as the compiler placed them; the ledger has nothing placed to "
                   "explain")
    lines += [f"\\* {'; '.join(notes)}", ""] if notes else [""]
  lines += memory_table(results)
  (HERE / "results.json").write_text(json.dumps(results, indent=1))
  (HERE / "results.md").write_text("\n".join(lines))
  print("\n".join(lines))
  return lines


GB = 1e9


def memory_table(results: dict) -> list[str]:
  """MaxText's Llama-2-7B configuration on 8 x H100: the target compiler's memory per device against the analytic
  breakdown (shardlab/analysis/memory_model.py), per component, and the predicted step."""
  out = ["### llama2_7b on 8 x H100 (MaxText's one-node configuration): " + " ".join(LLAMA2_7B), "",
         "| added overrides (attention, remat, ...) | compiled: arguments / temp / **peak** GB | fits 80 GB "
         "| analytic: state (params + Adam) / grads / gathered weights / layer gradient / activations / **total** GB "
         "| compiled / analytic | predicted step s (MFU) | GEMM and fused attention / other kernels s (kernels) | compile s |",
         "|---|---|---|---|---:|---|---|---:|"]
  rows = {}
  for name, extra in LLAMA2_7B_RUNS.items():
    f = RUNS / "llama2_7b" / slug(name) / "summary.json"
    s = load(f)
    label = f"{name}: `{' '.join(extra) or '(none)'}`"
    if s.get("status") != "ok":
      out.append(error_row(label, s, 9, f"llama2_7b {name}"))
      rows[name] = {"status": s["status"], "error": s.get("error")}
      continue
    m, a, p = s["memory"], s["memory"]["analytic"], s["prediction"]
    rows[name] = {"overrides": extra, "memory": m, "compile_times_s": s["compile_times_s"],
                  "t_overlapped_s": p["t_overlapped_s"], "mfu": p["mfu"], "t_gemm_s": p.get("t_gemm_s"),
                  "t_other_kernels_s": p.get("t_other_kernels_s"), "kernels": p.get("kernels"),
                  "n_params": s["n_params"]}
    out.append(f"| {label} | {m['argument'] / GB:.1f} / {m['temp'] / GB:.1f} / **{m['peak'] / GB:.1f}** "
               f"| {'yes' if m['fits'] else '**no**'} ({m['headroom_bytes'] / GB:+.1f}) "
               f"| {(a['master_params'] + a['optimizer']) / GB:.1f} / {a['grads'] / GB:.1f} / "
               f"{(a['gathered_weights'] + a['compute_params']) / GB:.1f} / {a.get('layer_gradient', 0) / GB:.1f} / "
               f"{a['activations'] / GB:.1f} / "
               f"**{a['total'] / GB:.1f}** | {m['compiled_over_analytic']:.2f} "
               f"| {p['t_overlapped_s']:.2f} ({p['mfu']:.0%}) "
               f"| {p.get('t_gemm_s', 0):.2f} / {p.get('t_other_kernels_s', 0):.2f} ({p.get('kernels', 0)}) "
               f"| {s['compile_times_s'].get('target', 0):.0f} |")
  results["llama2_7b"] = rows
  return out + [""]


if __name__ == "__main__":
  machines = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--machine=")]
  if "--table" not in sys.argv:
    run_all([a for a in sys.argv[1:] if not a.startswith("-")], machines, "--force" in sys.argv)
  table()
  if NOT_RUN:
    print(f"\n{len(NOT_RUN)} rows have no run: {', '.join(NOT_RUN)}", file=sys.stderr)
    sys.exit(1)
