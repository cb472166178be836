"""vca-patch: convert pretrained vision transformers to Visual-Contrast Attention."""

__version__ = "0.1.0"

from .attention import MultipoleAttention, TokenLayout, VisualContrastAttention
from .config import ConfigError, MANOConfig, TargetConfig, VCAConfig
from .hub import from_pretrained, push_to_hub
from .io import save_pretrained
from .surgery import NothingToPatchError, PatchError, PatchReport, patch_model, unpatch_model

__all__ = [
    "ConfigError",
    "MANOConfig",
    "MultipoleAttention",
    "NothingToPatchError",
    "PatchError",
    "PatchReport",
    "TargetConfig",
    "TokenLayout",
    "VCAConfig",
    "VisualContrastAttention",
    "__version__",
    "from_pretrained",
    "patch_model",
    "push_to_hub",
    "save_pretrained",
    "unpatch_model",
]
