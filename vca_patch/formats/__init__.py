"""Built-in checkpoint formats other than vca-patch's own folder, each registered with `core.formats` on import.

A format lives here, above `checkpoint/` and `surgery/`, when writing or reading it composes a target with them:
LLaVA-SP's folders load their base LLaVA and re-apply a VCA/MANO patch of its vision tower. `hub/` reaches these
formats only through the registry; importing `vca_patch` imports this package, so they are always registered.
"""

from vca_patch.formats import llava_sp  # noqa: F401  (registers the LLaVA-SP checkpoint format)
