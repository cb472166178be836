"""Narrow terminals: at any COLUMNS (0, 1, 20) every table row is printed with its names whole (a listing, one row
a line, where rich would drop or fold a column), and a table that fits is still printed as a table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.table import Table

from tests.cli.test_robustness_tables import _hf_vit
from vca_patch.cli.common import StdoutConsole
from vca_patch.cli.narrow import MIN_WIDTH, PIPED_WIDTH, console_width, listing
from vca_patch.cli.report_view import sites_table
from vca_patch.surgery import inspect_model

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = ("0", "20", "1")
# One process started at COLUMNS=0 (the consoles are built then), three widths (the console reads COLUMNS at each
# print; one start-up instead of three, ~10 s each), then an `error:` line and a usage error at COLUMNS=1.
INSPECT_AT_WIDTHS = f"""
import os
from vca_patch.cli import app

def run(*args):
    try:
        app(["inspect", "vit_tiny_patch16_224", *args])
    except SystemExit as exc:
        print(f"=== exit {{exc.code}}", flush=True)

for width in {WIDTHS!r}:
    os.environ["COLUMNS"] = width
    print(f"=== COLUMNS={{width}}", flush=True)
    run("--img-size", "32", "--layers", "0-1")
run("--img-size", "33")
run("--layers", "x")
"""


def _printed(monkeypatch, capsys, columns: str, *objects) -> str:
    monkeypatch.setenv("COLUMNS", columns)
    StdoutConsole(color_system=None).print(*objects)
    return capsys.readouterr().out


def test_inspect_prints_every_module_name_whole_at_columns_0_20_and_1():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "0"}
    env.pop("TERMINAL_WIDTH", None)
    run = subprocess.run([sys.executable, "-c", INSPECT_AT_WIDTHS], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("=== exit 0") == 3 and run.stdout.count("=== exit 2") == 2, run.stdout + run.stderr
    outputs = dict(zip(WIDTHS, run.stdout.split("=== COLUMNS=")[1:], strict=True))
    for width, output in outputs.items():
        lines = output.splitlines()
        for block in range(12):  # each row on one line, its module name and its action together
            row = [line for line in lines if f"blocks.{block}.attn" in line.split()]
            assert len(row) == 1, f"COLUMNS={width}: blocks.{block}.attn on {len(row)} lines:\n{output}"
            assert ("patch" if block < 2 else "skip: not in config.layers") in row[0], output
        assert re.search(r"sites patched / skipped[:│ ]+2 / 10", output), output  # label and value whole, together
        assert max(map(len, lines)) > MIN_WIDTH, output  # long lines left to the terminal, never one char a line
    errors = " ".join(run.stderr.split())  # typer's usage-error box at its floored width, not 1 char a line
    assert "error: vit_tiny_patch16_224 takes 33×33 px, not a whole number of 16×16 patches" in run.stderr, errors
    assert "Invalid value for --layers: 'x' is not a block index" in errors.replace(" │ │ ", " "), errors


def test_a_table_that_fits_stays_a_table_even_with_paths_folded(monkeypatch, capsys):
    """At 80 columns a transformers ViT's long module paths fold inside the table: still a table (its header)."""
    report = inspect_model(_hf_vit())
    out = _printed(monkeypatch, capsys, "80", sites_table(report))
    assert "module (class)" in out and "action" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    narrow = _printed(monkeypatch, capsys, "30", sites_table(report))
    for site in report.patched:  # too narrow for the table: one line a site, its path whole
        assert any(line.startswith(f"module (class): {site.path} (") and "action: patched" in line
                   for line in narrow.splitlines()), narrow  # fmt: skip


def test_a_key_value_table_lists_as_key_colon_values():
    table = Table(title="Summary", show_header=False)
    table.add_column()
    table.add_column()
    table.add_row("[bold]parameters after[/]", "5,689,908\n(+0.009 M)")
    table.add_row("empty", "")
    assert listing(table).plain.splitlines() == ["Summary", "parameters after: 5,689,908 (+0.009 M)", "empty"]


def test_a_headed_table_lists_header_colon_value_with_groups_indented():
    table = Table("px", "variant", "ms")
    table.add_row("224", "original", "9.1")
    table.add_row("", "vca", "")  # the rest of the 224 px group; no time measured
    assert listing(table).plain.splitlines() == ["px: 224; variant: original; ms: 9.1", "  variant: vca"]


@pytest.mark.parametrize(
    ("columns", "width"), [("0", PIPED_WIDTH), ("", PIPED_WIDTH), ("x", PIPED_WIDTH), ("1", MIN_WIDTH), ("97", 97)]
)
def test_columns_zero_or_garbage_means_unset_and_the_width_has_a_floor(columns, width):
    assert console_width(columns, is_terminal=False) == width
