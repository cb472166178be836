"""Latents and conditions for diffusion distillation: generated at random, or read from a folder of tensors.

Each item is (latent [C, H, W], conditions): DiT a class label, PixArt text embeddings, SD3/Flux text embeddings and
a pooled projection (Flux also a guidance scale when it embeds one). What a file does not hold is drawn at random
with the right shape, from a seed of (recipe seed, split, index), so every epoch and every resumed run sees the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from vca_patch.data.errors import DatasetError
from vca_patch.train.diffusion_spec import DiffusionSpec

FAMILIES = {
    "DiTTransformer2DModel": "dit",
    "PixArtTransformer2DModel": "pixart",
    "SD3Transformer2DModel": "sd3",
    "FluxTransformer2DModel": "flux",
}
_SPLITS = {"train": 0, "eval": 1}
_CONDITION_KEYS = ("class_labels", "encoder_hidden_states", "pooled_projections", "guidance")


def model_family(model: nn.Module) -> str:
    """ "dit", "pixart", "sd3" or "flux" for a diffusers transformer (patched or not); ValueError otherwise."""
    name = type(model).__name__
    if name not in FAMILIES:
        raise ValueError(f"diffusion recipes take a diffusers {', '.join(FAMILIES)}; got {name}")
    return FAMILIES[name]


def latent_shape(model: nn.Module, spec: DiffusionSpec) -> tuple[int, int, int]:
    """(C, H, W) of one latent: the model's input channels, `spec.latent_size` or the model's `sample_size`.

    Flux takes packed latents: C is its `in_channels` (64 for FLUX.1: 16 VAE channels × 2 × 2) on the packed grid."""
    config = model.config
    size = spec.latent_size or getattr(config, "sample_size", None)
    if not size:
        raise ValueError(f"{type(model).__name__} has no sample_size: set diffusion.latent_size in the recipe")
    return int(config.in_channels), int(size), int(size)


def random_conditions(model: nn.Module, spec: DiffusionSpec, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One item's conditions of the shapes `model` takes, drawn from `generator`."""
    family, config = model_family(model), model.config
    if family == "dit":
        classes = int(config.num_embeds_ada_norm or 0)
        if classes < 1:
            raise ValueError("this DiT is not class-conditional (num_embeds_ada_norm is unset)")
        return {"class_labels": torch.randint(0, classes, (), generator=generator)}
    L = spec.text_tokens
    if family == "pixart":
        return {"encoder_hidden_states": torch.randn(L, int(config.caption_channels), generator=generator)}
    out = {
        "encoder_hidden_states": torch.randn(L, int(config.joint_attention_dim), generator=generator),
        "pooled_projections": torch.randn(int(config.pooled_projection_dim), generator=generator),
    }
    if family == "flux" and getattr(config, "guidance_embeds", False):
        out["guidance"] = 1.0 + 4.0 * torch.rand((), generator=generator)
    return out


def _generator(spec: DiffusionSpec, split: str, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(((spec.seed * 2 + _SPLITS[split]) * 1_000_003 + index) % (2**63))


class GeneratedLatents(Dataset):
    """`count` standard-normal latents with random conditions (deterministic per index)."""

    def __init__(self, model: nn.Module, spec: DiffusionSpec, split: str, count: int) -> None:
        self.model, self.spec, self.split, self.count = model, spec, split, count
        self.shape = latent_shape(model, spec)
        random_conditions(model, spec, torch.Generator())  # unsupported conditioning fails here, not in a worker

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        g = _generator(self.spec, self.split, int(i))
        latent = torch.randn(self.shape, generator=g)
        return latent, random_conditions(self.model, self.spec, g)


def _read(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        data: Any = load_file(str(path))
    else:
        data = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(data, torch.Tensor):
        data = {"latents": data}
    if not isinstance(data, dict) or not isinstance(data.get("latents"), torch.Tensor):
        raise DatasetError(f"{path}: expected a latent tensor or a dict with a 'latents' tensor")
    unknown = sorted(set(data) - {"latents", *_CONDITION_KEYS})
    if unknown:
        raise DatasetError(f"{path}: unknown key {unknown[0]!r}; valid: latents, {', '.join(_CONDITION_KEYS)}")
    return data


class LatentFolder(Dataset):
    """Latents read from `root` (*.pt / *.safetensors, sorted by name; a file may hold a batch), with the
    conditions they store and random ones for those they do not."""

    def __init__(self, model: nn.Module, spec: DiffusionSpec, root: str | Path) -> None:
        root = Path(root)
        if not root.is_dir():
            raise DatasetError(f"diffusion.latents: {root} is not a folder of .pt/.safetensors latents")
        files = sorted(p for p in root.iterdir() if p.suffix in (".pt", ".safetensors") and p.is_file())
        if not files:
            raise DatasetError(f"diffusion.latents: {root} holds no .pt or .safetensors files")
        self.model, self.spec = model, spec
        channels = int(model.config.in_channels)
        self.items: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        for path in files:
            data = _read(path)
            latents = data["latents"].float()
            if latents.ndim == 3:
                latents = latents[None]
            if latents.ndim != 4 or latents.shape[1] != channels:
                raise DatasetError(
                    f"{path}: latents of shape {tuple(data['latents'].shape)}; {type(model).__name__} takes "
                    f"[{channels}, H, W] (or a batch [B, {channels}, H, W])"
                )
            for b in range(latents.shape[0]):
                cond = {k: _row(data[k], b, latents.shape[0], path, k) for k in _CONDITION_KEYS if k in data}
                self.items.append((latents[b], cond))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        latent, stored = self.items[int(i)]
        cond = random_conditions(self.model, self.spec, _generator(self.spec, "train", int(i)))
        cond.update(stored)
        return latent, cond


def _row(value: torch.Tensor, b: int, batch: int, path: Path, key: str) -> torch.Tensor:
    """Item `b` of a stored condition (a batch of `batch` rows, or one row shared by a single latent)."""
    if batch == 1 and (value.ndim == 0 or value.shape[0] != 1):
        return value
    if value.ndim == 0 or value.shape[0] != batch:
        raise DatasetError(f"{path}: {key} has {value.shape[0] if value.ndim else 0} rows for {batch} latents")
    return value[b]


class _Slice(Dataset):
    def __init__(self, base: Dataset, start: int, stop: int) -> None:
        self.base, self.start, self.stop = base, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.base[self.start + i]


def latent_datasets(model: nn.Module, spec: DiffusionSpec) -> tuple[Dataset, Dataset]:
    """(train, eval) latents for `spec`: generated, or split from the folder (eval after train, disjoint)."""
    if spec.latents is None:
        return (
            GeneratedLatents(model, spec, "train", spec.train_latents),
            GeneratedLatents(model, spec, "eval", spec.eval_latents),
        )
    folder = LatentFolder(model, spec, spec.latents)
    n = len(folder)
    if n < 2:
        raise DatasetError(f"diffusion.latents: {spec.latents} holds {n} latent; need at least 2 (train and eval)")
    enough = n >= spec.train_latents + spec.eval_latents
    n_eval = spec.eval_latents if enough else min(spec.eval_latents, max(1, n // 5))
    n_train = min(spec.train_latents, n - n_eval)
    return _Slice(folder, 0, n_train), _Slice(folder, n_train, n_train + n_eval)
