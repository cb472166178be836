"""Shared CLI helpers: consoles, error exits, argument parsing."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

console = Console()
if not console.is_terminal:  # piped or captured output: do not squeeze tables into 80 columns
    console = Console(width=160)
err_console = Console(stderr=True)


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def prepare_cpu_kernel() -> None:
    """Load VCA's fused CPU kernel under a spinner (compiled on the first run), not silently in a first forward."""
    from ..attention import fused_cpu

    if fused_cpu.kernel_status() == "fused (not built yet)":
        with console.status("Loading VCA's fused CPU kernel (compiled on the first run, 10–30 s)..."):
            fused_cpu.kernel_available()


def parse_layers(spec: str | None) -> list[int] | None:
    """'0-5,8' -> [0, 1, 2, 3, 4, 5, 8]; None or 'all' -> None."""
    if spec is None or spec.strip().lower() == "all":
        return None
    layers: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                start, end = (int(v) for v in part.split("-", 1))
                if start > end:
                    raise ValueError
                layers.update(range(start, end + 1))
            else:
                layers.add(int(part))
        except ValueError:
            raise typer.BadParameter(
                f"{part!r} is not a block index or range; use e.g. '0-5,8'", param_hint="--layers"
            ) from None
    if any(i < 0 for i in layers):
        raise typer.BadParameter("block indices are non-negative", param_hint="--layers")
    return sorted(layers)
