"""VCA's fused CPU kernel: the same function as the float64 reference and the composite path, used only where
it applies, rebuilt constants after parameter updates, and a clean fallback when it cannot be built."""

import copy
import os
import warnings

import pytest
import torch

from tests.support.reference.vca import reference_vca
from tests.support.vca import randomised
from vca_patch.layers.fused_qkv import QKVWithSeparateBias, SplitQKV
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.vca import fused_cpu
from vca_patch.targets.vca.layer import VisualContrastAttention

if os.environ.get("VCA_PATCH_REQUIRE_CPU_KERNEL") == "1" and not fused_cpu.kernel_available():  # `make test` sets it
    raise RuntimeError(f"VCA_PATCH_REQUIRE_CPU_KERNEL=1, but the kernel is unavailable: {fused_cpu.kernel_status()}")
pytestmark = pytest.mark.skipif(not fused_cpu.kernel_available(), reason=f"kernel: {fused_cpu.kernel_status()}")


def _calls_kernel(module: torch.nn.Module, x: torch.Tensor, layout: TokenLayout) -> tuple[torch.Tensor, int]:
    """module(x) and how many times the fused op ran (counted through wrappers on both of `fused_cpu`'s entries:
    `attend_cpu` and `attend_cpu_into_q`)."""
    calls = []
    originals = {name: getattr(fused_cpu, name) for name in ("attend_cpu", "attend_cpu_into_q")}

    def counting(original):
        def run(*args):
            calls.append(args)
            return original(*args)

        return run

    for name, original in originals.items():
        setattr(fused_cpu, name, counting(original))
    try:
        out = module(x, layout=layout)
    finally:
        for name, original in originals.items():
            setattr(fused_cpu, name, original)
    return out, len(calls)


CASES = [  # batch, prefix, grid, channels, heads, contrast grid
    (1, 1, (9, 7), 32, 4, (3, 3)),
    (2, 0, (5, 8), 24, 3, (2, 3)),  # head width 8: below one vector
    (2, 3, (17, 11), 40, 2, (3, 2)),  # head width 20: a masked tail; uneven, overlapping pooling windows
    (1, 1, (36, 30), 64, 4, (7, 7)),  # 1081 tokens: three Stage-I key blocks (online softmax)
    (3, 1, (2, 3), 16, 2, (3, 3)),  # more contrast tokens than patches (windows repeat), no interior row
    (2, 0, (1, 1), 8, 1, (1, 1)),  # a single patch
]
OPTIONS = [
    {},
    {"prefix_readout": "exact", "stage2_temperature": True},
    {"softmax": "separate", "prefix_readout": "exact"},
    {"softmax": "separate", "stage2_temperature": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "paper")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}P{c[1]}g{c[2][0]}x{c[2][1]}C{c[3]}M{c[4]}")
def test_kernel_matches_float64_reference(case, options):
    batch, prefix, grid, dim, heads, contrast = case
    module = randomised(VisualContrastAttention(dim, heads, contrast_grid=contrast, layer_index=3, **options))
    x = torch.randn(batch, prefix + grid[0] * grid[1], dim)
    expected = reference_vca(module, x, prefix, grid)
    with torch.no_grad():
        got, calls = _calls_kernel(module, x, TokenLayout(prefix, grid))
    assert calls == 1
    assert (got.double() - expected).norm() / expected.norm() < 2e-6


@pytest.mark.parametrize(
    "threads, grid",
    [(2, (46, 46)), (4, (36, 30)), (3, (10, 10))],  # 5 key blocks in 4 chunks (the last empty); 3 in 3; 1 in 1
)
def test_kernel_splits_the_keys_of_few_heads_across_threads(threads, grid):
    """One image and one head: Stage I's keys go to several threads and their partial softmaxes are merged."""
    module = randomised(VisualContrastAttention(16, 1, contrast_grid=(3, 3), prefix_readout="exact"))
    x = torch.randn(1, 1 + grid[0] * grid[1], 16)
    expected = reference_vca(module, x, 1, grid)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got, calls = _calls_kernel(module, x, TokenLayout(1, grid))
    finally:
        torch.set_num_threads(previous)
    assert calls == 1
    assert (got.double() - expected).norm() / expected.norm() < 2e-6


def test_kernel_and_composite_paths_agree_and_the_switch_works():
    module = randomised(VisualContrastAttention(48, 4, contrast_grid=(3, 3), prefix_readout="exact"))
    x, layout = torch.randn(2, 1 + 100, 48), TokenLayout(1, (10, 10))
    with torch.no_grad():
        fused, calls = _calls_kernel(module, x, layout)
        with fused_cpu.use_kernel(False):
            composite, composite_calls = _calls_kernel(module, x, layout)
            assert fused_cpu.kernel_status() == "composite (disabled)"
    assert (calls, composite_calls) == (1, 0)
    torch.testing.assert_close(fused, composite, rtol=1e-5, atol=1e-5)


