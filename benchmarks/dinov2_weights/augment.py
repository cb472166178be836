"""Photometric augmentation of training crops: colour jitter, grayscale and Gaussian blur, DINO-style.

Distillation matches the frozen original on whatever it is shown, so the student should be shown what the original
was trained to handle: DINOv2 trained on colour-jittered (p 0.8), grayscale (p 0.2) and blurred views. Photo folders
are mostly colour pictures, while the images users run (and the held-out set here: camera, cell, clock, gravel)
include grey ones. The ops are torchvision's; the parameters are drawn from the caller's generator, so a crop stays
a pure function of its (seed, index), as `PhotoCrops` needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torchvision.transforms.v2.functional as TF


@dataclass(frozen=True)
class PhotometricAugment:
    """Random colour jitter, grayscale and blur of an image in [0, 1] (`__call__(image [3, H, W], generator)`).

    jitter_p: probability of colour jitter, which scales brightness, contrast and saturation each by a factor drawn
        uniformly from [1 − strength, 1 + strength], in a random order (torchvision's ColorJitter without hue);
    grayscale_p: probability of replacing the image by its luma (repeated to three channels);
    blur_p, blur_sigma: probability and σ range (pixels of the crop) of a Gaussian blur, kernel ±3σ.
    """

    jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.2
    grayscale_p: float = 0.2
    blur_p: float = 0.3
    blur_sigma: tuple[float, float] = (0.1, 2.0)

    def __post_init__(self) -> None:
        for name in ("jitter_p", "grayscale_p", "blur_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {getattr(self, name)}")
        for name in ("brightness", "contrast", "saturation"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1) (a factor 1 ± {name}), got {getattr(self, name)}")
        low, high = self.blur_sigma
        if not 0.0 < low <= high:
            raise ValueError(f"blur_sigma must be (low, high) with 0 < low <= high, got {self.blur_sigma}")

    def __call__(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """image [3, H, W] in [0, 1] -> the augmented image, same shape, in [0, 1]."""

        def uniform(low: float, high: float) -> float:
            return low + (high - low) * float(torch.rand((), generator=generator))

        if uniform(0, 1) < self.jitter_p:
            ops = (
                (TF.adjust_brightness, self.brightness),
                (TF.adjust_contrast, self.contrast),
                (TF.adjust_saturation, self.saturation),
            )
            for i in torch.randperm(len(ops), generator=generator).tolist():
                op, strength = ops[i]
                image = op(image, uniform(1 - strength, 1 + strength))
        if uniform(0, 1) < self.grayscale_p:
            image = TF.rgb_to_grayscale(image, num_output_channels=3)
        if uniform(0, 1) < self.blur_p:
            sigma = uniform(*self.blur_sigma)
            size = 2 * math.ceil(3 * sigma) + 1
            image = TF.gaussian_blur(image, [size, size], [sigma, sigma])
        return image
