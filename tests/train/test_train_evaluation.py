"""The engine's per-image evaluation (what gather_for_metrics collects) reproduces `vca_patch.eval.fidelity`."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import vca_patch
from tests.support.recovery import tiny_vit
from vca_patch.eval.fidelity import fidelity
from vca_patch.train import evaluate, teacher_from


@pytest.mark.parametrize("labels", [True, False])
def test_evaluate_matches_fidelity(labels):
    torch.manual_seed(0)
    student = tiny_vit()
    vca_patch.patch_model(student.eval(), vca_patch.VCAConfig(contrast_tokens=4, init="paper"))  # far from exact
    teacher = teacher_from(student)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(150, 1, 28, 28, generator=g), torch.randint(0, 10, (150,), generator=g)
    data = TensorDataset(x, y) if labels else TensorDataset(x)
    got = evaluate(student, teacher, data, images=140)  # two batches of the engine's 128, the last partial
    batches = [tuple(b) if labels else b[0] for b in DataLoader(TensorDataset(x[:140], y[:140]), batch_size=50)]
    report = fidelity(teacher, student, batches)
    want = {**report.summary(), "layer_error": report.layer_error}
    assert set(got) == set(want)
    assert got.pop("layer_error") == pytest.approx(want.pop("layer_error"), rel=1e-9)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert got["mean_layer_error"] > 0.05 and got["patch_cosine"] < 0.999  # a real gap was measured
