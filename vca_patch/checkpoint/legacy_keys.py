"""State-dict keys of checkpoints written by earlier versions, renamed to the keys the rebuilt model holds.

An adapter that keeps the attention module and swaps its implementation (diffusers processors) holds the
replacement's new parameters in a child of that module (`ModelAdapter.new_parameters`). That child was named `vca`
for every target before it was named for its target (`attn.mano.…` for MANO), so a MANO checkpoint saved before holds
`attn.vca.…` where the rebuilt model expects `attn.mano.…`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vca_patch.surgery import get_patch_state

LEGACY_HOLDER = "vca"  # the name every target's holder had before


def holder_renames(model: nn.Module) -> dict[str, str]:
    """{old key prefix: new key prefix} for each site of the patched `model` whose new parameters live in a child
    of the kept attention module named other than `LEGACY_HOLDER`: `"<site>.vca."` -> `"<site>.<holder>."`."""
    patch = get_patch_state(model)
    if patch is None or getattr(patch.adapter, "install_replacement", None) is None:  # modules swapped whole
        return {}
    renames = {}
    for path in patch.originals:
        module = model.get_submodule(path)
        holder = patch.adapter.new_parameters(module)
        name = next((n for n, m in module._modules.items() if m is holder), None) if holder is not None else None
        if name is not None and name != LEGACY_HOLDER:
            renames[f"{path}.{LEGACY_HOLDER}."] = f"{path}.{name}."
    return renames


def renamed_legacy_holders(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`state` with each site's `….vca.…` keys renamed to the target's holder (`holder_renames`), where the
    checkpoint has the old name and none of the new one and the model expects the renamed key; else unchanged."""
    renames = holder_renames(model)
    if not renames:
        return state
    expected = set(model.state_dict())
    renamed = dict(state)
    for old, new in renames.items():
        if any(key.startswith(new) for key in state):
            continue
        for key in [k for k in state if k.startswith(old) and new + k[len(old) :] in expected]:
            renamed[new + key[len(old) :]] = renamed.pop(key)
    return renamed
