"""The planner's memory model (see plan.py for the CLI side)."""
