"""Model surgery: walk, match, build, swap, report."""

from vca_patch.surgery.patch import (
    NothingToPatchError,
    PatchError,
    PatchState,
    get_patch_state,
    inspect_model,
    patch_model,
    patched_layers,
    unpatch_model,
)
from vca_patch.surgery.report import PatchedSite, PatchReport

__all__ = [
    "NothingToPatchError",
    "PatchError",
    "PatchReport",
    "PatchState",
    "PatchedSite",
    "get_patch_state",
    "inspect_model",
    "patch_model",
    "patched_layers",
    "unpatch_model",
]
