"""benchmarks/recovery_step.py: its quick run on random weights times both precisions and the attention alone."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "recovery_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("recovery_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_times_both_precisions_side_by_side(bench, tmp_path, capsys):
    result = bench.main(["--quick", "--random", "--repeats", "1", "--results", str(tmp_path)])
    saved = json.loads((tmp_path / "recovery_step_quick.json").read_text())
    assert saved["step_seconds"] == result["step_seconds"]
    step = result["step_seconds"]
    assert set(step) == {"float32", "bf16 autocast"} and min(step.values()) > 0
    assert result["step_speedup_bf16"] == pytest.approx(step["float32"] / step["bf16 autocast"])
    assert len(result["attention_seconds"]) == 3
    for times in result["attention_seconds"].values():
        assert set(times) == {"PyTorch SDPA in bf16", "float32 SDPA (ours)"} and min(times.values()) > 0
    assert "runs a step" in capsys.readouterr().out


def test_stolen_share(bench):
    assert bench.stolen_share((10, 100), (20, 300)) == pytest.approx(0.05)
    assert bench.stolen_share(None, (20, 300)) is None and bench.stolen_share((1, 5), (1, 5)) is None
