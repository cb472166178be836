"""benchmarks/gpu_check.py: its CPU dry run covers every section; without CUDA it refuses in one line."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.support.paths import BENCHMARKS

SCRIPT = BENCHMARKS / "gpu_check.py"
SECTIONS = ("bf16_fidelity", "recipe", "profile", "timing", "deploy")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
def test_dry_run_cpu_runs_every_section_and_writes_their_numbers(tmp_path):
    out = tmp_path / "check.json"
    proc = _run("--dry-run-cpu", "--in-process", "--output", str(out), timeout=600)  # ~25 s alone
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] is True and result["meta"]["dry_run_cpu"] is True
    assert list(result["sections"]) == list(SECTIONS)
    for name, section in result["sections"].items():
        assert section["status"] == "ok", (name, section.get("error"))
        assert 0 < section["seconds"] <= section["cap_s"]

    fid = result["sections"]["bf16_fidelity"]
    for model in ("vca", "softmax"):
        rows = fid[model]
        assert rows["float32"]["output_relative_error"] < 1e-5  # float32 against float64: rounding only
        for mode in ("autocast_bf16", "bf16_weights"):
            errors = [rows[mode]["output_relative_error"], *rows[mode]["layer_relative_error"]]
            assert len(rows[mode]["layer_relative_error"]) == len(fid["layers"]) == 2
            # bf16 rounding is really there (2^-8 per element), and bounded
            assert all(math.isfinite(e) and 1e-4 < e < fid["tolerance"] for e in errors), (model, mode, errors)
    assert fid["passed"] is True

    recipe = result["sections"]["recipe"]
    assert recipe["recipe_status"] == "completed" and recipe["losses_finite"] is True
    assert recipe["losses"]["transfer"] and recipe["losses"]["distill"]
    assert recipe["after"]["mean_layer_error"] < recipe["before"]["mean_layer_error"]  # calibration + transfer help
    assert recipe["images_per_s"] > 0

    prof = result["sections"]["profile"]
    for key in ("vca@64", "original@64"):
        assert prof[key]["top"] and all(e["self_time_us"] > 0 and e["calls"] >= 1 for e in prof[key]["top"])
        assert prof[key]["total_self_time_us"] >= sum(e["self_time_us"] for e in prof[key]["top"])
    assert any("scaled_dot_product" in e["name"] for e in prof["original@64"]["top"] + prof["vca@64"]["top"])

    timing = result["sections"]["timing"]
    assert [row["px"] for row in timing["results"]] == [48, 64] and not timing["skipped"]
    for row in timing["results"]:
        for variant in ("original_sdpa", "vca_eager", "vca_compile"):
            assert row[variant]["median_ms"] > 0 and row[variant]["images_per_s"] > 0
        assert row["vca_eager_over_original"] == pytest.approx(
            row["vca_eager"]["median_ms"] / row["original_sdpa"]["median_ms"]
        )

    deploy = result["sections"]["deploy"]
    assert deploy["graph_breaks"] == {"original": 0, "vca": 0, "vca_local11": 0, "mano": 0}
    assert any("scaled_dot_product" in k for k in deploy["attention_kernels"]["original"])
    measured = {(r["variant"], r["mode"], r["px"]) for r in deploy["rows"]}
    eager = {(v, "eager", px) for v in ("original", "vca", "vca_local11", "mano") for px in (28, 42)}
    assert measured == eager | {(v, "compile", px) for v in ("original", "vca") for px in (28, 42)}
    assert "cudagraphs: CUDA graphs need a CUDA device" in deploy["skipped"]
    medians = {(r["variant"], r["mode"], r["px"]): r["median_ms"] for r in deploy["rows"]}
    for ratio in deploy["ratios"]:
        key = (ratio["variant"], ratio["mode"], ratio["px"])
        assert ratio["ratio"] == pytest.approx(medians[key] / medians[("original", *key[1:])])
    assert set(deploy["crossover"]) == {"vca eager", "vca_local11 eager", "mano eager", "vca compile"}
    assert deploy["onnx_gpu"]["status"] == "skipped" and deploy["onnx_gpu"]["reason"]
    assert "| vca | compile |" in proc.stdout  # the summary table


def test_crossover_is_interpolated_in_log_tokens():
    crossover = _module()._crossover
    assert crossover([(1000, 0.5), (100, 2.0)])["tokens"] == round(100 * 10 ** (2 / 3))  # 464: a third short of 1000
    assert crossover([(100, 2.0), (1000, 1.1)])["tokens"] is None
    assert "slower at every size" in crossover([(100, 2.0), (1000, 1.1)])["how"]
    assert "faster already" in crossover([(100, 0.9), (1000, 0.5)])["how"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_cuda_it_refuses_in_one_line(tmp_path):
    out = tmp_path / "never.json"
    proc = _run("--output", str(out), timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: needs a CUDA GPU; found none"), proc.stderr
    assert "--dry-run-cpu" in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists()


def test_help_documents_the_sections_and_options():
    proc = _run("--help", timeout=60)
    assert proc.returncode == 0
    for word in (*SECTIONS, "--dry-run-cpu", "--output", "--budget", "gpu_check.json", "6 minutes"):
        assert word in proc.stdout, word


def test_a_section_past_its_cap_is_killed_and_recorded_as_a_timeout():
    entry = _module().run_section("timing", 1.5, dry_run=True, compile_mode=None)
    assert entry["status"] == "timeout" and "cap" in entry["error"]
    assert entry["seconds"] < 10  # killed, not waited for


def test_unknown_section_is_a_usage_error():
    proc = _run("--dry-run-cpu", "--sections", "timing,warp", timeout=60)
    assert proc.returncode == 2 and "unknown ['warp']" in proc.stderr
