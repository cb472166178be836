"""Analytic multiply-accumulate (MAC) count of one Multipole Attention layer (docs/mano.md §4).

Counts what the layer computes beyond the level-0 token-wise projections (qkv and proj on all N tokens,
which a model-level count already charges as linear layers), with the padded window counts the module
really runs:

    prefix queries           2·P·N·C                      (scores + weighted values over all N keys)
    level-0 windows          2·nW₀·T₀·(T₀ + P_g)·C        (P_g = P with prefix="global", else 0)
    coarse level ℓ ≥ 1       4·n_ℓ·C²                      (qkv + proj on n_ℓ = H_ℓ·W_ℓ tokens)
                             + 2·nW_ℓ·T_ℓ²·C               (windowed attention)
                             + n_ℓ·C²·r² per conv          (down conv, up transposed conv; 0 for avg/nearest)

T = window tokens, nW = windows of the padded level; norms, softmax, pooling and V-cycle sums are
O(N·C) and ignored. FLOPs = 2 × MACs. `coarse=False` counts a layer whose coarse levels vanish (U = 0 or γ = 0, the
"preserve" init, at inference: `MultipoleAttention.coarse_levels_vanish`), which skips them.
"""

from __future__ import annotations

from typing import Any

from vca_patch.layers.macs import AttentionShape, register_attention_macs
from vca_patch.targets.mano.levels import plan_levels


def mano_attention_macs(
    num_prefix_tokens: int,
    grid: tuple[int, int],
    dim: int,
    *,
    window: int = 7,
    rate: int = 2,
    levels: int | None = None,
    down: str = "conv",
    up: str = "conv",
    prefix: str = "global",
    pad: bool = True,
    attn_dim: int | None = None,
    coarse: bool = True,
) -> float:
    """MACs of one MANO layer on P prefix tokens + an H×W grid with C channels (attn_dim: M·d, default C); coarse:
    whether the coarse levels run (False: skipped, as with U = 0 at inference)."""
    C, A, P = dim, attn_dim or dim, num_prefix_tokens
    plan = plan_levels(tuple(grid), window, rate, levels, pad)
    N = P + plan[0].num_tokens
    level0 = plan[0]
    joined = P if prefix == "global" else 0
    macs = 2.0 * P * N * A + 2.0 * level0.num_windows * level0.window_tokens * (level0.window_tokens + joined) * A
    convs = (down == "conv") + (up == "conv")
    for level in plan[1:] if coarse else ():
        n, T = level.num_tokens, level.window_tokens
        macs += 4.0 * n * C * A + 2.0 * level.num_windows * T * T * A + convs * n * C * C * rate * rate
    return macs


def mano_macs_from_config(shape: Any, config: Any = None) -> float:
    """`mano_attention_macs` for a bench `AttentionShape` (num_prefix_tokens, grid, dim) and a MANOConfig."""
    settings = {
        key: getattr(config, key)
        for key in ("window", "rate", "levels", "down", "up", "prefix", "pad")
        if config is not None and hasattr(config, key)
    }
    return mano_attention_macs(shape.num_prefix_tokens, shape.grid, shape.dim, **settings)


@register_attention_macs("mano")
def _mano_from_config(shape: AttentionShape, config: Any) -> float:
    return mano_macs_from_config(shape, config)
