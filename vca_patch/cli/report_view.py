"""Rich tables for patch reports, shared by `convert` and `inspect`."""

from __future__ import annotations

from rich import box
from rich.markup import escape
from rich.table import Table

from vca_patch.surgery import PatchReport
from vca_patch.surgery.report import settings_items


def sites_table(report: PatchReport, *, dry_run: bool = False) -> Table:
    """One row per attention site: where it is (module path, its class below), its shape, the settings (one per
    line) and what was (or would be) done.

    The token layout is the model's, the same for every site, so it is in the title. Cells wrap at spaces and fold
    elsewhere, never cut: the table fits an 80-column terminal without losing a name."""
    layout = report.layout
    tokens = f" · prefix+grid tokens {layout.num_prefix_tokens}+{layout.grid[0]}x{layout.grid[1]}" if layout else ""
    title = "Attention sites" + (" (dry run: unchanged)" if dry_run else "") + tokens
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    settings = [settings_items(s.settings) for s in report.patched]
    widest = max((len(item) for items in settings for item in items), default=8)  # one setting a line, unfolded
    columns = [("module (class)", "left", None), ("block", "right", 5), ("C/heads", "right", 7),
               ("settings", "left", max(widest, 8)), ("+params", "right", None), ("action", "left", None)]  # fmt: skip
    for column, justify, width in columns:  # a fixed width is never squeezed: paths and notes give way, by folding
        table.add_column(column, justify=justify, overflow="fold", width=width)
    verb = "patch" if dry_run else "patched"
    for s, items in zip(report.patched, settings, strict=True):
        action = f"[green]{verb}[/]" if s.exact_carry_over else f"[cyan]{verb}, approximate[/]: {'; '.join(s.notes)}"
        table.add_row(
            _module(s.path, s.original_class), str(s.layer_index), f"{s.dim}/{s.num_heads}",
            "\n".join(items), f"{s.params_added:,}", action,
        )  # fmt: skip
    for s in report.skipped:
        table.add_row(_module(s.path, s.class_name), "", "", "", "", f"[yellow]skip[/]: {escape(s.reason)}")
    return table


def _module(path: str, class_name: str) -> str:
    return f"{escape(path)}\n[dim]({escape(class_name)})[/]"


def totals_table(report: PatchReport, probe: dict[str, float] | None = None) -> Table:
    """Sites and parameter totals, and how far the patched outputs are from the original's on a probe batch."""
    table = Table(title="Summary", title_justify="left", show_header=False)
    table.add_column(style="bold", overflow="fold")
    table.add_column(justify="right", overflow="fold")
    table.add_row("sites patched / skipped", f"{len(report.patched)} / {len(report.skipped)}")
    table.add_row("parameters before", f"{report.params_before:,}")
    table.add_row("parameters after", f"{report.params_after:,} (+{report.params_added / 1e6:.3f} M)")
    if probe:
        table.add_row("probe: output cosine to original", f"{probe['cosine']:.4f}")
        table.add_row("probe: relative error", f"{probe['relative_error']:.4f}")
        if "top1_agreement" in probe:
            table.add_row("probe: top-1 agreement", f"{probe['top1_agreement']:.2%}")
    return table
