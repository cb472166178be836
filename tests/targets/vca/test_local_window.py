"""VCA's local term (`local_window`): neighbourhood attention against a float64 loop reference, the layer's mix,
the config option, checkpoints and calibration's joint fit."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import vca_patch
from tests.support.real_weights import load_dinov2_or_skip, quick_cosines
from tests.support.reference.vca import reference_vca
from tests.support.vca import randomised
from vca_patch.core.errors import ConfigError
from vca_patch.layers.layout import TokenLayout
from vca_patch.recovery import calibrate
from vca_patch.recovery.calibrate import _pre_proj
from vca_patch.recovery.capture import capture_original_layers, original_attention, patched_modules
from vca_patch.surgery import get_patch_state
from vca_patch.targets.vca import fused_cpu, neighbourhood
from vca_patch.targets.vca.config import VCAConfig
from vca_patch.targets.vca.layer import VisualContrastAttention
from vca_patch.targets.vca.neighbourhood import neighbourhood_attention

timm = pytest.importorskip("timm")


def _loop_reference(q, k, v, prefix: int, grid: tuple[int, int], kernel: int, scale: float) -> torch.Tensor:
    """float64, one query at a time: softmax over the prefix keys and the patches within kernel // 2 rows and
    columns of the query's patch; [B, M, H·W, d]."""
    q, k, v = q.double(), k.double(), v.double()
    H, W = grid
    reach = kernel // 2
    out = torch.zeros(*q.shape[:2], H * W, q.shape[-1], dtype=torch.float64)
    for i in range(H * W):
        r, c = divmod(i, W)
        keys = list(range(prefix))
        keys += [prefix + rr * W + cc for rr in range(H) for cc in range(W) if abs(rr - r) <= reach >= abs(cc - c)]
        logits = torch.einsum("bmd,bmkd->bmk", q[:, :, prefix + i], k[:, :, keys]) * scale
        weights = torch.exp(logits - logits.max(-1, keepdim=True).values)
        weights = weights / weights.sum(-1, keepdim=True)
        out[:, :, i] = torch.einsum("bmk,bmkd->bmd", weights, v[:, :, keys])
    return out


