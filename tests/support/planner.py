"""Tiny models, model summaries, synthetic measurements and image folders for the planner's tests."""

from __future__ import annotations

import numpy as np
import timm
import torch
from PIL import Image

from vca_patch.planner import ModelInfo
from vca_patch.planner.costs import LatencyTable
from vca_patch.planner.sensitivity import Loss, MergeSchedule, Sensitivity

RES = 56  # 4x4 patches of 14 px + CLS


def tiny_dinov2(depth: int = 4) -> torch.nn.Module:
    model = timm.create_model(
        "vit_small_patch14_dinov2", pretrained=False, img_size=RES, depth=depth, embed_dim=64, num_heads=4,
        init_values=0.5, num_classes=0,
    )  # fmt: skip
    with torch.no_grad():  # sharper attention than the random init's near-uniform one
        for block in model.blocks:
            block.attn.qkv.weight[:128].mul_(8.0)
    return model.eval()


def synthetic_info(depth: int = 4) -> ModelInfo:
    return ModelInfo(depth, 64, 4, 1, 14, 12.0 * 64 * 64, tuple(f"blocks.{i}" for i in range(depth)), "norm")


def synthetic_measurements() -> tuple[ModelInfo, LatencyTable, Sensitivity]:
    info = synthetic_info()
    table = LatencyTable(
        original_s=1.0, other_s=0.2, softmax_tokens=[3, 17], softmax_s=[0.05, 0.2], vca_s={4: 0.1, 16: 0.15}
    )
    sens = Sensitivity()
    for block in range(4):
        sens.vca[(block, 4)] = Loss(0.02 * (block + 1), 0.01)
        sens.vca[(block, 16)] = Loss(0.005 * (block + 1), 0.004)
    sens.merge[MergeSchedule(0, 4)] = Loss(0.01, 0.3)
    sens.merge[MergeSchedule(2, 6)] = Loss(0.002, 0.1)
    return info, table, sens


def image_folder(folder, count: int) -> None:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (70, 84, 3), dtype=np.uint8)).save(folder / f"{i}.png")
