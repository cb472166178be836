"""vca-patch: convert pretrained vision transformers to Visual-Contrast Attention."""

from vca_patch import _startup  # noqa: F401  first: the CLI's signals while importing (seconds) are one line
from vca_patch._version import __version__
from vca_patch.checkpoint import save_pretrained
from vca_patch.core.errors import ConfigError
from vca_patch.eval.fidelity import FidelityReport, fidelity  # the function shadows the module name on the package
from vca_patch.formats.llava_sp import load_spatial_tokens, save_spatial_tokens  # registers the built-in formats
from vca_patch.hub import from_pretrained, push_to_hub
from vca_patch.layers.layout import TokenLayout
from vca_patch.planner import load_plan
from vca_patch.planner.speedup import SpeedupReport, make_faster
from vca_patch.recovery import calibrate
from vca_patch.surgery import NothingToPatchError, PatchError, PatchReport, patch_model, unpatch_model
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.didb.config import DIDBConfig
from vca_patch.targets.llava_sp import (
    SpatialTokensConfig,
    add_spatial_tokens,
    image_token_count,
    remove_spatial_tokens,
)
from vca_patch.targets.mano.config import MANOConfig
from vca_patch.targets.mano.layer import MultipoleAttention
from vca_patch.targets.merge import MergeConfig
from vca_patch.targets.vca.config import VCAConfig
from vca_patch.targets.vca.layer import VisualContrastAttention

__all__ = [
    "ConfigError",
    "DIDBConfig",
    "FidelityReport",
    "MANOConfig",
    "MergeConfig",
    "MultipoleAttention",
    "NothingToPatchError",
    "PatchError",
    "PatchReport",
    "SpatialTokensConfig",
    "SpeedupReport",
    "TargetConfig",
    "TokenLayout",
    "VCAConfig",
    "VisualContrastAttention",
    "__version__",
    "add_spatial_tokens",
    "calibrate",
    "fidelity",
    "from_pretrained",
    "image_token_count",
    "load_plan",
    "load_spatial_tokens",
    "make_faster",
    "patch_model",
    "push_to_hub",
    "remove_spatial_tokens",
    "save_pretrained",
    "save_spatial_tokens",
    "unpatch_model",
]
