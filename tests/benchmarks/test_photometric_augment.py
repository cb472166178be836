"""PhotometricAugment (colour jitter, grayscale, blur of training crops) and PhotoCrops with it."""

from __future__ import annotations

import pytest
import torch
from dinov2_weights.augment import PhotometricAugment
from dinov2_weights.photos import IMAGENET_MEAN, IMAGENET_STD, PhotoCrops

OFF = {"jitter_p": 0.0, "grayscale_p": 0.0, "blur_p": 0.0}


def _image(seed: int = 0, size: int = 24) -> torch.Tensor:
    return torch.rand(3, size, size, generator=torch.Generator().manual_seed(seed)) * 0.5 + 0.25  # no clipping


def _luma(image: torch.Tensor) -> torch.Tensor:
    """ITU-R 601 luma of [3, H, W], in the image's dtype (float64 for the references)."""
    return 0.2989 * image[0] + 0.587 * image[1] + 0.114 * image[2]


def _draw(augment: PhotometricAugment, image: torch.Tensor, seed: int) -> torch.Tensor:
    return augment(image, torch.Generator().manual_seed(seed))


def test_same_seed_same_result_and_off_is_identity():
    image, augment = _image(), PhotometricAugment(jitter_p=1.0, grayscale_p=0.5, blur_p=0.5)
    assert torch.equal(_draw(augment, image, 3), _draw(augment, image, 3))
    assert len({tuple(_draw(augment, image, s).flatten()[:4].tolist()) for s in range(10)}) > 1
    assert torch.equal(_draw(PhotometricAugment(**OFF), image, 3), image)


def test_grayscale_is_the_luma_on_every_channel():
    image = _image(1).double()
    out = _draw(PhotometricAugment(**{**OFF, "grayscale_p": 1.0}), image.float(), 0).double()
    luma = _luma(image)
    for channel in out:
        assert torch.allclose(channel, luma, atol=1e-6)


@pytest.mark.parametrize("name", ["brightness", "contrast", "saturation"])
def test_each_jitter_factor_stays_in_its_range(name):
    image = _image(2).double()
    augment = PhotometricAugment(**{**OFF, "jitter_p": 1.0, "brightness": 0.0, "contrast": 0.0, "saturation": 0.0,
                                    name: 0.3})  # fmt: skip
    luma = _luma(image)
    anchor = {"brightness": torch.zeros_like(image), "contrast": luma.mean().expand_as(image), "saturation": luma}[name]
    factors = []
    for seed in range(40):
        out = _draw(augment, image.float(), seed).double()
        # out = anchor + f·(image − anchor): recover f by least squares, and check the fit is exact
        delta = image - anchor
        f = float((out - anchor).flatten() @ delta.flatten() / delta.flatten().square().sum())
        assert torch.allclose(out, anchor + f * delta, atol=1e-5)
        factors.append(f)
    assert 0.7 - 1e-6 <= min(factors) < 0.85 and 1.15 < max(factors) <= 1.3 + 1e-6  # uniform over [0.7, 1.3]


def test_blur_keeps_mass_and_spreads_a_point_by_sigma():
    point = torch.zeros(3, 41, 41)
    point[:, 20, 20] = 1.0
    augment = PhotometricAugment(**{**OFF, "blur_p": 1.0, "blur_sigma": (1.5, 1.5)})
    out = _draw(augment, point, 0)[0].double()
    assert float(out.sum()) == pytest.approx(1.0, abs=1e-4)
    rows = torch.arange(41, dtype=torch.float64) - 20
    variance = float((out.sum(1) * rows.square()).sum())
    assert variance == pytest.approx(1.5**2, rel=0.05)  # a 10% wider or narrower blur fails


def test_default_probabilities_show_in_many_draws():
    image = _image(4, 8)
    augment = PhotometricAugment(jitter_p=0.0, blur_p=0.0)  # grayscale alone, p = 0.2
    greyed = sum(bool(torch.equal(out[0], out[1])) for out in (_draw(augment, image, s) for s in range(600)))
    assert abs(greyed / 600 - 0.2) < 0.06  # binomial sd 0.016


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"jitter_p": 1.5}, "jitter_p"), ({"grayscale_p": -0.1}, "grayscale_p"), ({"brightness": 1.0}, "brightness"),
     ({"blur_sigma": (2.0, 1.0)}, "blur_sigma"), ({"blur_sigma": (0.0, 1.0)}, "blur_sigma")],
)  # fmt: skip
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PhotometricAugment(**kwargs)


def test_photo_crops_augment_before_normalising():
    photos = {"a": _image(5, 40), "b": _image(6, 40)}
    plain = PhotoCrops(photos, 16, 8, seed=1)
    grey = PhotoCrops(photos, 16, 8, seed=1, augment=PhotometricAugment(**{**OFF, "grayscale_p": 1.0}))
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    for i in range(8):
        x, y = grey[i]
        pixels = x * std + mean  # back to [0, 1]: one grey value on every channel
        assert y == 0 and torch.allclose(pixels, pixels[:1].expand(3, -1, -1), atol=1e-5)
        crop = plain[i][0] * std + mean  # the same crop (same photo, window and flip), before greying
        assert torch.allclose(pixels[0], _luma(crop), atol=1e-5)
