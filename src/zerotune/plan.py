"""`zerotune plan RECIPE [--json]`: the plan computed once (planner/compute.py), printed (planner/report.py), and
written to runs/<r>/plan/ (plan.json, memory.png)."""

from __future__ import annotations

import json

from . import manifest as mf
from .config import Recipe
from .layout import layout, write_resolved_recipe
from .planner.compute import compute_plan
from .planner.report import format_plan, plot_memory


def plan_main(r: Recipe, as_json: bool = False) -> int:
    p = compute_plan(r)  # PlanError / CapabilityError: user errors, reported by cli.main
    paths = layout(r)
    plot_memory(p, paths.plan_png)
    mf.write(paths.plan_json, p.to_json())
    write_resolved_recipe(paths.plan, r)
    print(json.dumps(p.to_json(), indent=2, default=str) if as_json else format_plan(p) + f"\n\nwrote {paths.plan_png}")
    return 0 if p.recipe_batch.fits else 1
