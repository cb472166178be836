"""Optional interfaces a target config may implement beside `TargetConfig`'s hooks, checked with `isinstance`
(runtime-checkable protocols) instead of looked up by name: shared code asks `isinstance(config, PackedForm)`."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class PackedForm(Protocol):
    """A packed checkpoint form (DIDB: binarised Linears as sign bits and scales): `save_pretrained(...,
    packed=True)` and `convert --packed` save `packed_state_dict`, loading a packed folder calls `load_packed`, and
    `is_packed` (a `TargetConfig` hook, default False) says when a model is held packed and so saves packed only."""

    def pack(self, model: nn.Module) -> nn.Module:
        """Hold `model`'s modules packed, in place."""
        ...

    def packed_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """`model`'s state dict in the packed form (the model is not changed)."""
        ...

    def load_packed(self, model: nn.Module, state_dict: dict[str, Any], source: str) -> None:
        """Put a freshly built `model` into the packed form of `state_dict` (ValueError when it does not fit)."""
        ...
