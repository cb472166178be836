"""Calibration options are declared once, by the target (`TargetConfig.calibration_options`, validated by its
handler's `calibration_settings`); the generic driver (`vca_patch.calibrate`) and the CLI read them from the
registered target."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

import vca_patch
from tests.support.models import tiny
from vca_patch.cli import app
from vca_patch.cli.fidelity import calibrated_targets
from vca_patch.core.errors import ConfigError
from vca_patch.layers.carried import CarriedAttention, CarriedAttentionLayer
from vca_patch.layers.layout import TokenLayout
from vca_patch.recovery import calibrate
from vca_patch.recovery.calibrate import CalibrationOptions
from vca_patch.targets.base import CONFIG_TYPES, TargetConfig, register_target
from vca_patch.targets.handler import TargetHandler, handler_for, register_handler, unregister_handler
from vca_patch.targets.vca.calibrate import VCACalibration

TARGET = "test-gain"


class GainAttention(CarriedAttentionLayer):
    """The carried softmax attention times a scalar gain, built at half the original's output."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.tensor(0.5, **self.factory_kwargs))

    def forward_tokens(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        q, k, v = self._qkv_heads(x)
        out = self.norm_and_gate(
            x, self._merge_heads(F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v))
        )
        return self.proj_drop(self.proj(out)) * self.gain


@dataclass(frozen=True)
class GainCalibration:
    """The out-of-tree target's calibration options: a ridge on the gain's least-squares fit."""

    ridge: float = field(default=0.0, metadata={"help": "ridge of the gain fit, relative to ‖output‖²"})

    def __post_init__(self) -> None:
        if self.ridge < 0:
            raise ConfigError(f"ridge must be >= 0, got {self.ridge}")


def _make_target() -> type[TargetConfig]:
    @register_target
    @dataclass
    class GainConfig(TargetConfig):
        target: ClassVar[str] = TARGET
        calibration_options: ClassVar[type] = GainCalibration

    @register_handler(GainConfig)
    class GainHandler(TargetHandler):
        def build_layer(self, config: GainConfig, carried: CarriedAttention, layer_index: int) -> nn.Module:
            layer = GainAttention.from_carried(carried)
            layer.layer_index = layer_index
            return layer

        def calibrates(self, config: GainConfig, layer: nn.Module) -> bool:
            return isinstance(layer, GainAttention)

        def calibrate_layer(
            self, config: GainConfig, layer: nn.Module, capture: Any, teacher: Any, measure: Any, options: Any
        ) -> dict:
            """The gain minimising ‖g·y − o‖² + ridge·‖g·y‖² over the captured outputs o, in closed form."""
            assert isinstance(options, GainCalibration)  # the driver hands over the validated instance
            measure("init")
            with torch.no_grad():
                y = layer(capture.inputs, layout=capture.layout).double()
                o = capture.outputs.double()
                fit = (y * o).sum() / ((1 + options.ridge) * (y * y).sum())
                layer.gain.mul_(fit.to(layer.gain.dtype))
            measure("gain")
            return {"contrast_tokens": 0, "temperature": None}

    return GainConfig


@pytest.fixture
def gain() -> Iterator[type[TargetConfig]]:
    config_cls = _make_target()
    try:
        yield config_cls
    finally:
        CONFIG_TYPES.pop(TARGET, None)
        unregister_handler(config_cls)


def test_vca_declares_its_options_once_with_help_and_validation():
    assert vca_patch.VCAConfig.calibration_options is VCACalibration
    assert vca_patch.MergeConfig.calibration_options is VCACalibration  # the VCA blocks of a plan calibrate as VCA
    assert all(f.metadata["help"] for f in fields(VCACalibration))
    driver = {f.name for f in fields(CalibrationOptions)}
    assert driver == {"grow_tokens", "inputs", "layer"}  # no copy of VCA's fields in the generic driver
    vca = vca_patch.VCAConfig
    assert VCACalibration() == handler_for(vca).calibration_settings(vca, {})
    assert handler_for(vca).calibration_settings(vca, {"norm": "lstsq"}).norm == "lstsq"
    with pytest.raises(ConfigError, match=r"unknown VCA calibration options \['norms'\]; valid: \['dwc'"):
        handler_for(vca).calibration_settings(vca, {"norms": "rms"})
    with pytest.raises(ConfigError, match="norm must be 'rms', 'lstsq' or None"):
        VCACalibration(norm="l2")


def _never_read() -> Iterator[torch.Tensor]:
    raise AssertionError("the options are checked before any batch is read")
    yield torch.zeros(())  # pragma: no cover


def test_bad_options_are_refused_before_any_work():
    model, _ = tiny()
    vca_patch.patch_model(model, vca_patch.VCAConfig(contrast_tokens=4))
    for options, match in (({"norm": "l2"}, "norm must be"), ({"temprature": True}, "unknown VCA calibration")):
        with pytest.raises(ConfigError, match=match):
            calibrate(model, _never_read(), **options)
    mano, _ = tiny()
    vca_patch.patch_model(mano, vca_patch.MANOConfig(window=2))
    with pytest.raises(ConfigError, match=r"MANO layers take no calibration options; drop \['norm'\]"):
        calibrate(mano, _never_read(), norm="rms")


def test_out_of_tree_target_calibrates_through_the_driver_with_its_own_options(gain):
    assert TARGET in calibrated_targets()  # the CLI reads which targets calibrate from the registry
    torch.manual_seed(0)
    model, _ = tiny()
    model = model.double().eval()
    x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
    vca_patch.patch_model(model, gain())
    report = calibrate(model, [x], ridge=0.25)
    # The layer is the original attention at half its output: the ridge fit moves the gain to 1 / (1 + ridge).
    gains = [m.gain.item() for m in model.modules() if isinstance(m, GainAttention)]
    assert len(gains) == 2 and gains == pytest.approx([0.8, 0.8], abs=1e-9)
    assert report.steps == ["init", "gain"]
    assert [layer.errors["init"] for layer in report.layers] == pytest.approx([0.5, 0.5], abs=1e-9)
    assert [layer.errors["gain"] for layer in report.layers] == pytest.approx([0.2, 0.2], abs=1e-9)
    with pytest.raises(ConfigError, match="ridge must be >= 0"):
        calibrate(model, [x], ridge=-1.0)
    calibrate(model, [x])  # default ridge 0: the exact gain, so the model is the original again
    with torch.no_grad():
        assert (model(x) - expected).abs().max() < 1e-10


def test_calibrate_of_a_merge_plan_validates_with_vca_options():
    model, _ = tiny()
    plan = vca_patch.MergeConfig(schedule=[0, 1], vca_layers={0: 4})
    vca_patch.patch_model(model, plan)
    with pytest.raises(ConfigError, match=r"calibration options \['ridge'\]; valid: \['dwc', 'dwc_ridge'"):
        calibrate(model, _never_read(), ridge=0.1)
    report = calibrate(copy.deepcopy(model), [torch.randn(2, 3, 64, 64)], dwc=False)
    assert [layer.layer_index for layer in report.layers] == [0] and "dwc" not in report.steps


def test_convert_refuses_calibration_options_naming_the_calibrating_targets(gain, tmp_path):
    result = CliRunner().invoke(
        app, ["convert", "deit_tiny_patch16_224", "--to", "mano", "--eval-split", "val", "-o", str(tmp_path / "o")]
    )
    assert result.exit_code == 2
    assert f"--eval-split is for --to vca or --to merge or --to {TARGET}, not --to mano" in result.output
