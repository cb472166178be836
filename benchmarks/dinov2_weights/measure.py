"""Re-exported: the measurements live in `vca_patch.eval.final_tokens`."""

from vca_patch.eval.final_tokens import fidelity, final_tokens, latency, tokens

__all__ = ["fidelity", "final_tokens", "latency", "tokens"]
