"""`plan_model`: measure, search, apply and check a conversion plan that meets a latency budget."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from vca_patch.bench.timing import RatioInterval, RatioTiming, time_ratios
from vca_patch.core.errors import ConfigError
from vca_patch.eval.final_tokens import fidelity, final_tokens, tokens
from vca_patch.planner.costs import LatencyTable, measure_latency_table
from vca_patch.planner.images import split_for_measurement
from vca_patch.planner.latency import Reach, TimedPlans, anchor_plans, as_interval, fastest_options, reachable
from vca_patch.planner.model_info import ModelInfo, PlanError, model_info
from vca_patch.planner.search import (
    MAX_MERGE_FRACTION,
    OBJECTIVES,
    Candidate,
    candidates,
    no_plan_error,
    pareto,
)
from vca_patch.planner.sensitivity import MergeSchedule, Sensitivity, measure_sensitivity, merge_schedules
from vca_patch.recovery.calibrate import calibrate as calibrate_model
from vca_patch.surgery import patch_model
from vca_patch.targets.base import TargetConfig, plan_space
from vca_patch.targets.handler import handler_for

DEFAULT_CONTRAST_TOKENS = (16, 49)
# up to 1.4: r = 160 per block from block 0 at 518 px on DINOv2-S (1369 patches); its block timings on an idle
# 2-core machine predict 0.55x for 1.0 (r = 114, measured 0.52x), 0.48x for 1.2 (r = 137) and 0.43x for 1.4
DEFAULT_MERGE_FRACTIONS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.85, 0.95, 1.0, 1.2, 1.4)
# front-loaded merging: shares of the patch tokens merged in the first merging block (`MergeSchedule`)
DEFAULT_MERGE_LEADS = (0.25, 0.33)
DEFAULT_MANO_WINDOWS = (7,)
PLAN_UNMERGE_MODES = ("auto", *plan_space().unmerge_modes)
LATENCY_SLACK = 0.05  # finalists may be predicted this much (relative) over the budget: their measured time decides
SEARCH_MARGIN = 0.1  # sensitivity is measured only for what a plan predicted within budget × (1 ± this) could use
TIMING_CAP = 30  # a whole-model comparison runs at most this many times `min_time` seconds
MIN_SAVING = 0.03  # a VCA / MANO block must be this much faster than a softmax block to be an option
# a smaller VCA n must be this much (of a softmax block) faster than the next larger n to be an option too: at 518 px
# on DINOv2-S n = 16 saved 1.1 ms of a 34.5 ms block over n = 49 and lost more fidelity in every block
FEWER_TOKENS_SAVING = 0.1
# recover(twin, original) -> a line for the log: trains a planned copy's new parameters in place (a recipe run)
Recover = Callable[[nn.Module, nn.Module], str]
# a faster finalist whose measured objective is at most this much lower counts as equally faithful and is chosen
EQUAL_FIDELITY = 0.002


def planned_unmerge(objective: str, unmerge: str = "auto") -> str:
    """The unmerge a plan uses: `unmerge` itself, or for "auto" the one that serves `objective`. The residual
    unmerge keeps the CLS token bit-identical and lifts every patch token, for about 0.01 of the original's latency
    at 224 px and none measurable at 518 px (DINOv2 ViT-S/14 on 2 CPU cores, batch 1), so "auto" takes it unless
    only the CLS token counts."""
    if unmerge not in PLAN_UNMERGE_MODES:
        raise PlanError(f"unmerge must be one of {list(PLAN_UNMERGE_MODES)}, got {unmerge!r}")
    if unmerge != "auto":
        return unmerge
    return "copy" if objective == "cls" else "residual"


@dataclass
class PlanResult:
    """The chosen plan, every candidate, both fronts and what was measured."""

    config: TargetConfig  # the plan space's config (token merging's)
    chosen: Candidate  # its `latency`: predicted by the block timings calibrated on every whole-model timing
    candidates: list[Candidate]
    front: list[Candidate]
    merging_front: list[Candidate]
    measured: dict[str, float]
    info: ModelInfo
    resolution: int
    budget: float
    objective: str
    sensitivity: Sensitivity
    table: LatencyTable
    # the chosen plan as a finalist: scored on the calibration images kept for scoring, timed against the original
    # ({} when it was the only candidate within the budget and so neither)
    finalist: dict[str, Any] = field(default_factory=dict)
    timed: TimedPlans = field(default_factory=TimedPlans)  # every plan timed against the original

    @property
    def latency(self) -> RatioInterval | None:
        """The chosen plan's measured latency ratio and its confidence interval (None: never timed)."""
        return self.chosen.measured_latency

    @property
    def straddles_budget(self) -> bool:
        """The chosen plan's measured interval holds the budget: at this machine's noise it may be on either side."""
        return self.latency is not None and self.latency.straddles(self.budget)

    @property
    def over_budget(self) -> bool:
        """The chosen plan's measured latency ratio is above the budget (its prediction was within it)."""
        return bool(self.measured) and self.measured["latency_ratio"] > self.budget

    def details(self, model_name: str | None = None) -> dict[str, Any]:
        """JSON-safe record for the plan file."""
        return {
            "model": {
                "name": model_name,
                **self.info.expect(),
                "resolution": self.resolution,
                "tokens": self.info.tokens(self.resolution),
                "patch_tokens": self.info.tokens(self.resolution) - self.info.num_prefix_tokens,
            },
            "budget": self.budget,
            "objective": self.objective,
            "chosen": self.chosen.to_dict(),
            "measured": self.measured,
            "measured_over_budget": self.over_budget,
            "latency_interval": None if self.latency is None else self.latency.to_dict(),
            "latency_straddles_budget": self.straddles_budget,
            "finalist": {k: v for k, v in self.finalist.items() if not k.endswith("_per_image")},
            "front": [c.to_dict() for c in self.front],
            "merging_front": [c.to_dict() for c in self.merging_front],
            "latency_table": self.table.to_dict(),
            "timed": self.timed.to_dict(),
            "sensitivity": self.sensitivity.to_dict(),
            "search": "block latencies timed, then rescaled to whole-model timings against the original (the "
            "fastest merge schedule, VCA / MANO everywhere; then the finalists); sensitivity measured for what a "
            "plan predicted within the budget could use; every measured merge schedule (r per block from block j), "
            "each with VCA(n) / MANO(k) added greedily to the blocks before j by latency saved per predicted loss; "
            "the best predicted plans within the budget plus 5%, the best merging-only and the best hybrid ones are "
            "then measured (VCA calibrated on every other calibration image, every plan scored on the rest) and "
            "timed against the original until each ratio's confidence interval is narrow or clear of the budget; "
            "the best measured among those within the budget is chosen",
        }


