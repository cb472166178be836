"""Calibration that scales with the tokens: the conv fit's normal equations summed over chunks of images equal the
fit on every image's features at once, the teacher comes from the capture's forward, the per-step errors are
measured on the first images (the last step's on all), and `progress` reports each calibrated layer in order."""

from __future__ import annotations

import copy
import importlib

import pytest
import timm
import torch
import torch.nn.functional as F

import vca_patch
import vca_patch.targets.vca.calibrate as vca_calibrate
from vca_patch import VCAConfig
from vca_patch.layers.projection_probe import projection_input
from vca_patch.recovery import CalibrationReport, calibrate
from vca_patch.recovery.capture import LayerCapture, capture_original_layers, original_attention, patched_modules
from vca_patch.targets.vca.neighbourhood import neighbourhood_attention

driver = importlib.import_module("vca_patch.recovery.calibrate")  # the module (the package exports the function)
RIDGE = 1e-3


def _vit(depth: int = 2, **config) -> torch.nn.Module:
    """A small random timm ViT (float64, 4×4 patches and a CLS token) converted to VCA."""
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=64, depth=depth, num_classes=0, global_pool="token"
    )
    model = model.double().eval()
    vca_patch.patch_model(model, VCAConfig(contrast_tokens=4, **config))
    return model


