"""MANO's model-card text: the hooks `MANOConfig` exposes to checkpoint/model_card.py (tags, citation, section)."""

from __future__ import annotations

from typing import Any

PAPER = "https://arxiv.org/abs/2507.02748"
DISPLAY_NAME = "MANO"
TAGS = ("mano", "multipole-attention", "linear-attention")
CITATION = """@article{colagrande2025mano,
  title   = {Linear Attention with Global Context: A Multipole Attention Mechanism for Vision and Physics},
  author  = {Colagrande, Alex and Caillon, Paul and Feillet, Eva and Allauzen, Alexandre},
  journal = {arXiv preprint arXiv:2507.02748},
  year    = {2025}
}"""


def card_section(config: dict[str, Any]) -> tuple[str, str, str]:
    """(attention name, intro paragraph, conversion-table rows) of a MANO checkpoint's card."""
    window, rate = config["window"], config["rate"]
    levels = config["levels"] if config.get("levels") is not None else "auto"
    intro = (
        f"[Multipole Attention]({PAPER}) (MANO) with\n"
        f"vca-patch. MANO attends within {window}×{window} windows on a hierarchy of grids\n"
        f"coarsened by {rate} and combined in a V-cycle, so attention costs O(N·C·(C + k²)) instead of O(N²·C)."
    )
    rows = (
        f"| window k / rate r / levels | {window} / {rate} / {levels} |\n"
        f"| down / up | {config['down']} / {config['up']} |\n"
        f"| prefix tokens | {config['prefix']} |\n"
        f"| initialisation | {config['init']} |"
    )
    return "Multipole Attention (MANO)", intro, rows
