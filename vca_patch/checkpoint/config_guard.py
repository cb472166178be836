"""What a checkpoint's config.json may ask the loader to do: build a model class with plain options, nothing else.

config.json comes from wherever the checkpoint came from (any Hub repo), and loading turns its names into a
class and its options into constructor keywords. So, before anything is built or fetched:

- `base.architecture` names a model class: a registered timm model, or a `transformers.PreTrainedModel`
  subclass that `transformers` exports (never a function, module, Auto class or dunder attribute);
- timm `model_args` hold only plain constructor options (`TIMM_MODEL_ARGS`) with JSON scalar/list values;
  file paths, URLs and overlays (`checkpoint_path`, `pretrained_cfg_overlay`, ...) are refused;
- a transformers `config` holds no key that makes transformers run code or read files (`auto_map`,
  `trust_remote_code`, Hub attention kernels, pretrained backbones, path-valued options, a local `_name_or_path`).

Each violation raises `UnsafeConfigError` naming the field and what is allowed. The generic checks live here;
each library's own (timm, transformers, diffusers, or an out-of-tree family's) are its `ModelLibrary.check_base`
/ `check_config_keys` hooks (families/library.py), found through the adapter that config.json names.
"""

from __future__ import annotations

import re
from typing import Any

from vca_patch.core.config_checks import unsafe as _fail
from vca_patch.core.errors import UnsafeConfigError
from vca_patch.core.hub_access import is_hub_id
from vca_patch.families import legacy_export, loadable_adapters

# The built-in libraries' checks, importable from here as before; their home is the family's package, reached
# through the registry (`ModelLibrary.legacy_exports`), so this module imports no family.
_LIBRARY_CHECKS = (
    "TIMM_ARCHITECTURE", "TIMM_CFG_SOURCES", "TIMM_MODEL_ARGS", "check_timm_architecture", "check_timm_base",
    "check_timm_keys", "check_timm_model_args", "check_transformers_base", "check_transformers_config",
    "local_name_or_path_removed", "transformers_model_class",
)  # fmt: skip


def __getattr__(name: str) -> Any:
    """A built-in library's check by its old name here (`from vca_patch.checkpoint.config_guard import ...`)."""
    if name in _LIBRARY_CHECKS:
        return legacy_export(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_REVISION = re.compile(r"[A-Za-z0-9][\w.\-/]{0,254}")
_WEIGHTS_FILENAME = re.compile(r"[A-Za-z0-9][\w.-]*\.(?:safetensors|bin)")


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


def check_loadable(meta: dict[str, Any], where: str) -> None:
    """Refuse a config.json whose base model description could name anything but a model class and options:
    the generic checks, then the checks of the library its adapter rebuilds (`ModelLibrary.check_base`)."""
    adapters = loadable_adapters()
    adapter = meta.get("adapter")
    if adapter not in adapters:
        raise _fail(where, "adapter", adapter, f"expected one of {sorted(adapters)}")
    base = meta.get("base")
    if not isinstance(base, dict):
        raise _fail(where, "base", base, "expected an object describing the base model")
    library = adapters[adapter]
    if base.get("library") != library.name:
        raise _fail(where, "base.library", base.get("library"), f"the {adapter} adapter rebuilds {library.name} models")
    hub_id = base.get("hf_hub_id")
    if hub_id is not None and not is_hub_id(hub_id):
        raise _fail(where, "base.hf_hub_id", hub_id, "expected null or a Hub model id 'org/name'")
    library.check_base(base, where)
    library.check_config_keys(meta, where)


__all__ = [
    "UnsafeConfigError",
    "check_hub_ref",
    "check_loadable",
    "is_hub_id",
    *_LIBRARY_CHECKS,
]
