"""What a model family does for the checkpoint and loading code: the hooks of its model library.

Each family package declares one `ModelLibrary` (families/timm/library.py, families/transformers/library.py,
families/diffusers/library.py) and sets it as `library` on its adapters; an out-of-tree family does the same
before `register_family`. Shared code finds libraries through the registered adapters (`vca_patch.families.
libraries()` / `library_for_name`) and dispatches by the adapter name and `base.library` recorded in
config.json:

- `checkpoint.config_guard.check_loadable` calls `check_base` (and `check_config_keys`) before anything is built;
- `checkpoint.folder` adds `config_keys` to config.json;
- `checkpoint.base_model.load_base_model` asks libraries by `load_priority` whether they `claim` a name, and the
  first that does `load`s it (`vca_patch.families.library_for_name`); `sizes_from_config` tells the CLI whether
  `--img-size` is a model argument or must match the model's own config;
- `cli.convert` asks `takes_no_images` before loading, to refuse image options for a model that takes no images;
- `checkpoint.model_card` asks `card_task` for the card's pipeline tag;
- `checkpoint.config_guard` / `checkpoint.base_model` re-export a built-in library's `legacy_exports` for old imports.

An adapter without a library (`library = None`, e.g. generic detection) converts models but cannot be saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vca_patch.core.errors import UnsafeConfigError


class ModelLibrary:
    """Hooks for one model library (timm, transformers, diffusers, or an out-of-tree one)."""

    name: str = ""  # the `base.library` its adapters' `describe_base` records
    # load_base_model asks libraries in increasing order (ties: registration order); the first that claims a
    # name loads it. Built in: diffusers 10, transformers 20, timm 90 (the fallback: it claims every name).
    load_priority: int = 0

    def check_base(self, base: dict[str, Any], where: str) -> None:
        """Refuse (UnsafeConfigError) a config.json `base` that could name anything but a model class and plain
        options; runs before `create_base` sees it. A library that cannot check its bases cannot be loaded."""
        raise UnsafeConfigError(f"{where}: the {self.name!r} library declares no base check; it cannot be loaded")

    def check_config_keys(self, meta: dict[str, Any], where: str) -> None:
        """Check the library's own top-level config.json keys (those `config_keys` writes)."""

    def config_keys(self, model: nn.Module, base: dict[str, Any]) -> dict[str, Any]:
        """Extra top-level config.json keys for a patched model of this library (e.g. timm's own)."""
        return {}

    def card_task(self, base: dict[str, Any], default: str | None) -> str | None:
        """The model card's pipeline tag for this base (`default`: image classification)."""
        return default

    def claims(self, name: str) -> bool:
        """Whether `load` builds the model `name` (a model name, Hub id or local folder) for load_base_model."""
        return False

    def load(
        self, name: str, *, pretrained: bool = True, weights: Path | None = None, model_args: dict[str, Any] | None
    ) -> nn.Module:
        """The model `name` with its own (`pretrained`), local (`weights`) or random weights."""
        raise NotImplementedError(f"the {self.name!r} library loads no models by name")

    def sizes_from_config(self, name: str) -> bool:
        """Whether the model `name` takes its input size from its own config rather than an `img_size` model
        argument (transformers): the CLI then passes no `model_args` and refuses an `--img-size` that differs from
        the config's. Asked of the library that claims a local folder, and of every library for other names."""
        return False

    def takes_no_images(self, name: str) -> bool:
        """Whether `name` is, from local files alone (no Hub access), a model of this library that takes no images
        (a diffusers pipeline folder), so that `convert` refuses image options before loading it."""
        return False

    def legacy_exports(self) -> dict[str, Any]:
        """Name -> object of the library's own checks and loaders that `checkpoint.config_guard` and
        `checkpoint.base_model` re-exported before they moved into the family's package; old imports of those
        names from there still resolve (built-in libraries only). A new library has none."""
        return {}
