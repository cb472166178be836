"""What an adapter tells surgery about one model family."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..attention import CarriedAttention, TokenLayout
from .verify import TOLERANCE, verification_error


@dataclass
class AttentionSite:
    """A self-attention module that can be converted."""

    path: str
    module: nn.Module
    layer_index: int
    dim: int
    num_heads: int
    notes: list[str] = field(default_factory=list)  # what the conversion drops or changes
    verified: bool | None = None  # a reference softmax attention reproduced the module (None: not checked)

    @property
    def class_name(self) -> str:
        return type(self.module).__name__


@dataclass
class SkippedSite:
    """An attention-like module left untouched, and why."""

    path: str
    class_name: str
    reason: str


class LayoutTracker:
    """Forward hook on a model's embedding module that records the token layout of the current input.

    A callable object rather than a closure, so `copy.deepcopy(model)` copies it along with the
    modules that read it.
    """

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.layout: TokenLayout | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.layout = self.adapter.layout_from_embedding(module, args, kwargs, output)

    def current(self) -> TokenLayout:
        if self.layout is None:
            raise RuntimeError("no token layout yet: run the whole model (its patch embedding sets the grid)")
        return self.layout


class ModelAdapter(ABC):
    """Knows one model family: where its attention is, its token layout, how to rebuild it."""

    name: str

    @classmethod
    @abstractmethod
    def applies_to(cls, model: nn.Module) -> bool: ...

    @abstractmethod
    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]: ...

    @abstractmethod
    def embedding_module(self, model: nn.Module) -> nn.Module:
        """The module whose forward fixes the token layout of the current input."""

    @abstractmethod
    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout: ...

    @abstractmethod
    def carry(self, site: AttentionSite) -> CarriedAttention:
        """The site's q/k/v/proj (and norms, gate, dropout) for a replacement to reuse."""

    @abstractmethod
    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        """JSON-safe description from which `create_base` rebuilds the unpatched model."""

    @classmethod
    @abstractmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        """Rebuild the unpatched architecture (random weights) from `describe_base`'s output."""

    def call_original(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run an original attention module on [B, N, C] tokens, returning [B, N, C_out]."""
        return module(x)

    @abstractmethod
    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        """Make `replacement` accept the family's call convention (hooks on the replacement only)."""

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        """The token layout at the model's native input size, when it has one."""
        return None

    def verify(self, site: AttentionSite) -> AttentionSite:
        """Check the site against a reference softmax attention built from its weights; records the outcome."""
        error = verification_error(site.module, self.carry(site), self.call_original)
        site.verified = None if error is None else error < TOLERANCE
        if site.verified is False:
            site.notes.append(f"reference softmax attention differs by {error:.2g} (relative)")
        return site

    def install_layout_tracker(self, model: nn.Module) -> LayoutTracker:
        tracker = LayoutTracker(self)
        self.embedding_module(model).register_forward_hook(tracker, with_kwargs=True)
        return tracker

    @staticmethod
    def remove_layout_tracker(model: nn.Module) -> None:
        for module in model.modules():
            for key, hook in list(module._forward_hooks.items()):
                if isinstance(hook, LayoutTracker):
                    del module._forward_hooks[key]
                    module._forward_hooks_with_kwargs.pop(key, None)