def test_kernel_is_not_used_where_it_does_not_apply():
    module = randomised(VisualContrastAttention(32, 4, contrast_grid=(2, 2)))
    x, layout = torch.randn(1, 1 + 16, 32), TokenLayout(1, (4, 4))
    assert _calls_kernel(module, x, layout)[1] == 0  # autograd: parameters need gradients
    with torch.no_grad():
        assert _calls_kernel(module.double(), x.double(), layout)[1] == 0  # float64
        module.float()
        assert _calls_kernel(module, x, layout)[1] == 1
    module.requires_grad_(False)
    assert _calls_kernel(module, x, layout)[1] == 1  # frozen model, grad mode on: still inference


def test_kernel_arguments_follow_parameter_updates():
    module = randomised(VisualContrastAttention(32, 4, contrast_grid=(2, 2), stage2_temperature=True))
    x, layout = torch.randn(1, 1 + 36, 32), TokenLayout(1, (6, 6))
    with torch.no_grad():
        module(x, layout=layout)  # builds and caches the constants
        for parameter in (module.contrast_embed_neg, module.lambda2.q1, module.dwc.weight, module.stage2_temperature):
            parameter.add_(0.1 * torch.randn_like(parameter))  # in place, as an optimiser step
            expected = reference_vca(module, x, 1, (6, 6))
            got, calls = _calls_kernel(module, x, layout)
            assert calls == 1 and (got.double() - expected).norm() / expected.norm() < 2e-6
        module.qkv.weight.data = module.qkv.weight.data * 1.5  # a replaced tensor: the q/k/v views follow
        expected = reference_vca(module, x, 1, (6, 6))
        got, calls = _calls_kernel(module, x, layout)
        assert calls == 1 and (got.double() - expected).norm() / expected.norm() < 2e-6


