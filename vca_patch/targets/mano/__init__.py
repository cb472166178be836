"""Multipole Attention (MANO; Colagrande et al., arXiv 2507.02748) as a conversion target."""

from vca_patch.targets.mano import macs  # noqa: F401  (registers the analytic MAC count)
from vca_patch.targets.mano.config import MANOConfig
from vca_patch.targets.mano.handler import MANOHandler  # registers MANO's handler with its config
from vca_patch.targets.mano.layer import MultipoleAttention

__all__ = ["MANOConfig", "MANOHandler", "MultipoleAttention"]
