"""The registry of analytic attention costs: one `fn(shape, config) -> MACs` per target name.

Counted in MACs (one multiply + one add); FLOPs = 2 × MACs. "softmax" is the original attention, 2·N²·C for
N tokens of C channels (q·kᵀ and A·v); norms, softmax exponentials and pooling are ignored (O(N·C)). Each target
registers its own count from its package with `register_attention_macs(name)` (VCA: `targets/vca/macs.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vca_patch.core.registry import Registry
from vca_patch.layers.layout import TokenLayout


@dataclass(frozen=True)
class AttentionShape(TokenLayout):
    """One attention layer's problem size: a token layout (P prefix tokens + an H×W grid), C channels, M heads."""

    dim: int
    num_heads: int


AttentionMacs = Callable[[AttentionShape, Any], float]
ATTENTION_MACS: Registry[AttentionMacs] = Registry("MAC count")


def register_attention_macs(target: str) -> Callable[[AttentionMacs], AttentionMacs]:
    """Decorator: `fn(shape, config) -> MACs` of one attention layer of `target` (config may be None). A target
    another function counts is refused (`unregister_attention_macs` it first); the same function again is a no-op."""

    def wrap(fn: AttentionMacs) -> AttentionMacs:
        return ATTENTION_MACS.register(target, fn)

    return wrap


def unregister_attention_macs(target: str) -> AttentionMacs:
    """Remove the MAC count of `target`; the function."""
    return ATTENTION_MACS.unregister(target)


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
