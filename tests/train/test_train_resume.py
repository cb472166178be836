"""Resume: with dropout and drop-path an interrupted + resumed run equals an uninterrupted one (accelerate's RNG
states), checkpoints load with weights_only=True only, and checkpoint writes are atomic."""

from __future__ import annotations

import copy
import pickle
import shutil
from pathlib import Path

import pytest
import timm
import torch
from torch.utils.data import TensorDataset

import vca_patch
from tests.support.recovery import TINY_ARGS
from vca_patch.train import make_accelerator, recipe_from_dict, run_recipe, teacher_from
from vca_patch.train.checkpoints import list_checkpoints, save_checkpoint

RECIPE = {
    "name": "dropout-resume",
    "train": {"batch_size": 8, "eval_every": 3, "checkpoint_every": 3, "eval_images": 16, "log_every": 100},
    "stages": [
        {"name": "transfer", "kind": "attention_transfer", "steps": 2, "lr": 3e-3, "warmup_steps": 1},
        {"name": "distill", "kind": "distill", "steps": 4, "lr": 1e-3, "carried_lr": 1e-4, "rest_lr": 1e-4},
    ],
}


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


@pytest.fixture(scope="module")
def dropout_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A patched random-weight tiny ViT with drop-path 0.2 and projection dropout 0.1, and its teacher."""
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, drop_path_rate=0.2, proj_drop_rate=0.1, **TINY_ARGS
    )
    vca_patch.patch_model(model.eval(), vca_patch.VCAConfig(contrast_tokens=4))
    return model, teacher_from(model)


def _run(pair, out: Path, **kw):
    student, teacher = (copy.deepcopy(m) for m in pair)
    spec = recipe_from_dict(RECIPE)
    return run_recipe(
        student, teacher, spec, out, train_set=_data(48, 1), eval_set=_data(16, 2),
        accelerator=make_accelerator("no", device="cpu"), **kw,
    )  # fmt: skip


def _strip(evaluations: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "images_per_s"} for e in evaluations]


def test_resume_with_dropout_and_drop_path_matches_an_uninterrupted_run(tmp_path, dropout_pair, monkeypatch):
    full = _run(dropout_pair, tmp_path / "full")
    cut = _run(dropout_pair, tmp_path / "cut", stop_after_steps=3)
    assert not cut.completed and list_checkpoints(tmp_path / "cut")[-1].name == "step_0000003"  # mid-distill
    shutil.copytree(tmp_path / "cut", tmp_path / "control")

    real_load, calls = torch.load, []

    def recording_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    resumed = _run(dropout_pair, tmp_path / "cut", resume=True)
    assert len(calls) >= 3 and all(w is True for w in calls), calls  # optimizer, scheduler, RNG states
    assert resumed.metrics["resumed_from"] == 3 and resumed.completed
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert _strip(full.metrics["evaluations"]) == _strip(resumed.metrics["evaluations"])

    # Control: the same resume without restoring the torch RNG draws other dropout masks and ends elsewhere.
    monkeypatch.setattr(torch, "set_rng_state", lambda state: None)
    again = _run(dropout_pair, tmp_path / "control", resume=True)
    assert again.metrics["resumed_from"] == 3
    assert not all(torch.equal(a, b) for a, b in zip(full.model.parameters(), again.model.parameters(), strict=True))


def test_a_hostile_pickle_in_a_checkpoint_is_refused(tmp_path, dropout_pair):
    _run(dropout_pair, tmp_path / "run", stop_after_steps=3)
    marker = tmp_path / "pwned"

    class Hostile:
        def __reduce__(self):
            return (Path.touch, (marker,))

    ckpt = list_checkpoints(tmp_path / "run")[-1]
    (ckpt / "optimizer.bin").write_bytes(pickle.dumps({"state": Hostile()}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        _run(dropout_pair, tmp_path / "run", resume=True)
    assert not marker.exists()


def test_checkpoint_writes_are_atomic(tmp_path):
    accelerator = make_accelerator("no", device="cpu")
    first = save_checkpoint(accelerator, tmp_path, 1, {"global_step": 1})
    assert list_checkpoints(tmp_path) == [first] and (first / "random_states_0.pkl").is_file()

    def broken_save_state(output_dir: str, **kwargs) -> None:
        (Path(output_dir) / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    real = accelerator.save_state
    accelerator.save_state = broken_save_state
    try:
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(accelerator, tmp_path, 2, {"global_step": 2})
    finally:
        accelerator.save_state = real
    assert list_checkpoints(tmp_path) == [first]  # the half-written folder is hidden, never a checkpoint
    again = save_checkpoint(accelerator, tmp_path, 2, {"global_step": 2}, keep=1)
    assert list_checkpoints(tmp_path) == [again] and not (again / "model.safetensors").exists()
