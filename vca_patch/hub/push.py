"""`push_to_hub`: a converted model or checkpoint folder to a Hub repo, in one commit.

Everything that can be checked locally is checked before any network use (repo id, folder, token,
reachability); the local folder is never modified. The upload goes through huggingface_hub
(`create_repo(exist_ok=True)`, then `upload_folder` as one commit), which sends large files as one
Xet/LFS upload each and skips content the Hub already has, so a retried push resumes cheaply.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.checkpoint.folder import (
    CONFIG_NAME,
    FORMS,
    CheckpointError,
    from_pretrained,
    read_checkpoint_config,
    save_pretrained,
    weights_name,
)
from vca_patch.checkpoint.model_card import render_model_card
from vca_patch.core.formats import format_of_folder, format_of_model
from vca_patch.core.weights import WeightsMismatchError, read_state_dict
from vca_patch.hub.errors import HubError
from vca_patch.hub.formats import push_format
from vca_patch.hub.resolve import validate_repo_id
from vca_patch.hub.staging import stage_folder
from vca_patch.hub.upload import require_hub, resolve_token, upload_stage
from vca_patch.surgery import PatchError, get_patch_state


def stage_checkpoint(folder: Path, meta: dict[str, Any], repo_id: str, stage: Path) -> list[str]:
    """Lay out in `stage` the files to upload: config, weights, and the model card for `repo_id`.

    A card vca-patch generated is regenerated with the repo id filled in; a card edited by hand is kept.
    """
    card = render_model_card(meta, repo_id=repo_id)
    generated = (render_model_card(meta), render_model_card(meta, repo_id))
    return stage_folder(folder, [CONFIG_NAME, weights_name(meta)], stage, card, generated)


def _check_pushable(meta: dict[str, Any], where: str) -> None:
    if meta.get("checkpoint_form") == "delta" and "path" in meta["delta"]["base_weights"]:
        raise HubError(
            f"{where} is a delta against the local file {meta['delta']['base_weights']['path']}, which nobody "
            "else can fetch: push the merged form, or save the delta against Hub weights "
            "(base_weights='org/name@revision')"
        )


def check_folder_loads(folder: Path, meta: dict[str, Any]) -> None:
    """What is pushed must load: a merged folder is loaded as users will (`from_pretrained`); a delta's weights
    file is read (its base weights are the Hub's, fetched by whoever loads it). CheckpointError otherwise."""
    try:
        if meta.get("checkpoint_form") == "delta":
            read_state_dict(folder / weights_name(meta))
        else:
            from_pretrained(folder)
    except (CheckpointError, WeightsMismatchError, PatchError) as exc:
        raise CheckpointError(f"{folder} does not load, so nothing was pushed: {exc}") from None


def push_to_hub(
    model_or_dir: nn.Module | str | Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    form: str = "merged",
    base_weights: str | Path | dict[str, Any] | None = None,
    base_state_dict: dict[str, torch.Tensor] | None = None,
    model_args: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> str:
    """Upload a converted model (saved first with `save_pretrained`) or a checkpoint folder to `repo_id`.

    Creates the repo if needed (`private` applies then), commits config.json, the weights and the model
    card in one commit on `revision` (a branch, created if missing; default main), and returns the commit
    URL. `form`, `base_weights`, `base_state_dict`, `model_args` and `metadata` go to `save_pretrained`
    when a model is given.
    """
    repo_id = validate_repo_id(repo_id)
    fmt = format_of_model(model_or_dir) if isinstance(model_or_dir, nn.Module) else format_of_folder(model_or_dir)
    if fmt is not None:  # a registered format's model or folder (e.g. LLaVA-SP's)
        options = {"private": private, "token": token, "revision": revision, "commit_message": commit_message}
        given = {"form": form != "merged", "base_weights": base_weights is not None,
                 "base_state_dict": base_state_dict is not None, "model_args": model_args is not None}  # fmt: skip
        return push_format(fmt, model_or_dir, repo_id, metadata=metadata, given=given, **options)
    folder: Path | None = None
    if isinstance(model_or_dir, nn.Module):
        if get_patch_state(model_or_dir) is None:
            raise PatchError("model is not patched by vca_patch; call vca_patch.patch_model(model) first")
    else:
        folder = Path(model_or_dir).expanduser()
        meta = read_checkpoint_config(folder)
        _check_pushable(meta, str(folder))
        check_folder_loads(folder, meta)
    token = resolve_token(token)
    require_hub(repo_id, folder)
    with tempfile.TemporaryDirectory(prefix="vca-patch-push-") as tmp:
        if folder is None:
            folder = save_pretrained(
                model_or_dir,
                Path(tmp) / "checkpoint",
                model_args=model_args,
                metadata=metadata,
                form=form,
                base_weights=base_weights,
                base_state_dict=base_state_dict,
                repo_id=repo_id,
            )
            meta = read_checkpoint_config(folder)
            _check_pushable(meta, "this model")
        stage = Path(tmp) / "upload"
        stage.mkdir()
        stage_checkpoint(folder, meta, repo_id, stage)
        message = (
            commit_message
            or f"Upload {meta['base']['architecture']} converted to VCA ({meta.get('checkpoint_form', 'merged')})"
        )
        stale = [name for name in FORMS.values() if name != weights_name(meta)]  # the other form's weights
        return upload_stage(
            stage, repo_id, token=token, private=private, revision=revision, commit_message=message,
            delete_patterns=stale,
        )  # fmt: skip
