"""A downstream check for head-less backbones: a Fashion-MNIST linear probe on [CLS, mean patch] features.

Two accuracies per converted model: a probe trained on its own features ("own": is the information still there?)
and the original's probe applied to its features ("original's": is it a drop-in replacement?). The original's probe
is scored on the same test images for both models, so its share of the original's accuracy has a paired standard
error, far below either accuracy's binomial one, and the share of test images it classes alike on both is reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dinov2_weights.load import final_tokens
from dinov2_weights.photos import normalize
from vca_patch.data.fashion_mnist import load_fashion_mnist

DOMAIN_PREFIX = "fashion-mnist-"  # how the names `domain_photos` gives begin


def fashion_mnist_images(split: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(28 px grey images in [0, 1] [N, 1, 28, 28], int64 labels): the first `count` of `split`."""
    return load_fashion_mnist(split, limit=count, img_size=28, normalize=False).tensors


def domain_photos(count: int, skip: int) -> dict[str, torch.Tensor]:
    """`count` unlabelled Fashion-MNIST training images after the first `skip` (the probe's), as 28 px RGB "photos"
    {name: [3, 28, 28] in [0, 1]} for `PhotoCrops`: the probe's domain, for distilling on it without its labels."""
    if count < 1 or skip < 0:
        raise ValueError(f"need count >= 1 and skip >= 0, got count={count}, skip={skip}")
    images = fashion_mnist_images("train", skip + count)[0][skip:]
    if len(images) < count:
        raise ValueError(f"Fashion-MNIST has {skip + len(images)} training images, fewer than {skip} + {count}")
    return {f"{DOMAIN_PREFIX}train-{skip + i:05d}": image.expand(3, -1, -1).clone() for i, image in enumerate(images)}


@torch.no_grad()
def probe_features(model: nn.Module, images: torch.Tensor, size: int, batch: int) -> np.ndarray:
    """[CLS, mean patch] features [N, 2C] of grey 28 px images upsampled to `size` px and ImageNet-normalised."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(images), batch):
        x = F.interpolate(images[i : i + batch], size=(size, size), mode="bilinear", align_corners=False)
        feats = final_tokens(model, normalize(x.expand(-1, 3, -1, -1)).to(device)).float().cpu()
        out.append(torch.cat([feats[:, 0], feats[:, 1:].mean(1)], dim=-1))
    return torch.cat(out).numpy()


def fit_probe(features: np.ndarray, labels: np.ndarray) -> Any:
    """A standardised multinomial logistic-regression probe (scikit-learn)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=0.1)).fit(features, labels)


def paired_share(correct: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(accuracy share, its standard error) of per-image correctness `correct` against `reference` on the same images:
    mean(correct) / mean(reference), and the paired difference's standard error over mean(reference)."""
    if correct.shape != reference.shape or correct.ndim != 1 or len(correct) < 2:
        raise ValueError(f"need two per-image correctness vectors of one length >= 2, got {correct.shape}, "
                         f"{reference.shape}")  # fmt: skip
    base = float(reference.mean())
    if base == 0:
        raise ValueError("the reference gets no test image right: a share of its accuracy is undefined")
    difference = correct.astype(np.float64) - reference.astype(np.float64)
    return float(correct.mean()) / base, float(difference.std(ddof=1) / np.sqrt(len(difference))) / base


@dataclass
class LinearProbe:
    """The original's probe and the data, to score converted models against it (`LinearProbe.fit`, `score`)."""

    train: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    size: int
    batch: int
    original: Any = None
    accuracy: float = 0.0
    predictions: np.ndarray | None = None  # the original's probe on the original's test features [test]

    @classmethod
    def fit(cls, original: nn.Module, train: int, test: int, size: int, batch: int = 16) -> LinearProbe:
        """Train the original's probe on `train` Fashion-MNIST training images; `accuracy` on `test` test images."""
        probe = cls(fashion_mnist_images("train", train), fashion_mnist_images("test", test), size, batch)
        probe.original = fit_probe(probe_features(original, probe.train[0], size, batch), probe.train[1].numpy())
        probe.predictions = probe.original.predict(probe_features(original, probe.test[0], size, batch))
        probe.accuracy = float((probe.predictions == probe.test[1].numpy()).mean())
        return probe

    def original_scores(self) -> dict[str, float]:
        """`score` of the original itself, without another pass: both probes are its probe on its own features."""
        return {"probe_own": self.accuracy, "probe_original": self.accuracy, "probe_original_share": 1.0,
                "probe_original_share_se": 0.0, "probe_agreement": 1.0}  # fmt: skip

    def score(self, model: nn.Module) -> dict[str, float]:
        """{"probe_own": a probe trained on `model`'s features, "probe_original": the original's probe on them,
        "probe_original_share" (>= 0.99: a drop-in replacement) and its paired "probe_original_share_se",
        "probe_agreement": the share of test images the original's probe classes alike on both models' features}."""
        own_train = probe_features(model, self.train[0], self.size, self.batch)
        own_test = probe_features(model, self.test[0], self.size, self.batch)
        labels = self.test[1].numpy()
        predictions = self.original.predict(own_test)
        correct = predictions == labels  # [test]
        share, share_se = paired_share(correct, self.predictions == labels)
        return {
            "probe_own": float(fit_probe(own_train, self.train[1].numpy()).score(own_test, labels)),
            "probe_original": float(correct.mean()),
            "probe_original_share": share,
            "probe_original_share_se": share_se,
            "probe_agreement": float((predictions == self.predictions).mean()),
        }


def original_probe_cell(row: dict[str, Any]) -> str:
    """A table cell for the original's probe on a model's features: its accuracy and, for a converted model, the
    share of the original's accuracy it keeps ± the paired standard error (older results without one: accuracy)."""
    if "probe_original_share_se" not in row or row["probe_original_share_se"] == 0:
        return f"{row['probe_original']:.3f}"
    share, share_se = 100 * row["probe_original_share"], 100 * row["probe_original_share_se"]
    return f"{row['probe_original']:.3f} ({share:.1f} ± {share_se:.1f}%)"
