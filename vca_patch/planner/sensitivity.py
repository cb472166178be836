"""Per-layer sensitivity, measured on calibration images: the fidelity cost of each candidate change alone.

* VCA(n) in one block (with a local term of window `local_window` when > 0; calibrated on the same images when
  `calibrate`), every other block softmax;
* MANO(k) in one block (window k, its preserving init: training-free), every other block softmax;
* merging r tokens per block from block j to the last (the ToMe schedule, started at depth j).

Each is run from the original's hidden state at the first block it changes (teacher-forced up to there), and
scored against the original's final tokens: the losses 1 − CLS cosine and 1 − mean patch-token cosine. The configs
come from the plan space (`targets.base.plan_space()`): its block kinds and merge schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from vca_patch.eval.final_tokens import fidelity
from vca_patch.planner.images import split_for_measurement
from vca_patch.planner.model_info import ModelInfo, block_inputs, run_from
from vca_patch.recovery.calibrate import calibrate as calibrate_model
from vca_patch.recovery.capture import capture_original_layers
from vca_patch.surgery import get_patch_state, patch_model, unpatch_model
from vca_patch.targets.base import BlockKind, TargetConfig, plan_space


@dataclass
class Loss:
    cls: float
    patch: float

    def to_dict(self) -> dict[str, float]:
        return {"cls": self.cls, "patch": self.patch}


@dataclass
class Sensitivity:
    """{(block, n): Loss} of VCA alone in one block; {(start, r): Loss} of merging r per block from `start` on;
    {(block, k): Loss} of MANO with window k alone in one block; `local_window`: the VCA blocks' local term (0: none).
    """

    vca: dict[tuple[int, int], Loss] = field(default_factory=dict)
    merge: dict[tuple[int, int], Loss] = field(default_factory=dict)
    mano: dict[tuple[int, int], Loss] = field(default_factory=dict)
    local_window: int = 0

    def of(self, kind: str) -> dict[tuple[int, int], Loss]:
        """The per-block losses of one attention kind: "vca" ({(block, n): Loss}) or "mano" ({(block, k): Loss})."""
        return {"vca": self.vca, "mano": self.mano}[kind]

    def to_dict(self) -> dict:
        return {
            "vca": [{"block": b, "n": n, **loss.to_dict()} for (b, n), loss in sorted(self.vca.items())],
            "vca_local_window": self.local_window,
            "merge": [{"start": j, "r": r, **loss.to_dict()} for (j, r), loss in sorted(self.merge.items())],
            "mano": [{"block": b, "window": k, **loss.to_dict()} for (b, k), loss in sorted(self.mano.items())],
        }


def _loss(reference: torch.Tensor, candidate: torch.Tensor) -> Loss:
    scores = fidelity(reference.double(), candidate.double())
    return Loss(1.0 - scores["cls_cosine"], 1.0 - scores["patch_token_cosine"])


def merge_rates(info: ModelInfo, resolution: int, start: int, fractions: Sequence[float]) -> list[int]:
    """r per block that merges about `fraction` of the patch tokens away over blocks start..depth-1."""
    patches = info.tokens(resolution) - info.num_prefix_tokens
    blocks = info.depth - start
    return sorted({max(1, round(f * patches / blocks)) for f in fractions})


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
    log: Callable[[str], None] | None = None,
) -> Sensitivity:
    """Measure every candidate alone; the model is left unpatched as it came. With calibration, VCA blocks are
    calibrated on every other image and every candidate is scored on the rest (`split_for_measurement`). Merging
    is measured with `unmerge` (the plan space's), as the plan will apply it."""
    log = log or (lambda message: None)
    space = plan_space()
    fit, images = split_for_measurement(images, calibrate)
    states = block_inputs(model, info, images)
    reference = model.get_submodule(info.norm_path)(states[-1])
    result = Sensitivity(local_window=local_window)

    def loss_of(config: TargetConfig, start: int, calibrate_block: Callable[[int], None] | None = None) -> Loss:
        """The loss of `config` run from block `start` (calibrated there first with `calibrate_block`, when given);
        the model is unpatched after."""
        patch_model(model, config)
        try:
            if calibrate_block is not None:
                calibrate_block(start)
            return _loss(reference, run_from(model, info, start, states[start], resolution))
        finally:
            unpatch_model(model)

    for start in merge_starts:
        for r in merge_rates(info, resolution, start, merge_fractions):
            schedule = [0] * start + [r] * (info.depth - start)
            result.merge[(start, r)] = loss_of(space.schedule_config(schedule, unmerge=unmerge), start)
        done = [(r, round(1 - loss.cls, 4)) for (j, r), loss in result.merge.items() if j == start]
        log(f"  merging from block {start}: (r, CLS cosine) {done}")
    kinds = ((space.kind("vca"), contrast_tokens, local_window), (space.kind("mano"), mano_windows, 0))
    for kind, values, window in kinds:
        fits = _calibration(model, kind, values[0], fit) if calibrate and kind.calibrates and values else None
        settings = {"calibrate": calibrate if kind.calibrates else None, "local_window": window}
        for value in values:
            for block in range(info.depth):
                result.of(kind.name)[(block, value)] = loss_of(kind.config(value, [block], **settings), block, fits)
            alone = [round(1 - result.of(kind.name)[(b, value)].cls, 4) for b in range(info.depth)]
            local = f" + local {window}x{window}" if window else ""
            log(f"  {kind.label} {kind.symbol}={value}{local}: CLS cosine alone per block {alone}")
    return result


def _calibration(model: nn.Module, kind: BlockKind, value: int, fit: torch.Tensor) -> Callable[[int], None]:
    """`calibrate(block)`: calibrates that block of the model (patched with `kind` there) on `fit`, from the
    original layers' inputs and outputs captured once here for every block (with `kind` at `value` everywhere)."""
    patch_model(model, kind.config(value, None, calibrate=True, local_window=0))
    try:
        paths = {site.layer_index: site.path for site in get_patch_state(model).report.patched}
        captures = capture_original_layers(model, [fit])
    finally:
        unpatch_model(model)

    def calibrate(block: int) -> None:
        with torch.enable_grad():
            calibrate_model(model, [fit], captures={paths[block]: captures[paths[block]]})

    return calibrate
