"""Per-layer sensitivity, measured on calibration images: the fidelity cost of each candidate change alone.

* VCA(n) in one block (with a local term of window `local_window` when > 0; calibrated on the same images when
  `calibrate`), every other block softmax;
* MANO(k) in one block (window k, its preserving init: training-free), every other block softmax;
* merging r tokens per block from block j to the last (the ToMe schedule, started at depth j), and front-loaded:
  a share of the patch tokens merged in block j itself, then r per block (`MergeSchedule`).

Each is run from the original's hidden state at the first block it changes (teacher-forced up to there), and
scored against the original's final tokens: the losses 1 − CLS cosine and 1 − mean patch-token cosine. The configs
come from the plan space (`targets.base.plan_space()`): its block kinds and merge schedules.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from vca_patch.eval.final_tokens import fidelity
from vca_patch.planner.images import split_for_measurement
from vca_patch.planner.model_info import ModelInfo, block_inputs, run_blocks, run_from
from vca_patch.recovery.calibrate import calibrate as calibrate_model
from vca_patch.recovery.capture import capture_original_layers
from vca_patch.surgery import patch_model, unpatch_model
from vca_patch.targets.base import TargetConfig, plan_space
from vca_patch.targets.handler import handler_for


@dataclass
class Loss:
    cls: float
    patch: float

    def to_dict(self) -> dict[str, float]:
        return {"cls": self.cls, "patch": self.patch}


@dataclass(frozen=True)
class MergeSchedule:
    """Token merging from block `start` on: `r` tokens after each block, except `first` (when given) after block
    `start` itself. A front-loaded merge (a large `first`, a small `r`) keeps more tokens to the end than ToMe's
    constant r at the same cost, so the unmerge has more to give back: patch tokens stay closer (DINOv2-S at 518 px,
    calibration crops: `docs/guides/planner.md`)."""

    start: int
    r: int
    first: int | None = None

    @property
    def lead(self) -> int:
        """Tokens merged after block `start`."""
        return self.r if self.first is None else self.first

    def per_block(self, depth: int) -> list[int]:
        """r of every block of a `depth`-block model: 0 before `start`."""
        return [0] * self.start + [self.lead] + [self.r] * (depth - self.start - 1)

    def label(self) -> str:
        """ "r=114", or "452 then r=34" when front-loaded."""
        return f"r={self.r}" if self.first is None else f"{self.first} then r={self.r}"

    def __lt__(self, other: MergeSchedule) -> bool:
        return (self.start, self.lead, self.r) < (other.start, other.lead, other.r)


@dataclass
class Sensitivity:
    """{(block, n): Loss} of VCA alone in one block; {MergeSchedule: Loss} of each merge schedule;
    {(block, k): Loss} of MANO with window k alone in one block; `local_window`: the VCA blocks' local term (0: none).
    """

    vca: dict[tuple[int, int], Loss] = field(default_factory=dict)
    merge: dict[MergeSchedule, Loss] = field(default_factory=dict)
    mano: dict[tuple[int, int], Loss] = field(default_factory=dict)
    local_window: int = 0

    def of(self, kind: str) -> dict[tuple[int, int], Loss]:
        """The per-block losses of one attention kind: "vca" ({(block, n): Loss}) or "mano" ({(block, k): Loss})."""
        return {"vca": self.vca, "mano": self.mano}[kind]

    def to_dict(self) -> dict:
        return {
            "vca": [{"block": b, "n": n, **loss.to_dict()} for (b, n), loss in sorted(self.vca.items())],
            "vca_local_window": self.local_window,
            "merge": [
                {"start": s.start, "r": s.r, "first": s.lead, **loss.to_dict()}
                for s, loss in sorted(self.merge.items())
            ],
            "mano": [{"block": b, "window": k, **loss.to_dict()} for (b, k), loss in sorted(self.mano.items())],
        }


def _loss(reference: torch.Tensor, candidate: torch.Tensor) -> Loss:
    scores = fidelity(reference.double(), candidate.double())
    return Loss(1.0 - scores["cls_cosine"], 1.0 - scores["patch_token_cosine"])


def merge_rates(info: ModelInfo, resolution: int, start: int, fractions: Sequence[float]) -> list[int]:
    """r per block that merges about `fraction` of the patch tokens away over blocks start..depth-1.

    A fraction f asks for r = f · patches / (blocks from `start` on). One merge takes at most half the patch tokens
    left (ToMe's bipartite matching), so the last blocks of a large r take what is left: a fraction above 1 merges
    more in the early blocks and leaves fewer tokens sooner, which is what reaches the fastest plans (DINOv2-S at
    518 px from block 0: 1.0 is r = 114, 1.2 is r = 137)."""
    patches = info.tokens(resolution) - info.num_prefix_tokens
    blocks = info.depth - start
    return sorted({max(1, round(f * patches / blocks)) for f in fractions})


def merge_schedules(
    info: ModelInfo,
    resolution: int,
    starts: Sequence[int],
    fractions: Sequence[float],
    lead_shares: Sequence[float] = (),
) -> list[MergeSchedule]:
    """Every constant r of `merge_rates` from each start and, for each share s of `lead_shares` (of the patch
    tokens, at most 0.5: one merge takes at most half), the same r after a first block that merges s of the patch
    tokens: front-loaded schedules (where that is more than r)."""
    patches = info.tokens(resolution) - info.num_prefix_tokens
    leads = sorted({min(round(share * patches), (patches + 1) // 2) for share in lead_shares})
    out = []
    for start in starts:
        for r in merge_rates(info, resolution, start, fractions):
            out.append(MergeSchedule(start, r))
            out += [MergeSchedule(start, r, lead) for lead in leads if lead > r]
    return out


@torch.no_grad()
def measure_sensitivity(
    model: nn.Module,
    info: ModelInfo,
    images: torch.Tensor,
    resolution: int,
    *,
    contrast_tokens: Sequence[int],
    merge_starts: Sequence[int],
    merge_fractions: Sequence[float],
    mano_windows: Sequence[int] = (),
    calibrate: bool = True,
    unmerge: str = "copy",
    local_window: int = 0,
    merges: Sequence[MergeSchedule] | None = None,
    blocks: Sequence[int] | None = None,
    log: Callable[[str], None] | None = None,
) -> Sensitivity:
    """Measure every candidate alone; the model is left unpatched as it came. With calibration, VCA blocks are
    calibrated on every other image and every candidate is scored on the rest (`split_for_measurement`). Merging
    is measured with `unmerge` (the plan space's), as the plan will apply it. `merges`: the schedules to measure
    (default: `merge_schedules` of the starts and fractions); `blocks`: where VCA and MANO are measured (default:
    every block), e.g. only those a plan within the budget could convert."""
    log = log or (lambda message: None)
    space = plan_space()
    fit, images = split_for_measurement(images, calibrate)
    states = block_inputs(model, info, images)
    reference = model.get_submodule(info.norm_path)(states[-1])
    result = Sensitivity(local_window=local_window)
    merges = merge_schedules(info, resolution, merge_starts, merge_fractions) if merges is None else merges
    for schedule in merges:
        config = space.schedule_config(schedule.per_block(info.depth), unmerge=unmerge)
        loss = _merge_loss(model, info, resolution, config, schedule.start, states, reference)
        result.merge[schedule] = loss
    for start in sorted({s.start for s in result.merge}):
        done = [f"{s.label()} {1 - loss.cls:.4f}" for s, loss in sorted(result.merge.items()) if s.start == start]
        log(f"  merging from block {start}, CLS cosine: {', '.join(done)}")
    blocks = list(range(info.depth) if blocks is None else blocks)
    for kind, values, window in ((space.kind("vca"), contrast_tokens, local_window),
                                 (space.kind("mano"), mano_windows, 0)):  # fmt: skip
        for value in values if blocks else ():
            config = kind.config(value, blocks, calibrate=calibrate if kind.calibrates else None, local_window=window)
            twin = _converted(model, config, fit if calibrate else None)
            for block in blocks:
                hidden = run_blocks(twin, info, block, block + 1, states[block], resolution)
                loss = _loss(reference, run_from(model, info, block + 1, hidden, resolution))
                result.of(kind.name)[(block, value)] = loss
            alone = [round(1 - result.of(kind.name)[(b, value)].cls, 4) for b in blocks]
            local = f" + local {window}x{window}" if window else ""
            log(f"  {kind.label} {kind.symbol}={value}{local}: CLS cosine alone in blocks {blocks}: {alone}")
    return result


def _merge_loss(
    model: nn.Module,
    info: ModelInfo,
    resolution: int,
    config: TargetConfig,
    start: int,
    states: list[torch.Tensor],
    reference: torch.Tensor,
) -> Loss:
    """The loss of a merge schedule starting at block `start`, run from the original's state entering it; the
    model is unpatched after."""
    patch_model(model, config)
    try:
        return _loss(reference, run_from(model, info, start, states[start], resolution))
    finally:
        unpatch_model(model)


def _converted(model: nn.Module, config: TargetConfig, fit: torch.Tensor | None) -> nn.Module:
    """A copy of `model` with `config`'s blocks converted and, given `fit` images and a kind that calibrates, each
    calibrated teacher-forced on them (from the original's inputs to that block: what calibrating it alone does).
    One copy per setting, its blocks then run one at a time between the original's, instead of one patch and one
    calibration per block (each patch verifies every layer: ~40 s of the old planner's 12 minutes)."""
    twin = copy.deepcopy(model)
    patch_model(twin, config)
    handler = handler_for(config)
    if fit is not None and any(handler.calibrates(config, module) for module in twin.modules()):
        calibrate_model(twin, [fit], captures=capture_original_layers(twin, [fit]))
    return twin
