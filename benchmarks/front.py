"""The speed-fidelity front of a real DINOv2 ViT-S/14: every documented conversion at each resolution, measured.

    python benchmarks/front.py                          # 224, 518 and 1036 px, 48 held-out images each
    python benchmarks/front.py --sizes 518 --recover-steps 60   # + the VCA rows after recovery
    python benchmarks/front.py --sizes 1036 --budgets --rows "VCA local 7 + calibrate" --recover-steps 150
    python benchmarks/front.py --quick                  # seconds: a tiny random-weight ViT (tests)
    python benchmarks/front.py --replot results/front.json results/front_518_planner.json   # one plot of runs

For each resolution, on one machine and in one process:

* rows: VCA's defaults (training-free, and calibrated), VCA with the 7x7 local term, the README's faithful setting
  (11x11 local term, blocks 6 and 8 kept softmax), token merging at r = N/24, N/16 and N/12 per block (N the patch
  tokens; residual unmerge), MANO (k = 7, training-free), and the planner's choice at each budget (`--budgets`,
  planned on the calibration crops only); with `--recover-steps S`, every row with calibrated VCA blocks also
  after S steps of `recipes/dinov2_small.yaml` (feature distillation) on unlabelled training photos;
* fidelity: CLS and per-patch-token cosine of the final tokens to the original's, on held-out images (the 10
  evaluation photos whole plus random crops of them: 48 by default) whose source photos no calibration, planning
  or training image shares;
* latency: batch-1 CPU latency ÷ the original's, every model timed interleaved in rounds in this one process, with
  the machine's load average before and after;
* the floor: the latency ratio no attention replacement can go below (attention free, every linear layer kept),
  from the FLOP model.

No setting here was chosen on the held-out images: the rows are the documented settings, the planner sees only the
calibration crops. Writes RESULTS/front[_quick].json, .md and .png.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dinov2_weights.measure import fidelity, latency, tokens
from torch import nn

import vca_patch
from vca_patch.core.atomic import atomic_write_text
from vca_patch.planner import PlanError, model_info, plan_model
from vca_patch.planner.costs import plan_macs
from vca_patch.recovery import calibrate
from vca_patch.surgery import patch_model
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.mano.config import MANOConfig
from vca_patch.targets.merge import MergeConfig
from vca_patch.targets.vca.config import VCAConfig

RESULTS = Path(__file__).parent / "results"
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "dinov2_small.yaml"
FULL = {"sizes": [224, 518, 1036], "calibration": 16, "plan_images": 8, "eval_crops": 38, "repeats": 3,
        "min_time": 2.0, "budgets": [0.8, 0.6, 0.45, 0.35, 0.25]}  # fmt: skip
QUICK = {"sizes": [56], "calibration": 4, "plan_images": 4, "eval_crops": 0, "repeats": 1, "min_time": 0.0,
         "budgets": [0.9]}  # fmt: skip
MERGE_DIVISORS = (24, 16, 12)  # r = patch tokens / d per block


@dataclass(frozen=True)
class Row:
    """One conversion: its config for a model at a resolution, whether its VCA blocks are calibrated."""

    name: str
    kind: str  # "vca", "merge", "mano" or "plan": the plot's series
    config: Callable[[int, int], TargetConfig]  # (patch tokens, depth) -> config
    calibrated: bool


def fixed_rows() -> list[Row]:
    """The documented settings (none chosen on the held-out images)."""
    rows = [
        Row("VCA defaults", "vca", lambda n, d: VCAConfig(), False),
        Row("VCA defaults + calibrate", "vca", lambda n, d: VCAConfig(), True),
        Row("VCA local 7 + calibrate", "vca", lambda n, d: VCAConfig(local_window=7), True),
        Row("VCA local 11, blocks 6, 8 softmax + calibrate", "vca",
            lambda n, d: VCAConfig(local_window=11, layers=[b for b in range(d) if b not in (6, 8)]), True),
    ]  # fmt: skip
    for divisor in MERGE_DIVISORS:
        merging = lambda n, d, k=divisor: MergeConfig(r=max(1, round(n / k)), unmerge="residual")  # noqa: E731
        rows.append(Row(f"merging r = N/{divisor}", "merge", merging, False))
    rows.append(Row("MANO k = 7", "mano", lambda n, d: MANOConfig(window=7), False))
    return rows


def load_inputs(size: int, settings: dict, quick: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(model, calibration crops, held-out images) at `size` px: the real DINOv2 and its two disjoint photo sets,
    or (quick) a tiny random-weight ViT of the same family and random images."""
    if quick:
        import timm

        torch.manual_seed(0)
        model = timm.create_model(
            "vit_small_patch14_dinov2", pretrained=False, img_size=size, depth=4, embed_dim=64, num_heads=4,
            init_values=0.5, num_classes=0,
        ).eval()  # fmt: skip
        return model, torch.randn(settings["calibration"], 3, size, size), torch.randn(3, 3, size, size)
    from dinov2_weights import load_dinov2_small
    from dinov2_weights.photos import calibration_images, evaluation_images

    model = load_dinov2_small("timm", img_size=size)
    return model, calibration_images(settings["calibration"], size), evaluation_images(size, settings["eval_crops"])