def test_split_projections_and_q_norm_take_the_kernel_too():
    dim, heads, grid = 32, 4, (5, 5)
    x, layout = torch.randn(2, 25, dim), TokenLayout(0, grid)
    linears = [torch.nn.Linear(dim, dim, bias=bias) for bias in (True, False, True)]  # BEiT-style: no k bias
    split = randomised(VisualContrastAttention(dim, heads, contrast_grid=(2, 2), qkv=SplitQKV.of(*linears)))
    biases = map(torch.nn.Parameter, torch.randn(2, dim).unbind())
    separate_bias = QKVWithSeparateBias.of(torch.nn.Linear(dim, 3 * dim, bias=False), *biases)
    beit = randomised(VisualContrastAttention(dim, heads, contrast_grid=(2, 2), qkv=separate_bias))
    normed = randomised(VisualContrastAttention(dim, heads, contrast_grid=(2, 2)))
    normed.q_norm = torch.nn.LayerNorm(dim // heads)  # a copy in another layout: biases are not folded
    normed.k_norm = torch.nn.LayerNorm(dim // heads)
    for module in (split, beit, normed):
        with torch.no_grad():
            composite = module.attend(x, *_fused_module_qkv(module, x), layout)
            got, calls = _calls_kernel(module, x, layout)
        assert calls == 1
        torch.testing.assert_close(got, composite, rtol=1e-5, atol=1e-5)


def _fused_module_qkv(module: VisualContrastAttention, x: torch.Tensor):
    """q, k, v per head from the projection module's own forward (not the split the layer makes of it)."""
    return module.qkv(x).view(*x.shape[:2], 3, module.num_heads, module.head_dim).permute(2, 0, 3, 1, 4).unbind(0)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch):
    def no_compiler() -> None:
        raise RuntimeError("Error building extension\nc++: error: command not found\nninja: build stopped")

    extension = copy.copy(fused_cpu._EXTENSION)  # a kernel never built yet, whose build fails
    extension.loaded, extension.error, extension._build = False, None, no_compiler
    monkeypatch.setattr(fused_cpu, "_EXTENSION", extension)
    module = randomised(VisualContrastAttention(16, 2, contrast_grid=(2, 2)))
    x, layout = torch.randn(1, 16, 16), TokenLayout(0, (4, 4))
    with pytest.warns(RuntimeWarning, match="c\\+\\+: error: command not found"), torch.no_grad():
        first = module(x, layout=layout)
    assert fused_cpu.kernel_status().startswith("composite (RuntimeError: c++: error")
    with warnings.catch_warnings(record=True) as later, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(module(x, layout=layout), first)
    assert not later  # warned once, not on every call
    expected = reference_vca(module, x, 0, (4, 4))
    assert (first.double() - expected).norm() / expected.norm() < 2e-6


def test_env_switch_disables_the_kernel(monkeypatch):
    monkeypatch.setenv(fused_cpu.ENV_SWITCH, "0")
    module = randomised(VisualContrastAttention(16, 2, contrast_grid=(2, 2)))
    with torch.no_grad():
        assert _calls_kernel(module, torch.randn(1, 16, 16), TokenLayout(0, (4, 4)))[1] == 0
    assert fused_cpu.kernel_status() == "composite (disabled)"


def test_op_rejects_bad_inputs_clearly():
    q = torch.randn(1, 2, 5, 8)
    arguments = VisualContrastAttention(16, 2, contrast_grid=(2, 2)).kernel_arguments()
    with pytest.raises(RuntimeError, match="prefix \\+ H·W"):
        fused_cpu.attend_cpu(q, q, q, 0, 2, 3, None, None, *arguments)  # 5 tokens are not 2·3
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        fused_cpu.attend_cpu(q.double(), q, q, 1, 2, 2, None, None, *arguments)
    tokens = torch.randn(1, 6, 16)  # a [B, N, C] buffer and its head view, as a q projection returns
    heads = tokens.view(1, 6, 2, 8).transpose(1, 2)
    k = torch.randn(1, 2, 6, 8)
    with pytest.raises(RuntimeError, match="its own dense"):  # a view into a wider buffer (a fused qkv)
        fused_cpu.attend_cpu_into_q(tokens, heads[:, :, 1:], k, k, 1, 2, 2, None, None, *arguments)
    with pytest.raises(RuntimeError, match="must not share memory"):
        fused_cpu.attend_cpu_into_q(tokens, heads, heads, k, 0, 2, 3, None, None, *arguments)


def test_op_over_q_is_the_functional_op_in_q_buffer():
    """o written over q (read before written, per head and row block) equals the op that allocates o, with the
    exact prefix read-out (rows written in Stage I) and with a head's keys split across threads."""
    torch.manual_seed(0)
    module = randomised(VisualContrastAttention(32, 2, contrast_grid=(3, 3), prefix_readout="exact"))
    tokens, k, v = (torch.randn(1, 1 + 46 * 46, 32) for _ in range(3))  # q's buffer must be its own
    heads = [t.view(1, -1, 2, 16).transpose(1, 2) for t in (tokens, k, v)]
    args = (*heads[1:], 1, 46, 46, torch.randn(32), torch.randn(32), *module.kernel_arguments())
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # 2 heads < 2·threads: the keys are split (three parallel regions)
    try:
        expected = fused_cpu.attend_cpu(heads[0].clone(), *args)
        out = fused_cpu.attend_cpu_into_q(tokens, heads[0], *args)
    finally:
        torch.set_num_threads(previous)
    assert out.data_ptr() == tokens.data_ptr()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_fused_layer_allocates_only_q_k_and_v():
    """Eager inference: o goes into q's buffer and proj's output into k's, so the layer's tensors peak at q, k, v
    (the composite path and the functional op would add o and the output: five [B, N, C] tensors)."""
    from vca_patch.bench.memory import LiveTensorBytes

    module = randomised(VisualContrastAttention(64, 4, contrast_grid=(4, 4))).eval()
    x = torch.randn(2, 1 + 32 * 32, 64)
    unit = x.numel() * x.element_size()
    with torch.inference_mode():
        module(x, layout=TokenLayout(1, (32, 32)))  # the cached kernel arguments are not per-call memory
        with LiveTensorBytes() as tracker:
            out = module(x, layout=TokenLayout(1, (32, 32)))
    assert out.shape == x.shape
    assert 3 * unit <= tracker.peak < 3.2 * unit


@pytest.mark.parametrize(
    "log, reason",
    [
        ("FAILED: x.o\n/bin/sh: 1: c++: not found\nninja: build stopped", "/bin/sh: 1: c++: not found"),
        ("x.cpp:3:10: fatal error: ATen/ATen.h: No such file\nninja: build stopped", "x.cpp:3:10: fatal error: ATen"),
        ("undefined symbol: sgemm_", "undefined symbol: sgemm_"),
    ],
)
def test_build_failure_reason_is_the_line_that_says_why(log, reason):
    assert fused_cpu._reason(RuntimeError(log)).startswith(f"RuntimeError: {reason}")
