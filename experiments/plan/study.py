"""The planner's layout search on two questions: the Scaling Book's LLaMA-2 13B exercise on a TPU v5p 16x16x16
slice, and LLaMA-3 70B on 8 nodes of 8 H100. Predictions only (closed forms, no devices, no compiles).

  python experiments/plan/study.py            # writes results.md and one figure per question next to this file

Each question is one `python -m shardlab.plan` command line (printed in results.md); this script runs them
in-process and tabulates the layouts.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))          # this checkout's shardlab, whichever one is installed

from shardlab.plan import run  # noqa: E402
COMMON = ["precision=bf16", "schedule.gather_dtype=compute", "schedule.remat=full", "train.mfu=0.4"]
QUESTIONS = {
    "book": ["model=llama2_13b", "model.seq_len=32768", "hardware=tpu_v5p", "mesh.fsdp=1024", "mesh.tensor=4",
             "mesh.fsdp_ici_axes=2", "train.global_batch_tokens=3000000", *COMMON, "search=true",
             "plot_layouts=1x1024x4,1x2048x2,1x512x8,1x4096x1,4096x1x1"],
    "h100": ["model=llama3_70b", "hardware=h100", "mesh.fsdp=64", "mesh.tensor=1",
             "train.global_batch_tokens=1048576", *COMMON, "search=true",
             "plot_layouts=1x64x1,1x8x8,1x4x16,8x8x1"],
    "h100_small": ["model=llama3_70b", "hardware=h100", "mesh.fsdp=64", "mesh.tensor=1",
                   "train.global_batch_tokens=131072", *COMMON, "search=true",
                   "plot_layouts=2x4x8,1x8x8,1x64x1,1x4x16"],
}
SHOW = {"book": [(4096, 1, 1), (1, 4096, 1), (1, 2048, 2), (1, 1024, 4), (1, 512, 8), (4, 256, 4), (512, 2, 4)],
        "h100": [(64, 1, 1), (8, 8, 1), (1, 64, 1), (1, 32, 2), (1, 8, 8), (2, 4, 8), (1, 4, 16), (1, 1, 64)],
        "h100_small": [(8, 8, 1), (1, 64, 1), (1, 8, 8), (2, 4, 8), (4, 2, 8), (1, 4, 16)]}


def row(l: dict) -> str:
  gb = lambda v: f"{v / 1e9:.1f}"
  crit = l["critical_batch_per_device"]
  ratios = " / ".join(f"{l['comm_to_math'][a]:.2f}" for a in ("data", "fsdp", "tensor"))
  ici = " / ".join(str(l["ici_axes"][a]) for a in ("data", "fsdp", "tensor"))
  bw = " / ".join(f"{l['axis_bandwidth'][a] / 1e9:.0f}" for a in ("data", "fsdp", "tensor"))
  return " | ".join([f"{l['data']} x {l['fsdp']} x {l['tensor']}", ici, bw, gb(l["memory_per_device_bytes"]),
                     gb(l["memory_margin_bytes"]), "yes" if l["fits"] else "**no**", ratios,
                     "yes" if l["compute_bound"] else "**no**",
                     "any batch" if crit["this_mesh"] is None else f"{crit['this_mesh']:.0f} ({crit['binding_axis']})",
                     f"{1e3 * l['step_time_s']:.0f}" if l["step_time_s"] < 100 else f"{l['step_time_s']:.1f} s",
                     f"{100 * l['mfu']:.0f}%", "; ".join(l["rejected_because"]) or "qualifies"])


HEAD = ("| data x fsdp x tensor | torus axes M (d / f / t) | GB/s per axis (d / f / t) | GB/device | margin GB "
        "| fits | comm / math (d / f / t) | compute-bound | critical B/N tokens (binding axis) | step ms | MFU "
        "| rejected because |\n"
        "|---|---|---|---:|---:|---|---|---|---|---:|---:|---|")


def main() -> None:
  out = []
  for name, argv in QUESTIONS.items():
    argv = [*argv, f"plot={HERE / (name + '.png')}"]
    res = run(argv)
    by = {(l["data"], l["fsdp"], l["tensor"]): l for l in res["layouts"]}
    out += [f"## {name}", "", "```bash", "python -m shardlab.plan " + " ".join(
        a if not a.startswith("plot=") else f"plot=experiments/plan/{name}.png" for a in argv), "```", "",
        f"{res['search']['considered']} layouts of {res['search']['devices']} devices, "
        f"{res['search']['qualifying']} qualify. Best five:", "", HEAD]
    out += ["| " + row(l) + " |" for l in res["layouts"][:5]]
    out += ["", "Selected layouts:", "", HEAD] + ["| " + row(by[s]) + " |" for s in SHOW[name]]
    best = res["layouts"][0]
    out += ["", f"Best layout's plan ({best['data']} x {best['fsdp']} x {best['tensor']}, the JSON's top level): "
            f"max_batch_per_device_tokens {res['max_batch_per_device_tokens']:.0f} "
            f"(unrounded {res['batch_window']['max_batch_per_device_tokens_unrounded']:.0f}), critical "
            f"{res['critical_batch_per_device']['this_mesh']} ({res['critical_batch_per_device']['binding_axis']}), "
            f"microbatches {res['microbatches']}, x_opt {res['x_opt']:.0f}.", ""]
  (HERE / "results.md").write_text("\n".join(out))
  print("\n".join(out))


if __name__ == "__main__":
  sys.exit(main())
