"""Building a timm model to convert by name (or `hf-hub:` id): pretrained, local or random weights.

Network access is checked up front, so an offline machine gets a clear error in seconds instead
of a long retry loop.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from torch import nn

from vca_patch.core.hub_access import (
    HubUnavailableError,
    UnknownModelError,
    hub_cache_only,
    hub_offline_reason,
    offline_error,
)
from vca_patch.core.weights import load_state_dict_checked, read_state_dict
from vca_patch.families.timm.guard import check_timm_model_args

HUB_PREFIX = "hf-hub:"


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
        raise offline_error(f"pretrained weights of {name} ({hub_id})", reason)
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
            try:  # a Hub model already in the local cache still loads offline (no request to an unreachable Hub)
                with hub_cache_only():
                    return timm.create_model(name, pretrained=pretrained, **model_args)
            except Exception as exc:
                raise offline_error(f"the config of {name}", reason) from exc
    return timm.create_model(name, pretrained=pretrained, **model_args)


def load_timm_model(
    name: str, *, pretrained: bool = True, weights: Path | None = None, model_args: dict[str, Any] | None = None
) -> nn.Module:
    """A timm model by name (or `hf-hub:` id) with Hub, local (`weights`) or random weights; `model_args` are
    limited to the plain constructor options a checkpoint can record (TIMM_MODEL_ARGS)."""
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
