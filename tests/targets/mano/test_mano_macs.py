import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.mano.config import MANOConfig
from vca_patch.targets.mano.layer import MultipoleAttention
from vca_patch.targets.mano.macs import mano_attention_macs, mano_macs_from_config


@pytest.mark.parametrize(
    "P,grid,window,down,up,prefix",
    [
        (1, (14, 14), 7, "conv", "conv", "global"),
        (2, (10, 7), 3, "conv", "nearest", "global"),
        (0, (9, 9), 2, "avg", "conv", "separate"),
        (1, (16, 16), 4, "avg", "nearest", "separate"),
    ],
)
@pytest.mark.parametrize("trained", [True, False])
def test_analytic_macs_equal_counted_macs(P, grid, window, down, up, prefix, trained):
    """The formula plus the level-0 qkv/proj equals torch's FLOP counter (math SDPA, so attention is counted); with
    the preserve init's U = 0 the layer skips its coarse levels at inference, and `coarse=False` counts that."""
    module = MultipoleAttention(64, 4, window=window, down=down, up=up, prefix=prefix)
    if trained:
        module.reset_mano_parameters("multipole")
    N = P + grid[0] * grid[1]
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        module(torch.randn(1, N, 64), layout=TokenLayout(P, grid))
    level0_linear = N * 4 * 64 * 64
    settings = {"window": window, "down": down, "up": up, "prefix": prefix, "coarse": trained}
    expected = mano_attention_macs(P, grid, 64, **settings) + level0_linear
    assert counter.get_total_flops() / 2 == expected
    if not trained:  # the skipped levels are a real share of the full count
        assert mano_attention_macs(P, grid, 64, **{**settings, "coarse": True}) > 1.05 * (expected - level0_linear)


def test_macs_are_linear_in_tokens():
    # docs/mano.md §8.4: per-token cost flat from 32² to 128² grids; softmax attention grows with N.
    per_token = [mano_attention_macs(1, (s, s), 192, window=8) / (s * s) for s in (32, 64, 128)]
    assert max(per_token) / min(per_token) < 1.1
    softmax = [2 * (1 + s * s) * 192 for s in (32, 128)]
    assert softmax[1] / softmax[0] > 15


def test_from_config_reads_a_mano_config():
    class Shape:
        num_prefix_tokens, grid, dim, num_heads = 1, (14, 14), 192, 3

    config = MANOConfig(window=4, down="avg", up="nearest")
    assert mano_macs_from_config(Shape, config) == mano_attention_macs(
        1, (14, 14), 192, window=4, down="avg", up="nearest"
    )
