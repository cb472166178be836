"""Whole-model latency for the planner: plans timed against the original, the block-timing model calibrated on them,
and which parts of the search space a plan within the budget could use at all.

Block timings (`costs.measure_latency_table`) give the shape of the latency model, not its level: on a loaded
2-core machine they predicted 0.88x for DINOv2-S merging r = 108 at 518 px, which runs at 0.57x on an idle one.
So a few "anchor" plans are timed as whole models first (the fastest merge schedule and a middle one, VCA or MANO
in every block), the VCA and MANO block times read off those (`corrected_blocks`), each part's saving rescaled to
match (`costs.fit_scales`), and all refitted once the finalists are timed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from vca_patch.bench.timing import RatioInterval
from vca_patch.planner.costs import LatencyTable, fit_scales
from vca_patch.planner.model_info import ModelInfo
from vca_patch.planner.search import Candidate
from vca_patch.planner.sensitivity import MergeSchedule


def as_interval(value: RatioInterval | float) -> RatioInterval:
    """A timing as a `RatioInterval`; a plain ratio (a stand-in timer's) is taken as exact."""
    return value if isinstance(value, RatioInterval) else RatioInterval.exact(float(value))


CLEAR_PER_SHAPE = 2  # merge schedules of one shape kept clear within the budget (`_undominated`)
MAY_PAY = 1.25  # a VCA / MANO block timed alone within this of a softmax block's time may still pay
MAX_SPREAD = 0.15  # `TimedPlans.spread` counts at most this much: more widens the search and the finalists to
# nearly everything, each timed as uncertainly (at load 7 on 2 cores, 0.3 took 8 minutes at 518 px)


@dataclass
class TimedPlans:
    """Every plan timed against the original so far: by description, (the plan, its latest measured ratio), and
    every timing in order (`history`: a plan timed again, e.g. an anchor among the finalists, counts twice)."""

    plans: dict[str, tuple[Candidate, RatioInterval]] = field(default_factory=dict)
    history: list[tuple[Candidate, RatioInterval]] = field(default_factory=list)

    def add(self, cand: Candidate, interval: RatioInterval) -> None:
        self.plans[cand.describe()] = (cand, interval)
        self.history.append((cand, interval))

    def spread(self) -> float:
        """The widest relative half-interval among the timings (at most MAX_SPREAD): how far off a prediction
        calibrated on them may be, on this machine now."""
        widths = [(t.high - t.low) / (2 * t.ratio) for _, t in self.history if t.ratio > 0]
        return min(max(widths, default=0.0), MAX_SPREAD)

    def get(self, name: str) -> RatioInterval | None:
        return self.plans[name][1] if name in self.plans else None

    def fitted(self, table: LatencyTable, info: ModelInfo, resolution: int) -> LatencyTable:
        """`table` calibrated on these timings: VCA and MANO blocks timed whole where a plan converted every block
        (`corrected_blocks`), then every part's saving rescaled (`fit_scales`); `table` itself when none."""
        if not self.plans:
            return table
        table = corrected_blocks(table, info, resolution, self)
        shapes = [((c.schedule, c.vca_layers, c.mano_layers), t) for c, t in self.history]
        return replace(table, scales=fit_scales(table, info, resolution, shapes))

    def marked(self, cands: Sequence[Candidate]) -> list[Candidate]:
        """`cands`, those timed carrying their measured ratio (`Candidate.measured_latency`)."""
        return [replace(c, measured_latency=self.get(c.describe())) if c.describe() in self.plans else c for c in cands]

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {name: interval.to_dict() for name, (_, interval) in self.plans.items()}


def _everywhere(cand: Candidate, depth: int) -> tuple[str, int] | None:
    """(kind, value) when `cand` converts every block to one VCA n or one MANO k and merges nothing, else None."""
    for kind, blocks in cand.blocks.items():
        if len(blocks) == depth and len(set(blocks.values())) == 1 and not any(cand.schedule):
            return kind, next(iter(blocks.values()))
    return None


def corrected_blocks(table: LatencyTable, info: ModelInfo, resolution: int, timed: TimedPlans) -> LatencyTable:
    """`table` with each VCA n / MANO k block's time read off a timed plan that has that block everywhere (the
    kind's other values shifted alike): ratio = 1 − depth · (softmax block − that block) / original. A block timed
    alone on a loaded machine can read slower than a softmax block while the whole model runs faster (DINOv2-S at
    518 px, load 7 on 2 cores: VCA 348 ms against softmax 304 ms), which no scale of its saving could correct."""
    seconds = {"vca": dict(table.vca_s), "mano": dict(table.mano_s)}
    full = table.block_s(info.tokens(resolution))
    for cand, interval in timed.plans.values():
        found = _everywhere(cand, info.depth)
        if found is not None:
            kind, value = found
            shift = full - (1 - interval.ratio) * table.original_s / info.depth - seconds[kind][value]
            seconds[kind] = {v: t + shift for v, t in seconds[kind].items()}
    return replace(table, vca_s=seconds["vca"], mano_s=seconds["mano"])


def fastest_options(table: LatencyTable, ns: Sequence[int], windows: Sequence[int]) -> dict[str, int]:
    """{kind: value} of the fastest VCA n and MANO k block among those offered (a kind not offered is absent)."""
    out = {}
    if ns:
        out["vca"] = min(ns, key=lambda n: table.vca_s[n])
    if windows:
        out["mano"] = min(windows, key=lambda k: table.mano_s[k])
    return out


def _fastest_before(table: LatencyTable, options: dict[str, int], start: int) -> tuple[dict, dict]:
    """(VCA blocks, MANO blocks): the fastest offered block kind in every block before `start`."""
    if not options:
        return {}, {}
    seconds = {kind: (table.vca_s if kind == "vca" else table.mano_s)[value] for kind, value in options.items()}
    kind = min(seconds, key=seconds.get)
    blocks = dict.fromkeys(range(start), options[kind])
    return (blocks, {}) if kind == "vca" else ({}, blocks)


def anchor_plans(
    info: ModelInfo,
    resolution: int,
    table: LatencyTable,
    schedules: Sequence[MergeSchedule],
    ns: Sequence[int],
    windows: Sequence[int],
) -> list[Candidate]:
    """The plans timed first to calibrate the block timings: the fastest merge schedule from the first start (the
    largest r) and a middle one, VCA(fastest n) in every block and MANO(fastest k) in every block, each offered and
    for VCA and MANO, where its block timed alone may pay (within MAY_PAY of a softmax block: timed alone on a
    loaded machine, a VCA block that pays read 1.14x a softmax block's time)."""
    out = []
    constant = [s for s in schedules if s.first is None]
    first = min((s.start for s in constant), default=None)
    rates = sorted(s.r for s in constant if s.start == first)
    for r in sorted({rates[-1], rates[len(rates) // 2]} if rates else ()):
        out.append(Candidate([0] * first + [r] * (info.depth - first)))
    full = MAY_PAY * table.block_s(info.tokens(resolution))
    options = fastest_options(table, [n for n in ns if table.vca_s[n] <= full],
                              [k for k in windows if table.mano_s[k] <= full])  # fmt: skip
    if "vca" in options:
        out.append(Candidate([0] * info.depth, dict.fromkeys(range(info.depth), options["vca"])))
    if "mano" in options:
        out.append(Candidate([0] * info.depth, mano_layers=dict.fromkeys(range(info.depth), options["mano"])))
    return [c.with_latency(table, info, resolution) for c in out]


@dataclass
class Reach:
    """What a plan predicted within the budget (plus a margin) could use: merge schedules, blocks that
    may be VCA or MANO (before a schedule's start, when merging alone does not already reach), and whether the
    plans without merging reach."""

    schedules: list[MergeSchedule]
    blocks: list[int]
    unmerged: bool


def reachable(
    info: ModelInfo,
    resolution: int,
    table: LatencyTable,
    schedules: Sequence[MergeSchedule],
    options: dict[str, int],
    budget: float,
    margin: float,
    timed: TimedPlans | None = None,
) -> Reach:
    """Prune the search before its sensitivity is measured: a schedule is kept when, with the fastest block kind
    (`options`) in every block before its start, it is predicted within `budget` × (1 + `margin`), or merging alone
    on it was `timed` within that, whatever the prediction; the blocks before a kept schedule's start may be VCA or
    MANO only if merging alone is predicted over `budget` × (1 − `margin`) (where merging alone fits, a VCA or MANO
    block only costs fidelity). Of each shape's schedules that merging alone keeps clear within the budget, only
    the lightest `CLEAR_PER_SHAPE` are kept (`_undominated`). Predicted with `table` as calibrated."""
    measured = {c.describe(): t.ratio for c, t in (timed.plans.values() if timed is not None else ())}
    kept, clear, blocks = [], set(), set()
    for merge in schedules:
        schedule, start = merge.per_block(info.depth), merge.start
        vca, mano = _fastest_before(table, options, start)
        alone = measured.get(Candidate(schedule).describe(), float("inf")) <= budget * (1 + margin)
        if not alone and table.ratio(info, resolution, schedule, vca, mano) > budget * (1 + margin):
            continue
        kept.append(merge)
        if table.ratio(info, resolution, schedule, {}) > budget * (1 - margin):
            blocks.update(range(start))
        else:
            clear.add(merge)
    vca, mano = _fastest_before(table, options, info.depth)
    unmerged = bool(options) and table.ratio(info, resolution, [0] * info.depth, vca, mano) <= budget * (1 + margin)
    if unmerged:
        blocks.update(range(info.depth))
    return Reach(_undominated(kept, clear), sorted(blocks) if options else [], unmerged)


def _undominated(kept: list[MergeSchedule], clear: set[MergeSchedule]) -> list[MergeSchedule]:
    """`kept` less the schedules a lighter one of the same shape (start, first merge) dominates: merging more
    tokens costs fidelity, so once `CLEAR_PER_SHAPE` schedules of a shape run clear within the budget by merging
    alone, a heavier one of that shape (faster still, less faithful; with VCA or MANO before it, faster and less
    faithful again) cannot be the best plan. The second clear one is kept in case the first times over."""
    seen: dict[tuple[int, int | None], int] = {}
    dominated = set()
    for merge in sorted(kept, key=lambda m: m.r):
        shape = (merge.start, merge.first)
        if seen.get(shape, 0) >= CLEAR_PER_SHAPE:
            dominated.add(merge)
        elif merge in clear:
            seen[shape] = seen.get(shape, 0) + 1
    return [merge for merge in kept if merge not in dominated]
