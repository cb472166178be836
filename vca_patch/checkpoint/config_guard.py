"""What a checkpoint's config.json may ask the loader to do: build a model class with plain options, nothing else.

config.json comes from wherever the checkpoint came from (any Hub repo), and loading turns its names into a
class and its options into constructor keywords. So, before anything is built or fetched:

- `base.architecture` names a model class: a registered timm model, or a `transformers.PreTrainedModel`
  subclass that `transformers` exports (never a function, module, Auto class or dunder attribute);
- timm `model_args` hold only plain constructor options (`TIMM_MODEL_ARGS`) with JSON scalar/list values;
  file paths, URLs and overlays (`checkpoint_path`, `pretrained_cfg_overlay`, ...) are refused;
- a transformers `config` holds no key that makes transformers run code or read files (`auto_map`,
  `trust_remote_code`, Hub attention kernels, pretrained backbones, path-valued options, a local `_name_or_path`).

Each violation raises `UnsafeConfigError` naming the field and what is allowed.
"""

from __future__ import annotations

import re
from typing import Any

from vca_patch.core.errors import UnsafeConfigError
from vca_patch.core.hub_access import is_hub_id

TIMM_ARCHITECTURE = "vca_patch"  # the timm entrypoint registered by vca_patch.hub.timm_entrypoint
ADAPTER_LIBRARIES = {  # adapter name -> library it rebuilds
    "timm-vit": "timm", "timm-pvt": "timm", "timm-swin": "timm", "hf-vision": "transformers",
    "hf-pvt": "transformers", "hf-pvt-v1": "transformers", "hf-swin": "transformers", "diffusers-dit": "diffusers",
}  # fmt: skip

# Plain keyword arguments of timm's ViT-style constructors (VisionTransformer, Eva, Beit, Cait): sizes, depths,
# flags, rates and names of built-in options; no layer classes, callables, files or pretrained-config overlays.
TIMM_MODEL_ARGS = frozenset(
    {
        # geometry and heads
        "img_size", "patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads",
        "num_kv_heads", "mlp_ratio", "depth_token_only", "mlp_ratio_token_only",
        # tokens and position embeddings
        "class_token", "reg_tokens", "num_reg_tokens", "no_embed_class", "pos_embed", "use_abs_pos_emb",
        "use_rel_pos_bias", "use_shared_rel_pos_bias", "use_rot_pos_emb", "rope_type", "rope_grid_offset",
        "rope_grid_indexing", "rope_temperature", "rope_rotate_half", "ref_feat_shape",
        "dynamic_img_size", "dynamic_img_pad",
        # block options
        "qkv_bias", "qkv_fused", "qk_norm", "proj_bias", "scale_attn_norm", "scale_mlp_norm", "scale_attn_inner",
        "scale_mlp", "swiglu_mlp", "swiglu_align_to", "attn_type", "init_values", "attn_only_layer_scale",
        "pre_norm", "final_norm", "fc_norm", "use_fc_norm", "use_post_norm", "use_pre_transformer_norm",
        "use_post_transformer_norm", "pool_include_prefix", "attn_pool_num_heads", "attn_pool_mlp_ratio",
        # regularisation and init
        "drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate",
        "weight_init", "fix_init", "head_init_scale",
        # hierarchical models (PVTv2, Swin): per-stage geometry
        "depths", "embed_dims", "sr_ratios", "mlp_ratios", "linear", "window_size", "always_partition",
        "strict_img_size",
    }
)  # fmt: skip
# timm.create_model keywords that read files or replace the pretrained config.
_TIMM_FILE_ARGS = frozenset(
    {"checkpoint_path", "pretrained_cfg", "pretrained_cfg_overlay", "pretrained", "cache_dir", "pretrained_strict"}
)
# pretrained_cfg keys that point at weights; save_pretrained never writes them.
TIMM_CFG_SOURCES = ("url", "hf_hub_id", "hf_hub_filename", "hf_hub_revision", "file", "source", "state_dict")
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
_PATH_KEY = re.compile(r"(?:^|_)(?:path|paths|file|files|filename|url|urls|uri|dir|directory)$")
_REVISION = re.compile(r"[A-Za-z0-9][\w.\-/]{0,254}")
_WEIGHTS_FILENAME = re.compile(r"[A-Za-z0-9][\w.-]*\.(?:safetensors|bin)")
_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9]*")
_TIMM_NAME = re.compile(r"[a-z0-9][a-z0-9_]*")
_TAG = re.compile(r"[A-Za-z0-9][\w.-]*")


