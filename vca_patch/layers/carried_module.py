"""Block edits: a target's replacements for modules of an attention site's block outside the attention itself.

A target handler's `block_edits(config, block, attention_name, layer_index)` returns {path inside the block: new
module} (default: none). Surgery builds them with the attention replacement, swaps them in with it, reports their
added parameters on the site, and `unpatch_model` puts the originals back. A replacement that reuses an original's
tensors subclasses `CarriesOriginal` (lists them in `carried_names`), so the original gets the current ones back
and is moved/cast along with the replacement; any other module is simply swapped back.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn


class CarriesOriginal:
    """Mixin for an nn.Module built around an original module's parameters (`carried_names`, same names)."""

    carried_names: ClassVar[tuple[str, ...]] = ()

    def keep_original(self, original: nn.Module) -> None:
        """Keep the replaced module outside the module tree (not in the state dict), moved/cast with this one."""
        self.__dict__["original_module"] = original

    def restore_into(self, original: nn.Module) -> None:
        """Give `original` this module's carried tensors where they are other objects (e.g. after assign=True)."""
        for name in self.carried_names:
            member = getattr(self, name)
            if getattr(original, name, None) is not member:
                setattr(original, name, member)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)  # type: ignore[misc]
        original = self.__dict__.get("original_module")
        if original is not None:
            self.restore_into(original)
            original._apply(fn, recurse)
        return self


def restore_block_edit(replacement: nn.Module, original: nn.Module) -> None:
    """Before swapping `original` back: hand it the replacement's current carried tensors, if it carries any."""
    if isinstance(replacement, CarriesOriginal):
        replacement.restore_into(original)


def keep_block_original(replacement: nn.Module, original: nn.Module) -> None:
    if isinstance(replacement, CarriesOriginal):
        replacement.keep_original(original)
