"""Folders of a checkpoint format registered outside vca_patch, through the Hub layer: what a push stages (the format's
files, a hand-edited card kept), what it refuses before any request, and a fetched folder loading again offline.
Also: the built-in formats are registered by importing any part of vca_patch, though hub/ never imports them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import vca_patch
from tests.support.hub import go_offline
from tests.support.models import tiny
from tests.support.paths import ROOT
from vca_patch.checkpoint.folder import CheckpointError
from vca_patch.core.formats import FORMATS, CheckpointFormat, format_of_folder, register_format

MARKER = "gain_format.json"


class Gain(nn.Module):
    """y = x * gain: one learned number, saved as JSON."""

    def __init__(self, gain: float = 1.0) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(gain))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def _read(folder: Path) -> dict:
    meta = json.loads((folder / MARKER).read_text())
    if not isinstance(meta.get("gain"), float):
        raise ValueError(f"{folder / MARKER}: gain must be a number, got {meta.get('gain')!r}")
    return meta


def _save(model: Gain, folder: Path, metadata: dict | None) -> Path:
    folder.mkdir(parents=True)
    (folder / MARKER).write_text(json.dumps({"gain": float(model.gain.detach()), "metadata": metadata or {}}))
    return folder


@pytest.fixture
def gain_format():
    fmt = register_format(
        CheckpointFormat(
            name="gain", marker=MARKER, patterns=("*.json", "README.md"), owns=lambda m: isinstance(m, Gain),
            save=_save, read=_read, load=lambda folder, device: Gain(_read(folder)["gain"]).to(device).eval(),
            card=lambda meta, repo: f"# gain {meta['gain']}" + (f" ({repo})" if repo else ""),
            commit_message=lambda meta: f"Upload gain {meta['gain']}",
        )
    )  # fmt: skip
    yield fmt
    FORMATS.pop("gain")


def _folder(path: Path, gain: float) -> Path:
    folder = _save(Gain(gain), path, None)
    (folder / ".secret.json").write_text("{}")  # hidden: never staged, though it matches *.json
    (folder / "optimizer.pt").write_bytes(b"pickle")  # matches no pattern: never staged
    return folder


def test_a_pushed_folder_stages_the_format_files_keeps_a_hand_card_and_loads_offline(
    gain_format, hub, tmp_path, monkeypatch, connections
):
    folder = _folder(tmp_path / "g", 1.5)
    (folder / "README.md").write_text("# my own words\n")
    url = vca_patch.push_to_hub(folder, "acme/gain")
    files = hub.files("acme/gain")
    assert url.endswith(hub.repos["acme/gain"].branches["main"])
    assert sorted(files) == ["README.md", MARKER]
    assert files["README.md"] == b"# my own words\n"  # edited by hand: pushed as is, not the format's card
    x = torch.randn(3)
    torch.testing.assert_close(vca_patch.from_pretrained("acme/gain")(x), 1.5 * x, rtol=0, atol=0)
    go_offline(monkeypatch)  # the cached snapshot loads again, with no connection made
    connections.clear()
    torch.testing.assert_close(vca_patch.from_pretrained("acme/gain")(x), 1.5 * x, rtol=0, atol=0)
    assert connections == []


def test_a_folder_of_the_format_that_does_not_load_is_refused_before_any_request(
    gain_format, hub, tmp_path, connections
):
    folder = _folder(tmp_path / "g", 2.0)
    (folder / MARKER).write_text(json.dumps({"gain": "two"}))
    assert format_of_folder(folder) is gain_format  # the marker claims it; loading then fails
    with pytest.raises(CheckpointError, match=r"does not load, so nothing was pushed: .*gain must be a number"):
        vca_patch.push_to_hub(folder, "acme/gain")
    assert connections == [] and "acme/gain" not in hub.repos


def test_a_vca_patch_folder_is_claimed_by_no_format(gain_format, tmp_path):
    model, args = tiny()
    vca_patch.patch_model(model, vca_patch.VCAConfig())
    folder = vca_patch.save_pretrained(model, tmp_path / "v", model_args=args)
    assert format_of_folder(folder) is None
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(vca_patch.from_pretrained(folder)(x), model.eval()(x))


def test_importing_the_hub_layer_alone_registers_the_built_in_formats():
    code = "import vca_patch.hub, vca_patch.core.formats as f; print(sorted(f.FORMATS))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "['LLaVA-SP']"
