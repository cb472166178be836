"""Hooks that let a replacement module accept its family's attention call convention.

Hooks are callable objects (not closures) so `copy.deepcopy(model)` keeps them working.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_TOKEN_NAMES = ("x", "hidden_states")
_MASK_NAMES = ("attn_mask", "attention_mask")


def call_tokens(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """The token tensor of an attention call, whichever convention (timm `x`, transformers `hidden_states`)."""
    return args[0] if args else next(kwargs[name] for name in _TOKEN_NAMES if name in kwargs)


def attention_output(output: Any) -> torch.Tensor:
    """An attention module's output tensor (transformers modules return `(output, weights)`)."""
    return output[0] if isinstance(output, tuple) else output


# Model-level flags transformers threads through every layer (TransformersKwargs); attention ignores them too.
_MODEL_FLAGS = ("output_hidden_states", "return_dict", "interpolate_pos_encoding", "num_items_in_batch", "use_cache")


class TokensOnly:
    """Forward pre-hook: call the replacement with the token tensor alone (and an explicit `layout=`).

    Keyword arguments in `dropped` (e.g. `rope`, a relative-position bias) are discarded — the adapter records
    that as an approximation. Any other keyword argument that asks for something (not None, not False) is an
    error naming it: a replacement never silently ignores an input it cannot apply (cross-attention's
    `encoder_hidden_states`, rotary `position_embeddings`, ...). A non-None mask is an error unless
    `mask_is_bias` (BEiT passes its relative-position bias as the mask), since VCA cannot apply one.
    """

    def __init__(self, dropped: tuple[str, ...] = (), mask_is_bias: bool = False) -> None:
        self.dropped = dropped
        self.mask_is_bias = mask_is_bias

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        owner = type(module).__name__
        if kwargs.get("is_causal"):
            raise ValueError(f"{owner} cannot apply causal attention")
        x = call_tokens(args, kwargs)
        masks = [kwargs.get(name) for name in _MASK_NAMES] + list(args[1:2])  # HF passes the mask second
        if any(isinstance(m, torch.Tensor) for m in masks) and not self.mask_is_bias:
            raise ValueError(f"{owner} cannot apply an attention mask to linear attention")
        known = {*_TOKEN_NAMES, *_MASK_NAMES, *_MODEL_FLAGS, *self.dropped, "layout"}
        asked = [
            name for name, value in kwargs.items() if name not in known and value is not None and value is not False
        ]
        if asked:
            raise TypeError(
                f"{owner} (patched by vca_patch) cannot apply the call argument(s) {', '.join(sorted(asked))}: "
                "the original attention used them and the replacement would ignore them; unpatch this layer "
                "(config.exclude) or call it without them"
            )
        return (x,), {"layout": kwargs["layout"]} if "layout" in kwargs else {}


class TupleOutput:
    """Forward hook: return `(output, None)` as Hugging Face attention modules do."""

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return output, None
