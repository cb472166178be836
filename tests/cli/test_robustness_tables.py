"""Every table a command prints fits an 80-column terminal: rich wraps or folds the cells, never cuts one short
with an ellipsis, and COLUMNS=80 sets that width for piped output too."""

from __future__ import annotations

import importlib
import os

import pytest
import timm
import torch
from rich.console import Console
from typer.testing import CliRunner

import vca_patch
from tests.support.models import tiny
from vca_patch import MANOConfig, VCAConfig
from vca_patch.bench.report import ratios_table, results_table
from vca_patch.cli import app
from vca_patch.cli.fidelity import layers_table, measured_table, summary_table
from vca_patch.cli.report_view import sites_table, totals_table
from vca_patch.eval.fidelity import compare_outputs
from vca_patch.eval.fidelity import fidelity as measure
from vca_patch.surgery import inspect_model

WIDTH = 80


def _render(table) -> list[str]:
    console = Console(width=WIDTH, record=True, color_system=None, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text().splitlines()


def _fits(lines: list[str]) -> None:
    too_wide = [line for line in lines if len(line) > WIDTH]
    assert not too_wide, "\n".join(too_wide)
    assert not any("…" in line for line in lines), "\n".join(lines)  # a cell cut short loses its meaning


def _hf_vit():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    return transformers.ViTForImageClassification(config).eval()


def _sweep() -> dict:
    """A bench result with the longest names and numbers a sweep gives (the keys results_table/ratios_table read)."""
    settings = {"device": "cpu", "dtype": "bfloat16", "batch": 64, "repeats": 5, "min_time": 0.5, "compile": True}
    meta = {"settings": settings, "threads": 16, "malloc": "hugepages", "vca_cpu_kernel": "fused"}
    results = [
        {"resolution": px, "tokens": (px // 16) ** 2 + 1, "variant": variant, "latency_ms": 12345.6,
         "throughput": 1234.56, "memory_infer_mib": 123456.0, "memory_train_mib": None, "gmacs": 1234.56}
        for px in (224, 1024) for variant in ("original", "original-unfused", "vca", "mano")
    ]  # fmt: skip
    ratios = [
        {"target": target, "resolution": 1024, "tokens": 4097, "flop_ratio": 0.123, "latency_ratio": 0.987,
         "latency_over_flop": 8.02, "latency_ratio_unfused": 0.456, "memory_infer_ratio": 0.31,
         "memory_train_ratio": None}
        for target in ("vca", "mano")
    ]  # fmt: skip
    return {"meta": meta, "results": results, "ratios": ratios, "crossover": {}}


def test_sites_tables_fit_80_columns_and_keep_every_name_whole():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=3)
    for config in (VCAConfig(exclude=r"blocks\.2\."), MANOConfig()):
        report = inspect_model(model, config)
        lines = _render(sites_table(report, dry_run=True))
        _fits(lines)
        text = "\n".join(lines)
        for site in report.patched:
            assert site.path in text and f"{site.dim}/{site.num_heads}" in text
            for item in vca_patch.surgery.report.settings_text(site.settings).split():
                assert item in text  # one setting a line, never folded
        assert all(site.path in text for site in report.skipped) and ("skip:" in text) == bool(report.skipped)
        title = " ".join(" ".join(lines[:2]).split())  # rich wraps a title to the table's width
        assert title.startswith("Attention sites (dry run: unchanged) · prefix+grid tokens 1+14x14")
        _fits(_render(totals_table(report, probe={"cosine": 0.9, "relative_error": 0.1, "top1_agreement": 0.5})))


def test_a_transformers_sites_table_folds_long_module_paths_within_80_columns():
    report = inspect_model(_hf_vit())
    assert max(len(s.path) for s in report.patched) > 20
    _fits(_render(sites_table(report)))


def test_fidelity_and_summary_tables_fit_80_columns():
    model, _ = tiny(img_size=32, depth=2)
    vca_patch.patch_model(model, VCAConfig(contrast_tokens=4))
    probe = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        report = measure(None, model, [probe])
        metrics = compare_outputs(model(probe), model(probe))
    title = "Fidelity to the original (256 held-out images of /a/long/path/to/the/data)"
    for table in (layers_table(report), measured_table(report), summary_table(report.summary()),
                  summary_table(metrics, title)):  # fmt: skip
        _fits(_render(table))
    assert any(line.split()[:2] == ["│", "images"] for line in _render(measured_table(report)))


def test_bench_tables_fit_80_columns_without_cutting_a_number():
    result = _sweep()
    for table in (results_table(result), ratios_table(result)):
        lines = _render(table)
        _fits(lines)
    text = "\n".join(_render(results_table(result)))
    assert "12345.6" in text and "1234.56" in text  # numbers whole, not folded


@pytest.mark.parametrize("command", [["inspect", "deit_tiny_patch16_224", "--exclude", "blocks\\.[2-9]"]])
def test_a_command_printed_at_80_columns_fits(command, monkeypatch):
    """The command's own console at 80 columns: every table line fits (one-line warnings are messages)."""
    module = importlib.import_module(f"vca_patch.cli.{command[0]}")
    monkeypatch.setattr(module, "console", Console(width=WIDTH, color_system=None))
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    tables = [line for line in result.output.splitlines() if not line.startswith(("warning:", "error:"))]
    assert any("blocks.11.attn" in line for line in tables)
    _fits(tables)


def test_columns_80_sets_the_width_of_piped_output(monkeypatch):
    from vca_patch.cli.common import stdout_console

    monkeypatch.setenv("COLUMNS", "80")
    assert stdout_console().width == 80
    monkeypatch.delenv("COLUMNS")
    assert stdout_console().width == 160  # captured here: not a terminal
