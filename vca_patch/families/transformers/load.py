"""Building a transformers model to convert: a local folder or ORG/NAME Hub id, with its own, local or random
weights (the Hub asked only when it is reachable)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from vca_patch.core.errors import UnsafeConfigError
from vca_patch.core.hub_access import HubUnavailableError, UnknownModelError, hub_offline_reason, offline_error
from vca_patch.core.install import install_hint
from vca_patch.core.weights import load_state_dict_checked, read_state_dict
from vca_patch.families.transformers.guard import transformers_model_class

HUB_PREFIX = "hf-hub:"


def names_transformers_model(name: str) -> bool:
    """A local folder with a config.json, or an ORG/NAME Hub id (timm names have no slash). Diffusers folders and
    repos are claimed first by the diffusers library (load_base_model asks it before this one)."""
    folder = Path(name)
    if folder.is_dir():
        return (folder / "config.json").is_file()
    return "/" in name and not name.startswith(HUB_PREFIX) and not name.startswith((".", "/"))


def load_transformers_model(name: str, *, pretrained: bool = True, weights: Path | None = None) -> nn.Module:
    """A transformers model from a local folder or Hub id, with its own, local or random weights."""
    try:
        import transformers
    except ImportError:
        raise UnknownModelError(
            f"{name} looks like a Hugging Face transformers model; install it with {install_hint('hf')}"
        ) from None
    reason = None if Path(name).is_dir() else hub_offline_reason()
    try:
        config = transformers.AutoConfig.from_pretrained(name, local_files_only=reason is not None)
    except (OSError, ValueError) as exc:
        if reason:
            error = offline_error(f"the config of {name}", reason)
            raise HubUnavailableError(f"{error} (A diffusers model: pass its local folder, with model_index.json and "
                                      "transformer/.)") from exc  # fmt: skip
        raise UnknownModelError(f"{name} is neither a timm name nor a transformers model: {exc}") from exc
    if config.architectures:
        try:
            model_cls = transformers_model_class(config.architectures[0], f"the config of {name}", "architectures[0]")
        except UnsafeConfigError as exc:
            raise UnknownModelError(str(exc)) from None
    else:
        model_cls = transformers.AutoModel
    if weights is not None:
        state_dict = read_state_dict(weights)
        model = model_cls(config) if model_cls is not transformers.AutoModel else model_cls.from_config(config)
        load_state_dict_checked(model, state_dict, str(weights))
        return model
    if not pretrained:
        return model_cls(config) if model_cls is not transformers.AutoModel else model_cls.from_config(config)
    try:
        return model_cls.from_pretrained(name, local_files_only=reason is not None)
    except OSError as exc:
        if reason:
            raise offline_error(f"pretrained weights of {name}", reason) from exc
        raise
