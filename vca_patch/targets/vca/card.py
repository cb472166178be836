"""VCA's model-card text: the hooks `VCAConfig` exposes to checkpoint/model_card.py (tags, citation, section)."""

from __future__ import annotations

from typing import Any

PAPER = "https://arxiv.org/abs/2511.00833"
DISPLAY_NAME = "VCA"
TAGS = ("vca", "visual-contrast-attention", "linear-attention")
CITATION = """@inproceedings{pu2025lineardiff,
  title     = {Linear Differential Vision Transformer: Learning Visual Contrasts via Pairwise Differentials},
  author    = {Pu, Yifan and others},
  booktitle = {Advances in Neural Information Processing Systems},
  year      = {2025}
}"""


def card_section(config: dict[str, Any]) -> tuple[str, str, str]:
    """(attention name, intro paragraph, conversion-table rows) of a VCA checkpoint's card."""
    intro = (
        f"[Visual-Contrast Attention]({PAPER}) (VCA, NeurIPS 2025) with\n"
        f"vca-patch. VCA attends through {config['contrast_tokens']} pooled\n"
        "contrast tokens, so attention costs O(N·n·C) instead of O(N²·C) in the number of tokens N."
    )
    rows = (
        f"| contrast tokens n | {config['contrast_tokens']} |\n"
        f"| Stage-II softmax | {config['softmax']} |\n"
        f"| initialisation | {config['init']} |"
    )
    return "Visual-Contrast Attention (VCA)", intro, rows