def _images(count: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _captures(model: torch.nn.Module, images: torch.Tensor) -> dict[str, LayerCapture]:
    return capture_original_layers(model, [images], teachers=list(patched_modules(model)))


def _perturb_gain(module: torch.nn.Module) -> None:
    """A non-trivial token gain, so that the fit's row weights are tested too."""
    if getattr(module, "token_gain", None) is not None:
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            module.token_gain.weight.copy_(0.05 * torch.randn(module.token_gain.weight.shape, generator=g))
            module.token_gain.bias.copy_(0.1 * torch.randn(module.token_gain.bias.shape, generator=g))


@torch.no_grad()
def _reference_conv_fit(module: torch.nn.Module, cap: LayerCapture, teacher: torch.Tensor) -> torch.Tensor:
    """The conv fit built the old way, independently: every image's features materialised at once ([C, S, T],
    the taps by `F.unfold`), then one ridge solve per channel. Returns the solution [C, T] (9 taps, bias, and with
    a local term β then α). Leaves the module as `_fit_dwc` starts from (conv 0; α = 1, β = 0)."""
    x, layout = cap.inputs, cap.layout
    B, N, _ = x.shape
    P, (H, W) = layout.num_prefix_tokens, layout.grid
    M, d = module.num_heads, module.head_dim
    C = M * d
    mixed = bool(module.local_window)
    module.dwc.weight.zero_()
    module.dwc.bias.zero_()
    if mixed:
        module.global_scale.fill_(1.0)
        module.local_scale.zero_()
    got, _ = projection_input(module, x, layout)
    q, k, v = module.qkv(x).view(B, N, 3, M, d).permute(2, 0, 3, 1, 4)  # [B, M, N, d] each
    v_grid = v[:, :, P:].permute(0, 1, 3, 2).reshape(B * C, 1, H, W)  # channel m·d + j
    features = [F.unfold(v_grid, 3, padding=1).view(B, C, 9, H * W), torch.ones(B, C, 1, H * W, dtype=x.dtype)]
    if mixed:
        local = neighbourhood_attention(module.q_norm(q), module.k_norm(k), v, layout, module.local_window, d**-0.5)
        features.append(local.permute(0, 1, 3, 2).reshape(B, C, 1, H * W))
    gain = module.token_gain
    if gain is not None:
        weight = gain(x[:, P:]).exp().repeat_interleave(d, dim=-1).transpose(1, 2)  # [B, C, HW]
        features = [f * weight.unsqueeze(2) for f in features]
    if mixed:
        features.append(got[:, P:].transpose(1, 2).unsqueeze(2))
    residual = teacher[:, P:] if mixed else teacher[:, P:] - got[:, P:]  # [B, HW, C]
    A = torch.cat(features, dim=2).permute(1, 0, 3, 2).reshape(C, B * H * W, -1)
    r = residual.permute(2, 0, 1).reshape(C, B * H * W)
    solution = []
    for c in range(C):
        gram = A[c].T @ A[c]
        gram += RIDGE * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
        solution.append(torch.linalg.solve(gram, A[c].T @ r[c]))
    return torch.stack(solution)


def _fitted(module: torch.nn.Module) -> torch.Tensor:
    """The conv fit's solution as the layer holds it: [C, T] in the reference's column order."""
    C = module.dwc.weight.shape[0]
    columns = [module.dwc.weight.view(C, 9), module.dwc.bias.view(C, 1)]
    if module.local_window:
        columns += [module.local_scale.view(C, 1), module.global_scale.view(C, 1)]
    return torch.cat(columns, dim=1)


def _assert_conv_fit_matches_reference(config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _vit(**config)
    captures = _captures(model, _images())
    monkeypatch.setattr(vca_calibrate, "CHUNK_TOKENS", 40)  # 17 tokens an image: chunks of 2, 2 and 1 image
    for path, module in patched_modules(model).items():
        _perturb_gain(module)
        cap = captures[path]
        expected = _reference_conv_fit(copy.deepcopy(module), cap, cap.teacher)
        vca_calibrate._fit_dwc(module, vca_calibrate._layer_data(module, cap, cap.teacher), RIDGE)
        got = _fitted(module).detach()
        error = float((got - expected).norm() / expected.norm())
        assert error < 1e-10, (config, path, error)


@pytest.mark.parametrize(
    "config",
    [{"token_magnitude": False}, {"token_magnitude": True}, {"local_window": 3, "token_magnitude": True}],
    ids=["plain", "gain", "local+gain"],
)
def test_chunked_conv_fit_equals_the_all_at_once_float64_fit(config, monkeypatch):
    _assert_conv_fit_matches_reference(config, monkeypatch)


def test_a_ten_percent_error_in_the_conv_fit_fails_the_comparison(monkeypatch):
    """The comparison above is sharp: a fit whose right-hand side is off by 10% does not pass it."""
    exact = vca_calibrate._dwc_normal_equations

    def off(*args, **kwargs):
        gram, rhs = exact(*args, **kwargs)
        return gram, 1.1 * rhs

    monkeypatch.setattr(vca_calibrate, "_dwc_normal_equations", off)
    with pytest.raises(AssertionError):
        _assert_conv_fit_matches_reference({"local_window": 3, "token_magnitude": True}, monkeypatch)


@torch.no_grad()
def _reference_gain_fit(module: torch.nn.Module, cap: LayerCapture, ridge: float) -> torch.Tensor:
    """The gain fit built the old way: every Stage-II row's regressors [x, 1] at once, one ridge solve ([M, C + 1])."""
    P, M, d = cap.layout.num_prefix_tokens, module.num_heads, module.head_dim
    got, _ = projection_input(module, cap.inputs, cap.layout)
    ratio = cap.teacher[:, P:].reshape(-1, M, d).norm(dim=-1) / got[:, P:].reshape(-1, M, d).norm(dim=-1)
    x = cap.inputs[:, P:].reshape(-1, cap.inputs.shape[-1])
    X = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    gram = X.T @ X
    gram += ridge * gram.diagonal()[:-1].mean() * torch.eye(len(gram), dtype=gram.dtype)
    return torch.linalg.solve(gram, X.T @ ratio.log()).T


def test_chunked_gain_and_norm_fits_equal_the_all_at_once_float64_fits(monkeypatch):
    model = _vit(token_magnitude=True)
    captures = _captures(model, _images())
    monkeypatch.setattr(vca_calibrate, "CHUNK_TOKENS", 40)
    for path, module in patched_modules(model).items():
        _perturb_gain(module)
        cap = captures[path]
        data = vca_calibrate._layer_data(module, cap, cap.teacher)
        expected = _reference_gain_fit(module, cap, 0.1)
        before = torch.cat([module.token_gain.weight, module.token_gain.bias[:, None]], dim=1).detach().clone()
        vca_calibrate._fit_magnitude(module, data, 0.1, vca_calibrate._gain_gram(module, data))
        after = torch.cat([module.token_gain.weight, module.token_gain.bias[:, None]], dim=1).detach()
        assert float((after - before - expected).norm() / expected.norm()) < 1e-10
        with torch.no_grad():
            got, _ = projection_input(module, cap.inputs, cap.layout)
        P, M, d = cap.layout.num_prefix_tokens, module.num_heads, module.head_dim
        rms = cap.teacher[:, P:].reshape(-1, M, d).pow(2).sum((0, 1)) / got[:, P:].reshape(-1, M, d).pow(2).sum((0, 1))
        expected = module.stage2_norm.weight.detach() * rms.sqrt()
        vca_calibrate._fit_norm(module, data, "rms")
        torch.testing.assert_close(module.stage2_norm.weight.detach(), expected, rtol=1e-12, atol=0)


def test_the_capture_records_each_layers_teacher_in_its_forward():
    model = _vit()
    images = _images(3)
    recorded = _captures(model, images)
    plain = capture_original_layers(model, [images])
    for path, module in patched_modules(model).items():
        cap = recorded[path]
        assert plain[path].teacher is None  # only where asked for
        with original_attention(model):
            teacher, _ = projection_input(model.get_submodule(path), cap.inputs, None, proj=module.proj)
        torch.testing.assert_close(cap.teacher, teacher, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cap.outputs, plain[path].outputs, rtol=0, atol=0)


def test_progress_is_called_once_per_calibrated_layer_in_order():
    model = _vit(depth=3)
    calls: list[tuple[int, int, str]] = []
    report = calibrate(model, [_images(2)], progress=lambda *args: calls.append(args))
    paths = list(patched_modules(model))
    assert calls == [(i, 3, path) for i, path in enumerate(paths, 1)]
    assert [layer.path for layer in report.layers] == paths


def test_a_grow_tokens_pass_reports_its_rebuilt_layers_anew():
    model = _vit(depth=2)
    calls: list[tuple[int, int, str]] = []
    report = calibrate(model, [_images(2)], grow_tokens=0.0, progress=lambda *args: calls.append(args))
    paths = list(patched_modules(model))
    assert report.grown == {0: 16, 1: 16}
    assert calls == [(1, 2, paths[0]), (2, 2, paths[1]), (1, 2, paths[0]), (2, 2, paths[1])]


def _calibrated(measure_tokens: int, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, CalibrationReport]:
    monkeypatch.setattr(driver, "MEASURE_TOKENS", measure_tokens)
    model = _vit(token_magnitude=True)
    return model, calibrate(model, [_images(6)], neg_noise=0.0)


def test_steps_are_measured_on_the_first_images_and_the_last_step_on_all(monkeypatch):
    """Measuring on fewer images changes neither the fit nor the last step's error (measured on all images);
    the earlier steps' errors are those of the first images."""
    whole, full = _calibrated(10_000, monkeypatch)
    cheap, part = _calibrated(40, monkeypatch)  # 17 tokens an image: the first 2 of 6 images
    for (name, a), (_, b) in zip(whole.state_dict().items(), cheap.state_dict().items(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    assert full.steps == part.steps and full.steps[-1] == "refit"
    for a, b in zip(full.layers, part.layers, strict=True):
        assert b.errors["refit"] == pytest.approx(a.errors["refit"], rel=1e-12)
        assert b.errors["init"] != pytest.approx(a.errors["init"], rel=1e-6)
    init = _vit(token_magnitude=True)
    captures = _captures(init, _images(6))
    for layer, (path, module) in zip(part.layers, patched_modules(init).items(), strict=True):
        first = driver._first_images(captures[path], 40)
        assert first.inputs.shape[0] == 2
        with torch.no_grad():
            assert layer.errors["init"] == pytest.approx(driver._layer_error(module, first), rel=1e-12)


def test_the_temperature_search_scores_the_first_images(monkeypatch):
    """With a search budget of two images, the chosen temperatures are those a search on those images alone picks."""
    monkeypatch.setattr(vca_calibrate, "SEARCH_TOKENS", 40)
    model = _vit()
    captures = _captures(model, _images(6))
    candidates = (0.5, 1.0, 2.0)
    for path, module in patched_modules(model).items():
        cap = captures[path]
        alone = copy.deepcopy(module)
        data = vca_calibrate._layer_data(module, cap, cap.teacher)
        first = vca_calibrate._layer_data(alone, _first_two(cap), cap.teacher[:2])
        chosen = vca_calibrate._search_temperature(module, data, candidates)
        assert chosen == vca_calibrate._search_temperature(alone, first, candidates)


def _first_two(cap: LayerCapture) -> LayerCapture:
    return LayerCapture(cap.inputs[:2], cap.outputs[:2], cap.layout, cap.teacher[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fused kernel", "composite"])
@pytest.mark.parametrize("config", [{"token_magnitude": True}, {"local_window": 3, "token_magnitude": True}])
def test_the_fits_replay_the_layer_from_cached_projections_as_its_forward_computes_it(dtype, config):
    """The fits run the layer from q, k, v computed once per layer: what they read is the layer's own input to its
    output projection (the forward's, hooked), on every image and on a slice of them."""
    model = _vit(**config).to(dtype)
    captures = capture_original_layers(model, [_images(3).to(dtype)], teachers=list(patched_modules(model)))
    for path, module in patched_modules(model).items():
        _perturb_gain(module)
        with torch.no_grad():
            module.dwc.weight.normal_(0.0, 0.1)
        cap = captures[path]
        data = vca_calibrate._layer_data(module, cap, cap.teacher)
        assert data.qkv is not None and vca_calibrate._replays(module)
        for part in (data, data.images(slice(1, 3))):
            with torch.no_grad():
                expected, _ = projection_input(module, part.x, part.layout)
                got = vca_calibrate._projection_input(module, part)
            tolerance = 1e-5 if dtype == torch.float32 else 1e-12
            torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_the_cli_callback_shows_each_pass(capsys):
    """Piped, the CLI's callback prints the total and each pass's last count (rich draws a bar on a terminal)."""
    from vca_patch.cli.fidelity import LayerProgress

    progress = LayerProgress(3)
    progress.start()
    for done in (1, 2, 3):
        progress(done, 3, f"blocks.{done - 1}.attn")
    for done in (1, 2):
        progress(done, 2, f"blocks.{done - 1}.attn")
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "Fitting 3 layers in closed form: 0/3 layers"
    assert lines[-1].startswith("Fitting 2 rebuilt layers again: 2/2 layers")
    assert any(line.startswith("Fitting 3 layers in closed form: 3/3 layers") for line in lines)
    unstarted = LayerProgress(2)  # called before `start`: the first pass opens its bar
    unstarted(1, 2, "blocks.0.attn")
    unstarted(2, 2, "blocks.1.attn")
    unstarted.close()
    assert capsys.readouterr().err.splitlines()[0] == "Fitting 2 layers in closed form: 0/2 layers"
