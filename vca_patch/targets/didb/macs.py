"""Analytic MACs of a DIDB attention layer for `vca-patch bench` (binary products counted as MACs)."""

from __future__ import annotations

from typing import Any

from vca_patch.layers.macs import AttentionShape, register_attention_macs


@register_attention_macs("didb")
def didb_attention_macs(shape: AttentionShape, config: Any = None) -> float:
    """Per layer: q·kᵀ per band (2 with HFSC) + A·v over N² pairs, and with HFSC the qk projection run on the
    second band (2·N·C² beyond the block's token-wise Linears). Haar split and neighbour term are O(N·C)."""
    tokens, dim = shape.num_tokens, shape.dim
    bands = 2 if config is None or getattr(config, "hfsc", True) else 1
    return (bands + 1) * tokens**2 * dim + (bands - 1) * 2 * tokens * dim**2
