"""Property-based robustness harness: VCA and MANO layers over random batch sizes (0 included), grids (1×1 to
non-square), prefix counts, dtypes and contrast-token counts, against the float64 references.

Each example builds a random layer, casts it to the dtype, and compares its output with the reference evaluated
in float64 on the same (rounded) weights and input. Tolerances are a few times the largest error measured over
600 examples per dtype (noted beside each). `VCA_HARNESS_EXAMPLES=1000` runs a longer sweep."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.reference.mano import reference_mano
from tests.support.reference.vca import reference_vca
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.mano.layer import MultipoleAttention
from vca_patch.targets.vca import fused_cpu
from vca_patch.targets.vca.layer import VisualContrastAttention

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Relative error (Frobenius) to the float64 reference, a few times the worst measured over 600 examples each.
# VCA in bfloat16: median 4e-3, worst 1.4e-1, where λ₁·A⁺ and λ₂·A⁻ nearly cancel (the differential amplifies
# rounding); every other case stays within a few unit round-offs (bf16 2⁻⁸, float32 2⁻²⁴).
VCA_TOL = {torch.float64: 1e-14, torch.float32: 1e-5, torch.bfloat16: 3e-1}  # worst 2.3e-15, 3.1e-6, 1.4e-1
MANO_TOL = {torch.float64: 3e-15, torch.float32: 4e-6, torch.bfloat16: 6e-2}  # worst 7.1e-16, 1.2e-6, 2.0e-2
EXAMPLES = int(os.environ.get("VCA_HARNESS_EXAMPLES", "25"))  # e.g. 1000 for a long run
HARNESS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, database=None
)

grids = st.tuples(st.integers(1, 6), st.integers(1, 6))  # 1×1 up to 6×6, most of them not square


def _random_parameters(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random and away from its preserving init, so each term of the layer matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.3)
            if name.endswith("norm.weight") or name == "up_gain":
                p.uniform_(0.5, 1.5, generator=gen)


def _compare(module: torch.nn.Module, reference, dtype: torch.dtype, batch: int, num_prefix: int, grid, seed: int):
    """The layer in `dtype` against `reference(float64 copy, x)`; returns the relative error (0 for a batch of 0)."""
    dim = module.qkv.in_features
    x = torch.randn(batch, num_prefix + grid[0] * grid[1], dim, generator=torch.Generator().manual_seed(seed))
    x = x.to(dtype)
    layer = module.to(dtype).eval()
    with torch.no_grad():
        got = layer(x, layout=TokenLayout(num_prefix, grid))
    assert got.shape == x.shape and got.dtype == dtype and got.device == x.device
    if batch == 0:
        return 0.0
    assert torch.isfinite(got).all()
    with torch.no_grad():
        expected = reference(copy.deepcopy(layer).double(), x.double())
    return float((got.double() - expected).norm() / expected.norm())


@pytest.mark.skipif(not fused_cpu.kernel_available(), reason=f"kernel: {fused_cpu.kernel_status()}")
@HARNESS
@given(
    batch=st.integers(0, 3),
    grid=grids,
    num_prefix=st.integers(0, 3),
    contrast=st.tuples(st.integers(1, 3), st.integers(1, 3)),  # n = 1 … 9 tokens, also more than the grid has
    softmax=st.sampled_from(["joint", "separate"]),
    readout=st.sampled_from(["exact", "contrast"]),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_vca_matches_the_float64_reference(batch, grid, num_prefix, contrast, softmax, readout, dtype, seed):
    if readout == "contrast" and num_prefix == 0:
        readout = "exact"  # the same function without prefix tokens
    module = VisualContrastAttention(
        16, 2, contrast_grid=contrast, layer_index=seed % 12, softmax=softmax, prefix_readout=readout,
        stage2_temperature=seed % 2 == 0,
    )  # fmt: skip
    _random_parameters(module, seed)
    torch_dtype = DTYPES[dtype]
    error = _compare(
        module, lambda m, x: reference_vca(m, x, num_prefix, grid), torch_dtype, batch, num_prefix, grid, seed
    )
    assert error < VCA_TOL[torch_dtype], (error, dtype)


@HARNESS
@given(
    batch=st.integers(0, 3),
    grid=grids,
    num_prefix=st.integers(0, 3),
    window=st.integers(1, 3),
    rate=st.integers(2, 3),
    variant=st.sampled_from([("conv", "conv"), ("avg", "nearest"), ("conv", "nearest"), ("avg", "conv")]),
    prefix=st.sampled_from(["global", "separate"]),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_mano_matches_the_float64_reference(batch, grid, num_prefix, window, rate, variant, prefix, dtype, seed):
    module = MultipoleAttention(16, 2, window=window, rate=rate, down=variant[0], up=variant[1], prefix=prefix)
    _random_parameters(module, seed)
    torch_dtype = DTYPES[dtype]
    error = _compare(
        module, lambda m, x: reference_mano(m, x, num_prefix, grid), torch_dtype, batch, num_prefix, grid, seed
    )
    assert error < MANO_TOL[torch_dtype], (error, dtype)
