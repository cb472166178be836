"""vca-patch: convert pretrained vision transformers to Visual-Contrast Attention."""

__version__ = "0.1.0"

from .attention import MultipoleAttention, TokenLayout, VisualContrastAttention
from .config import ConfigError, DIDBConfig, MANOConfig, TargetConfig, VCAConfig
from .fidelity import FidelityReport, fidelity  # the function shadows the module name on the package
from .hub import from_pretrained, push_to_hub
from .io import save_pretrained
from .merging import MergeConfig
from .planner import load_plan
from .recovery import calibrate
from .spatial_tokens import (
    SpatialTokensConfig,
    add_spatial_tokens,
    image_token_count,
    load_spatial_tokens,
    remove_spatial_tokens,
    save_spatial_tokens,
)
from .surgery import NothingToPatchError, PatchError, PatchReport, patch_model, unpatch_model

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
    "patch_model",
    "push_to_hub",
    "remove_spatial_tokens",
    "save_pretrained",
    "save_spatial_tokens",
    "unpatch_model",
]
