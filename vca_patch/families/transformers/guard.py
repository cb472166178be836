"""transformers' part of the config.json guard (checkpoint.config_guard): a model class transformers exports and
a config with no key that makes transformers run code or read files (`auto_map`, `trust_remote_code`, Hub
attention kernels, pretrained backbones, path-valued options, a local `_name_or_path`)."""

from __future__ import annotations

import re
from typing import Any

from vca_patch.core.config_checks import PATH_KEY, unsafe
from vca_patch.core.errors import UnsafeConfigError
from vca_patch.core.hub_access import is_hub_id
from vca_patch.core.install import install_hint
from vca_patch.core.sizes import SizeError, config_size_problem

# transformers config keys that make transformers load code, kernels, quantizers or other checkpoints.
_HF_CODE_KEYS = {
    "auto_map": "it points transformers at custom code",
    "trust_remote_code": "it lets transformers run code from the Hub",
    "custom_pipelines": "it points transformers at custom code",
    "quantization_config": "it makes transformers load a quantizer",
    "name_or_path": "it names a checkpoint to load from",
    "pretrained_model_name_or_path": "it names a checkpoint to load from",
    "_attn_implementation": "set attn_implementation instead",
    "_attn_implementation_internal": "set attn_implementation instead",
    "_experts_implementation": "set experts_implementation instead",
    "_experts_implementation_internal": "set experts_implementation instead",
}
_HF_IMPLEMENTATIONS = frozenset({"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"})
_HF_LABEL_MAPS = ("id2label", "label2id")  # free-form label names, not options
_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9]*")


def transformers_model_class(name: Any, where: str, field: str = "base.architecture") -> type:
    """The `transformers.PreTrainedModel` subclass `transformers` exports as `name`; nothing else."""
    try:
        import transformers
    except ImportError:
        raise UnsafeConfigError(
            f"{where}: {field} names a transformers model; install it with {install_hint('hf')}"
        ) from None
    allowed = "expected the class name of a transformers model (a PreTrainedModel subclass, e.g. 'ViTModel')"
    if not isinstance(name, str) or not _CLASS_NAME.fullmatch(name):
        raise unsafe(where, field, name, allowed)
    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        raise unsafe(where, field, name, f"transformers exports no such name; {allowed}") from None
    if not (
        isinstance(cls, type)
        and issubclass(cls, transformers.PreTrainedModel)
        and cls is not transformers.PreTrainedModel
        and cls.__name__ == name
        and cls.__module__.startswith("transformers.")
    ):
        raise unsafe(where, field, name, f"not a model class; {allowed}")
    return cls


def local_name_or_path_removed(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a transformers config dict) with every `_name_or_path` that is not a Hub id blanked."""
    out = {}
    for key, value in config.items():
        if key == "_name_or_path" and not is_hub_id(value):
            value = ""
        elif isinstance(value, dict) and key not in _HF_LABEL_MAPS:
            value = local_name_or_path_removed(value)
        out[key] = value
    return out


def _check_hf_key(key: str, value: Any, where: str, field: str) -> None:
    import torch

    if key.startswith("__") or key in _HF_CODE_KEYS:
        raise unsafe(where, field, value, _HF_CODE_KEYS.get(key, "dunder names are not config options"))
    if key == "_name_or_path":
        if value not in ("", None) and not is_hub_id(value):
            raise unsafe(
                where, field, value, "expected '' or a Hub id 'org/name', not a local path (save_pretrained writes '')"
            )
        return
    if key in ("attn_implementation", "experts_implementation"):
        choices = value.values() if isinstance(value, dict) else [value]
        if any(v is not None and v not in _HF_IMPLEMENTATIONS for v in choices):
            raise unsafe(where, field, value, f"expected null or one of {sorted(_HF_IMPLEMENTATIONS)} (no Hub kernels)")
    if key in ("dtype", "torch_dtype") and value is not None:
        dtypes = {name for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)}  # no lazy attributes
        if not isinstance(value, str) or value not in dtypes:
            raise unsafe(where, field, value, "expected null or a torch dtype name such as 'float32'")
    if key == "use_pretrained_backbone" and value:
        raise unsafe(where, field, value, "it makes transformers download backbone weights; a checkpoint holds its own")
    if key == "backbone" and value is not None:
        raise unsafe(where, field, value, "it names a checkpoint transformers would load; use backbone_config")
    if PATH_KEY.search(key) and value not in (None, "") and not isinstance(value, (bool, int, float)):
        raise unsafe(where, field, value, "options that name files, folders or URLs are not allowed")
    problem = config_size_problem(key, value)
    if problem:  # a size no model is built at: refused before the allocation
        raise SizeError(str(unsafe(where, field, value, problem)))


def check_transformers_config(config: Any, where: str, field: str = "base.config") -> None:
    """Refuse config keys that make `AutoConfig.for_model` / the model's constructor load code or files."""
    if not isinstance(config, dict):
        raise unsafe(where, field, config, "expected an object")
    for key, value in config.items():
        if not isinstance(key, str):
            raise unsafe(where, f"{field}.{key}", value, "config keys are strings")
        _check_hf_key(key, value, where, f"{field}.{key}")
        if isinstance(value, dict) and key not in _HF_LABEL_MAPS:
            check_transformers_config(value, where, f"{field}.{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    check_transformers_config(item, where, f"{field}.{key}[{i}]")


def check_transformers_base(base: dict[str, Any], where: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = transformers_model_class(base.get("architecture"), where)
    config = base.get("config")
    check_transformers_config(config, where)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise unsafe(where, "base.config.model_type", model_type, "expected a transformers model type such as 'vit'")
    expected = getattr(cls, "config_class", None)
    if isinstance(expected, type) and not issubclass(CONFIG_MAPPING[model_type], expected):
        raise unsafe(
            where,
            "base.config.model_type",
            model_type,
            f"{cls.__name__} takes a {expected.__name__}, not a {CONFIG_MAPPING[model_type].__name__}",
        )
