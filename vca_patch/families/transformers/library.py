"""transformers' library hooks (families/library.py): its guard checks and loading by folder or Hub id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.families.library import ModelLibrary
from vca_patch.families.transformers.guard import check_transformers_base


class TransformersLibrary(ModelLibrary):
    name = "transformers"
    load_priority = 20  # after diffusers (whose folders and repos also hold a config.json / have a slash)

    def check_base(self, base: dict[str, Any], where: str) -> None:
        check_transformers_base(base, where)

    def claims(self, name: str) -> bool:
        from vca_patch.families.transformers.load import names_transformers_model

        return names_transformers_model(name)

    def load(
        self, name: str, *, pretrained: bool = True, weights: Path | None = None, model_args: dict[str, Any] | None
    ) -> nn.Module:
        from vca_patch.families.transformers.load import load_transformers_model

        if model_args:
            raise ConfigError(
                f"model_args are timm constructor options ({', '.join(sorted(model_args))}); {name} is a "
                "transformers model, whose sizes come from its config.json: drop them (bench: use a timm model)"
            )
        return load_transformers_model(name, pretrained=pretrained, weights=weights)

    def sizes_from_config(self, name: str) -> bool:
        """A local folder with a config.json (the diffusers library claims its own folders first), or an ORG/NAME
        Hub id: its image size is its config's."""
        from vca_patch.families.transformers.load import names_transformers_model

        folder = Path(name)
        return (folder / "config.json").is_file() if folder.is_dir() else names_transformers_model(name)

    def legacy_exports(self) -> dict[str, Any]:
        """transformers' checks and loader, once re-exported by checkpoint.config_guard / checkpoint.base_model."""
        from vca_patch.families.transformers import guard
        from vca_patch.families.transformers.load import load_transformers_model

        names = ("check_transformers_base", "check_transformers_config", "local_name_or_path_removed",
                 "transformers_model_class")  # fmt: skip
        return {name: getattr(guard, name) for name in names} | {"load_transformers_model": load_transformers_model}


TRANSFORMERS = TransformersLibrary()