def plan_config(
    candidate: Candidate, info: ModelInfo, *, calibrate: bool = True, unmerge: str = "copy"
) -> TargetConfig:
    """The plan space's config that applies `candidate` (and refuses other models): its VCA blocks with the
    per-token gain when calibrated, and the candidate's local term."""
    return plan_space().plan_config(
        list(candidate.schedule), candidate.blocks, calibrate=calibrate, local_window=candidate.local_window,
        expect=info.expect(), unmerge=unmerge,
    )  # fmt: skip


def apply_plan(model: nn.Module, config: TargetConfig, calibration: torch.Tensor | None = None) -> nn.Module:
    """Patch `model` with the plan, in place; calibrate the blocks that calibrate (VCA) on `calibration` images when
    given (MANO blocks keep their preserving init)."""
    patch_model(model, config)
    handler = handler_for(config)
    if calibration is not None and any(handler.calibrates(config, module) for module in model.modules()):
        calibrate_model(model, [calibration])
    return model


def _calibrates(candidate: Candidate) -> bool:
    """Whether `candidate` has blocks of a kind that calibrates."""
    space = plan_space()
    return any(space.kind(kind).calibrates for kind, layers in candidate.blocks.items() if layers)


def time_plans(
    model: nn.Module,
    twins: dict[str, nn.Module],
    resolution: int,
    *,
    repeats: int = 3,
    min_time: float = 0.0,
    timing: RatioTiming | None = None,
) -> dict[str, RatioInterval]:
    """Batch-1 latency ratio of each planned copy to `model`, all timed side by side (interleaved, paired per round:
    `bench.timing.time_ratios`) until `timing` settles (default `default_timing` without a budget), `repeats`
    rounds and `min_time` seconds each at least."""
    timing = timing or default_timing(None, min_time)
    timing = replace(timing, min_rounds=max(repeats, timing.min_rounds))
    image = torch.randn(1, 3, resolution, resolution, generator=torch.Generator().manual_seed(resolution))
    fns = {name: (lambda m=m: final_tokens(m, image)) for name, m in {"original": model, **twins}.items()}
    with torch.no_grad():
        return time_ratios(fns, image.device, baseline="original", rule=timing, min_time=min_time)


def measure_plan(
    model: nn.Module,
    config: TargetConfig,
    images: torch.Tensor,
    resolution: int,
    *,
    calibration: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
    repeats: int = 3,
    batch: int = 8,
    min_time: float = 0.0,
    timed: RatioInterval | None = None,
    timing: RatioTiming | None = None,
) -> dict[str, float]:
    """CLS / patch-token / mean-patch cosine on `images` and measured latency ratio of the plan (on a copy), with its
    interval ("latency_low", "latency_high", "latency_rounds"): `timed`, when given (the same plan timed as a
    finalist: calibration changes no time), else timed now against `model`."""
    twin = apply_plan(copy.deepcopy(model), config, calibration)
    reference = tokens(model, images, batch) if reference is None else reference
    scores = fidelity(reference, tokens(twin, images, batch))
    if timed is None:
        plan = time_plans(model, {"plan": twin}, resolution, repeats=repeats, min_time=min_time, timing=timing)
        timed = as_interval(plan["plan"])
    latency = {"latency_ratio": timed.ratio, "latency_low": timed.low, "latency_high": timed.high}
    return {**scores, **latency, "latency_rounds": timed.rounds}