def _qkv(prefix: int, grid: tuple[int, int], dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N = prefix + grid[0] * grid[1]
    return [torch.randn(2, 3, N, 8, generator=g, dtype=torch.float64).mul(1.5).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("kernel", [1, 3, 5])
@pytest.mark.parametrize(("prefix", "grid"), [(0, (4, 5)), (1, (6, 6)), (2, (7, 3))])
def test_matches_the_float64_loop_reference(kernel, prefix, grid):
    q, k, v = _qkv(prefix, grid)
    layout = TokenLayout(prefix, grid)
    expected = _loop_reference(q, k, v, prefix, grid, kernel, 0.35)
    torch.testing.assert_close(neighbourhood_attention(q, k, v, layout, kernel, 0.35), expected, rtol=0, atol=1e-12)
    # float32: measured error ~3e-7; the tolerance would miss nothing like a 10% error of the output.
    got = neighbourhood_attention(*(t.float() for t in (q, k, v)), layout, kernel, 0.35)
    err = float((got.double() - expected).abs().max())
    assert err < 2e-6, err
    assert float((0.9 * expected - expected).abs().max()) > 100 * 2e-6


@pytest.mark.parametrize("path", [neighbourhood._blocked_attention, neighbourhood._dense_attention])
@pytest.mark.parametrize(("prefix", "grid", "kernel"), [(1, (17, 10), 5), (0, (9, 9), 7), (2, (3, 19), 3)])
def test_both_sdpa_paths_and_their_gradients_match_the_loop_reference(path, prefix, grid, kernel):
    """The query-block path on grids wider and taller than one 8×8 block, with ragged edges (the halos, their masks
    and the padding rows), and the dense path, forward and backward (the training path), against the float64 loop
    reference."""
    q, k, v = (t.requires_grad_() for t in _qkv(prefix, grid, seed=2))
    layout = TokenLayout(prefix, grid)
    expected = _loop_reference(q, k, v, prefix, grid, kernel, 0.35)
    got = path(q, k, v, layout, kernel, 0.35)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)  # measured ~5e-15
    weights = torch.randn_like(expected)
    for grad_got, grad_expected in zip(
        torch.autograd.grad((got * weights).sum(), (q, k, v)),
        torch.autograd.grad((expected * weights).sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(grad_got, grad_expected, rtol=0, atol=1e-12)  # measured ~1e-14


def test_dense_path_only_on_grids_where_it_computes_at_most_twice_the_blocks_logits():
    dense = neighbourhood._dense_is_cheaper
    assert dense(TokenLayout(1, (16, 16)), 7) and dense(TokenLayout(1, (16, 16)), 11)  # 224 px: 66k vs 50k / 83k
    assert not dense(TokenLayout(1, (24, 24)), 7) and not dense(TokenLayout(1, (37, 37)), 11)  # 332k vs 113k ...


def test_kernel_one_without_prefix_is_the_value_and_a_whole_grid_kernel_is_softmax_attention():
    q, k, v = _qkv(0, (4, 5))
    torch.testing.assert_close(neighbourhood_attention(q, k, v, TokenLayout(0, (4, 5)), 1, 0.5), v)
    q, k, v = _qkv(1, (4, 5), seed=1)  # kernel 9 reaches every patch from every patch of a 4×5 grid
    full = F.scaled_dot_product_attention(q, k, v, scale=0.5)[:, :, 1:]
    torch.testing.assert_close(neighbourhood_attention(q, k, v, TokenLayout(1, (4, 5)), 9, 0.5), full)


def test_bf16_runs_close_to_float32_and_an_even_kernel_is_refused():
    q, k, v = _qkv(1, (6, 6), dtype=torch.float32)
    layout = TokenLayout(1, (6, 6))
    ref = neighbourhood_attention(q, k, v, layout, 3, 0.35)
    got = neighbourhood_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout, 3, 0.35)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - ref).abs().max()) < 0.05 * float(ref.abs().max())
    with pytest.raises(ValueError, match="odd"):
        neighbourhood_attention(q, k, v, layout, 4, 0.35)


def _layer(local_window: int, readout: str = "exact") -> VisualContrastAttention:
    torch.manual_seed(0)
    module = VisualContrastAttention(
        24, 3, contrast_grid=(2, 2), layer_index=2, prefix_readout=readout, local_window=local_window
    )
    return randomised(module).double()


@pytest.mark.parametrize("readout", ["exact", "contrast"])
def test_layer_mix_matches_float64_reference(readout):
    """Before the projection: Stage II's rows times α, the patch rows plus β⊙neighbourhood attention (DWC zeroed
    here: the reference adds it to Stage II's rows, the layer after the mix)."""
    module = _layer(5, readout)
    with torch.no_grad():
        module.dwc.weight.zero_()
        module.dwc.bias.zero_()
    prefix, grid = 2, (4, 5)
    x = torch.randn(2, prefix + 20, 24, dtype=torch.float64)
    bare = copy.deepcopy(module)
    with torch.no_grad():
        bare.proj.weight.copy_(torch.eye(24, dtype=torch.float64))
        bare.proj.bias.zero_()
    o = reference_vca(bare, x, prefix, grid)  # [B, N, C]: the layer without its local term
    q, k, v = (t.view(2, -1, 3, 8).transpose(1, 2) for t in module.qkv(x).detach().chunk(3, dim=-1))
    local = _loop_reference(q, k, v, prefix, grid, 5, module.scale).transpose(1, 2).reshape(2, 20, 24)
    alpha, beta = module.global_scale.detach(), module.local_scale.detach()
    o[:, prefix if readout == "exact" else 0 :] *= alpha  # Stage II's rows: every row under contrast read-out
    o[:, prefix:] += beta * local
    expected = o @ module.proj.weight.detach().T + module.proj.bias.detach()
    layout = TokenLayout(prefix, grid)
    with torch.no_grad():
        torch.testing.assert_close(module(x, layout=layout), expected, rtol=1e-10, atol=1e-10)
    out = module(x.clone().requires_grad_(), layout=layout)  # the autograd path: the same, and α, β learn
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    out.square().sum().backward()
    assert module.local_scale.grad.abs().sum() > 0 and module.global_scale.grad.abs().sum() > 0


