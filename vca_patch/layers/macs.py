"""The registry of analytic attention costs: one `fn(shape, config) -> MACs` per target name.

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

from vca_patch.layers.layout import TokenLayout


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
