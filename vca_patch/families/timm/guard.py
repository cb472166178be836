"""timm's part of the config.json guard (checkpoint.config_guard): a registered timm model name, plain
constructor options (`TIMM_MODEL_ARGS`) and timm's own top-level keys, never a file, URL or config overlay."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from vca_patch.core.config_checks import PATH_KEY, is_plain, unsafe
from vca_patch.core.sizes import SizeError, config_size_problem

TIMM_ARCHITECTURE = "vca_patch"  # the timm entrypoint registered by vca_patch.hub.timm_entrypoint

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
_TIMM_NAME = re.compile(r"[a-z0-9][a-z0-9_]*")
_TAG = re.compile(r"[A-Za-z0-9][\w.-]*")


def check_timm_model_args(args: Any, where: str, field: str = "model_args") -> dict[str, Any]:
    """`args` if every key is a plain timm constructor option (TIMM_MODEL_ARGS) with a JSON scalar/list value."""
    if not isinstance(args, dict):
        raise unsafe(where, field, args, "expected an object of constructor options")
    for key, value in args.items():
        if key in _TIMM_FILE_ARGS or PATH_KEY.search(str(key)):
            raise unsafe(
                where,
                f"{field}.{key}",
                value,
                "it makes timm read a file, URL or pretrained config; a checkpoint's weights come only from its "
                "own weights file (build the model with --weights FILE / weights= instead)",
            )
        if key not in TIMM_MODEL_ARGS:
            raise unsafe(
                where,
                f"{field}.{key}",
                value,
                f"not one of the plain constructor options a checkpoint may set ({', '.join(sorted(TIMM_MODEL_ARGS))})",
            )
        if not is_plain(value):
            raise unsafe(where, f"{field}.{key}", value, "expected a number, string, boolean, null or a list of them")
        problem = config_size_problem(key, value)
        if problem:  # a size no model is built at: refused before the allocation
            raise SizeError(str(unsafe(where, f"{field}.{key}", value, problem)))
    return args


def check_timm_architecture(name: Any, where: str, field: str) -> str:
    """`name` if it is a timm model registered in timm (other than our own `vca_patch` entrypoint)."""
    import timm

    if not isinstance(name, str) or not _TIMM_NAME.fullmatch(name) or name == TIMM_ARCHITECTURE:
        raise unsafe(where, field, name, "expected the name of a registered timm model (see timm.list_models())")
    if not timm.is_model(name):
        raise unsafe(where, field, name, "not a registered timm model (see timm.list_models())")
    return name


def check_timm_keys(meta: dict[str, Any], where: str) -> None:
    """timm's own top-level keys (read by `timm.create_model("hf-hub:...")`): our entrypoint and plain options."""
    if "architecture" in meta and meta["architecture"] != TIMM_ARCHITECTURE:
        raise unsafe(where, "architecture", meta["architecture"], f"a vca-patch checkpoint names {TIMM_ARCHITECTURE!r}")
    if "model_args" in meta:
        check_timm_model_args(meta["model_args"], where)
    cfg = meta.get("pretrained_cfg", {})
    if not isinstance(cfg, dict):
        raise unsafe(where, "pretrained_cfg", cfg, "expected an object")
    for key in TIMM_CFG_SOURCES:
        if cfg.get(key) is not None:
            raise unsafe(where, f"pretrained_cfg.{key}", cfg[key], "a checkpoint's weights come from its own files")


def check_timm_base(base: dict[str, Any], where: str) -> None:
    check_timm_architecture(base.get("architecture"), where, "base.architecture")
    tag = base.get("pretrained_tag")
    if tag is not None and (not isinstance(tag, str) or not _TAG.fullmatch(tag)):
        raise unsafe(where, "base.pretrained_tag", tag, "expected a timm pretrained tag such as 'fb_in1k'")
    check_timm_model_args(base.get("model_args", {}), where, "base.model_args")


def timm_config_keys(model: nn.Module, base: dict[str, Any]) -> dict[str, Any]:
    """timm's config.json keys, so `timm.create_model("hf-hub:...")` finds the `vca_patch` entrypoint."""
    args = dict(base.get("model_args", {}))
    cfg = {k: v for k, v in (getattr(model, "pretrained_cfg", None) or {}).items() if k not in TIMM_CFG_SOURCES}
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items() if v is not None}
    if "num_classes" in args:
        cfg["num_classes"] = args["num_classes"]
    if args.get("img_size") is not None:
        size, chans = args["img_size"], args.get("in_chans", cfg.get("input_size", [3])[0])
        cfg["input_size"] = [chans, *(size if isinstance(size, (list, tuple)) else (size, size))]
    return {"architecture": TIMM_ARCHITECTURE, "model_args": args, "pretrained_cfg": cfg}
