"""Where a diffusers transformer to convert comes from: a local pipeline folder (model_index.json + transformer/),
a transformer folder (config.json naming a diffusers class), or a Hub repo (its transformer/ subfolder, pinned to
the commit its config came from).

The loaded model carries where it came from (`SOURCE`: Hub id, subfolder, commit), which the adapter's
`describe_base` records, so a delta checkpoint's base reference names the repo, the `transformer` subfolder and
a pinned revision. The Hub is asked only when it is reachable; offline, a repo that is not in the local cache
fails at once with one line that says what to pass instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vca_patch.core.bounded import read_json
from vca_patch.core.errors import ConfigError
from vca_patch.core.hub_access import HubUnavailableError, UnknownModelError, hub_offline_reason, is_hub_id
from vca_patch.core.install import install_hint
from vca_patch.core.weights import load_state_dict_checked, read_state_dict
from vca_patch.families.diffusers.guard import ARCHITECTURES

TRANSFORMER = "transformer"  # the subfolder of a diffusers pipeline that holds the denoising transformer
PIPELINE_INDEX = "model_index.json"
SOURCE = "vca_patch_source"  # model.__dict__ key: {"hf_hub_id", "subfolder", "revision"} of a loaded model
INSPECT_ONLY = ("SanaTransformer2DModel",)  # loaded to be listed: its attention is already linear, nothing converts
LOCAL_HINT = "pass a local diffusers folder (model_index.json with a transformer/ subfolder) or its transformer/ folder"


def _not_loadable(message: str) -> Exception:
    """The loader's "not a model vca-patch can load" error (io.base_model.UnknownModelError, imported late: io
    imports the adapters)."""

    return UnknownModelError(message)


def _diffusers_config(path: Path) -> dict[str, Any] | None:
    """A diffusers model config.json (it names `_class_name` and `_diffusers_version`), else None."""
    try:
        config = read_json(path, "diffusers config")  # bounded: a huge or deep file is no diffusers config
    except ConfigError:
        return None
    if isinstance(config, dict) and "_class_name" in config and "_diffusers_version" in config:
        return config
    return None


def local_transformer_folder(name: str | Path) -> Path | None:
    """The transformer folder of a local diffusers pipeline folder or transformer folder; None for anything else."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return None
    if (folder / PIPELINE_INDEX).is_file():
        if _diffusers_config(folder / TRANSFORMER / "config.json") is None:
            parts = sorted(p.name for p in folder.iterdir() if p.is_dir())
            raise _not_loadable(
                f"{folder} is a diffusers pipeline folder without a transformer/ subfolder (it has "
                f"{', '.join(parts) or 'no subfolders'}): vca-patch converts diffusion transformers (DiT, PixArt, "
                "SD3, Flux), not U-Nets"
            )
        return folder / TRANSFORMER
    if (folder / "config.json").is_file() and _diffusers_config(folder / "config.json") is not None:
        return folder
    return None


def is_local_diffusers(name: str | Path) -> bool:
    """A local diffusers pipeline or transformer folder (one that `load_diffusers_transformer` may still refuse)."""
    try:
        return local_transformer_folder(name) is not None
    except ValueError:  # UnknownModelError: a pipeline folder without a transformer
        return True


def is_diffusers_source(name: str) -> bool:
    """A local diffusers folder, or a Hub id whose pipeline index or transformer config is in the local cache or,
    when the Hub is reachable, on the Hub."""
    if is_local_diffusers(name):
        return True  # a pipeline folder without a transformer too: the loader says what it lacks

    if Path(name).expanduser().exists() or not is_hub_id(name):
        return False
    from huggingface_hub import try_to_load_from_cache

    for filename in (PIPELINE_INDEX, f"{TRANSFORMER}/config.json"):
        if isinstance(try_to_load_from_cache(name, filename), str):
            return True
    if hub_offline_reason() is not None:
        return False
    from huggingface_hub import hf_hub_download

    try:  # a few hundred bytes, into the cache
        hf_hub_download(name, PIPELINE_INDEX, etag_timeout=5)
    except Exception:  # no such file, or a private or missing repo: the transformers route reports it
        return False
    return True


def _hub_config(repo_id: str) -> tuple[dict[str, Any], str | None, str]:
    """(config, subfolder, commit) of a Hub repo's transformer: its transformer/ subfolder, else its root."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    reason = hub_offline_reason()
    for subfolder in (TRANSFORMER, None):
        try:
            path = Path(
                hf_hub_download(
                    repo_id, "config.json", subfolder=subfolder, local_files_only=reason is not None, etag_timeout=5
                )
            )
        except (EntryNotFoundError, LocalEntryNotFoundError):
            continue
        config = _diffusers_config(path)
        if config is None:
            continue
        commit = path.parents[1 if subfolder else 0].name  # <cache>/models--org--name/snapshots/<commit>/...
        return config, subfolder, commit
    if reason is not None:
        raise HubUnavailableError(
            f"the diffusers model {repo_id} must come from the Hugging Face Hub, which is unreachable here "
            f"({reason}), and it is not in the local cache: {LOCAL_HINT}"
        )
    raise _not_loadable(f"{repo_id} has no diffusers transformer config (transformer/config.json or config.json)")


def load_diffusers_transformer(name: str, *, pretrained: bool = True, weights: Path | None = None) -> nn.Module:
    """The diffusion transformer of a local folder or Hub repo, with its own, local (`weights`) or random weights,
    in eval mode; `model.__dict__[SOURCE]` says where it came from."""

    try:
        import diffusers
    except ImportError:
        raise UnknownModelError(
            f"{name} is a diffusers model; install diffusers with {install_hint('diffusers')}"
        ) from None
    local = local_transformer_folder(name)
    if local is not None:
        config = _diffusers_config(local / "config.json") or {}
        subfolder, commit, hub_id = None, None, None
    else:
        config, subfolder, commit = _hub_config(name)
        hub_id = name
    class_name = config.get("_class_name")
    if class_name not in (*ARCHITECTURES, *INSPECT_ONLY):
        raise _not_loadable(
            f"{name}: {class_name!r} is not a diffusion transformer vca-patch converts; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    model_cls = getattr(diffusers, class_name)
    if weights is not None:
        state_dict = read_state_dict(weights)  # a bad file fails before anything is built
        model = model_cls.from_config(config)
        load_state_dict_checked(model, state_dict, str(weights))
    elif not pretrained:
        model = model_cls.from_config(config)
    elif local is not None:
        model = model_cls.from_pretrained(str(local))
    else:
        model = model_cls.from_pretrained(
            name, subfolder=subfolder, revision=commit, local_files_only=hub_offline_reason() is not None
        )
    model.__dict__[SOURCE] = {"hf_hub_id": hub_id, "subfolder": subfolder, "revision": commit}
    return model.eval()
