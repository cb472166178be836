"""benchmarks/deploy_latency.py: one run gives, side by side, the converted / original ratios per size and mode and
the local term's share of a layer's time, and writes them to its JSON (tiny sizes, eager only: no compile here)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.support.paths import BENCHMARKS


def _module():
    spec = importlib.util.spec_from_file_location("deploy_latency", BENCHMARKS / "deploy_latency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tiny_run_reports_ratios_and_the_local_share(tmp_path, capsys):
    out = tmp_path / "deploy.json"
    args = ["--sizes", "56", "70", "--grids", "4", "--kernels", "3", "--modes", "eager", "--depth", "1"]
    result = _module().main([*args, "--rounds", "1", "--min-time", "0.01", "--json", str(out)])
    assert json.loads(out.read_text()) == result and result["depth"] == 1
    shown = [(row["size"], row["tokens"], row["mode"]) for row in result["models"]]
    assert shown == [(56, 17, "eager"), (70, 26, "eager")]
    for row in result["models"]:
        seconds = row["seconds"]
        assert set(seconds) == {"original", "vca", "vca_local11"} and min(seconds.values()) > 0
        assert row["ratio"] == {name: seconds[name] / seconds["original"] for name in ("vca", "vca_local11")}
    (layer,) = result["local_term"]
    assert layer["grid"] == [4, 4] and layer["kernel"] == 3
    seconds = layer["seconds"]
    assert layer["local_share"] == pytest.approx((seconds["3"] - seconds["0"]) / seconds["3"])
    # 2·16·(1 + 9)·384 local MACs against 4·17·384² + 8·49·17·384 + 9·16·384 in the layer
    assert layer["local_macs_share"] == pytest.approx(122880 / (122880 + 10027008 + 2558976 + 55296))
    printed = capsys.readouterr().out
    assert "56 px eager" in printed and "4x4 grid k=3" in printed and "its share" in printed


def test_sizes_that_are_not_whole_patches_are_refused(capsys):
    with pytest.raises(SystemExit):
        _module().main(["--sizes", "100"])
    assert "multiples of DINOv2's 14 px patch" in capsys.readouterr().err
