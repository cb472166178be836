"""`vca-patch bench dit-xl-2`: DiT shapes, latent token counts, analytic MACs, the crossover and the CLI route."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install -e '.[diffusers]')")

from vca_patch import VCAConfig
from vca_patch.bench import BenchError
from vca_patch.bench.diffusion import (
    DIFFUSION_MODELS,
    DiffusionBenchSettings,
    DiTShape,
    build_dit,
    crossover_text,
    dit_macs,
    run_diffusion_bench,
)


def test_dit_xl_2_shape_and_token_counts_of_256_to_2048_px():
    shape = DIFFUSION_MODELS["dit-xl-2"]
    assert (shape.dim, shape.heads, shape.patch_size, shape.depth) == (1152, 16, 2, 28)
    assert [shape.tokens(px) for px in (256, 512, 1024, 2048)] == [256, 1024, 4096, 16384]
    model = build_dit(DiTShape(heads=3, head_dim=8, patch_size=4, depth=5, num_classes=7), depth=2)  # small: fast
    attn = model.transformer_blocks[0].attn1
    assert len(model.transformer_blocks) == 2 and attn.heads == 3 and attn.to_q.in_features == 24
    assert model.config.patch_size == 4 and model.config.num_embeds_ada_norm == 7 and model.config.in_channels == 4
    # DiT paper, Table 4: DiT-XL/2 at 256 px is 118.6 G(M)ACs; the count leaves out embeddings and adaLN (~0.5%)
    assert dit_macs(shape, 256, 28) / 1e9 == pytest.approx(118.6, rel=0.01)


def test_analytic_macs_share_of_attention_and_vca_cost():
    shape = DIFFUSION_MODELS["dit-xl-2"]
    C = 1152
    for px, share in ((256, 0.036), (512, 0.13), (1024, 0.37)):  # docs/diffusion.md §1: attention's share
        N = shape.tokens(px)
        assert 2 * N * N * C / (dit_macs(shape, px, 1)) == pytest.approx(share, abs=0.01)
    vca = VCAConfig(contrast_tokens=64)
    N = shape.tokens(2048)
    expected = 12 * N * C * C + 8 * 64 * N * C + 9 * N * C  # linear layers + Stage I/II + depthwise 3x3
    assert dit_macs(shape, 2048, 1, "vca", vca) == pytest.approx(expected, rel=1e-12)


def test_bench_times_original_and_vca_and_reports_the_crossover():
    shape = DiTShape(heads=2, head_dim=16, patch_size=2, depth=2, num_classes=10)
    DIFFUSION_MODELS["dit-test"] = shape
    try:
        settings = DiffusionBenchSettings(resolutions=[64, 32], repeats=1, warmup=0)
        result = run_diffusion_bench("dit-test", [VCAConfig(contrast_tokens=4)], settings, log=lambda m: None)
    finally:
        del DIFFUSION_MODELS["dit-test"]
    rows = {(r["variant"], r["resolution"]): r for r in result["results"]}
    assert set(rows) == {(v, px) for v in ("original", "vca") for px in (32, 64)}
    assert rows["vca", 64]["tokens"] == 16 and rows["original", 32]["latent"] == 4
    assert all(r["latency_ms"] > 0 and len(r["latency_ms_runs"]) == 1 for r in rows.values())
    ratios = [r for r in result["ratios"] if r["target"] == "vca"]
    assert [r["tokens"] for r in ratios] == [4, 16]
    small = rows["vca", 32]["latency_ms"] / rows["original", 32]["latency_ms"]
    assert ratios[0]["latency_ratio"] == pytest.approx(small)
    assert set(result["crossover"]["vca"]) == {"latency_tokens", "flops_tokens"}
    assert json.loads(json.dumps(result)) == result  # JSON-safe


def test_crossover_text_names_tokens_and_pixels():
    shape = DIFFUSION_MODELS["dit-xl-2"]
    result = {
        "meta": {"shape": {**shape.__dict__}},
        "ratios": [
            {"target": "vca", "tokens": 256, "latency_ratio": 1.2, "flop_ratio": 1.1},
            {"target": "vca", "tokens": 4096, "latency_ratio": 0.8, "flop_ratio": 0.6},
        ],
        "crossover": {"vca": {"latency_tokens": 1024.0, "flops_tokens": 512.0}},
    }
    (line,) = crossover_text(result)
    assert "from ~1,024 tokens (~512 px)" in line and "MACs cross at ~512 tokens" in line
    result["crossover"]["vca"]["latency_tokens"] = None
    assert "slower than the original at every size measured" in crossover_text(result)[0]


def test_cli_routes_dit_names_and_refuses_bad_sizes(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from vca_patch.cli.app import app

    runner = CliRunner()
    result = runner.invoke(app, ["bench", "dit-xl-2", "--depth", "1", "--resolutions", "100"])
    assert result.exit_code == 2 and "not a multiple of 16" in result.output and "96" in result.output
    result = runner.invoke(app, ["bench", "dit-xl-2", "--depth", "0"])
    assert result.exit_code == 2 and "at least 1 block" in result.output

    seen = {}

    def fake(name, configs, settings, depth=None, log=print):
        seen.update(name=name, resolutions=settings.resolutions, depth=depth, targets=[c.target for c in configs])
        raise BenchError("stop here")

    monkeypatch.setattr("vca_patch.bench.diffusion.run_diffusion_bench", fake)
    result = runner.invoke(app, ["bench", "dit-xl-2", "--depth", "2", "--no-cpu-kernel"])
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen == {"name": "dit-xl-2", "resolutions": [256, 512, 1024, 2048], "depth": 2, "targets": ["vca"]}
