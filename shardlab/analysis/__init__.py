"""Analysis without devices: the roofline planner (planner.py)."""