def plan_fidelity(twin: nn.Module, images: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """CLS / patch-token / mean-patch cosine of a planned copy `twin` on `images` against `reference` (their original
    tokens; no timing); with the CLS and patch-token cosine of each image ("cls_per_image", "patch_per_image")."""
    return fidelity(reference, tokens(twin, images, 8), per_image=True)


def measured_score(scores: dict[str, Any], objective: str, per_image: bool = False) -> Any:
    """The objective from measured scores: their mean, or (`per_image`) a tensor with one value per image."""
    if per_image:
        cls, patch = torch.tensor(scores["cls_per_image"]), torch.tensor(scores["patch_per_image"])
    else:
        cls, patch = scores["cls_cosine"], scores["patch_token_cosine"]
    return {"cls": cls, "patch": patch, "both": 0.5 * (cls + patch)}[objective]


def beats_beyond_noise(scores: dict[str, Any], baseline: dict[str, Any], objective: str) -> tuple[bool, float, float]:
    """(better, mean gain, standard error): whether `scores` beat `baseline` on the same images by more than twice
    the standard error of their per-image difference (a paired comparison); with one image, by any margin."""
    gain = measured_score(scores, objective, per_image=True) - measured_score(baseline, objective, per_image=True)
    error = float(gain.std() / len(gain) ** 0.5) if len(gain) > 1 else 0.0
    return float(gain.mean()) > 2 * error, float(gain.mean()), error


def finalists(cands: Sequence[Candidate], budget: float, objective: str, top: int, slack: float) -> list[Candidate]:
    """The plans worth measuring: the `top` best predicted within `budget` × (1 + `slack`), and of those within
    the budget and within it plus the slack each, the best predicted, the best merging-only and the best hybrid
    (merging after VCA / MANO blocks) plan, so each kind of plan that may win is measured; with none predicted
    within the budget plus the slack, the fastest predicted plan and the fastest merging-only one. A plan timed
    already (`Candidate.measured_latency`) goes by its measured ratio instead of its prediction. Below a 1x budget
    the original itself is never measured: it runs at 1x by definition, and a timing of it could only read noise
    within the budget."""

    def latency(c: Candidate) -> float:  # a plan timed already goes by its timing
        return c.measured_latency.ratio if c.measured_latency is not None else c.latency

    def ranked(limit: float) -> list[Candidate]:
        return sorted((c for c in cands if latency(c) <= limit), key=lambda c: (-c.score(objective), latency(c)))

    if budget < 1:
        cands = [c for c in cands if not c.is_original]
    within, near = ranked(budget), ranked(budget * (1 + slack))
    if not near:  # predicted beyond reach: the fastest plans are measured, in case they are faster than predicted
        fastest = sorted(cands, key=latency)
        near = fastest[:1] + [c for c in fastest[1:] if c.merging_only][:1]
    out = near[:top]
    for group in (within, near):
        for cand in group[:1] + [c for c in group if c.merging_only][:1] + [c for c in group if c.hybrid][:1]:
            if cand not in out:
                out.append(cand)
    return out


def _log_timing(log: Callable[[str], None], cand: Candidate, scores: dict, objective: str, budget: float) -> None:
    """One line per finalist: its predicted and measured objective and latency, and whether its measured interval
    straddles the budget."""
    interval = _interval(scores)
    note = f" (straddles the {budget:g}x budget)" if interval.straddles(budget) else ""
    log(f"  {cand.describe()}: predicted {cand.score(objective):.4f} at {cand.latency:.2f}x, "
        f"measured {measured_score(scores, objective):.4f} at {interval.describe()}{note}")  # fmt: skip


def _measure_finalists(
    model: nn.Module,
    info: ModelInfo,
    chosen: Sequence[Candidate],
    images: torch.Tensor,
    measured: dict[str, dict[str, Any]],
    timed: TimedPlans,
    *,
    calibrate: bool,
    unmerge: str,
    recover: Recover | None = None,
    log: Callable[[str], None] | None = None,
    **timing: Any,
) -> None:
    """Apply, score and time together the plans in `chosen` not yet in `measured`, adding them there and to
    `timed` (an anchor is timed again: finalists are compared in one timing, under the same load): with
    calibration, VCA blocks calibrated on every other image and every plan scored on the rest; with `recover`, a
    plan with VCA blocks is recovered before it is scored, so it competes as it would be delivered."""
    fit, held_out = split_for_measurement(images, calibrate)
    reference = None
    twins: dict[str, nn.Module] = {}
    for cand in chosen:
        name = cand.describe()
        if name in measured:
            continue
        reference = tokens(model, held_out, 8) if reference is None else reference
        config = plan_config(cand, info, calibrate=calibrate, unmerge=unmerge)
        twins[name] = apply_plan(copy.deepcopy(model), config, fit if _calibrates(cand) else None)
        if recover is not None and cand.vca_layers:
            line = recover(twins[name], model)
            if log is not None:
                log(f"  {name}: {line}")
        measured[name] = plan_fidelity(twins[name], held_out, reference)
    if twins:
        intervals = time_plans(model, twins, int(images.shape[-1]), **timing)
        for cand in chosen:
            if cand.describe() in twins:
                interval = as_interval(intervals[cand.describe()])
                measured[cand.describe()] |= _latency(interval)
                timed.add(cand, interval)


def _latency(interval: RatioInterval) -> dict[str, float]:
    """A finalist's measured latency as its scores hold it: "latency_ratio" and the interval's fields."""
    return {"latency_ratio": interval.ratio, **interval.to_dict()}


def _interval(scores: dict[str, Any]) -> RatioInterval:
    """A finalist's measured latency as a `RatioInterval` (exact when a stand-in timer gave a plain ratio)."""
    if "ratio" in scores:
        return RatioInterval(scores["ratio"], scores["low"], scores["high"], int(scores["rounds"]))
    return RatioInterval.exact(scores["latency_ratio"])


def choose_measured(
    model: nn.Module,
    info: ModelInfo,
    cands: Sequence[Candidate],
    budget: float,
    objective: str,
    images: torch.Tensor,
    *,
    top: int = 4,
    calibrate: bool = True,
    unmerge: str = "copy",
    log: Callable[[str], None] | None = None,
    measured: dict[str, dict[str, Any]] | None = None,
    slack: float = LATENCY_SLACK,
    repeats: int = 3,
    min_time: float = 0.0,
    timing: RatioTiming | None = None,
    timed: TimedPlans | None = None,
    merge_fractions: Sequence[float] = (),
    recover: Recover | None = None,
    carried: Sequence[str] = (),
) -> tuple[Candidate, dict[str, Any]]:
    """The plan whose *measured* objective is best among those *measured* within `budget` (`finalists`, and the plans
    described in `carried`, e.g. an earlier round's choice, so a refit cannot drop it from the comparison); it carries
    its measured latency (`Candidate.measured_latency`). The prediction only shortlists: on DINOv2 it read 0.60x for
    a plan that measured 0.58x (and 0.503x for one at 0.49x), which a strict cut would refuse.

    The additive prediction underestimates how losses of several converted blocks compound, so it only ranks the
    candidates; each finalist is applied to a copy of `model`, measured, and timed against the original (all side by
    side, paired per round, until `timing` settles: default `default_timing`). With calibration, the VCA blocks
    are calibrated on every other image of `images` and every plan is measured on the rest (`split_for_measurement`).
    `measured` (plan description -> scores and "latency_ratio" on these images) keeps the measurements across
    calls, e.g. one per budget, so no plan is applied and measured twice; `timed` collects every latency measured
    (and holds those measured before, e.g. the anchors, for the message when nothing fits). If no finalist measures
    within the budget, the best predicted within it is kept (`PlanResult.over_budget` then flags it); with none
    predicted within it either, PlanError names the fastest plan measured and what would reach further.

    With `recover(twin, original)` (a recipe run, say), each finalist with VCA blocks is recovered before it is
    scored: recovered VCA competes with merging as it would be delivered.

    A plan with VCA or MANO blocks replaces the best merging-only plan only if it beats it beyond noise
    (`beats_beyond_noise`): on DINOv2 at 518 px, scored on 4 crops, a mixed plan read 0.986 against merging's
    0.974 and measured 0.985 against 0.989 on 16 held-out photos.
    """
    if not slack >= 0:
        raise PlanError(f"latency slack must be >= 0, got {slack!r}")
    timed = TimedPlans() if timed is None else timed
    measured = {} if measured is None else measured
    timing = timing or default_timing(budget, min_time)
    cands = timed.marked(cands)
    shortlist = finalists(cands, budget, objective, top, slack)
    listed = {c.describe() for c in shortlist}
    shortlist += [c for c in cands if c.describe() in carried and c.describe() not in listed]
    best_predicted = max((c for c in cands if c.latency <= budget), key=lambda c: (c.score(objective), -c.latency),
                         default=None)  # fmt: skip
    if shortlist == [best_predicted]:
        return best_predicted, {}
    _measure_finalists(model, info, shortlist, images, measured, timed, calibrate=calibrate, unmerge=unmerge,
                       recover=recover, log=log, timing=timing, repeats=repeats, min_time=min_time)  # fmt: skip
    for cand in shortlist:
        if timed.get(cand.describe()) != _interval(measured[cand.describe()]):  # measured by an earlier call
            timed.add(cand, _interval(measured[cand.describe()]))
        if log is not None:
            _log_timing(log, cand, measured[cand.describe()], objective, budget)
    shortlist = timed.marked(shortlist)
    within = [c for c in shortlist if c.measured_latency.ratio <= budget]
    if not within:
        if best_predicted is None:
            raise _no_plan(budget, cands, timed, merge_fractions)
        if log is not None:
            log(f"  no finalist measured within {budget:g}x: keeping the best predicted, {best_predicted.describe()}")
        return timed.marked([best_predicted])[0], measured[best_predicted.describe()]
    return _best_measured(within, measured, objective, log, budget)


def _best_measured(
    within: Sequence[Candidate], measured: dict[str, dict[str, Any]], objective: str, log: Callable | None, budget
) -> tuple[Candidate, dict[str, Any]]:
    """The best measured objective among the finalists measured `within` the budget, or a faster one as faithful
    (`_fastest_as_good`); a plan with VCA or MANO blocks only where it beats the best merging-only one beyond
    noise."""

    def key(c: Candidate) -> tuple[float, float]:
        return measured_score(measured[c.describe()], objective), -c.measured_latency.ratio

    chosen = max(within, key=key)
    merging = max((c for c in within if c.merging_only), key=key, default=None)
    if merging is not None and not chosen.merging_only:
        scores, baseline = measured[chosen.describe()], measured[merging.describe()]
        better, gain, error = beats_beyond_noise(scores, baseline, objective)
        if not better:
            if log is not None:
                log(f"  {chosen.describe()} beats merging alone by {gain:+.4f} (standard error {error:.4f} over "
                    f"{len(scores['cls_per_image'])} images): within noise, so {merging.describe()}")  # fmt: skip
            chosen = merging
    chosen = _fastest_as_good(chosen, within, measured, objective, log)
    if log is not None and chosen.measured_latency.straddles(budget):
        log(f"  {chosen.describe()} measured {chosen.measured_latency.describe()}: its interval straddles the "
            f"{budget:g}x budget, so on this machine it may run either side of it")  # fmt: skip
    return chosen, measured[chosen.describe()]


def _fastest_as_good(
    chosen: Candidate, within: Sequence[Candidate], measured: dict[str, dict[str, Any]], objective: str, log
) -> Candidate:
    """The fastest finalist within the budget whose measured objective is at most `EQUAL_FIDELITY` below
    `chosen`'s, so a user gets the faster of two equally faithful plans; a merging-only choice gives way only to
    merging-only plans (a plan with VCA or MANO blocks must beat merging alone beyond noise to be chosen)."""

    def ratio(c: Candidate) -> float:
        return c.measured_latency.ratio

    def score(c: Candidate) -> float:
        return measured_score(measured[c.describe()], objective)

    kinds = [c for c in within if c.merging_only or not chosen.merging_only]
    equal = [c for c in kinds if ratio(c) < ratio(chosen) and score(c) >= score(chosen) - EQUAL_FIDELITY]
    if not equal:
        return chosen
    faster = min(equal, key=ratio)
    if log is not None:
        log(
            f"  {faster.describe()} runs {ratio(faster):.3f}x against {chosen.describe()}'s {ratio(chosen):.3f}x at "
            f"{score(faster) - score(chosen):+.4f} {objective} cosine: as faithful and faster, so {faster.describe()}"
        )
    return faster


def _no_plan(budget: float, cands: Sequence[Candidate], timed: TimedPlans, merge_fractions: Sequence[float]):
    """The PlanError for a budget no plan meets (`search.no_plan_error`), over `cands` and every plan timed."""
    names = {c.describe() for c in cands}
    extra = [replace(c, measured_latency=t) for name, (c, t) in timed.plans.items() if name not in names]
    return no_plan_error(budget, [*timed.marked(cands), *extra], merge_fractions)


def default_timing(budget: float | None, min_time: float) -> RatioTiming:
    """The planner's rule for whole-model timings: 5 rounds at least, then until each ratio's 90% interval is within
    ±0.02 or clear of `budget`, for at most TIMING_CAP × `min_time` seconds per comparison (15 s at the default
    0.5 s: on a loaded machine the interval may never settle, and is then reported as it is)."""
    return RatioTiming(budget=budget, max_seconds=TIMING_CAP * min_time)


def _checked_options(
    images: torch.Tensor,
    budget: float,
    resolution: int,
    objective: str,
    unmerge: str,
    merge_fractions: Sequence[float],
    merge_leads: Sequence[float],
    mano_windows: Sequence[int],
    local_window: int,
) -> str:
    """The plan's unmerge (`planned_unmerge`), after refusing bad options with PlanError before any work."""
    if objective not in OBJECTIVES:
        raise PlanError(f"objective must be one of {list(OBJECTIVES)}, got {objective!r}")
    unmerge = planned_unmerge(objective, unmerge)
    if not budget > 0:
        raise PlanError(f"budget must be a positive latency ratio (e.g. 0.5 = half the original's), got {budget!r}")
    if images.ndim != 4 or tuple(images.shape[-2:]) != (resolution, resolution):
        raise PlanError(f"calibration images must be [B, 3, {resolution}, {resolution}], got {tuple(images.shape)}")
    if any(not 0 < f <= MAX_MERGE_FRACTION for f in merge_fractions):
        raise PlanError(f"merge fractions must lie in (0, {MAX_MERGE_FRACTION:g}], got {list(merge_fractions)}")
    if any(isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 0.5 for s in merge_leads):
        raise PlanError(f"merge leads must lie in (0, 0.5] (a share of the patch tokens), got {list(merge_leads)}")
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in mano_windows):
        raise PlanError(f"MANO windows must be positive integers (window side k), got {list(mano_windows)}")
    try:
        plan_space().check_settings(local_window=local_window)
    except ConfigError as error:
        raise PlanError(str(error)) from None
    return unmerge


