"""The Pareto front as a PNG: latency ratio vs CLS cosine, merging alone vs the planner."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def draw_front(
    path: str | Path,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    budget: float | None = None,
    chosen: tuple[float, float] | None = None,
    ylabel: str = "CLS cosine to the original",
) -> Path:
    """One line per series of (latency ratio, cosine) points; the budget as a vertical line, the chosen plan starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    try:
        for name, points in series.items():
            points = sorted(points)
            if points:
                axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        if budget is not None:
            axes.axvline(budget, color="grey", linestyle="--", linewidth=1, label=f"budget {budget:g}x")
        if chosen is not None:
            axes.plot(*chosen, marker="*", markersize=14, color="black", linestyle="none", label="chosen plan")
        axes.set_xlabel("latency ratio to the original (batch 1, CPU)")
        axes.set_ylabel(ylabel)
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend(loc="lower right", fontsize=8)
        figure.tight_layout()
        path = Path(path)
        figure.savefig(path)
    finally:
        plt.close(figure)
    return path
