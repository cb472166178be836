"""`vca-patch convert --budget B`: plan, convert, calibrate, measure and save in one command (`make_faster`).

The options that only this path reads, the one-line refusals of options it cannot honour, the calibration and
held-out image files, and what it prints. `convert.py` runs the steps it shares with every conversion (output
rules, lock, inputs, building the model) around these.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from rich.table import Table

from vca_patch.cli.common import check_model_sizes, console, err_console, prepare_cpu_kernel
from vca_patch.core.errors import ConfigError

if TYPE_CHECKING:
    from vca_patch.cli.convert_args import ConvertArgs
    from vca_patch.planner.speedup import Recover, SpeedupReport

PLAN_IMAGES = 8  # calibration images the planner reads unless --calibration-images is given (as `vca-patch plan`)
EVAL_LIMIT = 32  # held-out images measured at most
# convert options the planner's path cannot honour: {parameter: flag}; refused with --budget when given
NOT_WITH_BUDGET = {
    "plan": "--plan", "layers": "--layers", "include": "--include", "exclude": "--exclude", "strict": "--strict",
    "grow_tokens": "--grow-tokens", "calibration_kind": "--calibration-kind", "split": "--split",
    "eval_split": "--eval-split", "skip_bad_images": "--skip-bad-images", "probe_size": "--probe-size",
    "packed": "--packed",
}  # fmt: skip
ONLY_WITH_BUDGET = {
    "resolution": "--resolution", "eval_data": "--eval-data", "recipe": "--recipe",
    "merge_fractions": "--merge-fractions", "merge_leads": "--merge-leads", "mano_windows": "--mano-windows",
    "repeats": "--repeats",
    "min_time": "--min-time",
}  # fmt: skip
PLANNED_VCA_OPTIONS = {"target_contrast_tokens": "contrast_tokens", "target_local_window": "local_window"}


def refuse_without_budget(args: ConvertArgs, defaults: dict[str, Any]) -> None:
    """One line for a --budget-only option given (other than its default) without --budget."""
    for name, flag in ONLY_WITH_BUDGET.items():
        if getattr(args, name) != defaults[name]:
            raise ConfigError(f"{flag} goes with --budget (plan, convert and measure in one command); pass "
                              "--budget B too, or drop it")  # fmt: skip


def _numbers(text: str | None, kind: type, flag: str) -> list | None:
    """'0.5,0.7' -> [0.5, 0.7]; 'none' or '' -> []; None -> None (the planner's default)."""
    if text is None:
        return None
    if text.strip().lower() in ("", "none"):
        return []
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be a comma-separated list of numbers (or none), got {text!r}") from None


def refuse_what_budget_cannot_honour(
    args: ConvertArgs, target_values: dict[str, Any], defaults: dict[str, Any]
) -> None:
    """One line, before any work, for --budget with --plan, another --to, an option the planner does not take, a
    device or dtype other than the CPU's float32, no calibration folder, or a bad budget, count or timing."""
    from vca_patch.cli.target_options import target_options

    for name, flag in NOT_WITH_BUDGET.items():
        if getattr(args, name) != defaults[name]:
            raise ConfigError(f"--budget plans the conversion itself; {flag} does not apply to it: drop {flag}, or "
                              "drop --budget")  # fmt: skip
    if args.to not in (None, "vca"):
        raise ConfigError(f"--budget chooses per block between softmax, VCA, MANO and token merging; --to {args.to} "
                          "does not apply to it: drop --to (or drop --budget to convert every block)")  # fmt: skip
    flags = {option.param: option.flag for option in target_options()}
    unplanned = [flags[p] for p in target_values if p not in PLANNED_VCA_OPTIONS and target_values[p] != defaults[p]]
    if unplanned:
        raise ConfigError(f"--budget plans VCA blocks with their defaults; {', '.join(unplanned)} does not apply to "
                          "it: drop it")  # fmt: skip
    if args.dtype != "float32" or args.device not in ("auto", "cpu"):
        raise ConfigError("--budget plans for batch-1 float32 CPU latency; drop --dtype and --device")
    if not args.budget > 0:
        raise ConfigError(f"--budget must be a positive latency ratio (e.g. 0.6), got {args.budget}")
    if args.calibration_data is None or not Path(args.calibration_data).is_dir():
        raise ConfigError("--budget needs --calibration-data DIR, a folder of images to plan and calibrate on")
    if args.calibration_images is not None and args.calibration_images < 1:
        raise ConfigError(f"--calibration-images must be at least 1 image, got {args.calibration_images}")
    if args.repeats < 1 or not args.min_time >= 0:
        raise ConfigError(f"--repeats must be >= 1 and --min-time >= 0, got {args.repeats} and {args.min_time}")


def search_options(args: ConvertArgs, target_values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`make_faster`'s keywords from the options (after `refuse_what_budget_cannot_honour`): the planner's defaults
    but for the options given; --contrast-tokens N: VCA(N) only (0: no VCA blocks); --to vca: VCA blocks only."""
    refuse_what_budget_cannot_honour(args, target_values, defaults)
    search: dict[str, Any] = {"repeats": args.repeats, "min_time": args.min_time}
    for param, keyword in PLANNED_VCA_OPTIONS.items():
        if target_values[param] != defaults[param]:
            value = target_values[param]
            search[keyword] = ((value,) if value else ()) if keyword == "contrast_tokens" else value
    for keyword, text, kind, flag in (("merge_fractions", args.merge_fractions, float, "--merge-fractions"),
                                      ("merge_leads", args.merge_leads, float, "--merge-leads"),
                                      ("mano_windows", args.mano_windows, int, "--mano-windows")):  # fmt: skip
        values = _numbers(text, kind, flag)
        if values is not None:
            search[keyword] = values
    if args.to == "vca":  # given: VCA blocks only, no token merging or MANO
        if search.get("contrast_tokens") == ():
            raise ConfigError("--to vca with --contrast-tokens 0 leaves nothing to plan; drop one of them")
        search |= {"merge_fractions": [], "merge_leads": [], "mano_windows": []}
    return search


@dataclass
class ImageSplit:
    """The image files to plan and calibrate on, those kept apart to measure on, and where those came from."""

    calibration: list[Path]
    evaluation: list[Path]
    measured_on: str


def image_split(args: ConvertArgs) -> ImageSplit:
    """The first --calibration-images (default PLAN_IMAGES) files of --calibration-data to plan and calibrate on, and
    up to EVAL_LIMIT held-out files: those of --eval-data, else every 5th file of --calibration-data (counted from
    the last, `held_out_split`), which then never calibrate. Refuses an --eval-data that shares files with them."""
    from vca_patch.planner import PlanError
    from vca_patch.planner.images import image_files
    from vca_patch.planner.speedup import held_out_split

    count = PLAN_IMAGES if args.calibration_images is None else args.calibration_images
    files = image_files(args.calibration_data)
    if args.eval_data is None:
        calib, held = held_out_split(len(files))
        evaluation = [files[i] for i in held][:EVAL_LIMIT]
        where = f"held out of --calibration-data {args.calibration_data} (every 5th image; never calibrated on)"
        return ImageSplit([files[i] for i in calib][:count], evaluation, f"{len(evaluation)} images {where}")
    try:
        evaluation = image_files(args.eval_data)[:EVAL_LIMIT]
    except PlanError as error:  # its message names --calibration-data, the planner's option
        raise PlanError(str(error).replace("--calibration-data", "--eval-data")) from None
    shared = {p.resolve() for p in files} & {p.resolve() for p in evaluation}
    if shared:
        raise ConfigError(f"--eval-data {args.eval_data} shares {len(shared)} images with --calibration-data (e.g. "
                          f"{sorted(shared)[0]}): the conversion would be measured on its own images")  # fmt: skip
    return ImageSplit(files[:count], evaluation, f"{len(evaluation)} images of --eval-data {args.eval_data}")


def load_split(net: torch.nn.Module, split: ImageSplit, resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The calibration and held-out images at `resolution`, normalised with the model's mean and std."""
    from vca_patch.planner.images import load_images

    cfg = getattr(net, "pretrained_cfg", None) or {}
    norm = {k: tuple(cfg[k]) for k in ("mean", "std") if k in cfg}
    return load_images(split.calibration, resolution, **norm), load_images(split.evaluation, resolution, **norm)


def check_vca_pays(args: ConvertArgs, net: torch.nn.Module, resolution: int, search: dict[str, Any]) -> None:
    """Refuse, in one line, VCA blocks alone (--to vca with --budget) at a resolution where VCA is slower than
    softmax attention, naming what does pay."""
    from vca_patch.planner import model_info
    from vca_patch.planner.speedup import VCA_PAYS_FROM_TOKENS, vca_pays

    tokens = model_info(net).tokens(resolution)
    if search.get("merge_fractions") == [] and not vca_pays(tokens):
        raise ConfigError(f"VCA cannot pay at {resolution} px: {tokens} tokens, and VCA is slower than softmax "
                          f"attention below ~{VCA_PAYS_FROM_TOKENS}; token merging pays here (drop --to vca and "
                          "--budget plans it), or convert at a larger --resolution")  # fmt: skip


def recovery_hook(args: ConvertArgs, net: torch.nn.Module, resolution: int) -> Recover | None:
    """The --recipe run as `make_faster`'s recover hook, its training set built now (a missing folder, a recipe
    that trains at another size or a loss that does not fit the model is refused before the planning, in one line);
    None without --recipe."""
    if args.recipe is None:
        return None
    import tempfile

    from vca_patch.core.model_io import features_and_logits, model_input_size
    from vca_patch.data.build import build_dataset
    from vca_patch.train import load_recipe
    from vca_patch.train.engine import make_accelerator, run_recipe
    from vca_patch.train.objective import check_distill_fits
    from vca_patch.train.tasks.classification import check_data_fits

    spec = load_recipe(args.recipe)
    if spec.data.img_size not in (None, resolution):
        raise ConfigError(f"--recipe {args.recipe} trains at data.img_size {spec.data.img_size}, the model runs at "
                          f"{resolution} px: set data.img_size: {resolution} in a copy of the recipe (recovery "
                          "trains at the resolution the model will run at)")  # fmt: skip
    cfg = dict(getattr(net, "pretrained_cfg", None) or {}) | {"input_size": (3, resolution, resolution)}
    train_set = build_dataset(spec.data, "train", training=True, img_size=resolution, model_cfg=cfg)
    check_data_fits(train_set, model_input_size(net), spec)
    with torch.no_grad():  # one image through the model: distill compares logits with a head, features without
        has_head = features_and_logits(net, train_set[0][0][None])[1] is not None
    for stage in spec.stages:
        check_distill_fits(stage, has_head=has_head)

    def recover(model: torch.nn.Module, original: torch.nn.Module) -> str:
        with tempfile.TemporaryDirectory(prefix="vca-patch-recover-") as folder:
            result = run_recipe(model, original, spec, folder, train_set=train_set,
                                accelerator=make_accelerator(spec.train.mixed_precision, device="cpu"))  # fmt: skip
        model.load_state_dict(result.model.state_dict())  # the published weights (EMA when the recipe keeps one)
        model.eval()
        steps = sum(stage.steps for stage in spec.stages if stage.kind != "calibrate")
        return f"recovered with {args.recipe}: {steps} steps on {len(train_set)} images of {spec.data.path}"

    return recover


def run(
    args: ConvertArgs,
    net: torch.nn.Module,
    split: ImageSplit,
    resolution: int,
    search: dict[str, Any],
    recover: Recover | None = None,
) -> SpeedupReport:
    """`make_faster` on `net` in place (recovered by `recover` when given), under a spinner, with the planner's
    progress printed as it goes."""
    from vca_patch.planner import PlanError
    from vca_patch.planner.speedup import make_faster

    check_model_sizes(net, SimpleNamespace(), batch=max(len(split.calibration), len(split.evaluation)),
                      what=f"{args.model} at --resolution {resolution}")  # fmt: skip
    calib, held = load_split(net, split, resolution)
    prepare_cpu_kernel()  # VCA's fused CPU kernel compiled before any timing starts, not inside a timed call
    title = f"Planning {args.model} at {resolution} px for {args.budget:g}x the original's latency"
    with console.status(f"{title}...") as status:

        def log(message: str) -> None:
            console.print(message, highlight=False)
            status.update(f"{title}: {message.strip()[:60]}...")

        try:
            report = make_faster(net, calib, resolution=resolution, budget=args.budget, eval_images=held, log=log,
                                 recover=recover, **search)  # fmt: skip
        except PlanError as error:
            if search.get("merge_fractions") != []:
                raise
            raise PlanError(f"{error}; with VCA blocks alone (--to vca): drop --to vca to let the planner merge "
                            "tokens too") from None  # fmt: skip
    report.measured_on = split.measured_on
    return report


def results_table(report: SpeedupReport) -> Table:
    """The measured latency and fidelity of the saved model against its original, on the held-out images."""
    table = Table(title=f"Measured at {report.plan.resolution} px on {report.measured_on}")
    for column in ("latency ratio", "ms (original)", "CLS cosine", "patch-token cosine", "mean-patch cosine"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{report.latency_ratio:.3f}", f"{report.latency_ms:.1f} ({report.original_ms:.1f})",
        f"{report.cls_cosine:.4f}", f"{report.patch_token_cosine:.4f}", f"{report.mean_patch_cosine:.4f}",
    )  # fmt: skip
    return table


def show(args: ConvertArgs, report: SpeedupReport) -> None:
    """The plan, what it measured, a warning when it measured over the budget, and the next step."""
    from vca_patch.cli.plan import plan_table

    console.print(plan_table(report.plan))
    console.print(results_table(report))
    if not report.within_budget:
        err_console.print(
            f"[bold yellow]warning:[/] measured {report.latency_ratio:.3f}x, over the {args.budget:g}x budget (batch-1 "
            "timings move by a few percent between runs; on a busy machine by more): rerun on an idle machine with "
            "a longer --min-time, or plan for a lower --budget", highlight=False, soft_wrap=True,
        )  # fmt: skip
    if report.recovery is not None:
        console.print(report.recovery, highlight=False, soft_wrap=True)
    console.print(f"[bold]{report.summary()}[/]", highlight=False, soft_wrap=True)
    console.print(f"[bold green]Saved[/] {args.output}/ (model.safetensors, config.json, README.md)")