def test_fresh_local_term_is_the_plain_layer():
    plain = randomised(VisualContrastAttention(24, 3, contrast_grid=(2, 2), layer_index=1)).double()
    local = VisualContrastAttention(24, 3, contrast_grid=(2, 2), layer_index=1, local_window=3).double()
    local.load_state_dict(plain.state_dict(), strict=False)
    assert set(local.state_dict()) - set(plain.state_dict()) == {"global_scale", "local_scale"}
    x = torch.randn(2, 1 + 16, 24, dtype=torch.float64)
    layout = TokenLayout(1, (4, 4))
    torch.testing.assert_close(local(x, layout=layout), plain(x, layout=layout), rtol=0, atol=0)
    with pytest.raises(ValueError, match="local_window"):
        VisualContrastAttention(24, 3, local_window=2)


@pytest.mark.skipif(not fused_cpu.kernel_available(), reason=f"kernel: {fused_cpu.kernel_status()}")
@pytest.mark.parametrize("readout", ["exact", "contrast"])
@pytest.mark.parametrize(
    ("prefix", "grid", "kernel"), [(1, (6, 6), 3), (2, (5, 7), 5), (0, (4, 4), 7), (2, (17, 19), 7)]
)  # 17×19: more than one Stage-II block of 256 rows per head, whose local terms read keys across the blocks' edge
def test_fused_kernel_computes_the_local_term(readout, prefix, grid, kernel):
    """float32 inference through the fused kernel (α in RMSNorm₂'s per-head weight, the local term in the same op,
    β and v's bias folded in), with the per-token gain too, against the composite path of the same float32 layer."""
    torch.manual_seed(1)
    module = VisualContrastAttention(
        24, 3, contrast_grid=(2, 2), layer_index=2, prefix_readout=readout, local_window=kernel, token_magnitude=True
    )
    module = randomised(module)
    x = torch.randn(2, prefix + grid[0] * grid[1], 24)
    layout = TokenLayout(prefix, grid)
    with torch.no_grad():
        assert module._fused_kernel_usable(x)
        fused = module(x, layout=layout)
        with fused_cpu.use_kernel(False):
            assert not module._fused_kernel_usable(x)
            composite = module(x, layout=layout)
    err = float((fused - composite).abs().max() / composite.abs().max())
    assert err < 1e-5, err  # measured ~1e-7
    assert float((0.9 * composite - composite).abs().max() / composite.abs().max()) > 1000 * 1e-5


def test_config_option_validates_round_trips_and_refuses_hierarchical_stages():
    for bad in (2, -1, True, "7"):
        with pytest.raises(ConfigError, match="local_window"):
            VCAConfig(local_window=bad)
    config = VCAConfig(local_window=7)
    assert VCAConfig.from_json(config.to_json()) == config
    swin = timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, img_size=64, window_size=4, depths=(1, 1), embed_dim=24,
        num_heads=(1, 2), num_classes=0,
    ).eval()  # fmt: skip
    before = {name: p.clone() for name, p in swin.state_dict().items()}
    with pytest.raises(ConfigError, match="single-grid"):
        vca_patch.patch_model(swin, VCAConfig(local_window=3, stage_contrast_tokens=[4, 1]))
    assert get_patch_state(swin) is None  # nothing half-patched
    assert not any(isinstance(m, VisualContrastAttention) for m in swin.modules())
    assert swin.state_dict().keys() == before.keys()


def _tiny_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=64, depth=3, num_classes=0, global_pool="token"
    ).eval()


def test_checkpoint_round_trip_keeps_the_local_term(tmp_path):
    model = _tiny_vit()
    vca_patch.patch_model(model, VCAConfig(contrast_tokens=4, local_window=3))
    with torch.no_grad():
        for m in patched_modules(model).values():
            m.local_scale.normal_(0.0, 0.5)
    vca_patch.save_pretrained(
        model, tmp_path / "ckpt", model_args={"img_size": 64, "depth": 3, "num_classes": 0, "global_pool": "token"}
    )
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["config"]["local_window"] == 3
    reloaded = vca_patch.from_pretrained(tmp_path / "ckpt")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), model(x), rtol=0, atol=0)


