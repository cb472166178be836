"""A diffusers attention processor that runs a vca_patch replacement layer inside the original `Attention` module.

diffusers attention modules delegate their computation to a swappable *processor*
(`attn.set_processor(...)`), so a patch swaps the processor, never the module: `to_q`/`to_k`/`to_v`/`to_out`
(and `norm_q`/`norm_k`) stay where they are, under their state-dict names. The replacement layer (VCA, MANO, ...)
lives on the processor, outside the module tree; its *new* parameters are registered on the attention module as
a child named for the target (`vca`, `mano`, ...: `holder_name`), so they are saved, loaded, moved and trained with
the model, and a state dict says which target they belong to (`attn.vca.…`, `attn.mano.…`). Before every call
the processor re-binds the layer to what the attention module holds then (parameters replaced by
`load_state_dict(assign=True)`, a LoRA wrapper around `to_q`, a deep copy), so nothing is cached stale.
`JointLayerProcessor` does the same for joint image + text attention (SD3), returning both streams.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from vca_patch.layers.layout import TokenLayout

# The holder's name where the installer names no target (a caller written before holders were named for their
# target), and the name every target's holder had before: checkpoints may still hold `attn.vca.…` for any target.
DEFAULT_HOLDER = "vca"


def holder_name(target: str | None) -> str:
    """The child of a converted attention module that holds the replacement's new parameters: the target's name
    (`vca`, `mano`, ...) as a module name (other characters than letters, digits and `_` become `_`)."""
    return re.sub(r"\W", "_", target) if target else DEFAULT_HOLDER


def new_members(layer: nn.Module, attention: nn.Module) -> nn.Module:
    """A container of `layer`'s own parameters and submodules: those it added, not the attention's carried ones."""
    carried_names = set(layer.carried_members())
    theirs = {id(m) for m in attention.modules()}
    container = nn.Module()
    for name, param in layer._parameters.items():
        if param is not None and name not in carried_names:
            container.register_parameter(name, param)
    for name, module in layer._modules.items():
        if module is None or name in carried_names or id(module) in theirs:
            continue
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):  # not an Identity
            container.add_module(name, module)
    return container


class CarriedLayerProcessor:
    """Processor for a diffusers `Attention` whose softmax self-attention became `layer`.

    `sources` maps the layer's carried member names to module paths inside the attention module
    (e.g. {"to_q": "to_q", "proj": "to_out.0", "q_norm": "norm_q"}); `original` is the processor it replaced,
    kept for `unpatch_model`; `holder` is the attention module's child holding the layer's new parameters
    (`holder_name`). The call convention is diffusers' (`attn, hidden_states, ...`) plus an optional
    `layout=` for calling one attention module on its own. Cross-attention inputs and attention masks are
    refused: the layer is a self-attention over the image tokens. A processor for other streams overrides
    `check_streams` and `run` (and `__call__` for another call convention, as Flux's).
    """

    token_kind = "tokens"  # what `hidden_states` holds, as call errors name it
    holder = DEFAULT_HOLDER  # set per instance in __init__; the class default serves one unpickled from before

    def __init__(self, layer: nn.Module, sources: dict[str, str], original: Any, holder: str = DEFAULT_HOLDER) -> None:
        self.layer = layer
        self.sources = dict(sources)
        self.original = original
        self.holder = holder

    def owner(self, attn: nn.Module) -> str:
        """How call errors name this processor: its layer and the attention module it was patched into."""
        return f"{type(self.layer).__name__} (patched into {type(attn).__name__} by vca_patch)"

    @staticmethod
    def refuse_mask(owner: str, attention_mask: torch.Tensor | None) -> None:
        """Linear attention has no attention matrix to mask: a given mask is an error, never ignored."""
        if attention_mask is not None:
            raise ValueError(f"{owner} cannot apply an attention mask to linear attention")

    def bind(self, attn: nn.Module) -> None:
        """Point the layer at the modules and parameters `attn` holds now (identity checks, no copies)."""
        layer, modules = self.layer, self.layer._modules
        for name, path in self.sources.items():
            member = attn.get_submodule(path)
            if modules.get(name) is not member:
                modules[name] = member
        new = attn._modules.get(self.holder)
        if new is None:
            raise RuntimeError(f"{type(attn).__name__} has lost its `{self.holder}` parameters; re-patch the model")
        for name, param in new._parameters.items():
            if layer._parameters.get(name) is not param:
                layer._parameters[name] = param
        for name, module in new._modules.items():
            if modules.get(name) is not module:
                modules[name] = module
        layer.training = attn.training

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        layout: TokenLayout | None = None,
    ) -> Any:
        owner = self.owner(attn)
        self.check_streams(owner, encoder_hidden_states)
        self.refuse_mask(owner, attention_mask)
        if hidden_states.ndim != 3:
            raise ValueError(f"{owner} takes [B, N, C] {self.token_kind}, got shape {tuple(hidden_states.shape)}")
        self.bind(attn)
        return self.run(hidden_states, encoder_hidden_states, layout=layout)

    def check_streams(
        self, owner: str, encoder_hidden_states: torch.Tensor | None, rotary: tuple[torch.Tensor, ...] | None = None
    ) -> None:
        """Refuse a call whose streams this layer does not take (here: any text stream)."""
        if encoder_hidden_states is not None:
            raise TypeError(f"{owner} is a self-attention over image tokens; it got encoder_hidden_states")

    def run(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None, **kwargs: Any) -> Any:
        """The layer on the call's streams (checked, bound): here the image tokens only."""
        return self.layer(hidden_states, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layer!r})"


class JointLayerProcessor(CarriedLayerProcessor):
    """Processor for a diffusers joint (image + text) attention whose softmax attention became a
    `JointVisualContrastAttention`: `hidden_states` are the image tokens, `encoder_hidden_states` the text
    tokens; returns (image output, text output) as `JointAttnProcessor2_0` does."""

    token_kind = "image tokens"

    def check_streams(
        self, owner: str, encoder_hidden_states: torch.Tensor | None, rotary: tuple[torch.Tensor, ...] | None = None
    ) -> None:
        if encoder_hidden_states is None:
            raise TypeError(f"{owner} is a joint image + text attention; it needs encoder_hidden_states")

    def run(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None, **kwargs: Any) -> Any:
        return self.layer(hidden_states, encoder_hidden_states, **kwargs)
