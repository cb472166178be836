"""Push and reload against a local Hub on 127.0.0.1 that speaks huggingface_hub 2.4.0's protocol."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import pytest
import timm
import torch
from huggingface_hub import ModelCard, metadata_load
from safetensors.torch import save_file
from typer.testing import CliRunner

import vca_patch
from tests.support.hub import go_offline, point_at
from tests.support.models import tiny
from vca_patch import VCAConfig, patch_model
from vca_patch.checkpoint.folder import CheckpointError
from vca_patch.cli import app
from vca_patch.hub import HubAuthError, HubError, HubUnavailableError, InvalidRepoIdError, RepoNotFoundError

REPO = "acme/deit-tiny-vca"


@pytest.fixture
def converted(tmp_path):
    model, args = tiny()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model, VCAConfig(contrast_tokens=4))
    vca_patch.save_pretrained(model, tmp_path / "ckpt", model_args=args, metadata={"base_weights": "pretrained"})
    return model, args, base, tmp_path / "ckpt"


@torch.no_grad()
def _out(model) -> torch.Tensor:
    return model.eval()(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)))


def _tree_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_push_contract_folder_goes_up_in_one_commit_with_a_valid_card(hub, converted):
    folder = converted[3]
    before = _tree_digest(folder)
    url = vca_patch.push_to_hub(folder, REPO)

    sha = hub.repos[REPO].branches["main"]
    assert url == f"{hub.url}/{REPO}/commit/{sha}"
    assert len(hub.commit_payloads) == 1
    header, *ops = hub.commit_payloads[0]
    assert header["key"] == "header" and "converted to VCA" in header["value"]["summary"]
    assert sorted((op["key"], op["value"]["path"]) for op in ops) == [
        ("file", "README.md"),
        ("file", "config.json"),
        ("lfsFile", "model.safetensors"),
    ]
    weights = (folder / "model.safetensors").read_bytes()
    assert hub.lfs_puts == [(hashlib.sha256(weights).hexdigest(), len(weights))]  # one upload, whole file
    files = hub.files(REPO)
    assert files["model.safetensors"] == weights
    assert json.loads(files["config.json"]) == json.loads((folder / "config.json").read_text())

    # huggingface_hub may also GET /api/agent-harnesses (user-agent detection, once per process): not ours
    # and vca-patch's probe that the endpoint answers (HEAD /) comes before the push
    requests = [(m, p) for m, p in hub.log if p != "/api/agent-harnesses" and (m, p) != ("HEAD", "/")]
    assert requests[0] == ("POST", "/api/repos/create")
    assert ("POST", "/api/validate-yaml") in requests
    assert ("POST", f"/api/models/{REPO}/preupload/main") in requests
    assert ("POST", f"/{REPO}.git/info/lfs/objects/batch") in requests
    assert requests[-1] == ("POST", f"/api/models/{REPO}/commit/main")

    card_text = files["README.md"].decode()
    assert hub.validated_yaml and set(hub.validated_yaml) == {card_text}
    card = ModelCard(card_text)
    assert card.data.library_name == "vca-patch"
    assert card.data.base_model == "timm/deit_tiny_patch16_224.fb_in1k"
    assert "vca" in card.data.tags and "image-classification" in card.data.tags
    assert f'vca_patch.from_pretrained("{REPO}")' in card_text
    readme = folder.parent / "pushed-README.md"
    readme.write_bytes(files["README.md"])
    assert metadata_load(readme)["base_model_relation"] == "finetune"
    assert _tree_digest(folder) == before  # the local folder is untouched


def test_push_contract_model_as_delta_on_a_branch_then_reload_by_repo_id(hub, converted, tmp_path):
    model, args, base, folder = converted
    base_sha = hub.seed("acme/base", {"model.safetensors": _safetensors_bytes(base, tmp_path)})
    vca_patch.push_to_hub(folder, REPO)  # merged first; the delta push must remove its model.safetensors

    url = vca_patch.push_to_hub(
        model,
        REPO,
        revision="delta",
        form="delta",
        base_weights="acme/base",
        model_args=args,
        metadata={"base_weights": "pretrained"},
        commit_message="delta form",
    )
    assert url.endswith(hub.repos[REPO].branches["delta"])
    assert hub.commit_payloads[-1][0]["value"]["summary"] == "delta form"
    files = hub.files(REPO, "delta")
    assert sorted(files) == ["README.md", "config.json", "delta.safetensors"]
    assert sorted(hub.files(REPO, "main")) == ["README.md", "config.json", "model.safetensors"]
    meta = json.loads(files["config.json"])
    assert meta["delta"]["base_weights"] == {
        "hf_hub_id": "acme/base",
        "revision": base_sha,
        "filename": "model.safetensors",
    }
    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model == "acme/base" and card.data.base_model_relation == "adapter"

    expected = _out(model)
    assert torch.equal(_out(vca_patch.from_pretrained(REPO)), expected)
    assert torch.equal(_out(vca_patch.from_pretrained(REPO, revision="delta")), expected)
    assert torch.equal(_out(timm.create_model(f"hf-hub:{REPO}@delta", pretrained=True)), expected)


def _safetensors_bytes(tensors: dict, tmp_path: Path) -> bytes:
    path = tmp_path / "base.safetensors"
    save_file(tensors, str(path))
    return path.read_bytes()


def test_from_pretrained_repo_id_downloads_once_then_loads_offline_from_the_cache(
    hub, converted, monkeypatch, connections
):
    model, _, _, folder = converted
    vca_patch.push_to_hub(folder, REPO)
    first_sha = hub.repos[REPO].branches["main"]
    hub.log.clear()
    loaded = vca_patch.from_pretrained(REPO)
    assert torch.equal(_out(loaded), _out(model))
    downloads = sorted(p.rsplit("/", 1)[1] for m, p in hub.log if m == "GET" and "/resolve/" in p)
    assert downloads == ["config.json", "model.safetensors"]  # only the files the checkpoint needs
    assert torch.equal(_out(timm.create_model(f"hf-hub:{REPO}", pretrained=True)), _out(model))

    # a second commit; the first stays reachable by its sha
    with torch.no_grad():
        model.head.bias.add_(1.0)
    vca_patch.push_to_hub(model, REPO, model_args={"depth": 2, "img_size": 64})
    assert torch.equal(_out(vca_patch.from_pretrained(REPO)), _out(model))
    assert not torch.equal(_out(vca_patch.from_pretrained(REPO, revision=first_sha)), _out(model))
    with pytest.raises(RepoNotFoundError, match="has no revision 'nope'"):
        vca_patch.from_pretrained(REPO, revision="nope")

    hub.stop()
    go_offline(monkeypatch)
    assert torch.equal(_out(vca_patch.from_pretrained(REPO)), _out(model))
    connections.clear()
    with pytest.raises(HubUnavailableError, match=r"not in the local Hugging Face cache.*HF_HUB_OFFLINE is set"):
        vca_patch.from_pretrained("acme/never-downloaded")
    assert connections == []  # offline: fails at once, without trying the network


def test_a_repo_that_is_not_a_converted_checkpoint_says_so(hub):
    hub.seed("timm/plain", {"config.json": json.dumps({"architecture": "vit_base_patch16_224"}).encode()})
    hub.seed("acme/empty", {"README.md": b"# nothing\n"})
    with pytest.raises(CheckpointError, match="plain timm model config"):
        vca_patch.from_pretrained("timm/plain")
    with pytest.raises(CheckpointError, match=r"acme/empty is not a vca-patch checkpoint: missing config\.json"):
        vca_patch.from_pretrained("acme/empty")
    with pytest.raises(RepoNotFoundError, match="does not exist on the Hub"):
        vca_patch.from_pretrained("acme/missing")
    newer = {"format_version": 2, "vca_patch_version": "0.5.0", "adapter": "timm-vit", "base": {}, "config": {}}
    hub.seed("acme/newer", {"config.json": json.dumps({**newer, "layers": {}}).encode()})
    hub.log.clear()
    with pytest.raises(CheckpointError, match=r"vca-patch 0\.5\.0.*vca-patch>=0\.5\.0"):
        vca_patch.from_pretrained("acme/newer")
    assert not any("model.safetensors" in p for _, p in hub.log)  # refused before fetching weights


# -- bad input for push ---------------------------------------------------------------------------------------


def test_invalid_repo_id_is_refused_before_any_request(hub, converted):
    folder = converted[3]
    for bad in ("acme/a/b", "acme/bad--name", "https://huggingface.co/acme/x", ""):
        with pytest.raises(InvalidRepoIdError, match=r"not a valid Hub repo id|empty"):
            vca_patch.push_to_hub(folder, bad)
    assert hub.log == []


def test_missing_token_is_refused_with_the_login_hint(hub, converted, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubAuthError, match=r"hf auth login.*huggingface-cli login.*HF_TOKEN"):
        vca_patch.push_to_hub(converted[3], REPO)
    assert hub.log == []


def test_rejected_token_becomes_an_auth_error(hub, converted):
    hub.reject_tokens = True
    with pytest.raises(HubAuthError, match=r"refused the token .*write access"):
        vca_patch.push_to_hub(converted[3], REPO)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_network_fails_fast_and_keeps_the_folder(monkeypatch, tmp_path, converted, connections):
    folder = converted[3]
    before = _tree_digest(folder)
    point_at(monkeypatch, f"http://127.0.0.1:{_closed_port()}", tmp_path / "cache")
    with pytest.raises(HubUnavailableError, match=r"unreachable \(cannot connect.*nothing was uploaded.*unchanged"):
        vca_patch.push_to_hub(folder, REPO)
    with pytest.raises(HubUnavailableError, match="not in the local Hugging Face cache"):
        vca_patch.from_pretrained(REPO)
    assert 1 <= len(connections) <= 4, connections  # a probe or two each, no retry loop
    go_offline(monkeypatch)
    with pytest.raises(HubUnavailableError, match="HF_HUB_OFFLINE is set"):
        vca_patch.push_to_hub(folder, REPO)
    assert _tree_digest(folder) == before


def test_bad_folders_are_refused_before_any_request(hub, converted, tmp_path):
    model, args, base, _ = converted
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"missing config\.json, model\.safetensors"):
        vca_patch.push_to_hub(tmp_path / "empty", REPO)
    save_file(base, str(tmp_path / "base.safetensors"))
    vca_patch.save_pretrained(
        model, tmp_path / "local-delta", model_args=args, form="delta", base_weights=tmp_path / "base.safetensors"
    )
    with pytest.raises(HubError, match=r"delta against the local file .*push the merged form"):
        vca_patch.push_to_hub(tmp_path / "local-delta", REPO)
    assert hub.log == []


def test_cli_push_prints_the_commit_url_and_maps_errors_to_exit_codes(hub, converted, monkeypatch):
    runner = CliRunner()
    result = runner.invoke(app, ["push", str(converted[3]), REPO, "--message", "from the CLI"])
    assert result.exit_code == 0, result.output
    assert f"{hub.url}/{REPO}/commit/{hub.repos[REPO].branches['main']}" in result.output.replace("\n", "")
    assert hub.commit_payloads[-1][0]["value"]["summary"] == "from the CLI"

    (converted[3] / "README.md").write_text("---\nlicense: mit\n---\n# edited by hand\n")
    assert runner.invoke(app, ["push", str(converted[3]), REPO]).exit_code == 0
    assert hub.files(REPO)["README.md"] == b"---\nlicense: mit\n---\n# edited by hand\n"  # kept, not regenerated

    result = runner.invoke(app, ["push", str(converted[3]), "acme/bad--name"])
    assert result.exit_code == 2 and "not a valid Hub repo id" in result.output
    monkeypatch.delenv("HF_TOKEN")
    result = runner.invoke(app, ["push", str(converted[3]), REPO])
    assert result.exit_code == 1 and "HF_TOKEN" in result.output
