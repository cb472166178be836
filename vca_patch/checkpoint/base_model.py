"""Building the model to convert: a timm name, `hf-hub:` id or transformers model; pretrained, local or random weights.

Network access is checked up front, so an offline machine gets a clear error in seconds instead
of a long retry loop.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from torch import nn

from vca_patch.checkpoint.config_guard import UnsafeConfigError, check_timm_model_args, transformers_model_class
from vca_patch.core.hub_access import (
    HubUnavailableError,
    UnknownModelError,
    hub_offline_reason,
)
from vca_patch.core.weights import load_state_dict_checked, read_state_dict

HUB_PREFIX = "hf-hub:"


def _offline_error(what: str, reason: str) -> HubUnavailableError:
    return HubUnavailableError(
        f"{what} must come from the Hugging Face Hub, which is unreachable here ({reason}). "
        "Use --weights FILE for a local checkpoint, or --no-pretrained for random weights."
    )


def is_transformers_source(name: str) -> bool:
    """A local transformers model folder, or an ORG/NAME Hub id (timm names have no slash)."""
    folder = Path(name)
    if folder.is_dir():
        from vca_patch.families.diffusers.source import local_transformer_folder

        return (folder / "config.json").is_file() and local_transformer_folder(folder) is None  # not diffusers'
    return "/" in name and not name.startswith(HUB_PREFIX) and not name.startswith((".", "/"))


def check_timm_name(name: str) -> None:
    """Raise UnknownModelError with close matches when `name` is not a timm architecture."""
    import timm

    if name.startswith(HUB_PREFIX):
        return
    if timm.is_model(name.split(".")[0]):
        return
    close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
    hint = f"; did you mean: {', '.join(close)}?" if close else "; see timm.list_models()"
    raise UnknownModelError(f"unknown model {name!r}{hint}")


def _pretrained_file(name: str) -> str:
    """Local path of the model's pretrained weights: from the Hub cache, else downloaded."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name)
    hub_id = getattr(cfg, "hf_hub_id", None) if cfg is not None else None
    if not hub_id:
        raise HubUnavailableError(f"timm knows no Hub weights for {name!r}; use --weights FILE or --no-pretrained")
    filenames = ("model.safetensors", "pytorch_model.bin")
    for filename in filenames:
        cached = try_to_load_from_cache(hub_id, filename)
        if isinstance(cached, str):
            return cached
    reason = hub_offline_reason()
    if reason:
        raise _offline_error(f"pretrained weights of {name} ({hub_id})", reason)
    errors = []
    for filename in filenames:  # older repos hold only the torch file
        try:
            return hf_hub_download(hub_id, filename, etag_timeout=5)
        except Exception as exc:
            errors.append(f"{filename}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    raise HubUnavailableError(
        f"could not download pretrained weights of {name} from {hub_id} ({'; '.join(errors)}). "
        "Use --weights FILE for a local checkpoint, or --no-pretrained for random weights."
    )


def _create(name: str, pretrained: bool, model_args: dict[str, Any]) -> nn.Module:
    import timm

    if name.startswith(HUB_PREFIX):
        reason = hub_offline_reason()
        if reason:
            try:  # a Hub model already in the local cache still loads offline
                return timm.create_model(name, pretrained=pretrained, **model_args)
            except Exception as exc:
                raise _offline_error(f"the config of {name}", reason) from exc
    return timm.create_model(name, pretrained=pretrained, **model_args)


def load_transformers_model(name: str, *, pretrained: bool = True, weights: Path | None = None) -> nn.Module:
    """A transformers model from a local folder or Hub id, with its own, local or random weights."""
    try:
        import transformers
    except ImportError:
        raise UnknownModelError(
            f"{name} looks like a Hugging Face transformers model; install it with pip install 'vca-patch[hf]'"
        ) from None
    reason = None if Path(name).is_dir() else hub_offline_reason()
    try:
        config = transformers.AutoConfig.from_pretrained(name, local_files_only=reason is not None)
    except (OSError, ValueError) as exc:
        if reason:
            error = _offline_error(f"the config of {name}", reason)
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
            raise _offline_error(f"pretrained weights of {name}", reason) from exc
        raise


def load_base_model(
    name: str,
    *,
    pretrained: bool = True,
    weights: Path | None = None,
    model_args: dict[str, Any] | None = None,
) -> nn.Module:
    """A timm model by name (or `hf-hub:` id), or a transformers model (ORG/NAME or a local folder), with
    Hub, local (`weights`) or random weights.

    `model_args` are timm constructor options (e.g. `{"img_size": 224}`), limited to the plain options a
    checkpoint can record (config_guard.TIMM_MODEL_ARGS): weights come from `weights`, never from a
    `checkpoint_path` or `pretrained_cfg_overlay`.
    """
    from vca_patch.families.diffusers.source import is_diffusers_source, load_diffusers_transformer

    if is_diffusers_source(name):
        if model_args:
            raise TypeError(f"{name} is a diffusers model: no img_size or other timm model_args (any latent size runs)")
        return load_diffusers_transformer(name, pretrained=pretrained, weights=weights)
    if is_transformers_source(name):
        if model_args:
            raise ValueError(f"model_args are timm constructor options; {name} is a transformers model")
        return load_transformers_model(name, pretrained=pretrained, weights=weights)
    check_timm_name(name)
    model_args = dict(check_timm_model_args(dict(model_args or {}), "load_base_model"))
    if weights is not None:
        state_dict = read_state_dict(weights)  # fail on a bad file before building anything
        model = _create(name, False, model_args)
        load_state_dict_checked(model, state_dict, str(weights))
        return model
    if pretrained and not name.startswith(HUB_PREFIX):
        model_args["pretrained_cfg_overlay"] = {"file": _pretrained_file(name)}
    return _create(name, pretrained, model_args)
