"""The plan search: every measured merge schedule, each with a greedy VCA / MANO assignment of the blocks before it.

Predicted fidelity is additive in the measured losses (1 − cosine) of the parts, each measured alone; predicted
latency comes from the measured latency table. For each merge schedule (none, or r per block from block j on,
constant or front-loaded: `sensitivity.MergeSchedule`),
each block before j is softmax, VCA(n) or MANO(k); moves are made greedily, best latency saved per predicted loss
first: switching a block to VCA(n) or MANO(k) (from softmax, from the other kind, or VCA to a smaller n), each
move saving predicted latency; every step is a candidate. `choose` takes the best predicted objective within
the budget (`planner.choose_measured` then measures the best few and keeps the best measured); the Pareto front is
over (predicted latency ratio, predicted objective).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from vca_patch.bench.timing import RatioInterval
from vca_patch.planner.costs import LatencyTable, plan_macs
from vca_patch.planner.model_info import ModelInfo, PlanError
from vca_patch.planner.sensitivity import MergeSchedule, Sensitivity
from vca_patch.targets.base import plan_space

OBJECTIVES = ("cls", "patch", "both")
MAX_MERGE_FRACTION = 2.0  # merge fractions the planner takes: (0, 2] (above 1: merging front-loaded, `merge_rates`)


@dataclass
class Candidate:
    schedule: list[int]  # r per block
    vca_layers: dict[int, int] = field(default_factory=dict)
    mano_layers: dict[int, int] = field(default_factory=dict, kw_only=True)  # {block: window k}
    latency: float = 1.0  # predicted ratio to the original
    macs_ratio: float = 1.0  # FLOP model's ratio to the original
    cls: float = 1.0  # predicted CLS cosine
    patch: float = 1.0  # predicted mean patch-token cosine
    local_window: int = field(default=0, kw_only=True)  # the VCA blocks' local term (0: none)
    measured_latency: RatioInterval | None = field(default=None, kw_only=True)  # timed against the original

    def with_latency(self, table: LatencyTable, info: ModelInfo, resolution: int) -> Candidate:
        """This plan with its latency predicted by `table` (e.g. once its block timings are calibrated)."""
        return replace(self, latency=table.ratio(info, resolution, self.schedule, self.vca_layers, self.mano_layers))

    def score(self, objective: str) -> float:
        return {"cls": self.cls, "patch": self.patch, "both": 0.5 * (self.cls + self.patch)}[objective]

    @property
    def merging_only(self) -> bool:
        return not self.vca_layers and not self.mano_layers

    @property
    def is_original(self) -> bool:
        """No block changed: its latency is the original's by definition (a timing of it measures only noise)."""
        return self.merging_only and not any(self.schedule)

    @property
    def hybrid(self) -> bool:
        """Merging from some block on, with VCA or MANO blocks before it."""
        return any(self.schedule) and not self.merging_only

    @property
    def blocks(self) -> dict[str, dict[int, int]]:
        """{block kind: {block: value}}, by the plan space's kind names."""
        return {"vca": dict(self.vca_layers), "mano": dict(self.mano_layers)}

    def describe(self) -> str:
        parts = []
        if self.vca_layers:
            local = f" (local {self.local_window}x{self.local_window})" if self.local_window else ""
            parts.append(f"VCA{local} " + ", ".join(f"{i}:n={n}" for i, n in sorted(self.vca_layers.items())))
        if self.mano_layers:
            parts.append("MANO " + ", ".join(f"{i}:k={k}" for i, k in sorted(self.mano_layers.items())))
        if any(self.schedule):
            parts.append(describe_merging(self.schedule))
        return "; ".join(parts) or "original (softmax everywhere)"

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule,
            "vca_layers": self.vca_layers,
            "mano_layers": self.mano_layers,
            "local_window": self.local_window,
            "predicted_latency_ratio": self.latency,
            "macs_ratio": self.macs_ratio,
            "predicted_cls_cosine": self.cls,
            "predicted_patch_cosine": self.patch,
            "plan": self.describe(),
            "measured_latency": None if self.measured_latency is None else self.measured_latency.to_dict(),
        }