def paying_options(
    table: LatencyTable,
    info: ModelInfo,
    resolution: int,
    contrast_tokens: Sequence[int],
    mano_windows: Sequence[int],
    log: Callable[[str], None],
) -> tuple[list[int], list[int]]:
    """(VCA n, MANO k) worth measuring: each block at least MIN_SAVING faster than a softmax block at the full grid
    (VCA and MANO blocks come before the first merge), and a smaller n only where its block is also
    FEWER_TOKENS_SAVING of a softmax block faster than the next larger n's (fewer contrast tokens cost fidelity).
    The rest are logged: where VCA or MANO does not pay."""
    tokens, full = info.tokens(resolution), table.block_s(info.tokens(resolution))
    paying = {kind: [v for v in table.paying(kind, MIN_SAVING) if v in values]
              for kind, values in (("vca", contrast_tokens), ("mano", mano_windows))}  # fmt: skip
    for kind, values in (("vca", contrast_tokens), ("mano", mano_windows)):
        space, seconds = plan_space().kind(kind), {"vca": table.vca_s, "mano": table.mano_s}[kind]
        for value in sorted(set(values) - set(paying[kind])):
            log(f"  {space.label} {space.symbol}={value}: a block takes {1e3 * seconds[value]:.1f} ms, softmax "
                f"{1e3 * full:.1f} ms at {tokens} tokens: {space.label} does not pay here, not an option")  # fmt: skip
    ns: list[int] = []
    for n in sorted(paying["vca"], reverse=True):
        if ns and table.vca_s[n] > table.vca_s[ns[-1]] - FEWER_TOKENS_SAVING * full:
            log(f"  VCA n={n}: {1e3 * table.vca_s[n]:.1f} ms, n={ns[-1]} {1e3 * table.vca_s[ns[-1]]:.1f} ms: fewer "
                "contrast tokens save too little here to be an option")  # fmt: skip
            continue
        ns.append(n)
    return sorted(ns), paying["mano"]