def test_calibrate_fits_the_mix_at_the_least_squares_optimum():
    """Calibration fits the conv, α and β jointly by least squares on the layer's pre-projection rows: moving α or
    β away from the fit, along any direction, raises that error on the calibration batch."""
    images = [torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))]
    model = _tiny_vit()
    vca_patch.patch_model(model, VCAConfig(contrast_tokens=4, local_window=3))
    report = calibrate(model, images, magnitude=False, temperature=False)
    assert "dwc" in report.steps
    captures = capture_original_layers(model, images)
    g = torch.Generator().manual_seed(2)
    for path, module in patched_modules(model).items():
        cap = captures[path]
        P = cap.layout.num_prefix_tokens
        with original_attention(model), torch.no_grad():
            target, _ = _pre_proj(model.get_submodule(path), cap.inputs, None, proj=module.proj)

        def error(module=module, cap=cap, target=target, P=P) -> float:
            with torch.no_grad():
                got, _ = _pre_proj(module, cap.inputs, cap.layout)
            return float((got[:, P:] - target[:, P:]).double().norm())

        fitted = error()
        assert module.local_scale.abs().sum() > 0
        assert not torch.equal(module.global_scale, torch.ones_like(module.global_scale))
        for scale in (module.global_scale, module.local_scale):
            kept = scale.detach().clone()
            for _ in range(3):
                with torch.no_grad():
                    scale.add_(0.1 * kept.norm() / kept.numel() ** 0.5 * torch.randn(kept.shape, generator=g))
                assert error() > fitted
                with torch.no_grad():
                    scale.copy_(kept)
        assert error() == fitted


# --- real weights -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dinov2():
    return load_dinov2_or_skip()


def test_local_window_lifts_real_weight_fidelity(dinov2):
    """The quick real-weights setting (112 px): calibrated on 4 crops of the calibration photos, measured on the
    held-out evaluation photos; the local term raises both CLS and per-patch-token cosine."""
    before, after = quick_cosines(dinov2), quick_cosines(dinov2, local_window=5)
    # Measured (CLS, patch): (0.841, 0.748) -> (0.923, 0.907).
    assert after[0] > before[0] + 0.04, (before, after)
    assert after[1] > before[1] + 0.08, (before, after)


# --- CLI ----------------------------------------------------------------------------------------------------------


