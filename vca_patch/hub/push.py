"""`push_to_hub`: a converted model or checkpoint folder to a Hub repo, in one commit.

Everything that can be checked locally is checked before any network use (repo id, folder, token,
reachability); the local folder is never modified. The upload goes through huggingface_hub
(`create_repo(exist_ok=True)`, then `upload_folder` as one commit), which sends large files as one
Xet/LFS upload each and skips content the Hub already has, so a retried push resumes cheaply.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
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
from vca_patch.core.weights import WeightsMismatchError, read_state_dict
from vca_patch.hub.errors import LOGIN_HINT, HubAuthError, HubError, HubUnavailableError
from vca_patch.hub.resolve import hub_unreachable, validate_repo_id
from vca_patch.hub.staging import stage_folder
from vca_patch.surgery import PatchError, get_patch_state


def resolve_token(token: str | None) -> str:
    """The token to push with: `token`, else HF_TOKEN or the stored login; raise HubAuthError if none."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise HubAuthError(f"pushing to the Hub needs a token with write access: {LOGIN_HINT}")
    return token


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


def upload_stage(
    stage: Path,
    repo_id: str,
    *,
    token: str,
    private: bool,
    revision: str | None,
    commit_message: str,
    delete_patterns: Sequence[str] = (),
) -> str:
    """Upload the staged folder to `repo_id` (created if needed, on branch `revision`) in one commit that also
    deletes the repo's files matching `delete_patterns`; the commit URL. Hub errors become HubError subclasses."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=stage,
            revision=revision,
            commit_message=commit_message,
            delete_patterns=list(delete_patterns),
        )
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise HubAuthError(
                f"the Hub refused the token (HTTP {status}): it needs write access to {repo_id}; {LOGIN_HINT}"
            ) from None
        raise HubError(f"push to {repo_id} failed: {exc}") from exc
    except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled) as exc:
        raise HubUnavailableError(
            f"push to {repo_id} failed, the Hub is unreachable ({exc}); nothing local was changed"
        ) from exc
    return info.commit_url


def require_hub(repo_id: str, folder: Path | None) -> None:
    """HubUnavailableError, before anything is saved or staged, when the Hub cannot be reached (offline mode too)."""
    reason = hub_unreachable()
    if reason:
        raise HubUnavailableError(
            f"cannot push to {repo_id}: the Hugging Face Hub is unreachable ({reason}); nothing was uploaded"
            + (f" and {folder} is unchanged" if folder else "")
        )


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
    from vca_patch.targets.llava_sp.hub import has_spatial_tokens, is_spatial_folder, push_spatial_tokens

    if has_spatial_tokens(model_or_dir) if isinstance(model_or_dir, nn.Module) else is_spatial_folder(model_or_dir):
        options = {"private": private, "token": token, "revision": revision, "commit_message": commit_message}
        vca_only = {"form": form != "merged", "base_weights": base_weights is not None,
                    "base_state_dict": base_state_dict is not None, "model_args": model_args is not None}  # fmt: skip
        return push_spatial_tokens(model_or_dir, repo_id, metadata=metadata, vca_only=vca_only, **options)
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