def attention_floor(model: nn.Module, size: int) -> float:
    """The latency ratio with attention free (the FLOP model's linear layers alone over the whole model's)."""
    info = model_info(model)
    linear = info.depth * info.tokens(size) * info.linear_macs_per_token
    return linear / plan_macs(info, size, [], {})


def converted(model: nn.Module, row: Row, calib: torch.Tensor, cache: Cache) -> nn.Module:
    """A converted copy of `model` for `row` (calibrated on `calib` when the row says so; its weights from the
    cache when a run before calibrated it)."""
    info = model_info(model)
    twin = copy.deepcopy(model)
    patch_model(twin, row.config(info.tokens(calib.shape[-1]) - info.num_prefix_tokens, info.depth))
    if row.calibrated and not cache.load_weights(row.name, twin):
        calibrate(twin, [calib])
        cache.save_weights(row.name, twin)
    return twin


@dataclass(frozen=True)
class Cache:
    """What a run at one size keeps in `folder` (none when None), so that a run stopped part-way starts again
    where it was: each calibrated model's weights, each planner choice, each row's fidelity. Delete the folder
    when the code or the images change."""

    folder: Path | None
    size: int

    def _path(self, name: str, suffix: str) -> Path | None:
        slug = "".join(c if c.isalnum() else "_" for c in name)
        return None if self.folder is None else self.folder / f"{self.size}_{slug}{suffix}"

    def load_weights(self, name: str, model: nn.Module) -> bool:
        path = self._path(name, ".pt")
        if path is None or not path.is_file():
            return False
        model.load_state_dict(torch.load(path, weights_only=True))
        return True

    def save_weights(self, name: str, model: nn.Module) -> None:
        if (path := self._path(name, ".pt")) is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), path)

    def load_json(self, name: str) -> dict | None:
        path = self._path(name, ".json")
        return json.loads(path.read_text()) if path is not None and path.is_file() else None

    def save_json(self, name: str, data: dict) -> None:
        if (path := self._path(name, ".json")) is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(data) + "\n")


