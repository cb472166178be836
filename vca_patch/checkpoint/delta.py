"""Delta checkpoints: only the tensors a conversion added or changed, keyed to the base weights.

A delta folder holds `delta.safetensors` and a config.json with `"checkpoint_form": "delta"` and

    "delta": {
      "base_weights": {"hf_hub_id": "timm/deit_tiny_patch16_224.fb_in1k", "revision": "<commit sha>",
                       "filename": "model.safetensors"}       # a Hub file at a pinned commit
                    | {"path": "/abs/path/base.safetensors"},  # or a local file (tests, private use)
      "base_sha256": "...",  # fingerprint of the base tensors the delta reuses
      "added": 28, "changed": 0, "reused": 40
    }

"Changed" is decided against the base weights the model was converted from: `save_pretrained(form="delta")`
takes them as `base_state_dict=` or reads them from `base_weights=` (a file path, "org/name@revision",
or the dict above; by default the base's Hub id at the commit found in the local Hugging Face cache).
Loading fetches the base file (Hub cache first; fails fast when the Hub is unreachable), checks the
fingerprint, and overlays the delta, so both forms load to the same weights. A `{"path": ...}` written in
config.json is never followed by itself (the folder may come from anyone): the caller passes the file,
`from_pretrained(folder, base_weights=PATH)`, and a Hub reference is checked to be `org/name` at a revision.

A diffusers base lives in a subfolder of its pipeline repo: its reference adds `"subfolder": "transformer"` (the
filename stays the file's own, diffusion_pytorch_model.safetensors, or the `.safetensors.index.json` of sharded
weights, whose shards are fetched at the same commit); a local folder given as `base_weights=` (a diffusers
pipeline folder: its transformer/) is read from the weights file in it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vca_patch.checkpoint.base_model import HubUnavailableError, hub_offline_reason
from vca_patch.checkpoint.config_guard import UnsafeConfigError, check_hub_ref, is_hub_id
from vca_patch.core.bounded import read_json
from vca_patch.core.weights import read_state_dict

HUB_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
DIFFUSERS_WEIGHT_FILES = (
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.bin",
)
_SUBFOLDER = re.compile(r"[A-Za-z0-9][\w.-]*")  # one folder level, e.g. "transformer"
_SHARD_INDEX = re.compile(r"[A-Za-z0-9][\w.-]*\.safetensors\.index\.json")
_SHARD = re.compile(r"[A-Za-z0-9][\w.-]*\.safetensors")


class DeltaError(ValueError):
    """A delta checkpoint cannot be written or applied as asked."""


def fingerprint(tensors: dict[str, torch.Tensor], keys: list[str]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of `keys` (sorted)."""
    digest = hashlib.sha256()
    for key in sorted(keys):
        t = tensors[key].detach().to("cpu").contiguous()
        digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def split_delta(
    state: dict[str, torch.Tensor], base: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors of `state` that are new or differ from `base`, and the delta block for config.json."""
    delta: dict[str, torch.Tensor] = {}
    added = changed = 0
    reused: list[str] = []
    for key, value in state.items():
        ref = base.get(key)
        if ref is None:
            added += 1
            delta[key] = value
        elif ref.dtype != value.dtype or ref.shape != value.shape or not torch.equal(ref.to(value.device), value):
            changed += 1
            delta[key] = value
        else:
            reused.append(key)
    info = {"base_sha256": fingerprint(base, reused), "added": added, "changed": changed, "reused": len(reused)}
    return delta, info


def merge_delta(
    delta: dict[str, torch.Tensor], base: dict[str, torch.Tensor], model_keys: list[str], info: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The full state dict: base tensors for the keys the delta does not hold, then the delta."""
    reused = [k for k in model_keys if k not in delta]
    missing = [k for k in reused if k not in base]
    if missing:
        raise DeltaError(f"the base weights lack {len(missing)} tensors the delta relies on: {', '.join(missing[:6])}")
    if fingerprint(base, reused) != info.get("base_sha256"):
        raise DeltaError(
            "the base weights differ from those this delta was made against (fingerprint mismatch); "
            f"check that {describe_base_weights(info['base_weights'])} is the base the model was converted from"
        )
    return {**{k: base[k] for k in reused}, **delta}


def describe_base_weights(ref: dict[str, Any]) -> str:
    if "path" in ref:
        return f"local file {ref['path']}"
    return f"{ref['hf_hub_id']}@{ref['revision']} ({_in(ref.get('subfolder'), ref['filename'])})"


def _in(subfolder: str | None, filename: str) -> str:
    return f"{subfolder}/{filename}" if subfolder else filename


def _cached_hub_file(
    hub_id: str,
    revision: str | None = None,
    subfolder: str | None = None,
    filenames: tuple[str, ...] = HUB_WEIGHT_FILES,
) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    for filename in filenames:
        cached = try_to_load_from_cache(hub_id, _in(subfolder, filename), revision=revision)
        if isinstance(cached, str):
            return cached
    return None


def _hub_ref(
    hub_id: str, revision: str | None, subfolder: str | None = None, filenames: tuple[str, ...] = HUB_WEIGHT_FILES
) -> dict[str, Any]:
    """A pinned Hub reference: the revision given, else the commit of the cached file, else the Hub's main.
    `subfolder` (a diffusers pipeline's "transformer") is recorded when given."""
    where = {"subfolder": subfolder} if subfolder else {}
    cached = _cached_hub_file(hub_id, revision, subfolder, filenames)
    if cached is not None:
        path = Path(cached)  # <cache>/models--org--name/snapshots/<commit>/[<subfolder>/]<filename>
        commit = path.parents[1 if subfolder else 0].name
        return {"hf_hub_id": hub_id, "revision": revision or commit, "filename": path.name, **where}
    reason = hub_offline_reason()
    if reason:
        raise HubUnavailableError(
            f"the base weights {hub_id} are not in the local Hugging Face cache and the Hub is unreachable "
            f"({reason}); pass base_weights= a local file or base_state_dict="
        )
    from huggingface_hub import HfApi

    info = HfApi().model_info(hub_id, revision=revision, files_metadata=False)
    names = {s.rfilename for s in info.siblings or []}
    filename = next((f for f in filenames if _in(subfolder, f) in names), None)
    if filename is None:
        raise DeltaError(f"{hub_id} has none of {', '.join(_in(subfolder, f) for f in filenames)}")
    return {"hf_hub_id": hub_id, "revision": info.sha, "filename": filename, **where}


def _check_hub_id(hub_id: Any, prefix: str = "") -> None:
    if not is_hub_id(hub_id):
        raise DeltaError(f"{prefix}{hub_id!r} is not a Hub model id 'org/name' (optionally '@revision')")


def local_weights_file(folder: Path) -> Path:
    """The weights file of a local model folder: a diffusers pipeline folder's transformer/ (model_index.json
    beside it) or a model folder, as diffusers or transformers name their (possibly sharded) weights."""
    if (folder / "model_index.json").is_file():
        folder = folder / "transformer"
    for name in (*DIFFUSERS_WEIGHT_FILES, *HUB_WEIGHT_FILES, "model.safetensors.index.json"):
        if (folder / name).is_file():
            return folder / name
    raise DeltaError(
        f"{folder} holds no weights file ({', '.join((*DIFFUSERS_WEIGHT_FILES, *HUB_WEIGHT_FILES))}); pass the file"
    )


def base_weights_ref(spec: str | Path | dict[str, Any] | None, base: dict[str, Any]) -> dict[str, Any]:
    """Normalise `base_weights=` to {"path"} or {"hf_hub_id", "revision", "filename"[, "subfolder"]} (revision
    pinned). A diffusers base (base["library"]) is looked for in its recorded subfolder, with diffusers' names."""
    diffusers = base.get("library") == "diffusers"
    filenames = DIFFUSERS_WEIGHT_FILES if diffusers else HUB_WEIGHT_FILES
    if isinstance(spec, dict):
        if "path" in spec:
            return {"path": str(Path(spec["path"]).resolve())}
        if "hf_hub_id" not in spec:
            raise DeltaError(f"base_weights needs 'path' or 'hf_hub_id', got {sorted(spec)}")
        _check_hub_id(spec["hf_hub_id"])
        subfolder = spec.get("subfolder", base.get("subfolder"))
        ref = _hub_ref(spec["hf_hub_id"], spec.get("revision"), subfolder, filenames)
        return {**ref, "filename": spec.get("filename", ref["filename"])}
    if spec is not None and (isinstance(spec, Path) or Path(spec).exists()):
        path = Path(spec)
        if path.is_dir():
            path = local_weights_file(path)
        if not path.is_file():
            raise DeltaError(f"base weights file {path} does not exist")
        return {"path": str(path.resolve())}
    # A diffusers model loaded without vca-patch records no subfolder: its weights are at the root or in transformer/.
    subfolders = [base.get("subfolder")] if base.get("subfolder") or not diffusers else [None, "transformer"]
    if spec is not None:
        hub_id, _, revision = str(spec).removeprefix("hf-hub:").partition("@")
        _check_hub_id(hub_id, f"base weights {spec}: no such file, and ")
        return _first_hub_ref(hub_id, revision or None, subfolders, filenames)
    if not base.get("hf_hub_id"):
        raise DeltaError("the base model names no Hub weights; pass base_weights= (a file or 'org/name@revision')")
    return _first_hub_ref(base["hf_hub_id"], base.get("revision"), subfolders, filenames)


def _first_hub_ref(
    hub_id: str, revision: str | None, subfolders: list[str | None], filenames: tuple[str, ...]
) -> dict[str, Any]:
    """`_hub_ref` in the first of `subfolders` that holds the weights (the cache asked first, then the Hub)."""
    for subfolder in subfolders:
        if _cached_hub_file(hub_id, revision, subfolder, filenames) is not None:
            return _hub_ref(hub_id, revision, subfolder, filenames)
    for subfolder in subfolders[:-1]:
        try:
            return _hub_ref(hub_id, revision, subfolder, filenames)
        except DeltaError:  # not in this subfolder: the next one
            continue
    return _hub_ref(hub_id, revision, subfolders[-1], filenames)


def check_base_weights_ref(ref: Any, where: str) -> None:
    """A recorded `delta.base_weights`: a pinned Hub reference (with an optional one-level "subfolder", and a
    sharded `.safetensors.index.json` allowed as its file), or {"path": ...} (followed only when passed again)."""
    if isinstance(ref, dict) and set(ref) == {"path"} and isinstance(ref["path"], str):
        return
    if isinstance(ref, dict) and "subfolder" in ref:
        subfolder = ref["subfolder"]
        if not isinstance(subfolder, str) or not _SUBFOLDER.fullmatch(subfolder) or ".." in subfolder:
            raise UnsafeConfigError(
                f"{where}: delta.base_weights.subfolder = {subfolder!r:.80} is not allowed: expected one folder name"
            )
        ref = {k: v for k, v in ref.items() if k != "subfolder"}
    if isinstance(ref, dict) and isinstance(ref.get("filename"), str) and _SHARD_INDEX.fullmatch(ref["filename"]):
        ref = {**ref, "filename": ref["filename"].removesuffix(".index.json")}  # checked as the weights name
    try:
        check_hub_ref(ref, where, "delta.base_weights")
    except UnsafeConfigError as exc:
        raise UnsafeConfigError(f'{exc} (or {{"path": ...}}, a local file the loader must be given again)') from None


def load_base_state_dict(
    recorded: dict[str, Any], base_weights: str | Path | dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The base tensors to load a delta onto: `base_weights` when the caller gives them, else the recorded Hub file.

    A recorded local path is not followed: it was written by whoever made the folder, so the caller must pass
    the file explicitly.
    """
    if base_weights is not None:
        return fetch_base_state_dict(base_weights_ref(base_weights, {}))
    if "path" in recorded:
        raise DeltaError(
            f"this delta checkpoint was made against the local file {recorded['path']}; a path written in "
            "config.json is not followed. Pass the base weights yourself: from_pretrained(folder, "
            "base_weights=PATH) (or base_state_dict=), or load the merged form"
        )
    check_base_weights_ref(recorded, "config.json")
    return fetch_base_state_dict(recorded)


def fetch_base_state_dict(ref: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The base tensors a delta names: a local file, or a Hub file from the cache or downloaded."""
    if "path" in ref:
        if not Path(ref["path"]).is_file():
            raise DeltaError(f"the base weights of this delta checkpoint, {ref['path']}, do not exist")
        path = Path(ref["path"])
        if _SHARD_INDEX.fullmatch(path.name):
            return _read_shards(path, lambda shard: path.parent / shard)
        return read_state_dict(path)
    index = _hub_file(ref, ref["filename"])
    if _SHARD_INDEX.fullmatch(ref["filename"]):
        return _read_shards(index, lambda shard: _hub_file(ref, shard))
    return read_state_dict(index)


def _hub_file(ref: dict[str, Any], filename: str) -> Path:
    """One file of a pinned Hub reference (in its subfolder): from the cache, else downloaded."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    name = _in(ref.get("subfolder"), filename)
    cached = try_to_load_from_cache(ref["hf_hub_id"], name, revision=ref["revision"])
    if not isinstance(cached, str):
        reason = hub_offline_reason()
        if reason:
            raise HubUnavailableError(
                f"the base weights of this delta checkpoint ({describe_base_weights(ref)}) must come from the "
                f"Hugging Face Hub, which is unreachable here ({reason}), and they are not in the local cache. "
                "Load the merged form of the checkpoint, or run once online."
            )
        cached = hf_hub_download(ref["hf_hub_id"], name, revision=ref["revision"], etag_timeout=5)
    return Path(cached)


def _read_shards(index: Path, locate: Callable[[str], Path]) -> dict[str, torch.Tensor]:
    """The tensors of sharded weights: `index` (a .safetensors.index.json) names the shards, `locate` finds each."""
    data = read_json(index, "sharded-weights index", error=DeltaError)  # within a size and nesting limit
    try:
        shards = sorted(set(data["weight_map"].values()))
    except (KeyError, TypeError, AttributeError) as exc:
        raise DeltaError(f"{index} is not a sharded-weights index (no weight_map): {exc}") from None
    bad = [s for s in shards if not isinstance(s, str) or not _SHARD.fullmatch(s)]
    if bad:
        raise DeltaError(f"{index} names shards outside its folder or of another kind: {bad[:3]}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(read_state_dict(locate(shard)))
    return tensors
