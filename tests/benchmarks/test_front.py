"""benchmarks/front.py: one quick run measures every documented row and the planner side by side, with the
attention-free floor from the FLOP model and the machine's load, and writes its JSON, table and plot."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.support.paths import BENCHMARKS

pytestmark = pytest.mark.e2e


def _module():
    spec = importlib.util.spec_from_file_location("front", BENCHMARKS / "front.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_a_quick_front_measures_every_row(tmp_path):
    result = _module().main(["--quick", "--results", str(tmp_path)])
    assert json.loads((tmp_path / "front_quick.json").read_text()) == json.loads(json.dumps(result))
    assert (tmp_path / "front_quick.png").stat().st_size > 0
    size = result["sizes"]["56"]
    rows = size["rows"]
    fixed = [name for name in rows if not name.startswith("planner")]
    assert len(fixed) == 8 and {"VCA defaults", "merging r = N/12", "MANO k = 7"} <= set(fixed)
    for name in fixed:
        row = rows[name]
        assert row["latency_ratio"] > 0 and -1 <= row["patch_token_cosine"] <= 1 and -1 <= row["cls_cosine"] <= 1
    # a 4-block ViT, width 64, 17 tokens: 12·d² MACs per token in the Linears, 2·N²·d in attention, per block
    linear, attention = 17 * 12 * 64**2, 2 * 17**2 * 64
    assert size["floor"] == pytest.approx(linear / (linear + attention))
    assert len(size["load_average"]["before"]) == 3
    (planner,) = [rows[name] for name in rows if name.startswith("planner")]
    assert planner["budget"] == 0.9 and ("error" in planner or "latency_ratio" in planner)
    table = (tmp_path / "front_quick.md").read_text()
    assert all(name in table for name in fixed) and "attention-free floor 0.96x" in table


def test_chosen_rows_recovered_at_another_size_and_resumed_from_the_cache(tmp_path):
    """`--rows` keeps the named rows; `--recover-size` trains the recovery at a smaller size than the run's (the
    position table resampled for training, the run size's kept) and the cache lets a second run skip it."""
    argv = ["--quick", "--rows", "VCA local 7 + calibrate", "--budgets", "--recover-steps", "2",
            "--recover-size", "28", "--cache", str(tmp_path / "cache"), "--results", str(tmp_path)]  # fmt: skip
    first = _module().main(argv)["sizes"]["56"]["rows"]
    assert set(first) == {"VCA local 7 + calibrate", "VCA local 7 + calibrate + recovery"}
    recovery = first["VCA local 7 + calibrate + recovery"]["recovery"]
    assert recovery["steps"] == 2 and recovery["train_size"] == 28
    assert first["VCA local 7 + calibrate + recovery"]["cls_cosine"] != first["VCA local 7 + calibrate"]["cls_cosine"]
    again = _module().main(argv)["sizes"]["56"]["rows"]
    assert again["VCA local 7 + calibrate + recovery"]["recovery"] == recovery  # from the cache, not trained again


def test_replot_lays_later_runs_rows_over_the_first(tmp_path):
    def run(name: str, sizes: dict) -> object:
        path = tmp_path / name
        path.write_text(json.dumps({"sizes": sizes}))
        return path

    def size(rows: dict) -> dict:
        load = {"before": [1.0, 1.0, 1.0], "after": [1.0, 1.0, 1.0]}
        return {"tokens": 17, "original_ms": 1.0, "held_out_images": 2, "load_average": load, "floor": 0.5,
                "rows": rows}  # fmt: skip

    def row(kind: str, ratio: float) -> dict:
        return {"kind": kind, "latency_ratio": ratio, "cls_cosine": 0.9, "patch_token_cosine": 0.8}

    full = run("full.json", {"56": size({"merging": row("merge", 0.6), "planner 0.5x": row("plan", 0.55)})})
    apart = run("apart.json", {"56": size({"planner 0.5x": row("plan", 0.45)}), "112": size({"x": row("vca", 1)})})
    merged = _module().main(["--replot", str(full), str(apart), "--results", str(tmp_path)])
    assert merged["sizes"]["56"]["rows"]["planner 0.5x"]["latency_ratio"] == 0.45  # the later run's row
    assert merged["sizes"]["56"]["rows"]["merging"]["latency_ratio"] == 0.6 and set(merged["sizes"]) == {"56", "112"}
    assert (tmp_path / "front.png").stat().st_size > 0
