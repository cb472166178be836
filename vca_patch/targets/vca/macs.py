"""Analytic MACs of a VCA layer, registered for `vca-patch bench` and the planner.

    VCA (SDPA form)   8·n·N·C + 9·H·W·C   (Stage I 4nNC, Stage II 4nNC, depthwise 3×3 conv)
                      + 2·P·N·C when prefix tokens read all N keys exactly
                      + 2·H·W·(P + k²)·C with the k×k local term (neighbourhood attention)

The paper's 7·n·N·C counts Stage II's value product over n instead of the 2n stacked tokens that the single
SDPA call uses (docs/vca.md §3.2, §4.1); `vca_attention_macs(..., sdpa=False)` gives that form.
"""

from __future__ import annotations

from typing import Any

from vca_patch.layers.macs import AttentionShape, register_attention_macs


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
