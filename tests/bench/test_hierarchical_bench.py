"""`bench` rows for hierarchical ViTs (`bench.hierarchical`): the original vs each VCA mode vs MANO, MACs counted
per op. Timing is only checked to be measured (no wall-clock assertions); the MAC rows are checked for what
the architectures imply: PVT's reduction is quadratic in image area, Swin's windows are linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.bench.hierarchical import counted_gmacs, family, hierarchical_table, run_hierarchical_sweep

SWIN_ARGS = {"embed_dim": 16, "depths": [2, 2], "num_heads": [1, 2], "window_size": 4}
PVT_ARGS = {"depths": [1, 1, 1, 1]}  # pvt_v2_b0's widths and reductions (8, 4, 2, 1), one block per stage


def _rows(result: dict, variant: str) -> list[dict]:
    return [r for r in result["rows"] if r["variant"] == variant]


def test_family_of_timm_names():
    assert family("swin_tiny_patch4_window7_224") == "swin" and family("pvt_v2_b2") == "pvt"
    assert family("pvt_v2_b2_li") == "pvt" and family("deit_small_patch16_224") is None


def test_cpu_sdpa_is_counted():  # torch's counter knows only the CUDA SDPA ops: the sweep registers the CPU one
    class Attend(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k = x, x[:, :, :10]
            return F.scaled_dot_product_attention(q, k, k)

    x = torch.randn(2, 3, 50, 8)
    assert counted_gmacs(Attend(), x) * 1e9 == 3 * 2 * 50 * 10 * 8  # q·kᵀ and A·v, per image


def test_pvt_rows_show_the_reduction_kept_vca_getting_cheaper_with_the_input():
    result = run_hierarchical_sweep(
        "pvt_v2_b0", [64, 128], repeats=1, warmup=0, model_args=PVT_ARGS, log=lambda m: None
    )
    assert result["meta"]["family"] == "pvt" and "quadratic" in result["meta"]["finding"]
    assert {r["variant"] for r in result["rows"]} == {"original", "vca-carry", "vca-paper", "mano"}
    for variant in ("original", "vca-carry", "vca-paper"):
        assert all(r["latency_ms"] > 0 and r["gmacs"] > 0 and r["skipped"] is None for r in _rows(result, variant))
    refused = (  # MANO has no variant for PVT's reduction
        "PVT spatial-reduction attention is not plain softmax attention over one token grid: only a target that "
        "builds a variant for it takes it, not MultipoleAttention (targets that do: vca)"
    )
    assert all(r["skipped"] == refused for r in _rows(result, "mano"))
    carry = [r["mac_ratio"] for r in _rows(result, "vca-carry")]
    assert carry[1] < carry[0]  # SRA grows as N²/R², the kept-reduction VCA as N
    assert [r["stage1_tokens"] for r in _rows(result, "original")] == [16 * 16, 32 * 32]
    table = hierarchical_table(result)
    assert table.row_count == len(result["rows"])


def test_swin_rows_show_global_context_not_speed():
    result = run_hierarchical_sweep(
        "swin_tiny_patch4_window7_224", [32, 64], repeats=1, warmup=0, model_args=SWIN_ARGS, log=lambda m: None
    )
    assert {r["variant"] for r in result["rows"]} == {"original", "vca-residual", "vca-global", "mano"}
    assert all(r["skipped"] is None and r["latency_ms"] > 0 for r in result["rows"])
    residual = [r["mac_ratio"] for r in _rows(result, "vca-residual")]
    global_ = [r["mac_ratio"] for r in _rows(result, "vca-global")]
    assert all(ratio > 1 for ratio in residual)  # the window attention kept, a global branch added
    assert all(g < r for g, r in zip(global_, residual, strict=True))
