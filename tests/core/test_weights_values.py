"""Weights are data and are refused by name: a safetensors header that claims more than the file holds, a file that
is not a regular file, a tensor that is not floating point where the model holds floats (int8 would be cast without
a word), NaN or infinite weights (NaN metrics later); a model folder without weights, a file where a folder is
expected; and an export whose check against eager is not finite is a failure, not "max |error| nan"."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import vca_patch
from tests.support.cli import one_error_line, run_unchanged, runner
from tests.support.models import tiny
from vca_patch import VCAConfig, patch_model
from vca_patch.checkpoint.folder import CheckpointError
from vca_patch.cli.app import app
from vca_patch.core.weights import WeightsFileError, WeightsMismatchError, load_state_dict_checked, read_state_dict
from vca_patch.export import ExportError, export_model

ARGS = {"depth": 1, "img_size": 32, "patch_size": 8, "embed_dim": 16, "num_heads": 2, "num_classes": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model, args = tiny(**ARGS)
    patch_model(model, VCAConfig(contrast_tokens=4))
    return vca_patch.save_pretrained(model, tmp_path_factory.mktemp("ckpt") / "ckpt", model_args=args)


def _copy(ckpt, folder, change=None):
    """A copy of the checkpoint folder whose model.safetensors tensors went through `change` (a dict -> dict)."""
    folder.mkdir()
    for f in ckpt.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    if change is not None:
        save_file(change(load_file(str(folder / "model.safetensors"))), str(folder / "model.safetensors"))
    return folder


def _with(key_part: str, fn):
    def change(tensors):
        key = next(k for k in sorted(tensors) if key_part in k)
        return {**tensors, key: fn(tensors[key])}

    return change


# --- reading a weights file --------------------------------------------------------------------------------------


def test_a_header_claiming_a_huge_length_is_named(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "ok.safetensors"))
    body = (tmp_path / "ok.safetensors").read_bytes()[8:]
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", 2**60) + body)
    claim = r"w\.safetensors is not a readable safetensors file: its header claims 1152921504606846976 bytes, but"
    with pytest.raises(WeightsFileError, match=claim + r" the file holds \d+"):
        read_state_dict(tmp_path / "w.safetensors")


def test_a_file_shorter_than_the_header_length_is_named(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(WeightsFileError, match=r"w\.safetensors .* it is 2 bytes, shorter than the 8-byte header"):
        read_state_dict(tmp_path / "w.safetensors")


def test_a_corrupt_header_is_named(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", 8) + b"{not json")
    with pytest.raises(WeightsFileError, match=r"w\.safetensors is not a readable safetensors file"):
        read_state_dict(tmp_path / "w.safetensors")


def test_a_fifo_weights_file_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "w.safetensors")
    with pytest.raises(WeightsFileError, match=r"w\.safetensors is a FIFO \(named pipe\), not a regular file"):
        read_state_dict(tmp_path / "w.safetensors")


# --- values a model would take silently --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            lambda t: t.to(torch.int8),
            r"tensor blocks\.0\.attn\.qkv\.weight is int8, not floating point like the "
            r"model's float32",
        ),
        (
            lambda t: t.index_fill(0, torch.tensor([0]), float("nan")),
            r"tensor blocks\.0\.attn\.qkv\.weight holds \d+ NaN",
        ),
        (
            lambda t: t.index_fill(0, torch.tensor([0]), float("inf")),
            r"tensor blocks\.0\.attn\.qkv\.weight holds \d+ infinite",
        ),
    ],
    ids=["int8", "nan", "inf"],
)
def test_weights_a_model_would_take_silently_are_refused_by_name(fn, message):
    model, _ = tiny(**ARGS)
    state = _with("blocks.0.attn.qkv.weight", fn)(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsMismatchError, match=r"weights from w\.safetensors: " + message):
        load_state_dict_checked(model, state, "w.safetensors")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded


def test_nan_weights_in_a_checkpoint_are_a_checkpoint_error(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path / "nan", _with("head.weight", lambda t: torch.full_like(t, float("nan"))))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor head\.weight holds 48 NaN value\(s\) of 48"):
        vca_patch.from_pretrained(folder)


def test_int8_weights_are_one_line_through_the_cli(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path / "int8", _with("head.weight", lambda t: t.to(torch.int8)))
    result = run_unchanged(["fidelity", str(folder), "--device", "cpu"], [folder])
    one_error_line(result, 2, "model.safetensors: tensor head.weight is int8, not floating point")


def test_a_checkpoint_without_its_weights_is_named(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path / "bare")
    (folder / "model.safetensors").unlink()
    one_error_line(
        runner.invoke(app, ["export", str(folder)]), 2, "is not a vca-patch checkpoint: missing model.safetensors"
    )
    assert not (tmp_path / "bare.pt2").exists()


# --- model paths ------------------------------------------------------------------------------------------------

VIT = {"model_type": "vit", "architectures": ["ViTModel"], "hidden_size": 16, "num_hidden_layers": 1,
       "num_attention_heads": 2, "intermediate_size": 16, "image_size": 32, "patch_size": 8}  # fmt: skip


def test_a_transformers_folder_without_weights_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    folder = tmp_path / "vit"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(VIT))
    result = run_unchanged(["convert", f"{folder}/", "-o", str(tmp_path / "out")], [folder])
    one_error_line(result, 2, "no file named model.safetensors", "pass --weights FILE, or --no-pretrained")
    assert not (tmp_path / "out").exists()


def test_nan_weights_in_a_transformers_folder_are_named(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(**{k: v for k, v in VIT.items() if k not in ("model_type", "architectures")})
    model = transformers.ViTModel(config)
    with torch.no_grad():
        model.pooler.dense.bias.fill_(float("nan"))
    model.save_pretrained(tmp_path / "vit")
    result = run_unchanged(["convert", str(tmp_path / "vit"), "-o", str(tmp_path / "out")], [tmp_path / "vit"])
    one_error_line(result, 1, "the pretrained weights of", "tensor pooler.dense.bias holds 16 NaN value(s)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("given", ["{dir}/w.safetensors", "./w.safetensors"], ids=["path", "relative"])
def test_a_model_path_that_is_a_file_is_one_line(tmp_path, monkeypatch, given):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    save_file({"a": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    args = ["convert", given.format(dir=tmp_path), "--no-pretrained", "-o", str(tmp_path / "out")]
    one_error_line(run_unchanged(args, [tmp_path / "w.safetensors"]), 2, "w.safetensors is a file; a transformers "
                   "model is a folder with config.json (pass the folder)")  # fmt: skip
    assert not (tmp_path / "out").exists()


# --- export -----------------------------------------------------------------------------------------------------


def test_an_export_whose_check_is_not_finite_fails_and_writes_nothing(tmp_path):
    model, _ = tiny(**ARGS)
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))
    with pytest.raises(ExportError, match=r"the check against eager at 32x32 is not finite: eager and the exported "
                                          r"model gave NaN or infinite outputs.*nothing was written"):  # fmt: skip
        export_model(model, tmp_path / "m.pt2", dynamic=False)
    assert list(tmp_path.iterdir()) == []
