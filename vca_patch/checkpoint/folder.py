"""`save_pretrained` / `from_pretrained`: a folder with config.json, README.md and the weights.

config.json stores how to rebuild the base model and re-apply the patch; loading rebuilds the
base architecture, patches it with the stored config, checks the per-layer map and loads weights.

Two forms (`"checkpoint_form"` in config.json; absent means merged): "merged" holds every tensor in
model.safetensors; "delta" holds only new and changed tensors in delta.safetensors plus a reference to
the base weights (see io/delta.py). For timm bases config.json also carries timm's own keys
(`architecture: "vca_patch"`, `model_args`, `pretrained_cfg`), so `timm.create_model("hf-hub:...")`
loads it once `vca_patch` is imported (hub/timm_entrypoint.py registers the architecture).

config.json is untrusted input: before anything is built or fetched it is checked to name only model classes,
plain constructor options and a Hub base reference (io/config_guard.py); a delta's local base path is used only
when the caller passes it again (`from_pretrained(folder, base_weights=PATH)`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from vca_patch._version import __version__
from vca_patch.checkpoint.config_guard import (
    check_loadable,
    local_name_or_path_removed,
)
from vca_patch.checkpoint.delta import (
    base_weights_ref,
    check_base_weights_ref,
    fetch_base_state_dict,
    load_base_state_dict,
    merge_delta,
    split_delta,
)
from vca_patch.checkpoint.legacy_keys import renamed_legacy_holders
from vca_patch.checkpoint.model_card import check_metadata, render_model_card
from vca_patch.core.atomic import atomic_write_text, staged_directory
from vca_patch.core.bounded import read_json
from vca_patch.core.formats import format_of_model
from vca_patch.core.sizes import check_model_config
from vca_patch.core.weights import WeightsMismatchError, load_state_dict_checked, read_state_dict
from vca_patch.families import adapter_by_name
from vca_patch.surgery import PatchError, get_patch_state, patch_model, patched_layers
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.handler import handler_for
from vca_patch.targets.protocols import PackedForm

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DELTA_WEIGHTS_NAME = "delta.safetensors"
CARD_NAME = "README.md"
FORMS = {"merged": WEIGHTS_NAME, "delta": DELTA_WEIGHTS_NAME}


class CheckpointError(ValueError):
    """A folder is not a loadable vca-patch checkpoint."""


def _on_meta(fn, *args):
    with torch.device("meta"):
        return fn(*args)


def _check_rebuildable(model: nn.Module, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Rebuild the checkpoint's architecture on the meta device; its state-dict layout must match `tensors`."""
    state = get_patch_state(model)
    base = _on_meta(state.adapter.create_base, meta["base"])
    config = TargetConfig.from_dict(meta["config"])
    _on_meta(patch_model, base, config)
    packed_mismatch = None
    if meta.get("packed"):
        try:
            handler_for(config).load_packed(config, base, tensors, "save_pretrained")
        except ValueError as exc:  # the packed tensors do not fit the rebuilt Linears
            packed_mismatch = str(exc)
    ours = {k: tuple(v.shape) for k, v in tensors.items()}
    rebuilt = {k: tuple(v.shape) for k, v in base.state_dict().items()}
    if packed_mismatch or ours != rebuilt:
        diff = packed_mismatch or sorted(set(ours.items()) ^ set(rebuilt.items()))[:6]
        raise PatchError(
            f"{meta['base']['architecture']} rebuilt from its name and model_args "
            f"{meta['base']['model_args']} does not match this model (differs at {diff}); pass "
            "model_args= with the keyword arguments the model was created with"
        )