def describe_merging(schedule: Sequence[int]) -> str:
    """A merge schedule (r per block) in words: "merge r=114 from block 0" (constant), "merge 456 in block 0, then
    r=40" (front-loaded), or the r of each block from the first that merges."""
    start = next(i for i, r in enumerate(schedule) if r)
    lead, rest = schedule[start], list(schedule[start + 1 :])
    if all(r == lead for r in rest):
        return f"merge r={lead} from block {start}"
    if rest and all(r == rest[0] for r in rest):
        return f"merge {lead} in block {start}, then r={rest[0]}"
    return f"merge r per block from block {start}: {list(schedule[start:])}"


Option = tuple[str, int]  # ("vca", n) or ("mano", k)


def _candidate(
    info, resolution, table, sens, schedule, options: dict[int, Option], merge_key: MergeSchedule | None, base_macs
) -> Candidate:
    cls_loss = sens.merge[merge_key].cls if merge_key else 0.0
    patch_loss = sens.merge[merge_key].patch if merge_key else 0.0
    for block, (kind, value) in options.items():
        cls_loss += sens.of(kind)[(block, value)].cls
        patch_loss += sens.of(kind)[(block, value)].patch
    vca = {b: v for b, (kind, v) in sorted(options.items()) if kind == "vca"}
    mano = {b: v for b, (kind, v) in sorted(options.items()) if kind == "mano"}
    return Candidate(
        schedule=list(schedule),
        vca_layers=vca,
        mano_layers=mano,
        latency=table.ratio(info, resolution, schedule, vca, mano),
        macs_ratio=plan_macs(info, resolution, schedule, vca, mano, local_window=sens.local_window) / base_macs,
        cls=1.0 - cls_loss,
        patch=1.0 - patch_loss,
        local_window=sens.local_window if vca else 0,
    )


def _moves(block: int, current: Option | None, options: Sequence[Option], sens: Sensitivity) -> list[Option]:
    """The options block `block` may switch to from `current` (None: softmax): any measured one of another kind,
    or VCA with fewer contrast tokens (the search also needs each move to save predicted latency)."""
    out = []
    for kind, value in options:
        if (block, value) not in sens.of(kind) or current == (kind, value):
            continue
        if current is not None and current[0] == kind and value >= current[1] and plan_space().kind(kind).shrinks:
            continue
        out.append((kind, value))
    return out


def candidates(
    info: ModelInfo, resolution: int, table: LatencyTable, sens: Sensitivity, objective: str = "both"
) -> list[Candidate]:
    """Every candidate plan the greedy search visits (the original included)."""
    if objective not in OBJECTIVES:
        raise PlanError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if sens.vca and table.local_window != sens.local_window:
        raise PlanError(
            f"the VCA blocks were timed with local_window={table.local_window} but measured with "
            f"local_window={sens.local_window}: time and measure them with the same term"
        )
    base_macs = plan_macs(info, resolution, [], {})
    options: list[Option] = [("vca", n) for n in sorted({n for _, n in sens.vca})]
    options += [("mano", k) for k in sorted({k for _, k in sens.mano})]
    schedules: list[tuple[list[int], MergeSchedule | None, int]] = [([0] * info.depth, None, info.depth)]
    for merge in sorted(sens.merge):
        schedules.append((merge.per_block(info.depth), merge, merge.start))
    out = []
    for schedule, key, first in schedules:
        chosen: dict[int, Option] = {}
        current = _candidate(info, resolution, table, sens, schedule, chosen, key, base_macs)
        out.append(current)
        while True:
            best, best_value, best_options = None, None, chosen
            for block in range(first):
                for option in _moves(block, chosen.get(block), options, sens):
                    trial_options = {**chosen, block: option}
                    trial = _candidate(info, resolution, table, sens, schedule, trial_options, key, base_macs)
                    saved = current.latency - trial.latency
                    lost = current.score(objective) - trial.score(objective)
                    if saved <= 0:
                        continue
                    value = saved / max(lost, 1e-6)
                    if best_value is None or value > best_value:
                        best, best_value, best_options = trial, value, trial_options
            if best is None:
                break
            chosen, current = best_options, best
            out.append(current)
    return out


