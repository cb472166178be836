"""Cost of a plan: tokens per block, the FLOP model's MACs, and a latency model from measured block timings.

The token arithmetic, the per-block MAC counts and every config timed here come from the plan space
(`targets.base.plan_space()`: token merging's, with VCA and MANO blocks)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from vca_patch.bench.timing import RatioInterval, median, time_interleaved
from vca_patch.eval.final_tokens import final_tokens
from vca_patch.layers.layout import TokenLayout
from vca_patch.layers.macs import AttentionShape
from vca_patch.planner.model_info import ModelInfo
from vca_patch.surgery import get_patch_state, patch_model
from vca_patch.targets.base import TargetConfig, plan_space


def token_counts(info: ModelInfo, resolution: int, schedule: Sequence[int]) -> list[int]:
    """Tokens entering each block under a merge schedule (r per block; the plan space's `tokens_removed`)."""
    space, tokens, counts = plan_space(), info.tokens(resolution), []
    for i in range(info.depth):
        counts.append(tokens)
        tokens -= space.tokens_removed(tokens, info.num_prefix_tokens, schedule[i] if i < len(schedule) else 0)
    return counts


def plan_macs(
    info: ModelInfo,
    resolution: int,
    schedule: Sequence[int],
    vca_layers: dict[int, int],
    mano_layers: dict[int, int] | None = None,
    *,
    local_window: int = 0,
) -> float:
    """MACs of the blocks (FLOP model of bench/flops.py: 2·N²·C softmax, token-wise Linears, and each VCA(n) or
    MANO(k) block's count from the plan space's block kinds: VCA's with its local term of `local_window` when > 0,
    training-free MANO's at window k)."""
    space = plan_space()
    shape = AttentionShape(info.num_prefix_tokens, info.grid(resolution), info.dim, info.num_heads)
    blocks = {i: (space.kind(kind), value) for kind, layers in (("mano", mano_layers), ("vca", vca_layers))
              for i, value in (layers or {}).items()}  # fmt: skip
    total = 0.0
    for i, tokens in enumerate(token_counts(info, resolution, schedule)):
        total += tokens * info.linear_macs_per_token
        if i in blocks:
            kind, value = blocks[i]
            total += kind.macs(shape, value, local_window=local_window)
        else:
            total += 2.0 * tokens**2 * info.dim
    return total


SAVING_PARTS = ("merge", "overhead", "vca", "mano")  # what a plan saves, by part (`LatencyTable.savings`)


@dataclass
class LatencyTable:
    """Measured batch-1 seconds: one softmax block at several token counts, one VCA block per n and one MANO block
    per window k at the full grid, the rest of the model (embedding, final norm), and the whole original model.
    `local_window`: the VCA blocks were timed with that local term (0: none). `merge_overhead_s`: what a merging
    block costs over a softmax block at each of those token counts (the bipartite matching, the merge, proportional
    attention and undoing the merge at the unmerge); empty: not measured (no overhead counted)."""

    original_s: float
    other_s: float
    softmax_tokens: list[int]
    softmax_s: list[float]
    vca_s: dict[int, float] = field(default_factory=dict)
    mano_s: dict[int, float] = field(default_factory=dict)
    merge_overhead_s: list[float] = field(default_factory=list)
    local_window: int = 0
    # {part: k} (`SAVING_PARTS`): what whole-model timings showed each part's predicted saving to be worth
    # (`fit_scales`); empty: the block timings as measured
    scales: dict[str, float] = field(default_factory=dict)

    def block_s(
        self, tokens: int, contrast_tokens: int | None = None, window: int | None = None, merges: bool = False
    ) -> float:
        if contrast_tokens is not None:
            return self.vca_s[contrast_tokens]
        if window is not None:
            return self.mano_s[window]
        seconds = float(np.interp(tokens, self.softmax_tokens, self.softmax_s))
        if merges and self.merge_overhead_s:
            seconds += float(np.interp(tokens, self.softmax_tokens, self.merge_overhead_s))
        return seconds

    def ratio(
        self,
        info: ModelInfo,
        resolution: int,
        schedule: Sequence[int],
        vca_layers: dict[int, int],
        mano_layers: dict[int, int] | None = None,
    ) -> float:
        """Predicted latency of a plan over the original's: from the block timings, or once calibrated (`scales`)
        1 minus each part's predicted saving times its scale (the original itself is then exactly 1)."""
        if self.scales:
            saved = self.savings(info, resolution, schedule, vca_layers, mano_layers)
            ratio = 1.0 - sum(self.scales.get(kind, 1.0) * seconds for kind, seconds in saved.items()) / self.original_s
            return max(ratio, self.floor(info))
        counts = token_counts(info, resolution, schedule)
        mano_layers = mano_layers or {}
        merges = [i < len(schedule) and schedule[i] > 0 for i in range(len(counts))]
        blocks = sum(self.block_s(t, vca_layers.get(i), mano_layers.get(i), merges[i]) for i, t in enumerate(counts))
        return (self.other_s + blocks) / self.original_s

    def floor(self, info: ModelInfo) -> float:
        """The lowest ratio a plan can be predicted at: every block at the fewest tokens timed, plus the rest of
        the model. Scaled savings extrapolate: a merge scale fitted on a small model (3x) once predicted a
        front-loaded merge at -0.4x."""
        return (self.other_s + info.depth * min(self.softmax_s)) / self.original_s

    def savings(
        self,
        info: ModelInfo,
        resolution: int,
        schedule: Sequence[int],
        vca_layers: dict[int, int],
        mano_layers: dict[int, int] | None = None,
    ) -> dict[str, float]:
        """Seconds a plan saves over softmax blocks at the full grid, by part: each VCA and MANO block's ("vca",
        "mano"), fewer tokens in the other blocks ("merge"), and the merging blocks' matching overhead ("overhead",
        negative: a cost)."""
        full = self.block_s(info.tokens(resolution))
        mano_layers = mano_layers or {}
        saved = dict.fromkeys(SAVING_PARTS, 0.0)
        for i, tokens in enumerate(token_counts(info, resolution, schedule)):
            if i in vca_layers:
                saved["vca"] += full - self.vca_s[vca_layers[i]]
            elif i in mano_layers:
                saved["mano"] += full - self.mano_s[mano_layers[i]]
            else:
                saved["merge"] += full - self.block_s(tokens)
                if i < len(schedule) and schedule[i] > 0:
                    saved["overhead"] += self.block_s(tokens) - self.block_s(tokens, merges=True)
        return saved

    def paying(self, kind: str, min_saving: float = 0.03) -> list[int]:
        """The measured VCA n ("vca") or MANO k ("mano") whose block takes at least `min_saving` (a fraction)
        less than a softmax block at the full grid: the others cannot buy a plan any time (VCA and MANO blocks
        come before the first merge, on the full grid)."""
        full = self.softmax_s[int(np.argmax(self.softmax_tokens))]
        timed = {"vca": self.vca_s, "mano": self.mano_s}[kind]
        return sorted(value for value, seconds in timed.items() if seconds < (1 - min_saving) * full)

    def faster_mano_windows(self) -> list[int]:
        """The measured MANO windows whose block beats a softmax block at the full grid. MANO blocks come before the
        first merge, on the full grid, so a slower window can never save latency: the search would never pick it."""
        full = self.softmax_s[int(np.argmax(self.softmax_tokens))]
        return sorted(k for k, seconds in self.mano_s.items() if seconds < full)

    def to_dict(self) -> dict:
        return {
            "original_ms": 1e3 * self.original_s,
            "other_ms": 1e3 * self.other_s,
            "softmax_block_ms": {t: 1e3 * s for t, s in zip(self.softmax_tokens, self.softmax_s, strict=True)},
            "vca_block_ms": {n: 1e3 * s for n, s in self.vca_s.items()},
            "vca_local_window": self.local_window,
            "mano_block_ms": {k: 1e3 * s for k, s in self.mano_s.items()},
            "merge_overhead_ms": {t: 1e3 * s for t, s in zip(self.softmax_tokens, self.merge_overhead_s, strict=False)},
            "saving_scales": dict(self.scales),
        }


PlanShape = tuple[Sequence[int], dict[int, int], dict[int, int]]  # (schedule, VCA blocks, MANO blocks)
SCALE_SPREAD = 0.5  # a scale's prior: 1 ± this (the block timings are about right unless timings say otherwise)
NOISE_FLOOR = 0.01  # a whole-model timing counts as at least this uncertain (a ratio's half-interval)
MAX_SCALE = 5.0


def fit_scales(
    table: LatencyTable, info: ModelInfo, resolution: int, timed: Sequence[tuple[PlanShape, RatioInterval | float]]
) -> dict[str, float]:
    """{part: k in [0, MAX_SCALE]} (`SAVING_PARTS`) such that 1 − measured ≈ Σ k · (the part's predicted saving) /
    original over `timed` ((plan, measured ratio) pairs; a plain float is exact): least squares, each timing
    weighted by its interval (a noisy one counts less) and each k pulled toward 1 (± SCALE_SPREAD), so a part no
    timing pins down keeps its block timing. Block timings alone misjudge whole models (on DINOv2-S at 518 px on a
    loaded 2-core machine they predicted 0.88x for merging r = 108, 0.57x on an idle one, and on a busier one that
    nothing was faster than the original); merging's two parts, fewer tokens and the matching's overhead, get a
    scale each, so two merge plans timed fix even an overhead timed too large to leave any saving."""
    rows, targets = [], []
    for plan, value in timed:
        interval = value if isinstance(value, RatioInterval) else RatioInterval.exact(float(value))
        noise = max((interval.high - interval.low) / 2, NOISE_FLOOR)
        saved = table.savings(info, resolution, *plan)
        rows.append([saved[part] / table.original_s / noise for part in SAVING_PARTS])
        targets.append((1.0 - interval.ratio) / noise)
    prior = np.eye(len(SAVING_PARTS)) / SCALE_SPREAD
    a = np.vstack([np.array(rows).reshape(-1, len(SAVING_PARTS)), prior])
    b = np.concatenate([np.array(targets), prior @ np.ones(len(SAVING_PARTS))])
    return {part: float(k) for part, k in zip(SAVING_PARTS, _bounded_least_squares(a, b, MAX_SCALE), strict=True)}


def _bounded_least_squares(a: np.ndarray, b: np.ndarray, high: float) -> np.ndarray:
    """argmin ‖a·x − b‖ over 0 <= x <= high, by trying each variable free, at 0 or at `high` (a handful here)."""
    best, best_error = None, float("inf")
    for bounds in itertools.product((None, 0.0, high), repeat=a.shape[1]):
        x = np.array([0.0 if bound is None else bound for bound in bounds])
        free = [i for i, bound in enumerate(bounds) if bound is None]
        if free:
            x[free] = np.linalg.lstsq(a[:, free], b - a @ x, rcond=None)[0]
        error = float(np.sum((a @ x - b) ** 2))
        if x.min() >= -1e-12 and x.max() <= high + 1e-12 and error < best_error:
            best, best_error = x, error
    return np.clip(best, 0.0, high)


@torch.no_grad()
def measure_latency_table(
    model: nn.Module,
    info: ModelInfo,
    resolution: int,
    contrast_tokens: Sequence[int],
    *,
    mano_windows: Sequence[int] = (),
    repeats: int = 3,
    unmerge: str = "copy",
    min_time: float = 0.0,
    local_window: int = 0,
) -> LatencyTable:
    """Time the original model, its first block at a few token counts (softmax, and merging one token with
    `unmerge`: the matching's overhead) and that block as VCA(n) (with a local term of `local_window` when > 0) and
    as MANO(k) at the full grid; `repeats` rounds (3 at least; `min_time` adds none beyond: every fn runs each
    round, and `min_time` of a 1 ms block would take hundreds of rounds of the whole model). The table gives the
    latency model its shape; whole-model timings correct its level (`latency.TimedPlans.fitted`)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    full = info.tokens(resolution)
    prefix = info.num_prefix_tokens
    counts = sorted({max(prefix + 2, round(prefix + (full - prefix) * f)) for f in (1, 0.6, 0.35, 0.2, 0.1, 0.04)})
    block = info.blocks(model)[0]
    inputs = {t: torch.randn(1, t, info.dim, device=device, dtype=dtype) for t in counts}
    fns = {f"softmax:{t}": (lambda x=x: block(x)) for t, x in inputs.items()}
    image = torch.randn(1, 3, resolution, resolution, device=device, dtype=dtype)
    fns["original"] = lambda: final_tokens(model, image)
    x_full = torch.randn(1, full, info.dim, device=device, dtype=dtype)
    layout = TokenLayout(prefix, info.grid(resolution))
    # (config of a converted twin, {timing name: input of its first block}); merging one token, timed at every
    # token count, costs the matching's overhead alone
    space = plan_space()
    kinds = ((space.kind("vca"), contrast_tokens, local_window), (space.kind("mano"), mano_windows, 0))
    converted: list[tuple[TargetConfig, dict[str, torch.Tensor]]] = [
        (kind.config(value, [0], calibrate=None, local_window=window), {f"{kind.name}:{value}": x_full})
        for kind, values, window in kinds
        for value in values
    ]
    merging = space.schedule_config([1] + [0] * (info.depth - 1), unmerge=unmerge)
    converted.append((merging, {f"merge:{t}": x for t, x in inputs.items()}))
    twins = []  # kept alive while timing
    for config, timed in converted:
        twin = copy.deepcopy(model)
        patch_model(twin, config)
        twins.append(twin)
        twin_block, tracker = info.blocks(twin)[0], get_patch_state(twin).tracker
        if config is merging:  # its block does the end-of-model work too (the unmerge)
            space.mark_timed_block(twin_block)
        for key, x in timed.items():

            def run(b=twin_block, t=tracker, x=x):
                with t.scope(layout):
                    return b(x)

            fns[key] = run
    times = time_interleaved(fns, device, warmup=1, repeats=repeats, min_time=min_time, max_rounds=max(repeats, 3))
    seconds = {name: median(samples) for name, samples in times.items()}
    softmax = [seconds[f"softmax:{t}"] for t in counts]
    other = max(0.0, seconds["original"] - info.depth * softmax[-1])
    overhead = [max(0.0, seconds[f"merge:{t}"] - s) for t, s in zip(counts, softmax, strict=True)]
    return LatencyTable(
        seconds["original"], other, counts, softmax, {n: seconds[f"vca:{n}"] for n in contrast_tokens},
        {k: seconds[f"mano:{k}"] for k in mano_windows}, overhead, local_window,
    )  # fmt: skip
