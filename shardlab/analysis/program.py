"""What a compiled train step does, read from the compiler: collectives (the ledger), anything the compiler
added (the audit), memory and FLOPs per device."""
from __future__ import annotations

from shardlab.analysis import hlo


def memory(compiled) -> dict:
  """compiled.memory_analysis() per device; peak = arguments + outputs + temporaries - donated aliases."""
  m = compiled.memory_analysis()
  out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias",
                                                             "generated_code")}
  out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  return out


def flops(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0))


def audit(colls) -> dict:
  """Collectives in the compiled program that no shardlab collective placed: every collective the code
  places runs under a named scope (collectives.py), so one without is compiler-inserted resharding."""
  unplanned = [{"kind": c.kind, "axis": c.axis, "bytes": c.bytes_full, "name": c.name, "computation": c.computation}
               for c in colls if c.scope == "other"]
  return {"unplanned": unplanned, "collectives": len(colls)}


def analyze(compiled, mesh) -> dict:
  colls = hlo.collectives(compiled.as_text(), mesh.device_ids, tuple(mesh.axis_names))
  return {"comm": hlo.ledger(colls), "audit": audit(colls), "memory": memory(compiled),
          "flops_per_device": flops(compiled)}