def planned(
    model: nn.Module, calib: torch.Tensor, settings: dict, log: Callable[[str], None], cache: Cache
) -> dict[str, Any]:
    """{row name: (model, record)} of the planner's choice at each budget, planned on the calibration crops only."""
    from vca_patch.planner.planner import apply_plan

    size = calib.shape[-1]
    out: dict[str, Any] = {}
    for budget in settings["budgets"]:
        name = f"planner {budget:g}x"
        if (record := cache.load_json(name)) is not None:  # planned by a run before
            twin = None
            if "config" in record:
                twin = apply_plan(copy.deepcopy(model), TargetConfig.from_dict(record["config"]))
                cache.load_weights(name, twin)
            out[name] = (twin, {k: v for k, v in record.items() if k != "config"})
            continue
        started = time.perf_counter()
        try:
            result = plan_model(
                model, calib[: settings["plan_images"]], budget=budget, resolution=size, measure=False,
                repeats=settings["repeats"], min_time=settings["min_time"] / 4, log=log,
            )  # fmt: skip
        except PlanError as error:
            log(f"  planner at {budget:g}x: {error}")
            out[name] = (None, {"kind": "plan", "budget": budget, "error": str(error)})
            cache.save_json(name, out[name][1])
            continue
        twin = apply_plan(copy.deepcopy(model), result.config, calib if result.chosen.vca_layers else None)
        record = {"kind": "plan", "budget": budget, "plan": result.chosen.describe(),
                  "predicted_latency_ratio": result.chosen.latency, "seconds": time.perf_counter() - started,
                  "calibrated": bool(result.chosen.vca_layers)}  # fmt: skip
        out[name] = (twin, record)
        cache.save_weights(name, twin)
        cache.save_json(name, record | {"config": result.config.to_dict()})
    return out