def pareto(cands: Sequence[Candidate], objective: str) -> list[Candidate]:
    """The candidates no other beats on both predicted latency and objective, fastest first."""
    front, best = [], float("-inf")
    for cand in sorted(cands, key=lambda c: (c.latency, -c.score(objective))):
        if cand.score(objective) > best:
            front.append(cand)
            best = cand.score(objective)
    return front


def reach_advice(fastest: float, merge_fractions: Sequence[float] = ()) -> str:
    """What to do when no plan meets a budget, given the fastest plan's ratio (the low end of its measured
    interval, when timed): keep the original when nothing is faster than it, else what reaches further (more
    merging while the fractions allow it, a lower resolution, a smaller model)."""
    if fastest >= 1.0:
        return (
            "nothing measured is faster than the original here (too few tokens for VCA, MANO or merging to pay for "
            "themselves, or other work competing for the cores: see the load in the log): keep the original, or "
            "plan for a larger resolution or on an idle machine"
        )
    if max(merge_fractions, default=0.0) < MAX_MERGE_FRACTION:
        return (
            f"raise the budget; to go further, merge more (--merge-fractions up to {MAX_MERGE_FRACTION:g}), plan "
            "at a lower resolution, or use a smaller model"
        )
    return "raise the budget; to go further, plan at a lower resolution or use a smaller model"


def fastest_line(cands: Sequence[Candidate]) -> tuple[str, float]:
    """("the fastest measured plan, <plan>, runs <ratio and interval>", the low end of its interval) over the
    candidates timed against the original; the fastest predicted, said to be a prediction, when none was timed."""
    timed = [c for c in cands if c.measured_latency is not None]
    if timed:
        fastest = min(timed, key=lambda c: c.measured_latency.ratio)
        return (
            f"the fastest measured plan, {fastest.describe()}, runs {fastest.measured_latency.describe()} the "
            "original's latency",
            fastest.measured_latency.low,
        )
    if not cands:
        return "no plan was searched", 1.0
    fastest = min(cands, key=lambda c: c.latency)
    return (
        f"the fastest plan, {fastest.describe()}, is predicted at {fastest.latency:.2f}x (not timed)",
        fastest.latency,
    )


def choose(
    cands: Sequence[Candidate], budget: float, objective: str, merge_fractions: Sequence[float] = ()
) -> Candidate:
    """The best predicted objective within `budget` (latency ratio); PlanError if none fits, in one line: the
    fastest measured plan with its measured ratio (`Candidate.measured_latency`; the fastest predicted when none
    was timed) and what would reach further (`reach_advice`; `merge_fractions`: those searched)."""
    if not budget > 0:
        raise PlanError(f"budget must be a positive latency ratio (e.g. 0.5 = half the original's), got {budget!r}")
    fitting = [c for c in cands if c.latency <= budget]
    if not fitting:
        raise no_plan_error(budget, cands, merge_fractions)
    return max(fitting, key=lambda c: (c.score(objective), -c.latency))


def no_plan_error(budget: float, cands: Sequence[Candidate], merge_fractions: Sequence[float] = ()) -> PlanError:
    """PlanError, one line: no plan meets `budget`, the fastest measured plan and its ratio (`fastest_line`), and
    what would reach further (`reach_advice`)."""
    line, ratio = fastest_line(cands)
    timed = [c.measured_latency for c in cands if c.measured_latency is not None]
    if timed and min(timed, key=lambda t: t.ratio).straddles(budget):
        line += " (its interval holds the budget: on a quieter machine it may fit)"
    return PlanError(f"no plan meets the latency budget {budget:.2f}x: {line}; {reach_advice(ratio, merge_fractions)}")
