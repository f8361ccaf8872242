"""Reading compiled programs: the program object (program.py), ledger, audit, overlap, memory, the cost models
(costmodel.py: peak-rate ceiling; calibrated.py: the target's scheduled order at achieved rates), the timeline,
the planner, and `predict_fn`, which costs any jitted function on a real target."""


def __getattr__(name):
  if name == "predict_fn":
    from shardlab.analysis.predict import predict_fn
    return predict_fn
  raise AttributeError(name)
