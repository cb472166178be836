"""Rich tables for patch reports, shared by `convert` and `inspect`."""

from __future__ import annotations

from rich.table import Table

from ..surgery import PatchReport
from ..surgery.report import settings_text


def sites_table(report: PatchReport, *, dry_run: bool = False) -> Table:
    """One row per attention site: where it is, its shape, the layout, and what was (or would be) done."""
    layout = report.layout
    tokens = f"{layout.num_prefix_tokens}+{layout.grid[0]}x{layout.grid[1]}" if layout else "?"
    table = Table(title="Attention sites" + (" (dry run: nothing changed)" if dry_run else ""), title_justify="left")
    for column, justify in [
        ("module", "left"), ("class", "left"), ("block", "right"), ("C/heads", "right"),
        ("prefix+grid", "right"), ("settings", "left"), ("+params", "right"), ("action", "left"),
    ]:  # fmt: skip
        table.add_column(column, justify=justify, no_wrap=column in ("module", "class"))
    verb = "patch" if dry_run else "patched"
    for s in report.patched:
        action = f"[green]{verb}[/]" if s.exact_carry_over else f"[cyan]{verb}, approximate[/]: {'; '.join(s.notes)}"
        table.add_row(
            s.path, s.original_class, str(s.layer_index), f"{s.dim}/{s.num_heads}", tokens,
            settings_text(s.settings), f"{s.params_added:,}", action,
        )  # fmt: skip
    for s in report.skipped:
        table.add_row(s.path, s.class_name, "", "", "", "", "", f"[yellow]skip[/]: {s.reason}")
    return table


def totals_table(report: PatchReport, probe: dict[str, float] | None = None) -> Table:
    """Sites and parameter totals, and how far the patched outputs are from the original's on a probe batch."""
    table = Table(title="Summary", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("sites patched / skipped", f"{len(report.patched)} / {len(report.skipped)}")
    table.add_row("parameters before", f"{report.params_before:,}")
    table.add_row("parameters after", f"{report.params_after:,} (+{report.params_added / 1e6:.3f} M)")
    if probe:
        table.add_row("probe: output cosine to original", f"{probe['cosine']:.4f}")
        table.add_row("probe: relative error", f"{probe['relative_error']:.4f}")
        if "top1_agreement" in probe:
            table.add_row("probe: top-1 agreement", f"{probe['top1_agreement']:.2%}")
    return table
