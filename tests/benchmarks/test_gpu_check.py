"""benchmarks/gpu_check.py: its CPU dry run covers every section; without CUDA it refuses in one line; the deploy
section's pieces (plan, token counts, step errors, ONNX skip reasons, crossover, the Markdown summary) on their own."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.support.paths import BENCHMARKS

SCRIPT = BENCHMARKS / "gpu_check.py"
SECTIONS = ("bf16_fidelity", "recipe", "profile", "timing", "deploy")
VARIANTS = ("original", "vca", "vca_local11", "mano")


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
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
    proc = _run("--dry-run-cpu", "--in-process", "--sections", ",".join(SECTIONS), "--output", str(out), timeout=420)
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

    _check_deploy(result["sections"]["deploy"])
    # the summary printed at the end is the one --table makes from the JSON
    assert "| vca | compile |" in proc.stdout and "| model | graph breaks |" in proc.stdout
    table = _run("--table", str(out), timeout=60)
    assert table.returncode == 0 and table.stdout.strip() in proc.stdout


def _check_deploy(deploy: dict) -> None:
    assert deploy["errors"] == {} and deploy["variants"] == list(VARIANTS)
    assert {name: entry["graph_breaks"] for name, entry in deploy["graph_breaks"].items()} == dict.fromkeys(VARIANTS, 0)
    sizes = (28, 42, 56)
    assert {px: entry["tokens"] for px, entry in deploy["sizes"].items()} == {"28": 5, "42": 10, "56": 17}
    # the attention each model runs: the original one SDPA call a block, VCA two (both stages), all fused on the CPU
    for px in (28, 56):
        assert deploy["attention"][f"original eager {px}px"]["backends"] == {"flash (CPU)": 2}
        assert deploy["attention"][f"vca eager {px}px"]["backends"] == {"flash (CPU)": 4}
    assert deploy["attention"]["vca compile"]["backends"] == {"flash (CPU)": 4}
    assert all(not entry["math_fallback"] for entry in deploy["attention"].values())

    measured = {(r["variant"], r["mode"], r["px"]) for r in deploy["rows"]}
    eager = {(v, "eager", px) for v in VARIANTS for px in sizes}
    assert measured == eager | {(v, "compile", px) for v in ("original", "vca") for px in sizes}
    for row in deploy["rows"]:
        assert row["median_ms"] >= row["min_ms"] > 0 and row["repeats"] >= 3 and row["first_call_s"] > 0
        # dynamic shapes: one compile at the first size serves the others (no recompile per resolution)
        if row["mode"] == "compile":
            assert (row["compiled_frames"] > 0) == (row["px"] == sizes[0]), row
    assert "cudagraphs: CUDA graphs need a CUDA device" in deploy["skipped"]
    medians = {(r["variant"], r["mode"], r["px"]): r["median_ms"] for r in deploy["rows"]}
    assert len(deploy["ratios"]) == 3 * 3 + 3
    for ratio in deploy["ratios"]:
        key = (ratio["variant"], ratio["mode"], ratio["px"])
        assert ratio["ratio"] == pytest.approx(medians[key] / medians[("original", *key[1:])])
    assert set(deploy["crossover"]) == {"vca eager", "vca_local11 eager", "mano eager", "vca compile"}

    onnx = deploy["onnx"]["vca"]  # the dry run checks the export in onnxruntime's CPU provider
    assert onnx["status"] == "ok" and onnx["provider"] == "CPUExecutionProvider"
    assert [(c["batch"], c["height"], c["width"]) for c in onnx["checks"]] == [(2, 28, 28), (3, 42, 56)]
    assert onnx["max_relative_error"] < 2e-6  # float32 against float32: rounding only (about 2e-7 measured)
    assert onnx["onnx_median_ms"] > 0 and onnx["eager_fp32_median_ms"] > 0


def test_gpu_plan_measures_what_the_issue_asks():
    module = _module()
    plan = module.make_plan(False, None)
    assert plan.device == "cuda" and plan.mixed_precision == "bf16"
    assert list(plan.deploy_px) == [224, 518, 1036, 2048]
    assert all(batch >= 2 for batch in plan.deploy_px.values())  # batch 1 would be specialised: a recompile
    assert plan.deploy_modes == ("eager", "compile", "cudagraphs")
    assert set(plan.deploy_compiled) == set(plan.deploy_onnx) == set(VARIANTS)
    assert plan.onnx_provider == "CUDAExecutionProvider"
    assert sum(module.SHARES[name] for name in module.DEFAULT_SECTIONS) == module.DEFAULT_BUDGET_S < 360


def test_token_counts_follow_the_padded_patch_grid():
    module = _module()
    plan = module.Plan(device="cpu", deploy_depth=1)
    variants, errors = module._deploy_variants(plan)
    variants = dict(variants)
    assert list(variants) == list(VARIANTS) and errors == {}
    original = variants["original"]
    for px in (50, 56):  # 50 px is padded to 56: a 4x4 grid
        with torch.no_grad():
            tokens = original.forward_features(torch.randn(1, 3, px, px)).shape[1]
        assert module._tokens(original, px) == tokens == 17
    assert module._tokens(original, 2048) == 147**2 + 1  # 2048 px: not a multiple of 14, padded to 2058


def test_a_failing_deploy_step_is_recorded_and_the_next_one_runs(tmp_path):
    module = _module()
    deploy = module._Deploy.__new__(module._Deploy)
    deploy.rec = module.Recorder(tmp_path / "result.json", time.monotonic() + 60)
    deploy.rec.data.update(errors={}, skipped=[])
    ran = []

    def fail() -> None:
        raise ValueError("no such kernel")

    deploy.step("vca compile", fail)
    deploy.step("mano compile", lambda: ran.append("mano"))
    deploy.step("original onnx", lambda: ran.append("onnx"), reserve_s=3600)
    assert ran == ["mano"]
    written = json.loads((tmp_path / "result.json").read_text())
    assert written["errors"] == {"vca compile": "ValueError: no such kernel"}
    assert "no such kernel" in written["tracebacks"]["vca compile"]
    assert len(written["skipped"]) == 1 and written["skipped"][0].startswith("original onnx: ")


def test_onnx_is_skipped_with_the_reason_without_onnxruntime_gpu(monkeypatch):
    module = _module()
    plan = module.make_plan(False, None)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    assert module._onnx_session(plan) == (
        None,
        {"status": "skipped", "reason": "onnxruntime-gpu not installed (no onnxruntime at all)"},
    )
    monkeypatch.undo()
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime's CPU build shows the other case")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    session, skipped = module._onnx_session(plan)
    assert session is None and skipped["status"] == "skipped"
    assert skipped["reason"].startswith("onnxruntime-gpu not installed (onnxruntime ")


def test_crossover_is_interpolated_in_log_tokens():
    crossover = _module()._crossover
    assert crossover([(1000, 0.5), (100, 2.0)])["tokens"] == round(100 * 10 ** (2 / 3))  # 464: a third short of 1000
    assert "interpolated in log(tokens) between 100 and 1000" in crossover([(1000, 0.5), (100, 2.0)])["how"]
    assert crossover([(100, 2.0), (1000, 1.1)])["tokens"] is None
    assert "slower at every size" in crossover([(100, 2.0), (1000, 1.1)])["how"]
    assert "faster already" in crossover([(100, 0.9), (1000, 0.5)])["how"]


def test_summary_table_shows_ratios_crossovers_and_facts():
    module = _module()
    rows = [
        {"variant": v, "mode": "eager", "px": px, "tokens": t, "median_ms": ms, "first_call_s": 0.1, "peak_mib": 100.0}
        for v, px, t, ms in [("original", 224, 257, 2.0), ("original", 518, 1370, 4.0),
                             ("vca", 224, 257, 3.0), ("vca", 518, 1370, 2.0)]
    ]  # fmt: skip
    ratios, crossover = module._deploy_ratios(rows)
    assert [r["ratio"] for r in ratios] == [1.5, 0.5]
    section = {
        "variants": ["original", "vca"], "modes": ["eager"], "rows": rows, "ratios": ratios, "crossover": crossover,
        "sizes": {"224": {"batch": 8, "tokens": 257}, "518": {"batch": 2, "tokens": 1370}},
        "graph_breaks": {"original": {"graph_breaks": 0}, "vca": {"graph_breaks": 0}},
        "attention": {"original eager 224px": {"backends": {"cudnn": 2}, "flex_events": 0}},
        "onnx": {"vca": {"status": "skipped", "reason": "onnxruntime-gpu not installed"}},
        "skipped": ["cudagraphs: CUDA graphs need a CUDA device"], "errors": {"mano compile": "RuntimeError: boom"},
    }  # fmt: skip
    table = module.deploy_table(section)
    assert "| original | eager | 2.00 | 4.00 | — |" in table
    # the crossover of 1.5 -> 0.5 lies halfway, in log tokens, between 257 and 1370
    assert f"| vca | eager | 3.00 (1.50×) | 2.00 (0.50×) | ~{round(math.sqrt(257 * 1370))} tokens |" in table
    facts = module.deploy_facts(section)
    assert "| original | 0 | cudnn 2 / — | — | — |" in facts
    assert "| vca | 0 | — / — | — | skipped: onnxruntime-gpu not installed |" in facts
    assert "- failed: mano compile: RuntimeError: boom" in facts and "- skipped: cudagraphs" in facts


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
    for word in (*SECTIONS, "--dry-run-cpu", "--output", "--budget", "--table", "gpu_check.json", "6 minutes"):
        assert word in proc.stdout, word


def test_a_section_past_its_cap_is_killed_and_recorded_as_a_timeout():
    entry = _module().run_section("timing", 1.5, dry_run=True, compile_mode=None)
    assert entry["status"] == "timeout" and "cap" in entry["error"]
    assert entry["seconds"] < 10  # killed, not waited for


def test_unknown_section_is_a_usage_error():
    proc = _run("--dry-run-cpu", "--sections", "timing,warp", timeout=60)
    assert proc.returncode == 2 and "unknown ['warp']" in proc.stderr
