"""The conversion planner: per-layer sensitivity, a latency model, a search over softmax / VCA / MANO / merging."""

from vca_patch.planner.front import draw_front
from vca_patch.planner.model_info import ModelInfo, PlanError, model_info
from vca_patch.planner.plan_file import check_plan_fits, load_plan, read_plan, save_plan
from vca_patch.planner.planner import (
    PLAN_UNMERGE_MODES,
    PlanResult,
    apply_plan,
    choose_measured,
    measure_plan,
    plan_config,
    plan_model,
    planned_unmerge,
)
from vca_patch.planner.search import Candidate, candidates, choose, pareto

__all__ = [
    "PLAN_UNMERGE_MODES",
    "Candidate",
    "ModelInfo",
    "PlanError",
    "PlanResult",
    "apply_plan",
    "candidates",
    "check_plan_fits",
    "choose",
    "choose_measured",
    "draw_front",
    "load_plan",
    "measure_plan",
    "model_info",
    "pareto",
    "plan_config",
    "plan_model",
    "planned_unmerge",
    "read_plan",
    "save_plan",
]