def _fail(where: str, field: str, value: Any, why: str) -> UnsafeConfigError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return UnsafeConfigError(f"{where}: {field} = {shown} is not allowed: {why}")


def check_hub_ref(ref: Any, where: str, field: str) -> None:
    """A pinned Hub file reference {"hf_hub_id": "org/name", "revision": ..., "filename": ...}."""
    if not isinstance(ref, dict) or set(ref) != {"hf_hub_id", "revision", "filename"}:
        raise _fail(where, field, ref, 'expected {"hf_hub_id": "org/name", "revision": ..., "filename": ...}')
    if not is_hub_id(ref["hf_hub_id"]):
        raise _fail(where, f"{field}.hf_hub_id", ref["hf_hub_id"], "expected a Hub model id 'org/name'")
    revision = ref["revision"]
    if not isinstance(revision, str) or not _REVISION.fullmatch(revision) or ".." in revision:
        raise _fail(where, f"{field}.revision", revision, "expected a commit sha, branch or tag")
    if not isinstance(ref["filename"], str) or not _WEIGHTS_FILENAME.fullmatch(ref["filename"]):
        raise _fail(where, f"{field}.filename", ref["filename"], "expected a top-level .safetensors or .bin name")


# -- timm -----------------------------------------------------------------------------------------------


def _plain(value: Any) -> bool:
    scalar = (bool, int, float, str, type(None))
    return isinstance(value, scalar) or (isinstance(value, (list, tuple)) and all(isinstance(v, scalar) for v in value))


def check_timm_model_args(args: Any, where: str, field: str = "model_args") -> dict[str, Any]:
    """`args` if every key is a plain timm constructor option (TIMM_MODEL_ARGS) with a JSON scalar/list value."""
    if not isinstance(args, dict):
        raise _fail(where, field, args, "expected an object of constructor options")
    for key, value in args.items():
        if key in _TIMM_FILE_ARGS or _PATH_KEY.search(str(key)):
            raise _fail(
                where,
                f"{field}.{key}",
                value,
                "it makes timm read a file, URL or pretrained config; a checkpoint's weights come only from its "
                "own weights file (build the model with --weights FILE / weights= instead)",
            )
        if key not in TIMM_MODEL_ARGS:
            raise _fail(
                where,
                f"{field}.{key}",
                value,
                f"not one of the plain constructor options a checkpoint may set ({', '.join(sorted(TIMM_MODEL_ARGS))})",
            )
        if not _plain(value):
            raise _fail(where, f"{field}.{key}", value, "expected a number, string, boolean, null or a list of them")
    return args


def check_timm_architecture(name: Any, where: str, field: str) -> str:
    """`name` if it is a timm model registered in timm (other than our own `vca_patch` entrypoint)."""
    import timm

    if not isinstance(name, str) or not _TIMM_NAME.fullmatch(name) or name == TIMM_ARCHITECTURE:
        raise _fail(where, field, name, "expected the name of a registered timm model (see timm.list_models())")
    if not timm.is_model(name):
        raise _fail(where, field, name, "not a registered timm model (see timm.list_models())")
    return name


def check_timm_keys(meta: dict[str, Any], where: str) -> None:
    """timm's own top-level keys (read by `timm.create_model("hf-hub:...")`): our entrypoint and plain options."""
    if "architecture" in meta and meta["architecture"] != TIMM_ARCHITECTURE:
        raise _fail(where, "architecture", meta["architecture"], f"a vca-patch checkpoint names {TIMM_ARCHITECTURE!r}")
    if "model_args" in meta:
        check_timm_model_args(meta["model_args"], where)
    cfg = meta.get("pretrained_cfg", {})
    if not isinstance(cfg, dict):
        raise _fail(where, "pretrained_cfg", cfg, "expected an object")
    for key in TIMM_CFG_SOURCES:
        if cfg.get(key) is not None:
            raise _fail(where, f"pretrained_cfg.{key}", cfg[key], "a checkpoint's weights come from its own files")


def check_timm_base(base: dict[str, Any], where: str) -> None:
    check_timm_architecture(base.get("architecture"), where, "base.architecture")
    tag = base.get("pretrained_tag")
    if tag is not None and (not isinstance(tag, str) or not _TAG.fullmatch(tag)):
        raise _fail(where, "base.pretrained_tag", tag, "expected a timm pretrained tag such as 'fb_in1k'")
    check_timm_model_args(base.get("model_args", {}), where, "base.model_args")


# -- transformers ---------------------------------------------------------------------------------------


