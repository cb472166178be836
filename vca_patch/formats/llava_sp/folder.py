"""Save a LLaVA model with spatial tokens to a folder, and rebuild it from one (the file names and the metadata
check are the target's: `vca_patch.targets.llava_sp.io`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import nn

from vca_patch.core.atomic import staged_directory
from vca_patch.formats.llava_sp.vision_patch import new_tensors, reapply_vision_patch, vision_patch_records
from vca_patch.targets.llava_sp.card import render_card
from vca_patch.targets.llava_sp.config import SpatialTokensConfig
from vca_patch.targets.llava_sp.io import (
    CONFIG_FILE,
    FORMAT_VERSION,
    VISION_PATCH_FILE,
    WEIGHTS_FILE,
    read_spatial_tokens_config,
)
from vca_patch.targets.llava_sp.model import (
    SpatialTokensError,
    add_spatial_tokens,
    get_spatial_projector,
    image_token_count,
    llava_core,
)


def save_spatial_tokens(
    model: nn.Module,
    path: str | Path,
    *,
    processor: Any = None,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (a transformers LLaVA with spatial tokens) to `path`, atomically.

    The folder holds the LLaVA itself via `save_pretrained` (without the new modules, so its state-dict keys
    are the original ones), `spatial_tokens.safetensors` + `spatial_tokens.json`, a README.md card, and the
    processor (if given) with its image-token count updated. A VCA/MANO patch of the vision tower is recorded
    in spatial_tokens.json (its tensors are in the LLaVA's weights) and re-applied by load_spatial_tokens.
    """
    from transformers import PreTrainedModel

    projector = get_spatial_projector(model)
    if projector is None:
        raise SpatialTokensError("the model has no spatial tokens; use save_pretrained for a plain model")
    if not isinstance(model, PreTrainedModel):
        raise SpatialTokensError(
            f"{type(model).__name__} is not a transformers PreTrainedModel; with a PEFT (LoRA) model, call "
            "merge_and_unload() first and save the merged model"
        )
    meta = {
        "format": SpatialTokensConfig.format,
        "version": FORMAT_VERSION,
        "config": projector.spatial_config.to_dict(),
        **projector.settings(),
        "view_sizes": projector.spatial_tokens.sizes,
        "image_tokens": image_token_count(model),
        "parameters": sum(p.numel() for p in projector.spatial_tokens.parameters()),
        "vision_patch": vision_patch_records(model),
        "metadata": metadata or {},
    }
    json.dumps(meta)  # fail on non-JSON metadata before writing anything
    core = llava_core(model)
    with staged_directory(Path(path), overwrite=overwrite) as stage:
        core.multi_modal_projector = projector.original
        if projector.base_image_seq_length is not None:
            core.config.image_seq_length = projector.base_image_seq_length
        try:
            meta["base_image_tokens"] = image_token_count(model)
            model.save_pretrained(stage)
        finally:
            core.multi_modal_projector = projector
            if projector.base_image_seq_length is not None:
                core.config.image_seq_length = meta["image_tokens"]
        state = {k: v.detach().contiguous() for k, v in projector.spatial_tokens.state_dict().items()}
        save_file(state, str(stage / WEIGHTS_FILE))
        if meta["vision_patch"]:
            save_file(new_tensors(model), str(stage / VISION_PATCH_FILE))
        (stage / CONFIG_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        (stage / "README.md").write_text(render_card(meta), encoding="utf-8")
        if processor is not None:
            image_token_count(model, processor)
            processor.save_pretrained(stage)
    return Path(path)


def load_spatial_tokens(path: str | Path, **from_pretrained_kwargs: Any) -> nn.Module:
    """Rebuild a model saved by save_spatial_tokens: the LLaVA via transformers' from_pretrained (kwargs such
    as dtype or device_map pass through), then the spatial tokens with their saved weights."""
    import transformers

    path = Path(path)
    meta = read_spatial_tokens_config(path)
    config = SpatialTokensConfig.from_dict(meta["config"])
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise SpatialTokensError(f"{path} has {CONFIG_FILE} but no {WEIGHTS_FILE}")
    state = load_file(str(weights_file))
    llava_config = transformers.AutoConfig.from_pretrained(path)
    architecture = (llava_config.architectures or ["LlavaForConditionalGeneration"])[0]
    model_cls = getattr(transformers, architecture, None)
    if model_cls is None:
        raise SpatialTokensError(f"{path}/config.json names an unknown architecture {architecture!r}")
    records = meta.get("vision_patch") or []
    verbosity = transformers.logging.get_verbosity()
    if records:  # the patched layers' own tensors are unexpected to transformers: read back below, not lost
        transformers.logging.set_verbosity_error()
    try:
        model = model_cls.from_pretrained(path, **from_pretrained_kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)
    reapply_vision_patch(model, records, path / VISION_PATCH_FILE)
    add_spatial_tokens(model, config)
    projector = get_spatial_projector(model)
    settings = projector.settings()
    for key in ("grid", "num_prefix_tokens"):
        if settings[key] != meta[key]:
            raise SpatialTokensError(f"{path}: saved {key}={meta[key]} but the rebuilt model has {settings[key]}")
    projector.spatial_tokens.load_state_dict(state, strict=True)
    return model
