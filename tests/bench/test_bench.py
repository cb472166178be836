"""The benchmark's behaviour: MAC formulas, crossover, variants, memory probe, CLI output, compile."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.support.paths import BENCHMARKS
from vca_patch.bench import (
    ORIGINAL,
    UNFUSED,
    AttentionShape,
    BenchSettings,
    ModelShape,
    attention_macs,
    build_variants,
    crossover,
    model_macs,
    model_shape,
    register_attention_macs,
    run_sweep,
    softmax_attention_macs,
    time_interleaved,
)
from vca_patch.bench.flops import ATTENTION_MACS
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.vca.config import VCAConfig
from vca_patch.targets.vca.layer import VisualContrastAttention
from vca_patch.targets.vca.macs import vca_attention_macs

# --- analytic MACs -------------------------------------------------------------------------------------


def test_attention_macs_match_hand_values():
    deit_t = AttentionShape(1, (14, 14), 192, 3)  # docs/vca.md §3.2: 14.9 M vs 13.3 M (7nNC), 15.2 M (SDPA)
    assert softmax_attention_macs(deit_t) == 2 * 197**2 * 192 == 14_902_656
    assert vca_attention_macs(deit_t, 49, sdpa=False) == 7 * 49 * 197 * 192 + 9 * 196 * 192 == 13_312_320
    assert vca_attention_macs(deit_t, 49) == 8 * 49 * 197 * 192 + 9 * 196 * 192 == 15_165_696
    assert vca_attention_macs(deit_t, 49, exact_prefix=True) == 15_165_696 + 2 * 1 * 197 * 192
    assert vca_attention_macs(deit_t, 49, local_window=7) == 15_165_696 + 2 * 196 * (1 + 49) * 192
    local = attention_macs("vca", deit_t, VCAConfig(local_window=7))
    assert local == attention_macs("vca", deit_t, VCAConfig()) + 3_763_200
    big = AttentionShape(1, (28, 28), 192, 3)
    assert softmax_attention_macs(big) == 236_630_400


def test_model_macs_hand_computed_for_a_two_block_vit():
    shape = ModelShape(
        depth=2,
        dim=384,
        num_heads=6,
        num_prefix_tokens=1,
        patch_size=(16, 16),
        in_chans=3,
        linear_macs_per_token=12 * 384**2,
        embed_macs_per_patch=384 * 3 * 16 * 16,
    )
    embed = 196 * 384 * 3 * 256
    linear = 197 * 12 * 384**2
    assert model_macs(shape, (224, 224)) == embed + 2 * (linear + 2 * 197**2 * 384)
    vca = 8 * 49 * 197 * 384 + 9 * 196 * 384 + 2 * 1 * 197 * 384  # the default reads the CLS row exactly
    assert model_macs(shape, (224, 224), "vca", VCAConfig()) == embed + 2 * (linear + vca)
    paper = model_macs(shape, (224, 224), "vca", VCAConfig(prefix_readout="contrast"))
    assert paper == embed + 2 * (linear + vca - 2 * 197 * 384)
    # Only block 1 patched: block 0 keeps softmax.
    mixed = model_macs(shape, (224, 224), "vca", VCAConfig(layers=[1]))
    assert mixed == embed + 2 * linear + 2 * 197**2 * 384 + vca


def test_model_shape_reads_a_timm_vit():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2, mlp_ratio=2.0)
    shape = model_shape(model)
    assert (shape.depth, shape.dim, shape.num_heads, shape.num_prefix_tokens) == (2, 192, 3, 1)
    assert shape.linear_macs_per_token == (3 + 1 + 2 + 2) * 192**2
    assert shape.grid((512, 256)) == (32, 16)


def test_attention_macs_registry_is_extensible():
    @register_attention_macs("test-linear")
    def _linear(shape, config):
        return 3.0 * shape.num_tokens * shape.dim

    try:
        assert attention_macs("test-linear", AttentionShape(0, (2, 2), 8, 2)) == 96.0
    finally:
        del ATTENTION_MACS["test-linear"]
    with pytest.raises(KeyError, match="known"):
        attention_macs("nope", AttentionShape(0, (2, 2), 8, 2))


# --- crossover ---------------------------------------------------------------------------------------


def test_crossover_interpolates_in_log_space():
    assert crossover([100, 1000, 10000], [1.2, 0.8, 0.5]) == pytest.approx(math.sqrt(100 * 1000))
    assert crossover([100, 1000], [0.9, 0.5]) == 100
    assert crossover([100, 1000], [1.1, 1.0]) is None
    assert crossover([100, 1000, 10000], [1.5, None, 0.5]) == pytest.approx(1000)  # missing points skipped
    assert crossover([100, 1000, 10000], [1.2, 0.9, 1.1]) == pytest.approx(100 * 10 ** (0.2 / 0.3))


# --- variants ----------------------------------------------------------------------------------------


def test_interleaved_timing_adds_rounds_up_to_a_time_budget():
    calls: list[str] = []

    def sleeper(name: str, seconds: float):
        def run() -> None:
            calls.append(name)
            time.sleep(seconds)

        return run

    fns = {"fast": sleeper("fast", 0.001), "slow": sleeper("slow", 0.004)}
    cpu = torch.device("cpu")
    times = time_interleaved(fns, cpu, warmup=1, repeats=3)  # no budget: exactly `repeats` rounds
    assert [len(t) for t in times.values()] == [3, 3]
    assert calls[2:] == ["fast", "slow", "slow", "fast", "fast", "slow"]  # alternating order after the warm-up
    calls.clear()
    three = {name: sleeper(name, 0.0) for name in "abc"}
    time_interleaved(three, cpu, warmup=0, repeats=6)
    assert calls == list("abcbcacababcbcacab")  # each variant in each position once per 3 rounds
    follows = set(itertools.pairwise(calls))
    assert all(x != y for x, y in follows) and len(follows) == 6  # never right after itself; after both others
    calls.clear()
    times = time_interleaved(fns, cpu, warmup=0, repeats=3, min_time=0.03)
    rounds = len(times["fast"])
    assert rounds == len(times["slow"]) and sum(times["fast"]) >= 0.03  # the fast call sets the count
    assert sum(times["fast"]) - times["fast"][-1] < 0.03  # and no round more than it needed
    capped = time_interleaved(fns, cpu, warmup=0, repeats=2, min_time=10.0, max_rounds=4)
    assert [len(t) for t in capped.values()] == [4, 4]


def test_variants_share_weights_and_unfused_is_explicit():
    from timm.layers import use_fused_attn

    before = use_fused_attn()
    variants = build_variants("vit_tiny_patch16_224", [VCAConfig()], model_args={"depth": 1})
    assert use_fused_attn() == before
    names = [v.name for v in variants]
    assert names == [ORIGINAL, UNFUSED, "vca"]
    original, unfused, vca = (v.model for v in variants)
    assert original.blocks[0].attn.fused_attn and not unfused.blocks[0].attn.fused_attn
    assert isinstance(vca.blocks[0].attn, VisualContrastAttention)
    x = torch.randn(1, 3, 48, 64)  # dynamic image size: a non-square 3x4 grid
    with torch.no_grad():
        torch.testing.assert_close(original(x), unfused(x), atol=1e-5, rtol=1e-5)
        assert vca(x).shape == original(x).shape


# --- memory probe and CLI ------------------------------------------------------------------------------

_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}


def test_cpu_peak_memory_counts_live_tensors_exactly():
    from vca_patch.bench.memory import cpu_peak_mib

    weight = torch.randn(1024, 1024)
    assert cpu_peak_mib(lambda: torch.ones(16, 2**20).sum()) == pytest.approx(64.0, abs=1e-3)  # freed before return
    assert cpu_peak_mib(lambda: weight[:512].t()) == 0.0  # views of existing tensors allocate nothing
    assert cpu_peak_mib(lambda: weight.mul_(1.0)) == 0.0  # nor do in-place ops
    two_live = cpu_peak_mib(lambda: (torch.ones(2**20), torch.ones(2**20)))
    one_at_a_time = cpu_peak_mib(lambda: [torch.ones(2**20).sum() for _ in range(2)])
    assert two_live == pytest.approx(8.0, abs=1e-3) and one_at_a_time == pytest.approx(4.0, abs=1e-3)


@pytest.mark.parametrize("kernel", [True, False], ids=["fused-kernel", "composite"])
@pytest.mark.parametrize("px", [112, 160, 224])
def test_patched_inference_memory_not_above_original_on_small_grids(px, kernel):
    """At 1-4 patches per contrast token the 2n-token tensors could set the peak: each must die once used."""
    from vca_patch.bench.memory import cpu_peak_mib
    from vca_patch.targets.vca import fused_cpu

    variants = build_variants("deit_small_patch16_224", [VCAConfig()], model_args={"depth": 1}, unfused=False)
    x = torch.randn(1, 3, px, px)
    peaks = {}
    for v in variants:
        with torch.inference_mode(), fused_cpu.use_kernel(kernel):
            v.model(x)
            peaks[v.name] = cpu_peak_mib(lambda m=v.model: m(x))
    assert 0 < peaks["vca"] <= peaks[ORIGINAL], peaks


def test_vca_training_memory_is_linear_in_tokens():
    from vca_patch.bench.memory import cpu_peak_mib

    module = VisualContrastAttention(64, 2, contrast_grid=(4, 4))

    def step(side: int) -> float:
        x = torch.randn(1, 1 + side * side, 64, requires_grad=True)
        layout = TokenLayout(1, (side, side))
        return cpu_peak_mib(lambda: module(x, layout=layout).square().sum().backward())

    small, large = step(32), step(64)
    assert 3.5 * small < large < 4.5 * small  # 4x the tokens; quadratic memory would be ~16x


def test_cli_bench_writes_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [
        sys.executable, "-m", "vca_patch", "bench", "vit_tiny_patch16_224", "--depth", "1",
        "--resolutions", "32,64", "--repeats", "2", "--min-time", "0", "--warmup", "0", "--threads", "2",
        "--json", str(out_json), "--plot", str(out_png),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "patched / original" in done.stdout
    result = json.loads(out_json.read_text())
    assert set(result) == {"meta", "results", "ratios", "crossover"}
    assert result["meta"]["model"] == "vit_tiny_patch16_224" and result["meta"]["threads"] == 2
    rows = {(r["variant"], r["resolution"]): r for r in result["results"]}
    assert set(rows) == {(v, px) for v in (ORIGINAL, UNFUSED, "vca") for px in (32, 64)}
    for r in rows.values():
        assert r["latency_ms"] > 0 and len(r["latency_ms_runs"]) == 2 and r["throughput"] > 0
        assert r["gmacs"] > 0 and r["memory_infer_mib"] is not None
        assert 0 < r["weight_grads_mib"] <= r["memory_train_mib"]  # every gradient is allocated inside the step
    assert rows["vca", 64]["tokens"] == 17
    ratios = result["ratios"]
    assert [r["resolution"] for r in ratios] == [32, 64] and all(r["target"] == "vca" for r in ratios)
    for r in ratios:
        for key in ("flop_ratio", "latency_ratio", "latency_over_flop", "latency_ratio_unfused"):
            assert r[key] > 0, key
        vca, original = rows["vca", r["resolution"]], rows[ORIGINAL, r["resolution"]]
        assert vca["weight_grads_mib"] > original["weight_grads_mib"]  # VCA's own parameters add gradients
        assert r["memory_train_floor_ratio"] == pytest.approx(vca["weight_grads_mib"] / original["memory_train_mib"])
        assert r["memory_train_floor_ratio"] <= r["memory_train_ratio"]
        unfused = rows[UNFUSED, r["resolution"]]
        assert r["memory_train_ratio_unfused"] == pytest.approx(vca["memory_train_mib"] / unfused["memory_train_mib"])
    assert set(result["crossover"]["vca"]) >= {"latency_tokens", "flops_tokens", "latency_px"}
    assert out_png.stat().st_size > 1000
    assert result["meta"]["vca_cpu_kernel"] == _expected_kernel_status()
    assert ("VCA fused CPU kernel" in done.stdout) == (_expected_kernel_status() == "fused")


def _expected_kernel_status() -> str:
    from vca_patch.targets.vca import fused_cpu

    return "fused" if fused_cpu.kernel_available() else fused_cpu.kernel_status()


def test_cli_bench_times_the_composite_path_when_asked(tmp_path):
    out_json = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "vca_patch", "bench", "vit_tiny_patch16_224", "--depth", "1", "--resolutions", "32",
        "--repeats", "1", "--min-time", "0", "--warmup", "0", "--no-memory", "--no-unfused", "--no-cpu-kernel",
        "--json", str(out_json),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=_ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(out_json.read_text())["meta"]["vca_cpu_kernel"] == "composite (disabled)"
    assert "VCA composite (disabled)" in done.stdout


@pytest.mark.e2e
def test_benchmark_suite_smoke_writes_results_and_judges_targets(tmp_path):
    """benchmarks/run.py end to end on a tiny model: JSON per sweep, and each target row judged from its numbers."""
    script = str(BENCHMARKS / "run.py")
    cmd = [sys.executable, script, "--smoke", "--results", str(tmp_path)]
    done = subprocess.run(cmd, env=_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"smoke_deit_t_depth1.json", "patch_time.json", "targets.json"}
    sweep = json.loads((tmp_path / "smoke_deit_t_depth1.json").read_text())
    assert sweep["meta"]["model"] == "deit_tiny_patch16_224" and sweep["meta"]["model_args"] == {"depth": 1}
    ratio_224 = next(r for r in sweep["ratios"] if r["resolution"] == 224)
    targets = {row["target"]: row for row in json.loads((tmp_path / "targets.json").read_text())}
    latency = targets["smoke_deit_t_depth1 224px latency ratio ≤ 1.05"]
    assert latency["met"] == (ratio_224["latency_ratio"] <= 1.05)
    assert latency["value"].startswith(f"{ratio_224['latency_ratio']:.3f} ")
    for r in sweep["ratios"]:
        training = targets[f"smoke_deit_t_depth1 {r['resolution']}px training memory ≤ original"]
        assert training["met"] == (r["memory_train_ratio"] <= 1.0)
        # A miss says how low any activation saving could bring it (1-block DeiT-Ti at 112 px: its gradients alone).
        floor = f"weight gradients alone: {r['memory_train_floor_ratio']:.4f}"
        assert (floor in training["value"]) == (not training["met"])
    patch = json.loads((tmp_path / "patch_time.json").read_text())
    assert targets["patch_model(vit_base) < 1.0s"]["met"] == (patch["seconds_median"] < 1.0)
    assert sweep["meta"]["vca_cpu_kernel"] == _expected_kernel_status()


def test_cli_rejects_unknown_target():
    from typer.testing import CliRunner

    from vca_patch.cli.app import app

    result = CliRunner().invoke(app, ["bench", "vit_tiny_patch16_224", "--target", "nope", "--no-memory"])
    assert result.exit_code == 2
    assert "unknown target" in result.output


# --- torch.compile ---------------------------------------------------------------------------------


@pytest.mark.parametrize("softmax", ["joint", "separate"])
def test_vca_compiles_without_graph_breaks(softmax):
    torch._dynamo.reset()
    module = VisualContrastAttention(32, 4, contrast_grid=(2, 2), softmax=softmax)
    module.reset_vca_parameters("paper")
    layout = TokenLayout(1, (4, 5))
    x = torch.randn(2, 21, 32, requires_grad=True)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")  # fullgraph: any break raises
    out = compiled(x, layout=layout)
    torch.testing.assert_close(out, module(x, layout=layout), atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    assert x.grad is not None and module.lambda2.q1.grad is not None
    explained = torch._dynamo.explain(module)(x, layout=layout)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("kernel", [True, False], ids=["fused-kernel", "composite"])
def test_vca_inference_compiles_without_graph_breaks(kernel):
    """The no-autograd paths trace whole: with the fused CPU kernel as one opaque op (its grid sizes symbolic), without
    it as the composite path (in-place norm, split qkv, input pooling, cached λ)."""
    from vca_patch.targets.vca import fused_cpu

    torch._dynamo.reset()
    module = VisualContrastAttention(32, 4, contrast_grid=(2, 2), prefix_readout="exact", stage2_temperature=True)
    module.reset_vca_parameters("paper")
    layout = TokenLayout(1, (8, 9))  # 72 patches ≥ 8·4: the layer input is pooled
    x = torch.randn(1, 73, 32)
    graphs = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(module, fullgraph=True, backend=recording_backend)
    with torch.no_grad(), fused_cpu.use_kernel(kernel):
        torch.testing.assert_close(compiled(x, layout=layout), module(x, layout=layout), atol=1e-5, rtol=1e-5)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert len(graphs) == 1
    assert ("vca_patch.attend_cpu" in targets) is kernel
    assert any("scaled_dot_product_attention" in t for t in targets) is not kernel


def test_the_compiled_fused_kernel_serves_every_grid_from_one_dynamic_graph():
    """With dynamic=True the kernel's grid sizes are symbols: a second and third grid (non-square) reuse the first
    graph and match eager there; nothing is baked in for the first grid."""
    from vca_patch.targets.vca import fused_cpu

    torch._dynamo.reset()
    module = VisualContrastAttention(32, 4, contrast_grid=(2, 2), local_window=3).eval()
    with torch.no_grad():
        module.local_scale.fill_(0.5)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=counter)
    with torch.no_grad(), fused_cpu.use_kernel(True):
        for grid in ((8, 8), (6, 10), (12, 7)):
            x = torch.randn(2, 1 + grid[0] * grid[1], 32)
            layout = TokenLayout(1, grid)
            torch.testing.assert_close(compiled(x, layout=layout), module(x, layout=layout), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


def test_sweep_runs_explicit_softmax_within_a_memory_budget():
    """The unfused original materialises batch·heads·N² softmax tensors: one layer's logits and weights at inference,
    every layer's weights kept for a training step. Past the budget each is skipped, with a log line."""
    variants = build_variants("vit_tiny_patch16_224", [VCAConfig()], model_args={"depth": 3})
    one_map = 257**2 * 3 * 4 / 2**20  # MiB of one [1, 3, 257, 257] float32 tensor (256 px, 3 heads)

    def sweep(maps: float) -> tuple[dict, dict, list[str]]:
        settings = BenchSettings(resolutions=[64, 256], repeats=1, warmup=0, unfused_max_mib=maps * one_map)
        lines: list[str] = []
        result = run_sweep(variants, settings, log=lines.append)
        rows = {(r["variant"], r["resolution"]): r for r in result["results"]}
        return rows, {r["resolution"]: r for r in result["ratios"]}, lines

    rows, ratios, lines = sweep(3.01)  # all within: measured, and VCA's step keeps less than explicit softmax's
    assert rows[UNFUSED, 256]["memory_train_mib"] > 0 and ratios[256]["memory_train_ratio_unfused"] < 1
    assert ratios[64]["memory_train_ratio_unfused"] == pytest.approx(
        rows["vca", 64]["memory_train_mib"] / rows[UNFUSED, 64]["memory_train_mib"]
    )
    rows, ratios, lines = sweep(2.5)  # the training step's 3 maps are over, inference's 2 within
    assert rows[UNFUSED, 256]["memory_infer_mib"] > 0 and rows[UNFUSED, 256]["memory_train_mib"] is None
    assert ratios[256]["memory_train_ratio_unfused"] is None and rows[UNFUSED, 64]["memory_train_mib"] > 0
    assert any(line.startswith("memory 256px: original-unfused training skipped") for line in lines)
    rows, ratios, lines = sweep(1.5)  # inference over too: not run at all at 256 px
    assert rows[UNFUSED, 256]["latency_ms"] is None and rows[UNFUSED, 256]["memory_infer_mib"] is None
    assert "timing 256px (257 tokens): original, vca" in lines and rows[UNFUSED, 64]["latency_ms"] > 0


def test_sweep_times_compiled_models_when_asked():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    variants = build_variants("vit_tiny_patch16_224", [VCAConfig()], model_args={"depth": 1}, unfused=False)
    settings = BenchSettings(resolutions=[32], repeats=1, warmup=0, memory=False, compile=True)
    result = run_sweep(variants, settings, log=lambda _: None)
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])  # the original and the patched model
    assert result["meta"]["settings"]["compile"] is True
    assert all(r["latency_ms"] > 0 for r in result["results"])
