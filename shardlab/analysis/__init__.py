"""Reading compiled programs and predicting what they cost, in layers: each module imports only modules of the
layers before its own (LAYERS, checked by tests/test_structure.py), and nothing here imports the trainer, the entry
points, preflight or Hydra.

  hlo.py            HLO text -> computations, instructions, collectives (axis, bytes, trip counts), matmul FLOPs
  pipeline_replay.py  a pipeline table (shardlab/pipeline_tables.py) replayed on real links, and its picture
  program.py        a compiled step parsed once: its collectives, async pairs, scheduled order, the audit
  ledger.py         the traced program's collectives against the compiled ones, the compiler's rewrites named
  links.py          the links under each mesh axis (torus axes spanned, NVLink or NICs) and their bytes/s
  timeline.py       the step's dependency graph and its replay (and the Gantt chart, the Chrome trace)
  memory_model.py   the one analytic memory per device (the planner's too), beside the compiler's
  calibrated.py     the target's scheduled order replayed at achieved rates (and a kernel's price: gemm_seconds)
  closed_forms.py   the Scaling Book's closed forms: parameters, critical batches, a block's roofline
  context_cost.py   each context strategy's bytes and one layer's attention, by its own terms
  step_model.py     the time model: a layout's program priced kernel by kernel at calibrated rates, no compile
  batch_window.py   the largest batch that fits a mesh (analytic, or through compiled peaks)
  layout_search.py, pipeline_search.py   every layout (and pipeline layout) placed, priced and ranked
  planner.py        the answer (which layout, which batch) and the plan of one mesh, from the four above
  pipeline_cost.py  a pipeline's table, costed
  costmodel.py      the peak-rate replay, and a run's prediction, ledger and memory (predict_run)
  context_search.py  a step per context strategy and degree, and the choice (plan context_search)
  expert_cost.py    the expert search: each MoE dispatcher and degree priced by its own terms (plan expert_search)
  predict.py        `predict_fn`: any jitted function costed on a target; plan_figure.py: the planner's figure
  confirm.py        the planner's best layouts compiled for the target (the step builder passed in)"""

LAYERS = (("hlo", "pipeline_replay"), ("program", "ledger", "links", "timeline", "memory_model"), ("calibrated",),
          ("closed_forms",), ("context_cost",), ("step_model",), ("batch_window",), ("layout_search",),
          ("pipeline_search",), ("planner",), ("pipeline_cost",), ("costmodel", "context_search", "expert_cost"),
          ("predict", "plan_figure", "confirm"))


def __getattr__(name):
  if name == "predict_fn":
    from shardlab.analysis.predict import predict_fn
    return predict_fn
  raise AttributeError(name)