def _time_candidates(
    model: nn.Module, info: ModelInfo, cands: Sequence[Candidate], resolution: int, unmerge: str, **timing: Any
) -> dict[str, RatioInterval]:
    """Each plan applied to a copy (uncalibrated: calibration changes no time) and timed against `model`."""
    twins = {c.describe(): apply_plan(copy.deepcopy(model), plan_config(c, info, unmerge=unmerge)) for c in cands}
    return {name: as_interval(value) for name, value in time_plans(model, twins, resolution, **timing).items()}


def _anchored(
    model: nn.Module,
    info: ModelInfo,
    resolution: int,
    table: LatencyTable,
    anchors: Sequence[Candidate],
    timed: TimedPlans,
    unmerge: str,
    log: Callable[[str], None],
    **timing: Any,
) -> LatencyTable:
    """`table` rescaled to whole-model timings of `anchors` (added to `timed`)."""
    if not anchors:
        return table
    log(f"timing {len(anchors)} plans against the original to calibrate the block timings: {load_line()}")
    intervals = _time_candidates(model, info, anchors, resolution, unmerge, **timing)
    for cand in anchors:
        timed.add(cand, intervals[cand.describe()])
    fitted = timed.fitted(table, info, resolution)
    log(f"  each kind's predicted saving scaled by {', '.join(f'{k} {v:.2f}' for k, v in fitted.scales.items())}")
    for cand in anchors:
        log(f"  {cand.describe()}: block timings {cand.latency:.2f}x, measured {timed.get(cand.describe()).describe()},"
            f" calibrated {cand.with_latency(fitted, info, resolution).latency:.2f}x")  # fmt: skip
    return fitted