def transformers_model_class(name: Any, where: str, field: str = "base.architecture") -> type:
    """The `transformers.PreTrainedModel` subclass `transformers` exports as `name`; nothing else."""
    try:
        import transformers
    except ImportError:
        raise UnsafeConfigError(
            f"{where}: {field} names a transformers model; install it with pip install 'vca-patch[hf]'"
        ) from None
    allowed = "expected the class name of a transformers model (a PreTrainedModel subclass, e.g. 'ViTModel')"
    if not isinstance(name, str) or not _CLASS_NAME.fullmatch(name):
        raise _fail(where, field, name, allowed)
    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        raise _fail(where, field, name, f"transformers exports no such name; {allowed}") from None
    if not (
        isinstance(cls, type)
        and issubclass(cls, transformers.PreTrainedModel)
        and cls is not transformers.PreTrainedModel
        and cls.__name__ == name
        and cls.__module__.startswith("transformers.")
    ):
        raise _fail(where, field, name, f"not a model class; {allowed}")
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
        raise _fail(where, field, value, _HF_CODE_KEYS.get(key, "dunder names are not config options"))
    if key == "_name_or_path":
        if value not in ("", None) and not is_hub_id(value):
            raise _fail(
                where, field, value, "expected '' or a Hub id 'org/name', not a local path (save_pretrained writes '')"
            )
        return
    if key in ("attn_implementation", "experts_implementation"):
        choices = value.values() if isinstance(value, dict) else [value]
        if any(v is not None and v not in _HF_IMPLEMENTATIONS for v in choices):
            raise _fail(where, field, value, f"expected null or one of {sorted(_HF_IMPLEMENTATIONS)} (no Hub kernels)")
    if key in ("dtype", "torch_dtype") and value is not None:
        dtypes = {name for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)}  # no lazy attributes
        if not isinstance(value, str) or value not in dtypes:
            raise _fail(where, field, value, "expected null or a torch dtype name such as 'float32'")
    if key == "use_pretrained_backbone" and value:
        raise _fail(where, field, value, "it makes transformers download backbone weights; a checkpoint holds its own")
    if key == "backbone" and value is not None:
        raise _fail(where, field, value, "it names a checkpoint transformers would load; use backbone_config")
    if _PATH_KEY.search(key) and value not in (None, "") and not isinstance(value, (bool, int, float)):
        raise _fail(where, field, value, "options that name files, folders or URLs are not allowed")


def check_transformers_config(config: Any, where: str, field: str = "base.config") -> None:
    """Refuse config keys that make `AutoConfig.for_model` / the model's constructor load code or files."""
    if not isinstance(config, dict):
        raise _fail(where, field, config, "expected an object")
    for key, value in config.items():
        if not isinstance(key, str):
            raise _fail(where, f"{field}.{key}", value, "config keys are strings")
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
        raise _fail(where, "base.config.model_type", model_type, "expected a transformers model type such as 'vit'")
    expected = getattr(cls, "config_class", None)
    if isinstance(expected, type) and not issubclass(CONFIG_MAPPING[model_type], expected):
        raise _fail(
            where,
            "base.config.model_type",
            model_type,
            f"{cls.__name__} takes a {expected.__name__}, not a {CONFIG_MAPPING[model_type].__name__}",
        )


# -- the whole config.json ------------------------------------------------------------------------------


def check_diffusers_base(base: dict[str, Any], where: str) -> None:
    """The diffusers adapter's own check (imported here lazily: the adapter imports this module's helpers)."""
    from vca_patch.families.diffusers.dit import check_diffusers_base as check

    check(base, where)


_BASE_CHECKS = {"timm": check_timm_base, "transformers": check_transformers_base, "diffusers": check_diffusers_base}


def check_loadable(meta: dict[str, Any], where: str) -> None:
    """Refuse a config.json whose base model description could name anything but a model class and options."""
    adapter = meta.get("adapter")
    if adapter not in ADAPTER_LIBRARIES:
        raise _fail(where, "adapter", adapter, f"expected one of {sorted(ADAPTER_LIBRARIES)}")
    base = meta.get("base")
    if not isinstance(base, dict):
        raise _fail(where, "base", base, "expected an object describing the base model")
    library = ADAPTER_LIBRARIES[adapter]
    if base.get("library") != library:
        raise _fail(where, "base.library", base.get("library"), f"the {adapter} adapter rebuilds {library} models")
    hub_id = base.get("hf_hub_id")
    if hub_id is not None and not is_hub_id(hub_id):
        raise _fail(where, "base.hf_hub_id", hub_id, "expected null or a Hub model id 'org/name'")
    _BASE_CHECKS[library](base, where)
    if library == "timm":
        check_timm_keys(meta, where)