def test_convert_builds_the_local_term_and_refuses_a_bad_window(tmp_path):
    from typer.testing import CliRunner

    from vca_patch.cli import app

    runner = CliRunner()
    base = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "64"]
    out = tmp_path / "out"
    options = ["--contrast-tokens", "4", "--local-window", "3", "--device", "cpu", "--probe-size", "1"]
    result = runner.invoke(app, [*base, *options, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["config"]["local_window"] == 3
    reloaded = vca_patch.from_pretrained(out)
    assert {m.local_window for m in reloaded.modules() if isinstance(m, VisualContrastAttention)} == {3}
    for extra, message in ((["--local-window", "4"], "local_window must be 0 (off) or an odd kernel size"),
                           (["--to", "mano", "--local-window", "3"], "--local-window is for --to vca")):  # fmt: skip
        result = runner.invoke(app, [*base, *extra, "-o", str(tmp_path / "bad")])
        assert result.exit_code == 2 and message in result.output, result.output
        assert not (tmp_path / "bad").exists()


def test_joint_image_text_attention_refuses_the_local_term():
    pytest.importorskip("diffusers", reason="diffusers is not installed")
    from tests.support.diffusers_models import tiny_flux

    model = tiny_flux()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(ConfigError, match="joint image \\+ text attention"):
        vca_patch.patch_model(model, VCAConfig(contrast_tokens=4, local_window=3))
    assert get_patch_state(model) is None and not any(isinstance(m, VisualContrastAttention) for m in model.modules())
    assert model.state_dict().keys() == before.keys() and all(
        torch.equal(p, before[name]) for name, p in model.state_dict().items()
    )


@pytest.mark.skipif(not fused_cpu.kernel_available(), reason=f"kernel: {fused_cpu.kernel_status()}")
@pytest.mark.parametrize(("prefix", "grid", "kernel"), [(5, (13, 17), 11), (1, (16, 16), 9), (0, (3, 40), 11)])
def test_fused_op_with_folded_biases_matches_the_float64_loop_reference(prefix, grid, kernel):
    """The op at DINOv2's head size (d = 64) and the kernels users run (9, 11) on grids larger than the window, ragged
    ones included, with q's bias, v's bias and the output gain folded in: against the float64 loop reference."""
    g = torch.Generator().manual_seed(4)
    N, M, d = prefix + grid[0] * grid[1], 2, 64
    q, k, v = (torch.randn(1, M, N, d, generator=g) for _ in range(3))
    q_bias, v_bias, gain = (torch.randn(M * d, generator=g) for _ in range(3))
    scale = d**-0.5
    got = fused_cpu.neighbourhood_cpu(q, k, v, prefix, *grid, kernel, scale, q_bias, v_bias, gain)  # [1, H·W, M·d]
    biased_q = q.double() + q_bias.double().view(1, M, 1, d)
    expected = _loop_reference(biased_q, k, v, prefix, grid, kernel, scale) + v_bias.double().view(1, M, 1, d)
    expected = (expected * gain.double().view(1, M, 1, d)).transpose(1, 2).reshape(1, -1, M * d)
    err = float((got.double() - expected).abs().max() / expected.abs().max())
    assert err < 1e-5, err  # measured ~2e-7
    assert float((0.9 * expected - expected).abs().max() / expected.abs().max()) > 1000 * 1e-5


@pytest.mark.parametrize(("prefix", "grid", "kernel"), [(1, (6, 7), 3), (0, (12, 11), 5), (1, (40, 10), 3)])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_matches_the_float64_loop_reference(prefix, grid, kernel):
    """The CUDA path: FlexAttention with its shape-built block mask, run on the CPU (PyTorch's eager reference of
    flex_attention), against the float64 loop reference."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = _qkv(prefix, grid, seed=5)
    got = neighbourhood.flex_neighbourhood_attention(q, k, v, TokenLayout(prefix, grid), kernel, 0.35)
    torch.testing.assert_close(got, _loop_reference(q, k, v, prefix, grid, kernel, 0.35), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("prefix", "grid", "kernel"), [(1, (40, 10), 3), (5, (37, 37), 11), (0, (9, 30), 7)])
def test_flex_block_mask_visits_every_allowed_pair_and_skips_the_rest(prefix, grid, kernel):
    """The block mask built from the grid's shape holds every (query, key) pair the mask_mod allows, and leaves
    out key blocks out of every query's reach (what makes the Flex kernel linear in the tokens)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    N, block = prefix + grid[0] * grid[1], neighbourhood.FLEX_BLOCK
    mask_mod = neighbourhood.flex_mask_mod(prefix, grid[1], kernel)
    index = torch.arange(N)
    pairs = mask_mod(0, 0, index[:, None], index[None])  # [N, N]
    visited = neighbourhood.flex_block_mask(TokenLayout(prefix, grid), kernel, torch.device("cpu")).to_dense()[0, 0]
    visited = visited.repeat_interleave(block, 0).repeat_interleave(block, 1)[:N, :N].bool()
    assert bool((visited | ~pairs).all()) and int(visited.sum()) < N * N  # all allowed pairs; some blocks skipped
    blocks = -(-N // block)
    dense_blocks = torch.zeros(blocks, blocks, dtype=torch.bool)
    for i in range(blocks):
        for j in range(blocks):
            dense_blocks[i, j] = pairs[i * block : (i + 1) * block, j * block : (j + 1) * block].any()
    ours = neighbourhood.flex_block_mask(TokenLayout(prefix, grid), kernel, torch.device("cpu")).to_dense()[0, 0]
    assert torch.equal(ours.bool(), dense_blocks)  # exactly the blocks holding an allowed pair


def test_flex_is_the_path_on_cuda_only():
    q = torch.zeros(1, 1, 5, 8)
    assert not neighbourhood.flex_usable(q)  # CPU tensors: the fused kernel or SDPA
