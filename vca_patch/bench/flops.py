"""Analytic multiply-accumulate (MAC) counts of a ViT forward pass, per attention target.

Counted in MACs (one multiply + one add); FLOPs = 2 × MACs. Per block with N tokens, C channels:

    token-wise linear layers  Σ in·out·N        = 12·N·C² for qkv + proj + a 4× MLP
    softmax attention         2·N²·C            (q·kᵀ and A·v)
    VCA (SDPA form)           8·n·N·C + 9·H·W·C (Stage I 4nNC, Stage II 4nNC, depthwise 3×3 conv)
                              + 2·P·N·C when prefix tokens read all N keys exactly
                              + 2·H·W·(P + k²)·C with the k×k local term (neighbourhood attention)

Norms, softmax exponentials, pooling and the head are ignored (O(N·C) or O(C²)). The paper's
7·n·N·C counts Stage II's value product over n instead of the 2n stacked tokens that the single
SDPA call uses (docs/vca.md §3.2, §4.1); `vca_attention_macs(..., sdpa=False)` gives that form.

Each target registers its attention cost with `register_attention_macs(name)`; "softmax" is the
original attention. A second target (e.g. "mano") adds one function in its own module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..attention import TokenLayout


@dataclass(frozen=True)
class AttentionShape(TokenLayout):
    """One attention layer's problem size: a token layout (P prefix tokens + an H×W grid), C channels, M heads."""

    dim: int
    num_heads: int


AttentionMacs = Callable[[AttentionShape, Any], float]
ATTENTION_MACS: dict[str, AttentionMacs] = {}


def register_attention_macs(target: str) -> Callable[[AttentionMacs], AttentionMacs]:
    """Decorator: `fn(shape, config) -> MACs` of one attention layer of `target` (config may be None)."""

    def wrap(fn: AttentionMacs) -> AttentionMacs:
        ATTENTION_MACS[target] = fn
        return fn

    return wrap


def attention_macs(target: str, shape: AttentionShape, config: Any = None) -> float:
    """MACs of one attention layer (the part between the projections) of `target`."""
    try:
        fn = ATTENTION_MACS[target]
    except KeyError:
        raise KeyError(f"no analytic MAC count for target {target!r}; known: {sorted(ATTENTION_MACS)}") from None
    return fn(shape, config)


@register_attention_macs("softmax")
def softmax_attention_macs(shape: AttentionShape, config: Any = None) -> float:
    """2·N²·C: the N×N logits and the attention-weighted values."""
    return 2.0 * shape.num_tokens**2 * shape.dim


def vca_attention_macs(
    shape: AttentionShape,
    contrast_tokens: int,
    *,
    sdpa: bool = True,
    exact_prefix: bool = False,
    local_window: int = 0,
) -> float:
    """8·n·N·C + 9·H·W·C (7·n·N·C with sdpa=False), plus 2·P·N·C for an exact prefix read-out and
    2·H·W·(P + k²)·C for a local term of k = local_window (each patch's logits and values over P + k² keys)."""
    N, C, n = shape.num_tokens, shape.dim, contrast_tokens
    macs = (8.0 if sdpa else 7.0) * n * N * C + 9.0 * shape.num_patches * C
    if exact_prefix:
        macs += 2.0 * shape.num_prefix_tokens * N * C
    if local_window:
        macs += 2.0 * shape.num_patches * (shape.num_prefix_tokens + local_window**2) * C
    return macs


@register_attention_macs("vca")
def _vca_from_config(shape: AttentionShape, config: Any) -> float:
    n = getattr(config, "contrast_tokens", 49)
    exact = getattr(config, "prefix_readout", "contrast") == "exact"
    return vca_attention_macs(shape, n, exact_prefix=exact, local_window=getattr(config, "local_window", 0))


@dataclass(frozen=True)
class ModelShape:
    """What the MAC count needs from a ViT: per-block token-wise linear MACs per token, heads, prefix."""

    depth: int
    dim: int
    num_heads: int
    num_prefix_tokens: int
    patch_size: tuple[int, int]
    in_chans: int
    linear_macs_per_token: float  # Σ in·out of each block's token-wise Linear layers
    embed_macs_per_patch: float  # patch embedding: C·in_chans·p²

    def grid(self, resolution: tuple[int, int]) -> tuple[int, int]:
        return resolution[0] // self.patch_size[0], resolution[1] // self.patch_size[1]


def model_shape(model: nn.Module) -> ModelShape:
    """Read a timm ViT-style model (`blocks`, `patch_embed`, `num_prefix_tokens`); BenchError for any other."""
    from .errors import BenchError

    missing = [a for a in ("blocks", "patch_embed", "num_prefix_tokens", "embed_dim") if not hasattr(model, a)]
    if missing or not len(model.blocks) or not hasattr(model.blocks[0], "attn"):
        what = f"it has no {', '.join(missing)}" if missing else "it has no attention blocks"
        raise BenchError(
            f"{type(model).__name__} is not a ViT-style timm model that bench can measure ({what}); "
            "bench needs one with patch_embed and blocks, e.g. deit_small_patch16_224"
        )
    blocks = list(model.blocks)
    linear = [sum(m.in_features * m.out_features for m in b.modules() if isinstance(m, nn.Linear)) for b in blocks]
    embed = model.patch_embed
    patch = tuple(embed.patch_size)
    dim = int(model.embed_dim)
    in_chans = int(embed.proj.in_channels)
    attn = blocks[0].attn
    return ModelShape(
        depth=len(blocks),
        dim=dim,
        num_heads=int(attn.num_heads),
        num_prefix_tokens=int(model.num_prefix_tokens),
        patch_size=(int(patch[0]), int(patch[1])),
        in_chans=in_chans,
        linear_macs_per_token=sum(linear) / len(blocks),
        embed_macs_per_patch=float(dim * in_chans * patch[0] * patch[1]),
    )


def model_macs(shape: ModelShape, resolution: tuple[int, int], target: str = "softmax", config: Any = None) -> float:
    """MACs of one image's forward pass; blocks outside `config.layers` (when set) stay softmax."""
    grid = shape.grid(resolution)
    layer = AttentionShape(shape.num_prefix_tokens, grid, shape.dim, shape.num_heads)
    layers = getattr(config, "layers", None)
    total = layer.num_patches * shape.embed_macs_per_patch
    for i in range(shape.depth):
        patched = target != "softmax" and (layers is None or i in layers)
        total += layer.num_tokens * shape.linear_macs_per_token
        total += attention_macs(target if patched else "softmax", layer, config)
    return total


@register_attention_macs("mano")
def _mano_from_config(shape: AttentionShape, config: Any) -> float:
    from ..attention.mano_macs import mano_macs_from_config

    return mano_macs_from_config(shape, config)