def checkpoint_metadata(
    model: nn.Module, *, model_args: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The config.json content for a patched model (merged form)."""
    state = get_patch_state(model)
    if state is None:
        raise PatchError("model is not patched by vca_patch; call vca_patch.patch_model(model) first")
    base = state.adapter.describe_base(model)
    if model_args is not None:
        base["model_args"] = dict(model_args)
    if isinstance(base.get("config"), dict):  # a transformers config: a local folder it came from is not recorded
        base["config"] = local_name_or_path_removed(base["config"])
    meta = {
        "vca_patch_version": __version__,
        "format_version": FORMAT_VERSION,
        "adapter": state.adapter.name,
        "base": base,
        "config": handler_for(state.config).as_built(state.config, model).to_dict(),
        "layers": patched_layers(model),
        "params": {"before": state.report.params_before, "after": state.report.params_after},
        "metadata": dict(metadata or {}),
        "checkpoint_form": "merged",
    }
    if state.adapter.library is not None:  # the library's own top-level keys (timm's: its entrypoint, options)
        meta.update(state.adapter.library.config_keys(model, base))
    return meta


def save_pretrained(
    model: nn.Module,
    directory: str | Path,
    *,
    overwrite: bool = False,
    model_args: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    form: str = "merged",
    base_weights: str | Path | dict[str, Any] | None = None,
    base_state_dict: dict[str, torch.Tensor] | None = None,
    repo_id: str | None = None,
    packed: bool | None = None,
) -> Path:
    """Write a patched model to `directory` (weights, config.json, README.md), atomically.

    `model_args` are the keyword arguments the base model was created with, when they cannot be
    read back from the model; `metadata` (base_weights, probe, recipe, metrics, datasets: see
    io/model_card.py) goes into config.json and the model card.

    `form="delta"` writes only the tensors that are new or differ from the base weights the model was
    converted from: `base_state_dict` (those tensors) or else read from `base_weights` (a local file,
    "org/name@revision", or by default the base's Hub id at its cached commit), which is also the
    reference loaders fetch. `repo_id` fills in the model card's usage snippet.

    `packed=True` stores the target's packed form (`"packed": true` in config.json; DIDB: binarised Linears as sign
    bits + scales), which `from_pretrained` loads back as it was; a model already held packed saves packed (None).

    A model that a registered checkpoint format owns (`core.formats`; e.g. a LLaVA with spatial tokens) is written
    by that format, which `from_pretrained` recognises by its marker file; only `metadata` applies to it.
    """
    fmt = format_of_model(model) if isinstance(model, nn.Module) else None
    if fmt is not None:  # a registered format owns this model (e.g. a LLaVA with spatial tokens): its own folder
        given = {"overwrite": overwrite, "model_args": model_args, "form": form != "merged",
                 "base_weights": base_weights, "base_state_dict": base_state_dict, "repo_id": repo_id,
                 "packed": packed}  # fmt: skip
        refused = [name for name, value in given.items() if value not in (None, False)]
        if refused:
            raise ValueError(f"{', '.join(refused)} do not apply to {fmt.name} folders (their format writes them)")
        return fmt.save(model, Path(directory), metadata)
    if form not in FORMS:
        raise ValueError(f"form must be one of {sorted(FORMS)}, got {form!r}")
    meta = checkpoint_metadata(model, model_args=model_args, metadata=metadata)
    check_metadata(meta["metadata"])
    check_loadable(meta, "save_pretrained")  # what from_pretrained would refuse is not written
    packed = _packed_choice(model, packed, form)
    state_dict = _packed_state_dict(model) if packed else model.state_dict()
    if packed:
        meta["packed"] = True
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    _check_rebuildable(model, meta, tensors)
    if form == "delta":
        ref = base_weights_ref(base_weights, meta["base"])
        base = base_state_dict if base_state_dict is not None else fetch_base_state_dict(ref)
        tensors, info = split_delta(tensors, {k: v.detach().to("cpu") for k, v in base.items()})
        meta["checkpoint_form"] = "delta"
        meta["delta"] = {"base_weights": ref, **info}
    elif base_weights is not None or base_state_dict is not None:
        raise ValueError("base_weights / base_state_dict are for form='delta'")
    with staged_directory(Path(directory), overwrite=overwrite) as stage:
        save_file(tensors, str(stage / FORMS[form]), metadata={"format": "pt", "vca_patch": __version__})
        atomic_write_text(stage / CONFIG_NAME, json.dumps(meta, indent=2) + "\n")
        atomic_write_text(stage / CARD_NAME, render_model_card(meta, repo_id=repo_id))
    return Path(directory)


def _packed_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The patched model's state dict in its target's packed form (`PackedForm.packed_state_dict`)."""
    config = get_patch_state(model).config
    return handler_for(config).packed_state_dict(config, model)


def _packed_choice(model: nn.Module, packed: bool | None, form: str) -> bool:
    """Whether to save the target's packed form: asked for, or the model is held packed (it has no other)."""
    config = get_patch_state(model).config
    handler = handler_for(config)
    held = handler.is_packed(config, model)
    packed = held if packed is None else packed
    if held and not packed:
        raise ValueError(f"this {config.target} model is held in packed form and saves packed only (packed=True)")
    if packed and not isinstance(handler, PackedForm):
        raise ValueError(f"target {config.target!r} has no packed checkpoint form")
    if packed and form != "merged":
        raise ValueError("a packed checkpoint is merged (form='merged')")
    return packed


def weights_name(meta: dict[str, Any]) -> str:
    """The weights file of a checkpoint: model.safetensors (merged) or delta.safetensors (delta)."""
    return FORMS[meta.get("checkpoint_form", "merged")]


def check_checkpoint_config(meta: Any, where: str) -> dict[str, Any]:
    """Check parsed config.json content: a vca-patch config, of a format this version reads."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where} is not a vca-patch config: not a JSON object")
    required = ("format_version", "adapter", "base", "config", "layers")
    absent = [key for key in required if key not in meta]
    if absent:
        hint = (
            f"; it looks like a plain {meta.get('library_name') or 'timm'} model config (architecture "
            f"{meta['architecture']!r}): convert it with `vca-patch convert`"
            if "architecture" in meta and "format_version" not in meta
            else ""
        )
        raise CheckpointError(f"{where} is not a vca-patch config: missing {', '.join(absent)}{hint}")
    version = meta["format_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(f"{where}: format_version must be an integer, got {version!r}; the file was edited")
    if version > FORMAT_VERSION:
        writer = meta.get("vca_patch_version")
        need = f"'vca-patch>={writer}'" if isinstance(writer, str) and writer else "a newer vca-patch"
        raise CheckpointError(
            f"{where} was written by vca-patch {writer or '?'} (format {version}); this is vca-patch {__version__} "
            f"(format {FORMAT_VERSION}): upgrade with pip install -U {need} (or, where no such release is on your "
            "index, pip install -U from a newer vca-patch source tree)"
        )
    if version < 1:
        raise CheckpointError(
            f"{where} has format {version}, older than any vca-patch release reads (this is vca-patch {__version__}, "
            f"format {FORMAT_VERSION}); convert the original model again with `vca-patch convert`"
        )
    if meta.get("checkpoint_form", "merged") not in FORMS:
        raise CheckpointError(f"{where}: unknown checkpoint_form {meta['checkpoint_form']!r}; known: {sorted(FORMS)}")
    if meta.get("packed", False) not in (True, False):
        raise CheckpointError(f"{where}: packed must be true or false, got {meta['packed']!r}")
    if meta.get("packed") and meta.get("checkpoint_form", "merged") != "merged":
        raise CheckpointError(f"{where}: a packed checkpoint must be merged, not {meta['checkpoint_form']!r}")
    if meta.get("checkpoint_form") == "delta":
        if not isinstance(meta.get("delta"), dict) or "base_weights" not in meta["delta"]:
            raise CheckpointError(f"{where}: a delta checkpoint must name its base weights (delta.base_weights)")
        check_base_weights_ref(meta["delta"]["base_weights"], where)
    check_loadable(meta, where)
    return meta


def read_checkpoint_config(directory: Path) -> dict[str, Any]:
    """config.json of a checkpoint folder, checked for completeness and version."""
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointError(f"{directory}: no such folder (a checkpoint is a folder that save_pretrained wrote)")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is a file; a checkpoint is the folder that save_pretrained wrote")
    meta: Any = None
    if (directory / CONFIG_NAME).exists():  # read within a size and nesting limit; a FIFO or folder is refused
        meta = read_json(directory / CONFIG_NAME, "checkpoint config", error=CheckpointError)
    form = meta.get("checkpoint_form", "merged") if isinstance(meta, dict) else "merged"
    expected = (CONFIG_NAME, FORMS.get(form, WEIGHTS_NAME))
    missing = [name for name in expected if not (directory / name).exists()]  # a FIFO is named by its reader
    if missing:
        raise CheckpointError(f"{directory} is not a vca-patch checkpoint: missing {', '.join(missing)}")
    return check_checkpoint_config(meta, str(directory / CONFIG_NAME))


def build_model(meta: dict[str, Any]) -> nn.Module:
    """The converted architecture described by `meta` (checked by `check_loadable`), without weights."""
    check_loadable(meta, "config.json")
    for key in ("config", "model_args"):  # sizes, heads and weights checked before the base is built
        if isinstance(meta["base"].get(key), dict):
            check_model_config(meta["base"][key], "config.json", field=f"base.{key}.")
    adapter = adapter_by_name(meta["adapter"])
    model = adapter.create_base(meta["base"])
    patch_model(model, TargetConfig.from_dict(meta["config"]))
    if patched_layers(model) != meta["layers"]:
        raise CheckpointError(
            f"re-applying the stored patch gave layers {sorted(patched_layers(model))}, but the checkpoint "
            f"has {sorted(meta['layers'])}"
        )
    return model


def from_pretrained(
    directory: str | Path,
    *,
    device: str | torch.device = "cpu",
    base_weights: str | Path | dict[str, Any] | None = None,
    base_state_dict: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Rebuild a converted model from a `save_pretrained` folder, in eval mode.

    A delta checkpoint takes its base weights from `base_state_dict` or `base_weights` (a local file or
    "org/name@revision") when given, else fetches the Hub file its config.json names (cache first). A local
    path written in config.json is never followed: pass it as `base_weights=`.
    """
    directory = Path(directory)
    meta = read_checkpoint_config(directory)
    delta = meta.get("checkpoint_form") == "delta"
    if not delta and (base_weights is not None or base_state_dict is not None):
        raise ValueError(f"base_weights / base_state_dict are for delta checkpoints; {directory} is merged")
    if delta and base_state_dict is None:  # resolved before anything is built or read
        base_state_dict = load_base_state_dict(meta["delta"]["base_weights"], base_weights)
    model = build_model(meta)
    path = directory / weights_name(meta)
    try:
        state = read_state_dict(path)
    except WeightsMismatchError as exc:  # truncated, corrupt or not a weights file
        raise CheckpointError(str(exc)) from None
    state = renamed_legacy_holders(model, state)  # new parameters saved under `….vca.…` for any target
    if delta:
        state = merge_delta(state, base_state_dict, list(model.state_dict()), meta["delta"])
    if meta.get("packed"):  # the target rebuilds its packed modules from the file's tensors
        config = get_patch_state(model).config
        handler = handler_for(config)
        if not isinstance(handler, PackedForm):
            raise CheckpointError(f"{path} is packed, but target {meta['config'].get('target')!r} has no packed form")
        try:
            handler.load_packed(config, model, state, str(path))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    try:
        load_state_dict_checked(model, state, str(path))
    except WeightsMismatchError as exc:
        raise CheckpointError(str(exc)) from exc
    return model.to(device).eval()
