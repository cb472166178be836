"""diffusers' library hooks (families/library.py): its guard check (`guard.check_diffusers_base`), loading a
pipeline's transformer (`source`) and the card's generation task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vca_patch.families.diffusers.guard import check_diffusers_base
from vca_patch.families.diffusers.source import is_diffusers_source, is_local_diffusers, load_diffusers_transformer
from vca_patch.families.library import ModelLibrary

# The Hub task of a base architecture (None: no Hub task fits, e.g. class-conditional DiT).
TASKS = {
    "DiTTransformer2DModel": None,
    "PixArtTransformer2DModel": "text-to-image",
    "SD3Transformer2DModel": "text-to-image",
    "FluxTransformer2DModel": "text-to-image",
}


class DiffusersLibrary(ModelLibrary):
    name = "diffusers"
    load_priority = 10  # before transformers: a diffusers folder or repo also has a config.json / a slash

    def check_base(self, base: dict[str, Any], where: str) -> None:
        check_diffusers_base(base, where)

    def card_task(self, base: dict[str, Any], default: str | None) -> str | None:
        return TASKS.get(base["architecture"], default)

    def claims(self, name: str) -> bool:
        return is_diffusers_source(name)

    def load(
        self, name: str, *, pretrained: bool = True, weights: Path | None = None, model_args: dict[str, Any] | None
    ) -> nn.Module:
        if model_args:
            raise TypeError(f"{name} is a diffusers model: no img_size or other timm model_args (any latent size runs)")
        return load_diffusers_transformer(name, pretrained=pretrained, weights=weights)

    def takes_no_images(self, name: str) -> bool:
        """A local pipeline or transformer folder: its model denoises latents, it takes no images."""
        return is_local_diffusers(name)


DIFFUSERS = DiffusersLibrary()
