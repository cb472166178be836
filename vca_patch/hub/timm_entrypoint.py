"""timm integration: `timm.create_model("hf-hub:ORG/NAME")` loads a converted checkpoint once vca_patch is imported.

save_pretrained writes timm's config.json keys (`architecture: "vca_patch"`, `model_args`, `pretrained_cfg`)
beside its own. timm runs no remote code, so `register()` adds a `vca_patch` entrypoint to timm's registry
through the public `timm.models.register_model`; timm calls it with the source it resolved (`hf-hub:` id
with optional `@revision`, or `local-dir:` path) and the entrypoint defers to vca_patch's own loader, so
merged and delta checkpoints, revisions and the offline cache behave exactly as in `vca_patch.from_pretrained`.
`pretrained=False` (timm's default) gives the converted architecture with fresh weights. A delta checkpoint
made against a local base file loads with `timm.create_model(..., pretrained=True, base_weights=PATH)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.checkpoint.config_guard import TIMM_ARCHITECTURE
from vca_patch.checkpoint.folder import build_model, read_checkpoint_config
from vca_patch.hub.load import from_pretrained
from vca_patch.hub.resolve import fetch_checkpoint

_IGNORED = ("pretrained_cfg_overlay", "pretrained_model_args", "cache_dir")


def _source(pretrained_cfg: Any) -> tuple[str, str | None, bool]:
    """(repo id or folder, revision, is_local) from the pretrained_cfg timm resolved for an hf-hub:/local-dir: name."""
    cfg = pretrained_cfg if isinstance(pretrained_cfg, dict) else getattr(pretrained_cfg, "__dict__", {})
    if cfg.get("source") == "local-dir" and cfg.get("file"):
        return str(cfg["file"]), None, True
    if cfg.get("hf_hub_id"):
        repo_id, _, revision = str(cfg["hf_hub_id"]).partition("@")
        return repo_id, revision or None, False
    raise RuntimeError(
        f"timm's {TIMM_ARCHITECTURE!r} architecture is built from a converted checkpoint: use "
        "timm.create_model('hf-hub:ORG/NAME') or timm.create_model('local-dir:PATH')"
    )


def vca_patch(pretrained: bool = False, pretrained_cfg: Any = None, **kwargs: Any) -> nn.Module:
    """timm entrypoint for converted checkpoints; the name is what config.json's `architecture` holds."""
    ref, revision, local = _source(pretrained_cfg)
    cache_dir = kwargs.get("cache_dir")
    device = kwargs.pop("device", None) or "cpu"
    dtype = kwargs.pop("dtype", None)
    base_weights = kwargs.pop("base_weights", None)
    if base_weights is not None and not pretrained:
        raise ValueError("base_weights= is the base of a delta checkpoint's weights; it needs pretrained=True")
    meta = (
        read_checkpoint_config(Path(ref))
        if local
        else fetch_checkpoint(ref, revision, cache_dir=cache_dir, config_only=True)[1]
    )
    stored = meta["base"].get("model_args", {})
    requested = {k: v for k, v in kwargs.items() if k not in _IGNORED}
    num_classes = requested.pop("num_classes", stored.get("num_classes"))
    differ = sorted(k for k, v in requested.items() if stored.get(k) != (list(v) if isinstance(v, tuple) else v))
    if differ:
        raise ValueError(
            f"a converted checkpoint is rebuilt as saved; it cannot change {', '.join(differ)} at load time "
            f"(saved: { {k: stored.get(k) for k in differ} })"
        )
    if pretrained:
        base = {"base_weights": base_weights} if base_weights is not None else {}
        model = (
            from_pretrained(ref, revision, cache_dir=cache_dir, **base) if not local else from_pretrained(ref, **base)
        )
    else:
        model = build_model(meta).eval()
    if num_classes is not None and num_classes != stored.get("num_classes"):
        model.reset_classifier(num_classes)
    cfg = dict(pretrained_cfg) if isinstance(pretrained_cfg, dict) else {}
    model.pretrained_cfg = model.default_cfg = {
        **meta.get("pretrained_cfg", {}),
        **cfg,
        "architecture": TIMM_ARCHITECTURE,
    }
    return model.to(device=torch.device(device), dtype=dtype)


def register() -> None:
    """Register the `vca_patch` architecture with timm (once; a no-op when timm is not installed)."""
    try:
        import timm
        from timm.models import register_model
    except ImportError:  # pragma: no cover - timm is a dependency today; keep the Hub layer usable without it
        return
    if not timm.is_model(TIMM_ARCHITECTURE):
        register_model(vca_patch)