def load_line() -> str:
    """The machine's 1-minute load average against its cores and, when other work competes for them, what that
    does to timings: with OpenMP's default spin-waiting, threads that lose their core stall every parallel step
    (on 2 cores at load 3, DINOv2-S merging r = 114 at 518 px timed 1.97x the original's latency, 0.475x with
    OMP_WAIT_POLICY=PASSIVE, 0.52x idle)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    line = f"load average {load:.1f} on {cores} cores"
    if load <= 0.75 * cores:
        return line
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        return (
            f"{line}; other work competes for them, and OpenMP's spin-waiting then slows plans with many small "
            "steps (merging) the most: start Python with OMP_WAIT_POLICY=PASSIVE to time as an idle machine would"
        )
    return f"{line}; other work competes for them, so timings vary: see each interval"


def _timed_table(
    model: nn.Module,
    info: ModelInfo,
    resolution: int,
    contrast_tokens: Sequence[int],
    mano_windows: Sequence[int],
    schedules: Sequence[MergeSchedule],
    local_window: int,
    unmerge: str,
    timed: TimedPlans,
    log: Callable[[str], None],
    **timing: Any,
) -> LatencyTable:
    """The block timings calibrated on whole-model timings of anchor plans among `schedules`."""
    log(f"timing blocks at {resolution} px ({info.tokens(resolution)} tokens); merged tokens return by {unmerge}")
    table = measure_latency_table(
        model, info, resolution, contrast_tokens, mano_windows=mano_windows, repeats=timing["repeats"],
        unmerge=unmerge, min_time=timing["min_time"], local_window=local_window,
    )  # fmt: skip
    anchors = anchor_plans(info, resolution, table, schedules, contrast_tokens, mano_windows)
    return _anchored(model, info, resolution, table, anchors, timed, unmerge, log, **timing)


def _reach(
    info: ModelInfo,
    resolution: int,
    table: LatencyTable,
    schedules: Sequence[MergeSchedule],
    options: dict[str, int],
    budget: float,
    margin: float | None,
    timed: TimedPlans,
    log: Callable[[str], None],
) -> Reach:
    """What to measure the sensitivity of (`latency.reachable`, and the merge plans `timed` within reach; everything
    when `margin` is None), logged."""
    if margin is None:
        return Reach(list(schedules), list(range(info.depth)) if options else [], bool(options))
    reach = reachable(info, resolution, table, schedules, options, budget, margin, timed)
    blocks = f"blocks {reach.blocks[0]}-{reach.blocks[-1]}" if reach.blocks else "no block"
    log(f"within {budget:g}x (+{margin:.0%}) as calibrated: {len(reach.schedules)} of {len(schedules)} merge "
        f"schedules, VCA / MANO in {blocks}")  # fmt: skip
    return reach


def _choose(
    model: nn.Module,
    info: ModelInfo,
    table: LatencyTable,
    sens: Sensitivity,
    images: torch.Tensor,
    timed: TimedPlans,
    *,
    budget: float,
    objective: str,
    top: int,
    log: Callable[[str], None],
    **options: Any,
) -> tuple[Candidate, dict[str, Any], LatencyTable, list[Candidate]]:
    """(chosen, its finalist scores, the block timings fitted to every timing, every candidate): the finalists
    measured (`choose_measured`, within the budget plus a slack widened to the timings' spread), the block timings
    refitted to their timings, and measured again once if the refit brings plans onto the shortlist that were not
    measured. The chosen plan's `latency` is the final fit's."""
    resolution, measured = int(images.shape[-1]), {}
    slack = max(LATENCY_SLACK, timed.spread())  # as far as the timings so far may be off
    earlier: list[str] = []  # the first round's choice competes in the second
    for attempt in range(2):
        cands = timed.marked(candidates(info, resolution, table, sens, objective))
        chosen, finalist = choose_measured(model, info, cands, budget, objective, images, top=top, log=log,
                                           measured=measured, timed=timed, slack=slack, carried=earlier,
                                           **options)  # fmt: skip
        earlier = [chosen.describe()]
        table = timed.fitted(table, info, resolution)
        cands = timed.marked(candidates(info, resolution, table, sens, objective))
        more = [c for c in finalists(cands, budget, objective, top, slack) if c.describe() not in measured]
        if not finalist or not more or attempt:  # nothing measured (one plan within reach), or nothing new
            break
        log(f"refitted to the finalists' timings, {len(more)} more plans are within reach: measuring them")
    chosen = replace(chosen.with_latency(table, info, resolution), measured_latency=timed.get(chosen.describe()))
    return chosen, finalist, table, timed.marked(cands)


def plan_model(
    model: nn.Module,
    images: torch.Tensor,
    *,
    budget: float,
    resolution: int,
    contrast_tokens: Sequence[int] = DEFAULT_CONTRAST_TOKENS,
    merge_starts: Sequence[int] | None = None,
    merge_fractions: Sequence[float] = DEFAULT_MERGE_FRACTIONS,
    merge_leads: Sequence[float] = DEFAULT_MERGE_LEADS,
    mano_windows: Sequence[int] = DEFAULT_MANO_WINDOWS,
    local_window: int = 0,
    calibrate: bool = True,
    objective: str = "both",
    unmerge: str = "auto",
    eval_images: torch.Tensor | None = None,
    measure: bool = True,
    repeats: int = 3,
    min_time: float = 0.5,
    log: Callable[[str], None] | None = None,
    timing: RatioTiming | None = None,
    search_margin: float | None = SEARCH_MARGIN,
    top: int = 4,
    recover: Recover | None = None,
) -> PlanResult:
    """Plan `model` (unpatched, eval mode) at `resolution` to run within `budget` × the original's latency.

    `images` (calibration, [B, 3, resolution, resolution]) measure each candidate's loss and calibrate VCA;
    the chosen plan is then applied to a copy and measured on `eval_images` (default: `images`). `contrast_tokens`
    (VCA n) and `mano_windows` (MANO k) are the per-block options besides softmax; empty: not an option; one whose
    block is not faster than a softmax block at the full grid is timed only (`paying_options`). VCA blocks carry a
    local term of window `local_window` when > 0 (odd: VCA's `local_window`; timed and measured with it, so the
    search weighs its cost and its fidelity). `merge_fractions` in (0, 2]: of the patch tokens merged over the
    blocks from a start on (`sensitivity.merge_rates`; above 1, merging front-loaded); `merge_leads` in (0, 0.5]:
    each such r also after a first merging block that merges this share of the patch tokens (front-loaded merging,
    `sensitivity.MergeSchedule`; empty: constant r only). `unmerge` (token merging's
    "copy" or "residual", or "auto": `planned_unmerge`) is how merged tokens return at the end.

    Timing: block timings first (`repeats` rounds, `min_time` seconds), rescaled to whole-model timings of a few
    plans (`latency.anchor_plans`) and later of the finalists; every whole-model timing is paired per round against
    the original until `timing` settles (default `default_timing`: each ratio within ±0.02 at 90% confidence or
    clear of the budget, `repeats` rounds and `min_time` seconds at least, 30 × `min_time` seconds at most).
    `search_margin`: sensitivity is measured only for what a plan predicted within `budget` × (1 ± margin) could
    use, the margin widened to the first timings' own spread (`TimedPlans.spread`; None: everything). `top`:
    finalists by predicted objective. `recover(twin, original)`: each finalist with VCA blocks is recovered (a recipe
    run, in place on a planned copy) before it is scored, so recovered VCA competes with merging (each such
    finalist costs one recovery).
    """
    log = log or (lambda message: None)
    unmerge = _checked_options(images, budget, resolution, objective, unmerge, merge_fractions, merge_leads,
                               mano_windows, local_window)  # fmt: skip
    info = model_info(model)
    info.grid(resolution)
    starts = sorted(set(merge_starts if merge_starts is not None else range(0, info.depth, max(1, info.depth // 4))))
    if any(not 0 <= j < info.depth for j in starts):
        raise PlanError(f"merge starts must be blocks 0..{info.depth - 1}, got {starts}")
    timing = {"repeats": repeats, "min_time": min_time, "timing": timing or default_timing(budget, min_time)}
    timed = TimedPlans()
    schedules = merge_schedules(info, resolution, starts, merge_fractions, merge_leads)
    table = _timed_table(model, info, resolution, contrast_tokens, mano_windows, schedules, local_window, unmerge,
                         timed, log, **timing)  # fmt: skip
    ns, windows = paying_options(table, info, resolution, contrast_tokens, mano_windows, log)
    margin = None if search_margin is None else max(search_margin, timed.spread())
    reach = _reach(info, resolution, table, schedules, fastest_options(table, ns, windows), budget, margin, timed, log)
    if not reach.schedules and not reach.unmerged and budget < 1:  # from 1 on, the original itself fits
        raise _no_plan(budget, [], timed, merge_fractions)
    log(f"measuring sensitivity on {len(images)} images")
    sens = measure_sensitivity(
        model, info, images, resolution, contrast_tokens=ns if reach.blocks else (), merge_starts=starts,
        merge_fractions=merge_fractions, mano_windows=windows if reach.blocks else (), calibrate=calibrate,
        unmerge=unmerge, local_window=local_window, merges=reach.schedules, blocks=reach.blocks, log=log,
    )  # fmt: skip
    log("measuring the best predicted plans on the calibration images")
    chosen, finalist, table, cands = _choose(
        model, info, table, sens, images, timed, budget=budget, objective=objective, top=top, log=log,
        calibrate=calibrate, unmerge=unmerge, merge_fractions=merge_fractions, recover=recover, **timing,
    )  # fmt: skip
    config = plan_config(chosen, info, calibrate=calibrate, unmerge=unmerge)
    measured: dict[str, float] = {}
    if measure:
        log("measuring the chosen plan")
        measured = measure_plan(
            model, config, eval_images if eval_images is not None else images, resolution,
            calibration=images if calibrate else None, timed=chosen.measured_latency, **timing,
        )  # fmt: skip
        if chosen.measured_latency is None:  # the only plan within the budget: timed just now
            latency = [measured[f"latency_{key}"] for key in ("ratio", "low", "high", "rounds")]
            interval = RatioInterval(*latency[:3], int(latency[3]))
            chosen = replace(chosen, measured_latency=interval)
            timed.add(chosen, interval)
    return PlanResult(
        config=config, chosen=chosen, candidates=cands, front=pareto(cands, objective),
        merging_front=pareto([c for c in cands if c.merging_only], objective), measured=measured, info=info,
        resolution=resolution, budget=budget, objective=objective, sensitivity=sens, table=table, finalist=finalist,
        timed=timed,
    )  # fmt: skip
