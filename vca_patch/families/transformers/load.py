"""Building a transformers model to convert: a local folder or ORG/NAME Hub id, with its own, local or random
weights (the Hub asked only when it is reachable)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vca_patch.core.bounded import read_json
from vca_patch.core.errors import ConfigError, UnsafeConfigError
from vca_patch.core.hub_access import (
    HubUnavailableError,
    UnknownModelError,
    hub_offline_reason,
    is_path_like,
    offline_error,
)
from vca_patch.core.install import install_hint
from vca_patch.core.sizes import check_model_config
from vca_patch.core.weights import WeightsFileError, check_weight_values, load_state_dict_checked, read_state_dict
from vca_patch.families.transformers.guard import transformers_model_class

HUB_PREFIX = "hf-hub:"
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".onnx", ".pt2", ".ckpt", ".yaml")


def names_transformers_model(name: str) -> bool:
    """A local folder with a config.json, or an ORG/NAME Hub id (timm names have no slash). Diffusers folders and
    repos are claimed first by the diffusers library (load_base_model asks it before this one). A file given as a
    path or with a file's suffix, and a folder given as a path, are claimed too, so that loading says what to pass
    instead (a model is a folder with config.json; a timm name is neither)."""
    folder = Path(name)
    if folder.is_dir():
        return (folder / "config.json").exists() or is_path_like(name)
    if folder.exists():  # a file given as a path, or named like one (a timm name is never a file)
        return "/" in name or is_path_like(name) or folder.suffix in _FILE_SUFFIXES
    return "/" in name and not name.startswith(HUB_PREFIX) and not name.startswith((".", "/"))


def _check_local_source(name: str) -> None:
    """A local model path is a folder whose config.json is a regular JSON file within the size and nesting limits
    (`core.bounded`); a ConfigError naming the path otherwise. Hub ids are left to the Hub."""
    path = Path(name)
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(
            f"{name} is a file; a transformers model is a folder with config.json (pass the folder), and a weights "
            "file goes with --weights FILE beside the model's name"
        )
    if not (path / "config.json").exists():
        raise ConfigError(
            f"{name} is a folder without config.json; a transformers model folder holds config.json and its "
            "weights (save_pretrained writes both), and a timm model is given by its name"
        )
    read_json(path / "config.json", "model config", error=ConfigError)


def _checked_config(config: Any, name: str) -> None:
    """The config's sizes checked before a model is built from it (`core.sizes.check_model_config`)."""
    where = str(Path(name) / "config.json") if Path(name).is_dir() else f"the config of {name}"
    check_model_config(config.to_dict(), where)


def load_transformers_model(name: str, *, pretrained: bool = True, weights: Path | None = None) -> nn.Module:
    """A transformers model from a local folder or Hub id, with its own, local or random weights."""
    try:
        import transformers
    except ImportError:
        raise UnknownModelError(
            f"{name} looks like a Hugging Face transformers model; install it with {install_hint('hf')}"
        ) from None
    _check_local_source(name)
    reason = None if Path(name).is_dir() else hub_offline_reason()
    try:
        config = transformers.AutoConfig.from_pretrained(name, local_files_only=reason is not None)
    except (OSError, ValueError) as exc:
        if reason:
            error = offline_error(f"the config of {name}", reason)
            raise HubUnavailableError(f"{error} (A diffusers model: pass its local folder, with model_index.json and "
                                      "transformer/.)") from exc  # fmt: skip
        raise UnknownModelError(f"{name} is neither a timm name nor a transformers model: {exc}") from exc
    _checked_config(config, name)
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
    model = _pretrained(model_cls, name, reason)
    check_weight_values(model, model.state_dict(), f"the pretrained weights of {name}")  # no NaN, no infinity
    return model


def _pretrained(model_cls: Any, name: str, reason: str | None) -> nn.Module:
    """`model_cls.from_pretrained(name)`; a local folder without weights, or with a truncated or corrupt weights
    file, is one error naming the folder (a Hub id offline: the Hub's error)."""
    from safetensors import SafetensorError

    try:
        return model_cls.from_pretrained(name, local_files_only=reason is not None)
    except OSError as exc:
        if reason:
            raise offline_error(f"pretrained weights of {name}", reason) from exc
        if not Path(name).is_dir():
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200].rstrip(".")
        raise ConfigError(f"{name}: {first}; pass --weights FILE, or --no-pretrained for random weights") from None
    except SafetensorError as exc:
        raise WeightsFileError(
            f"the weights in {name} are not a readable safetensors file ({exc}): the file is truncated, corrupt or "
            "not a weights file; download or export it again"
        ) from None
