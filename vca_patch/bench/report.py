"""Showing a sweep: rich tables, a JSON file, a PNG plot of latency and memory against tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.table import Table

from vca_patch.core.atomic import atomic_file, atomic_write_text
from vca_patch.core.install import install_hint


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _kernel_note(meta: dict[str, Any]) -> str:
    """Which VCA path a CPU float32 run timed: the fused kernel or, and why, the composite one."""
    status = meta.get("vca_cpu_kernel")
    settings = meta["settings"]
    if status is None or settings["device"] != "cpu" or settings["dtype"] != "float32":  # compiled too: one op
        return ""
    return " · VCA fused CPU kernel" if status == "fused" else f" · VCA {status}"


def _rounds(settings: dict[str, Any]) -> str:
    """The title's count of timed runs: `repeats`, or "≥ repeats runs, ≥ min_time s each" with a time budget."""
    min_time = settings.get("min_time", 0.0)
    return f"≥ {settings['repeats']} runs, ≥ {min_time:g} s each" if min_time else str(settings["repeats"])


def results_table(result: dict[str, Any]) -> Table:
    """One row per resolution and variant: tokens, latency, throughput, memory, GMACs."""
    settings = result["meta"]["settings"]
    title = (
        f"{settings['device']} · {settings['dtype']} · batch {settings['batch']} · "
        f"{result['meta']['threads']} threads · median of {_rounds(settings)}"
        + (" · torch.compile" if settings.get("compile") else "")
        + (" · huge-page malloc" if result["meta"].get("malloc") == "hugepages" else "")
        + _kernel_note(result["meta"])
    )
    table = Table(title=title, title_justify="left")
    for column in ("px", "tokens", "variant", "latency ms", "img/s", "infer MiB", "train MiB", "GMACs"):
        table.add_column(column, justify="left" if column == "variant" else "right", overflow="fold")
    previous = None
    for r in result["results"]:
        px = str(r["resolution"]) if r["resolution"] != previous else ""
        previous = r["resolution"]
        table.add_row(
            px,
            str(r["tokens"]) if px else "",
            r["variant"],
            _fmt(r["latency_ms"], ".1f"),
            _fmt(r["throughput"], ".2f"),
            _fmt(r["memory_infer_mib"], ".0f"),
            _fmt(r["memory_train_mib"], ".0f"),
            f"{r['gmacs']:.2f}",
        )
    return table


def ratios_table(result: dict[str, Any]) -> Table:
    """Patched / original per target and resolution, and the crossover where latency ratio < 1."""
    table = Table(title="patched / original (fused SDPA)", title_justify="left")
    columns = ("target", "px", "tokens", "MAC ratio", "latency ratio", "÷ MAC", "vs unfused", "infer mem", "train mem")
    for column in columns:
        table.add_column(column, justify="left" if column == "target" else "right", overflow="fold")
    for r in result["ratios"]:
        lat = r["latency_ratio"]
        style = "green" if lat is not None and lat < 1 else "yellow"
        table.add_row(
            r["target"],
            str(r["resolution"]),
            str(r["tokens"]),
            f"{r['flop_ratio']:.3f}",
            f"[{style}]{_fmt(lat, '.3f')}[/]",
            _fmt(r["latency_over_flop"], ".2f"),
            _fmt(r["latency_ratio_unfused"], ".3f"),
            _fmt(r["memory_infer_ratio"], ".2f"),
            _fmt(r["memory_train_ratio"], ".2f"),
        )
    return table


def crossover_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for target, c in result["crossover"].items():
        lat = c["latency_tokens"]
        flops = c["flops_tokens"]
        lat_text = f"≈{lat:.0f} tokens (≈{c['latency_px']:.0f} px)" if lat is not None else "not within the sweep"
        flop_text = f"≈{flops:.0f} tokens" if flops is not None else "not within the sweep"
        lines.append(f"{target}: faster than the original from {lat_text}; fewer MACs from {flop_text}")
    return lines


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write `result` as indented JSON, atomically (a reader never sees half a file); the folder must exist."""
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def write_plot(result: dict[str, Any], path: Path) -> None:
    """Latency and inference/training memory against tokens (log-log), one line per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailableError(f"--plot needs matplotlib: {install_hint('bench')}") from exc
    panels = [("latency_ms", "latency (ms)"), ("memory_infer_mib", "inference memory (MiB)")]
    if any(r["memory_train_mib"] is not None for r in result["results"]):
        panels.append(("memory_train_mib", "training-step memory (MiB)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    variants = list(dict.fromkeys(r["variant"] for r in result["results"]))
    colors = {name: f"C{i}" for i, name in enumerate(variants)}  # one colour per variant in every panel
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        for name in variants:
            points = [(r["tokens"], r[key]) for r in result["results"] if r["variant"] == name and r[key] is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name, color=colors[name])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    settings = result["meta"]["settings"]
    fig.suptitle(f"{settings['device']} {settings['dtype']}, batch {settings['batch']}")
    fig.tight_layout()
    with atomic_file(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