def recovered(
    twin: nn.Module,
    original: nn.Module,
    steps: int,
    size: int,
    output: Path,
    log: Callable[[str], None],
    recipe_path: Path = RECIPE,
    photos: dict[str, torch.Tensor] | None = None,
    checkpoint_every: int | None = None,
) -> tuple[nn.Module, dict]:
    """A copy of `twin` after `steps` steps of the recovery recipe on fresh crops of unlabelled training photos (the
    calibration photos and the Debian photo packages, or `photos`; never an evaluation photo) at `size` px;
    `checkpoint_every`: every so many steps a checkpoint is kept under `output` (`train.checkpoints`)."""
    from dataclasses import replace

    from dinov2_weights.photo_packages import package_photos
    from dinov2_weights.photos import CALIBRATION_PHOTOS, PhotoCrops, load_photos

    from vca_patch.train.engine import make_accelerator, run_recipe
    from vca_patch.train.recipe import load_recipe

    photos = photos if photos is not None else load_photos(CALIBRATION_PHOTOS) | package_photos()
    recipe = load_recipe(recipe_path)
    (stage,) = [s for s in recipe.stages if s.kind != "calibrate"]
    recipe = replace(recipe, stages=[replace(stage, steps=steps, warmup_steps=min(stage.warmup_steps, steps // 4))])
    if checkpoint_every is not None:
        train = replace(recipe.train, checkpoint_every=checkpoint_every, keep_checkpoints=steps // checkpoint_every)
        recipe = replace(recipe, train=train)
    crops = PhotoCrops(photos, size, steps * recipe.train.batch_size, seed=2)
    started = time.perf_counter()
    log(f"  recovering: {steps} steps of {recipe.train.batch_size} crops of {len(photos)} photos at {size} px")
    student, teacher = _at_size(copy.deepcopy(twin), size), _at_size(copy.deepcopy(original), size)
    result = run_recipe(student, teacher, recipe, output, train_set=crops,
                        accelerator=make_accelerator(recipe.train.mixed_precision, device="cpu"))  # fmt: skip
    trained = copy.deepcopy(twin)
    kept = {k: v for k, v in result.model.cpu().state_dict().items() if k != "pos_embed"}
    trained.load_state_dict(kept, strict=False)  # the position table stays the run size's (frozen in training)
    return trained.eval(), {"steps": steps, "train_size": size, "photos": len(photos),
                            "seconds": time.perf_counter() - started}  # fmt: skip


def _at_size(model: nn.Module, size: int) -> nn.Module:
    """`model` (a timm ViT) taking `size` px inputs: its position table resampled where the size differs."""
    if model.patch_embed.img_size != (size, size):
        model.set_input_size(img_size=(size, size))
    return model


def run_size(size: int, settings: dict, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """Every row at `size` px: built, measured on the held-out images, timed side by side with the original."""
    model, calib, held = load_inputs(size, settings, quick)
    cache = Cache(settings.get("cache"), size)
    models: dict[str, nn.Module] = {"original": model}
    records: dict[str, dict] = {}
    for row in [r for r in fixed_rows() if settings.get("rows") is None or r.name in settings["rows"]]:
        log(f"  {row.name}")
        models[row.name] = converted(model, row, calib, cache)
        records[row.name] = {"kind": row.kind, "calibrated": row.calibrated}
    for name, (twin, record) in planned(model, calib, settings, log, cache).items():
        records[name] = record
        if twin is not None:
            models[name] = twin
    if settings["recover_steps"]:
        steps, train_size = settings["recover_steps"], settings["recover_size"] or size
        _add_recovered(model, models, records, steps, train_size, log, cache)
    reference = None
    for name, record in records.items():
        if name not in models:
            continue
        scores = cache.load_json(f"fidelity {name}")
        if scores is None:
            log(f"  fidelity: {name}")
            reference = tokens(model, held, 4) if reference is None else reference
            scores = fidelity(reference, tokens(models[name], held, 4))
            cache.save_json(f"fidelity {name}", scores)
        record.update(scores)
    load_before = os.getloadavg()
    timed = latency(models, (size,), settings["repeats"], log=log, min_time=settings["min_time"])
    for name in records:
        if name in models:
            records[name]["latency_ratio"] = timed[name][size]["ratio"]
    info = model_info(model)
    return {"tokens": info.tokens(size), "held_out_images": len(held), "calibration_images": len(calib),
            "original_ms": timed["original"][size]["ms"], "floor": attention_floor(model, size),
            "load_average": {"before": load_before, "after": os.getloadavg()}, "rows": records}  # fmt: skip


def _add_recovered(
    model: nn.Module, models: dict, records: dict, steps: int, size: int, log: Callable, cache: Cache
) -> None:
    """Each row with calibrated VCA blocks, recovered too (`steps` steps trained at `size` px; kept in `cache`)."""
    import tempfile

    for name in [n for n, r in records.items() if r.get("calibrated") and n in models]:
        new = f"{name} + recovery"
        twin, record = copy.deepcopy(models[name]), cache.load_json(new)
        if record is None or not cache.load_weights(new, twin):
            with tempfile.TemporaryDirectory() as folder:
                twin, record = recovered(models[name], model, steps, size, Path(folder), log)
            cache.save_weights(new, twin)
            cache.save_json(new, record)
        models[new] = twin
        records[new] = {**records[name], "recovery": record}


def markdown(results: dict) -> str:
    """One table per resolution, fastest first."""
    lines = []
    for size, result in results["sizes"].items():
        load = result["load_average"]
        lines += [
            f"\n**{size} px** ({result['tokens']} tokens; original {result['original_ms']:.0f} ms at batch 1; "
            f"{result['held_out_images']} held-out images; load average {load['before'][0]:.2f} before timing, "
            f"{load['after'][0]:.2f} after; attention-free floor {result['floor']:.2f}x)\n",
            "| conversion | latency ÷ original | CLS cosine | patch-token cosine |",
            "|---|---:|---:|---:|",
        ]
        done = {n: r for n, r in result["rows"].items() if "latency_ratio" in r}
        for name, row in sorted(done.items(), key=lambda kv: kv[1]["latency_ratio"]):
            label = f"{name}: {row['plan']}" if "plan" in row else name
            lines.append(f"| {label} | {row['latency_ratio']:.2f} | {row['cls_cosine']:.3f} | "
                         f"{row['patch_token_cosine']:.3f} |")  # fmt: skip
        for name, row in result["rows"].items():
            if "error" in row:
                lines.append(f"| {name} | — | — | — |\n\n{name}: {row['error']}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Patch-token and CLS cosine against latency ratio per resolution, one series per kind, the floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["sizes"])
    figure, axes = plt.subplots(2, len(sizes), figsize=(5 * len(sizes), 7.5), dpi=110, squeeze=False)
    try:
        for col, size in enumerate(sizes):
            result = results["sizes"][size]
            for line, (metric, label) in enumerate((("cls_cosine", "CLS"), ("patch_token_cosine", "patch token"))):
                ax = axes[line][col]
                for kind, marker in (("vca", "o"), ("merge", "^"), ("mano", "D"), ("plan", "s")):
                    points = sorted((r["latency_ratio"], r[metric]) for r in result["rows"].values()
                                    if r["kind"] == kind and "latency_ratio" in r)  # fmt: skip
                    if points:
                        ax.plot(*zip(*points, strict=True), marker + "-", label=kind)
                ax.axvline(result["floor"], color="grey", linestyle="--", label="attention-free floor")
                ax.set_title(f"{size} px: {label} cosine")
                ax.set_xlabel("latency ÷ original (batch 1, CPU)")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(path)
    finally:
        plt.close(figure)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random-weight ViT, few images (tests)")
    parser.add_argument("--sizes", type=int, nargs="+", help="resolutions (default 224 518 1036)")
    parser.add_argument("--budgets", type=float, nargs="*", help="the planner's budgets (default 0.8 .. 0.25)")
    parser.add_argument("--eval-crops", type=int, help="held-out crops besides the 10 whole photos (38)")
    parser.add_argument("--calibration", type=int, help="calibration crops (16)")
    parser.add_argument("--rows", nargs="*", help="only these fixed rows, by name (default: all; none: planner only)")
    parser.add_argument("--recover-steps", type=int, default=0, help="recovery steps per calibrated row (0: none)")
    parser.add_argument("--recover-size", type=int, default=0, help="train the recovery at this size (0: its own)")
    parser.add_argument("--min-time", type=float, help="seconds each model is timed at least (2)")
    parser.add_argument("--plan-images", type=int, help="calibration crops the planner reads (8)")
    parser.add_argument("--cache", type=Path, help="keep calibrated models, plans and fidelity here (resumable)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for the JSON / MD / PNG")
    parser.add_argument(
        "--replot",
        type=Path,
        nargs="+",
        help="measure nothing: plot these runs' rows as one front "
        "(a row of a later file replaces the same row of an earlier one) into RESULTS/front.png",
    )
    return parser.parse_args(argv)


def merged_runs(paths: list[Path]) -> dict[str, Any]:
    """The first run's record with every later run's rows laid over it, size by size (a size only a later run has
    is taken whole): the planner's rows of runs made apart join the front's full run."""
    merged = json.loads(paths[0].read_text())
    for path in paths[1:]:
        for size, result in json.loads(path.read_text())["sizes"].items():
            if size in merged["sizes"]:
                merged["sizes"][size]["rows"].update(result["rows"])
            else:
                merged["sizes"][size] = result
    return merged


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.replot:
        results = merged_runs(args.replot)
        plot(results, args.results / "front.png")
        print(markdown(results))
        return results
    settings = dict(QUICK if args.quick else FULL)
    for key in ("sizes", "budgets", "eval_crops", "calibration", "min_time", "plan_images"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    settings |= {"recover_steps": args.recover_steps, "recover_size": args.recover_size, "rows": args.rows}
    cache = {"cache": args.cache} if args.cache is not None else {}
    torch.set_num_threads(args.threads)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    results: dict[str, Any] = {"vca_patch": vca_patch.__version__, "torch": torch.__version__,
                               "platform": platform.platform(), "processor": _processor(), "threads": args.threads,
                               "settings": settings, "sizes": {}}  # fmt: skip
    for size in settings["sizes"]:
        log(f"{size} px")
        results["sizes"][str(size)] = run_size(size, settings | cache, args.quick, log)
    stem = "front_quick" if args.quick else "front"
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.results / f"{stem}.json", json.dumps(results, indent=2) + "\n")
    plot(results, args.results / f"{stem}.png")
    table = markdown(results)
    atomic_write_text(args.results / f"{stem}.md", table)
    print(table)
    return results


def _processor() -> str:
    """The CPU's model name (Linux), else platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
