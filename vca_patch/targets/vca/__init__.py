"""Visual-Contrast Attention (VCA; Pu et al., NeurIPS 2025, arXiv 2511.00833) as a conversion target."""

from vca_patch.targets.vca import macs  # noqa: F401  (registers the analytic MAC count)
from vca_patch.targets.vca.config import VCAConfig
from vca_patch.targets.vca.handler import VCAHandler  # registers VCA's handler with its config
from vca_patch.targets.vca.layer import VisualContrastAttention

__all__ = ["VCAConfig", "VCAHandler", "VisualContrastAttention"]
