"""The checkpoint-format registry: a format registered outside vca_patch (here, a toy one) is loaded, pushed and
fetched by `from_pretrained` / `push_to_hub` with no edit to hub/ or checkpoint/, as LLaVA-SP's is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import vca_patch
from vca_patch.core.formats import FORMATS, CheckpointFormat, format_of_folder, format_of_model, register_format

MARKER = "toy_format.json"


class Toy(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _save(model: Toy, folder: Path, metadata: dict | None) -> Path:
    folder.mkdir(parents=True)
    (folder / MARKER).write_text(json.dumps({"scale": model.scale.item(), "metadata": metadata or {}}))
    (folder / "notes.pkl").write_bytes(b"never uploaded")  # matches no pattern
    return folder


def _read(folder: Path) -> dict:
    return json.loads((folder / MARKER).read_text())


@pytest.fixture
def toy_format():
    fmt = register_format(
        CheckpointFormat(
            name="toy", marker=MARKER, patterns=("*.json", "README.md"), owns=lambda m: isinstance(m, Toy),
            save=_save, read=_read, load=lambda folder, device: Toy(_read(folder)["scale"]).to(device).eval(),
            card=lambda meta, repo: f"# toy, scale {meta['scale']}" + (f" ({repo})" if repo else ""),
            commit_message=lambda meta: f"Upload a toy of scale {meta['scale']}", push_options=("form",),
        )
    )  # fmt: skip
    yield fmt
    FORMATS.pop("toy")


def test_a_registered_format_is_recognised_and_loaded(toy_format, tmp_path):
    folder = _save(Toy(2.5), tmp_path / "toy", None)
    assert format_of_folder(folder) is toy_format and format_of_model(Toy()) is toy_format
    assert format_of_folder(tmp_path) is None and format_of_model(nn.Linear(2, 2)) is None
    loaded = vca_patch.from_pretrained(folder)
    assert isinstance(loaded, Toy) and loaded.scale.item() == 2.5 and not loaded.training


def test_a_registered_format_is_pushed_and_fetched_through_the_hub(toy_format, hub):
    url = vca_patch.push_to_hub(Toy(3.0), "acme/toy", metadata={"note": "x"})
    assert url.endswith(hub.repos["acme/toy"].branches["main"])
    files = hub.files("acme/toy")
    assert sorted(files) == ["README.md", MARKER]  # the format's patterns only: notes.pkl stays behind
    assert files["README.md"].decode() == "# toy, scale 3.0 (acme/toy)"
    fetched = vca_patch.from_pretrained("acme/toy")
    assert isinstance(fetched, Toy) and fetched.scale.item() == 3.0
    with pytest.raises(ValueError, match="form: for vca-patch checkpoints, not toy models"):
        vca_patch.push_to_hub(Toy(), "acme/toy", form="delta")
