"""Per-layer sensitivity, measured on calibration images: the fidelity cost of each candidate change alone.

* VCA(n) in one block (with a local term of window `local_window` when > 0; calibrated on the same images when
  `calibrate`), every other block softmax;
* MANO(k) in one block (window k, its preserving init: training-free), every other block softmax;
* merging r tokens per block from block j to the last (the ToMe schedule, started at depth j).

Each is run from the original's hidden state at the first block it changes (teacher-forced up to there), and
scored against the original's final tokens: the losses 1 − CLS cosine and 1 − mean patch-token cosine.
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
from vca_patch.targets.mano.config import MANOConfig
from vca_patch.targets.merge import MergeConfig
from vca_patch.targets.vca.config import VCAConfig


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
    is measured with `unmerge` (MergeConfig's), as the plan will apply it."""
    log = log or (lambda message: None)
    fit, images = split_for_measurement(images, calibrate)
    states = block_inputs(model, info, images)
    reference = model.get_submodule(info.norm_path)(states[-1])
    result = Sensitivity(local_window=local_window)
    for start in merge_starts:
        for r in merge_rates(info, resolution, start, merge_fractions):
            patch_model(model, MergeConfig(schedule=[0] * start + [r] * (info.depth - start), unmerge=unmerge))
            try:
                result.merge[(start, r)] = _loss(reference, run_from(model, info, start, states[start], resolution))
            finally:
                unpatch_model(model)
        done = [(r, round(1 - loss.cls, 4)) for (j, r), loss in result.merge.items() if j == start]
        log(f"  merging from block {start}: (r, CLS cosine) {done}")
    captures: dict = {}
    paths: dict[int, str] = {}
    if calibrate and contrast_tokens:  # the original layers' inputs/outputs, captured once for every layer
        patch_model(model, VCAConfig(contrast_tokens=contrast_tokens[0], token_magnitude=True))
        try:
            paths = {site.layer_index: site.path for site in get_patch_state(model).report.patched}
            captures = capture_original_layers(model, [fit])
        finally:
            unpatch_model(model)
    for n in contrast_tokens:
        for block in range(info.depth):
            config = VCAConfig(contrast_tokens=n, layers=[block], token_magnitude=calibrate, local_window=local_window)
            patch_model(model, config)
            try:
                if calibrate:
                    with torch.enable_grad():
                        calibrate_model(model, [fit], captures={paths[block]: captures[paths[block]]})
                result.vca[(block, n)] = _loss(reference, run_from(model, info, block, states[block], resolution))
            finally:
                unpatch_model(model)
        alone = [round(1 - result.vca[(b, n)].cls, 4) for b in range(info.depth)]
        log(
            f"  VCA n={n}{f' + local {local_window}x{local_window}' if local_window else ''}: CLS cosine alone "
            f"per block {alone}"
        )
    for k in mano_windows:
        for block in range(info.depth):
            patch_model(model, MANOConfig(window=k, layers=[block]))
            try:
                result.mano[(block, k)] = _loss(reference, run_from(model, info, block, states[block], resolution))
            finally:
                unpatch_model(model)
        alone = [round(1 - result.mano[(b, k)].cls, 4) for b in range(info.depth)]
        log(f"  MANO k={k}: CLS cosine alone per block {alone}")
    return result
