"""The recipe engine and calibration are target- and library-agnostic: MANO layers, transformers models."""

from __future__ import annotations

import json

import pytest
import torch

import vca_patch
from tests.support.recovery import TINY_ARGS, needs_fashion_mnist, probe_images, trained_tiny_vit
from vca_patch.eval.fidelity import fidelity
from vca_patch.recovery import calibrate
from vca_patch.train import finetune, recipe_from_dict, run_recipe, teacher_from
from vca_patch.train.params import parameter_groups

pytestmark = needs_fashion_mnist

RECIPE = {
    "name": "tiny-mano",
    "budget": "CPU, seconds",
    "data": {"kind": "fashion_mnist", "train_limit": 256, "eval_limit": 64},
    "train": {"batch_size": 16, "eval_every": 8, "checkpoint_every": 4, "eval_images": 64},
    "stages": [
        {"name": "transfer", "kind": "attention_transfer", "steps": 20, "lr": 3e-3, "warmup_steps": 1},
        {"name": "distill", "kind": "distill", "steps": 4, "lr": 1e-3, "carried_lr": 1e-4, "label_weight": 0.1},
    ],
}


def test_parameter_groups_of_a_mano_model_separate_carried_and_new():
    model = trained_tiny_vit()
    vca_patch.patch_model(model, vca_patch.MANOConfig(window=4, rate=2))
    groups = {k: [n for n, _ in v] for k, v in parameter_groups(model).items()}
    assert "blocks.0.attn.qkv.weight" in groups["carried"] and "blocks.0.attn.proj.bias" in groups["carried"]
    assert groups["new"] and all(".attn." in n and "qkv" not in n for n in groups["new"])
    assert not groups["lambda"] and "head.weight" in groups["rest"]


def test_fashion_mnist_recipe_runs_with_mano(tmp_path):
    model = trained_tiny_vit()
    vca_patch.patch_model(model, vca_patch.MANOConfig(window=4, rate=2, init="multipole"))
    teacher = teacher_from(model)
    probe = [probe_images(64)]
    before = fidelity(teacher, model, probe).layer_error
    train, _ = _datasets()
    spec = recipe_from_dict({**RECIPE, "stages": RECIPE["stages"][:1]})
    run_recipe(model, teacher, spec, tmp_path / "run", train_set=train)
    after = fidelity(teacher, model, probe).layer_error
    assert all(a < b for a, b in zip(after, before, strict=True)), (before, after)


def test_finetune_cli_path_with_a_mano_checkpoint(tmp_path):
    model = trained_tiny_vit()
    vca_patch.patch_model(model, vca_patch.MANOConfig(window=4, rate=2))
    vca_patch.save_pretrained(model, tmp_path / "conv", model_args=TINY_ARGS, metadata={"base_weights": "local file"})
    finetune(tmp_path / "conv", recipe_from_dict(RECIPE), tmp_path / "out")
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["status"] == "completed" and [e["step"] for e in metrics["evaluations"]] == [
        8,
        16,
        20,
        24,
    ]  # every 8 steps and at the end of each stage
    final = metrics["evaluations"][-1]
    assert 0 <= final["top1_agreement"] <= 1 and torch.isfinite(torch.tensor(final["loss"]))
    assert "lambda" not in final  # MANO has no λ: its target records no parameter trace
    again = vca_patch.from_pretrained(tmp_path / "out")
    assert again.vca_patch_state.config.target == "mano"


def _datasets():
    from vca_patch.data import load_fashion_mnist

    return load_fashion_mnist("train", limit=256), load_fashion_mnist("test", limit=64)


def test_calibration_and_fidelity_on_a_transformers_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=28, patch_size=4, num_channels=1, num_labels=10,
    )  # fmt: skip
    model = transformers.ViTForImageClassification(config).eval()
    vca_patch.patch_model(model, vca_patch.VCAConfig(contrast_tokens=4))
    images = [probe_images(32, "train")]
    report = calibrate(model, images)
    assert len(report.layers) == 2 and report.mean_error() < report.mean_error("init")
    result = fidelity(None, model, [probe_images(32)])
    assert len(result.layer_error) == 2 and 0 <= result.summary()["top1_agreement"] <= 1
