"""The Fashion-MNIST linear probe: its paired share of the original's accuracy, and the scores it reports."""

from __future__ import annotations

import copy
import statistics

import numpy as np
import pytest
import torch
from dinov2_weights.probe import (
    LinearProbe,
    domain_photos,
    fashion_mnist_images,
    original_probe_cell,
    paired_share,
    probe_features,
)
from torch import nn

from vca_patch.data.fashion_mnist import DEFAULT_ROOT


def test_paired_share_against_a_hand_computation():
    correct = np.array([1, 1, 0, 1, 0, 1, 1, 0], dtype=bool)
    reference = np.array([1, 1, 1, 1, 0, 0, 1, 1], dtype=bool)
    share, se = paired_share(correct, reference)
    assert share == pytest.approx((5 / 8) / (6 / 8), rel=1e-12)
    differences = [
        int(c) - int(r) for c, r in zip(correct, reference, strict=True)
    ]  # float64 reference, by the statistics module
    assert se == pytest.approx(statistics.stdev(differences) / len(differences) ** 0.5 / (6 / 8), rel=1e-12)
    assert paired_share(reference, reference) == (1.0, 0.0)  # the same answers: nothing lost, no uncertainty


def test_the_table_cell_gives_the_share_and_its_error_for_converted_models_only():
    converted = {"probe_original": 0.755, "probe_original_share": 0.755 / 0.77, "probe_original_share_se": 0.0123}
    assert original_probe_cell(converted) == "0.755 (98.1 ± 1.2%)"
    assert original_probe_cell({"probe_original": 0.77}) == "0.770"  # results written before the share had an error
    original = {"probe_original": 0.77, "probe_original_share": 1.0, "probe_original_share_se": 0.0}
    assert original_probe_cell(original) == "0.770"


@pytest.mark.parametrize(
    ("correct", "reference", "message"),
    [(np.ones(3, bool), np.ones(4, bool), "one length"), (np.ones(1, bool), np.ones(1, bool), ">= 2"),
     (np.ones(3, bool), np.zeros(3, bool), "no test image right")],
)  # fmt: skip
def test_paired_share_refuses_what_it_cannot_compare(correct, reference, message):
    with pytest.raises(ValueError, match=message):
        paired_share(correct, reference)


class PatchTokens(nn.Module):
    """A stand-in backbone: 7 px patch tokens of a random convolution, with their mean as the CLS token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 16, 7, stride=7)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        patches = self.embed(images).flatten(2).transpose(1, 2)  # [B, P, 16]
        return torch.cat([patches.mean(1, keepdim=True), patches], dim=1)  # [B, 1 + P, 16]


@pytest.mark.skipif(not DEFAULT_ROOT.is_dir(), reason="Fashion-MNIST not installed (apt-get dataset-fashion-mnist)")
def test_probe_scores_a_copy_as_the_original_and_a_perturbed_model_by_its_own_predictions():
    torch.manual_seed(0)
    original = PatchTokens().eval()
    probe = LinearProbe.fit(original, train=120, test=60, size=28)
    labels = probe.test[1].numpy()
    assert probe.accuracy == pytest.approx((probe.predictions == labels).mean()) and probe.accuracy > 0.3

    same = probe.score(copy.deepcopy(original))
    assert same["probe_original"] == probe.accuracy and same["probe_agreement"] == 1.0
    assert (same["probe_original_share"], same["probe_original_share_se"]) == (1.0, 0.0)

    perturbed = copy.deepcopy(original)
    with torch.no_grad():
        perturbed.embed.weight.add_(0.5 * perturbed.embed.weight.std() * torch.randn_like(perturbed.embed.weight))
    scores = probe.score(perturbed)
    predictions = probe.original.predict(probe_features(perturbed, probe.test[0], 28, 16))
    assert scores["probe_agreement"] == pytest.approx((predictions == probe.predictions).mean())
    assert 0 < scores["probe_agreement"] < 1  # the perturbation changed some of the probe's answers, not all
    assert scores["probe_original"] == pytest.approx((predictions == labels).mean())
    assert scores["probe_original_share"] == pytest.approx(scores["probe_original"] / probe.accuracy)
    assert scores["probe_original_share_se"] > 0


@pytest.mark.skipif(not DEFAULT_ROOT.is_dir(), reason="Fashion-MNIST not installed (apt-get dataset-fashion-mnist)")
def test_domain_photos_are_the_training_images_after_the_probes_as_grey_rgb():
    photos = domain_photos(3, skip=5)
    assert list(photos) == [f"fashion-mnist-train-{i:05d}" for i in (5, 6, 7)]  # not the probe's first 5
    images = fashion_mnist_images("train", 8)[0]
    for i, photo in enumerate(photos.values()):
        assert photo.shape == (3, 28, 28) and torch.equal(photo, images[5 + i].expand(3, -1, -1))
    with pytest.raises(ValueError, match="count >= 1"):
        domain_photos(0, skip=5)
    with pytest.raises(ValueError, match="fewer than"):
        domain_photos(10, skip=59_995)
