"""`vca-patch fidelity`: measure a converted checkpoint against its original on real data."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from vca_patch.bench.report import write_json
from vca_patch.cli.common import DEVICE_HELP, DTYPE_HELP, console, fail, resolve_device, resolve_dtype
from vca_patch.cli.target_options import split_options, typer_command
from vca_patch.targets import CONFIG_TYPES
from vca_patch.targets.handler import handler_for

KINDS = ("fashion_mnist", "imagefolder", "hf")
CALIBRATION_BATCH = 8  # images per batch read for calibration: the reading bar moves during a long capture


SKIP_HELP = "Skip unreadable or corrupt image files (counted and named on stderr) instead of stopping at the first"


def data_spec(
    kind: str | None,
    path: str | None,
    split: str,
    limit: int | None,
    option: str = "--data-kind",
    *,
    skip_bad_images: bool = False,
):
    """A DataSpec for one evaluation split given on the command line; without `kind`, inferred from `path`."""
    from vca_patch.data import infer_kind
    from vca_patch.train.recipe import DataSpec

    if kind is None:
        kind = infer_kind(path)
    if kind not in KINDS:
        fail(f"{option} must be one of {', '.join(KINDS)}, got {kind!r}", 2)
    return DataSpec(kind=kind, path=path, eval_split=split, eval_limit=limit, skip_bad_images=skip_bad_images)


class Batches:
    """`loader` whose batches show a progress bar (total and ETA; plain lines when piped) as they are read; its
    `dataset` and length kept. `then` runs after the last batch."""

    def __init__(self, loader, description: str, then=None) -> None:
        self.loader, self.description, self.then = loader, description, then
        self.dataset = loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        from vca_patch.cli.progress import track

        yield from track(self.loader, len(self.loader), self.description)
        if self.then is not None:
            self.then()


class LayerProgress:
    """`calibrate`'s `progress` callback on the console: a bar of the layers fitted (total and ETA; plain lines when
    piped), opened by `start` once the calibration images are read; a `grow_tokens` pass, whose count starts again
    at 1, gets a bar of its own."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._bar: Iterator[int] | None = None
        self._done = 0

    def start(self, total: int | None = None, description: str | None = None) -> None:
        """Open a bar of `total` layers (default: all), shown at 0 done."""
        from vca_patch.cli.progress import track

        self.close()
        total = self.layers if total is None else total
        description = description or f"Fitting {total} layers in closed form"
        self._bar, self._done = track(range(total), total, description, unit="layers"), 0
        next(self._bar, None)

    def __call__(self, done: int, total: int, path: str) -> None:
        """One more layer fitted (`calibrate` calls this after each layer)."""
        if done <= self._done:  # a new pass: the layers grow_tokens rebuilt
            self.start(total, f"Fitting {total} rebuilt layers again")
        elif self._bar is None:
            self.start(total)
        self._done = done
        next(self._bar, None)

    def close(self) -> None:
        """Close the bar (it is left as it is when calibration stops early)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def report_skipped(*datasets) -> None:
    """One warning line per dataset that skipped unreadable images (--skip-bad-images)."""
    from vca_patch.cli.common import err_console
    from vca_patch.data.images import skipped_images

    for dataset in datasets:
        skipped = skipped_images(dataset)
        line = skipped.summary() if skipped is not None else None
        if line:
            err_console.print(f"warning: {line}", highlight=False, soft_wrap=True, markup=False)


@dataclass
class FidelityArgs:
    """`fidelity`'s options."""

    checkpoint: Annotated[Path, typer.Argument(help="A converted checkpoint folder (save_pretrained / convert)")]
    data: Annotated[str | None, typer.Option(help="Dataset: idx folder, ImageFolder root or HF dataset name")] = None
    data_kind: Annotated[
        str | None,
        typer.Option(help="fashion_mnist, imagefolder or hf (default: from --data: idx files, a folder, or a name)"),
    ] = None
    split: Annotated[
        str, typer.Option(help="Split to measure on (ImageFolder: its sub-folder; val/test aliases; flat: held out)")
    ] = "test"
    limit: Annotated[int, typer.Option(help="Images to measure on")] = 512
    skip_bad_images: Annotated[bool, typer.Option("--skip-bad-images", help=SKIP_HELP)] = False
    batch_size: Annotated[int, typer.Option(help="Batch size")] = 64
    original: Annotated[
        Path | None,
        typer.Option(help="Checkpoint whose original attention is the reference (default: CHECKPOINT's own)"),
    ] = None
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the per-layer errors (needs matplotlib)")] = None
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the full report as JSON")] = None
    force: Annotated[bool, typer.Option("--force", help="Replace --json / --plot files that exist")] = False
    device: Annotated[str, typer.Option(help=f"Where to run both models: {DEVICE_HELP}")] = "auto"
    dtype: Annotated[str, typer.Option(help=f"{DTYPE_HELP} of both models (errors are summed in float64)")] = "float32"


@typer_command(FidelityArgs, target_options=False)
def fidelity(**options: Any) -> None:
    """Per-layer attention error, final-feature cosines and top-1 agreement of CHECKPOINT vs its original."""
    args, _ = split_options(FidelityArgs, options)
    _check_options(args)
    model, reference = _load_models(args)
    if not _takes_images(model):  # a diffusion transformer: latents, timesteps and conditions instead of images
        diffusion_fidelity(model, reference, args.data, args.limit, args.json_out)
        return
    report = _measure_on_images(args, model, reference)
    console.print(layers_table(report))
    console.print(measured_table(report))
    _write_report(args, report)


def _takes_images(model: Any) -> bool:
    """Whether the model's family measures it on images (`ModelAdapter.takes_images`; diffusion transformers:
    denoising steps)."""
    from vca_patch.families import hooks_for

    return hooks_for(model).takes_images


def _check_options(args: FidelityArgs) -> None:
    """Counts, and --json / --plot before any work: never an input, never inside one, their folder exists."""
    from vca_patch.core.paths import check_output

    if args.limit < 1:
        fail(f"--limit must be at least 1 image, got {args.limit}", 2)
    if args.batch_size < 1:
        fail(f"--batch-size must be at least 1, got {args.batch_size}", 2)
    inputs = {"checkpoint": args.checkpoint, "--original checkpoint": args.original, "--data": args.data}
    for option, out in (("--json", args.json_out), ("--plot", args.plot)):
        if out is not None:
            check_output(out, inputs, kind="file", force=args.force, option=option)
    if args.json_out is not None and args.plot is not None and args.json_out.resolve() == args.plot.resolve():
        fail(f"--json and --plot are the same file {args.json_out}; name two files", 2)


def _load_models(args: FidelityArgs) -> tuple[Any, Any]:
    """The converted model, and the reference teacher from --original (None: the model's own originals)."""
    from vca_patch.checkpoint import from_pretrained
    from vca_patch.train.finetune import teacher_from

    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    model = from_pretrained(args.checkpoint, device=device).to(dtype)
    if args.original is None:
        return model, None
    return model, teacher_from(from_pretrained(args.original, device=device).to(dtype))


def _measure_on_images(args: FidelityArgs, model: Any, reference: Any) -> Any:
    """The FidelityReport of `model` on --limit images of --data (at the model's input size)."""
    import torch
    from torch.utils.data import DataLoader

    from vca_patch.core.model_io import model_input_size
    from vca_patch.data import build_dataset
    from vca_patch.eval.fidelity import fidelity as measure

    spec = data_spec(args.data_kind, args.data, args.split, args.limit, skip_bad_images=args.skip_bad_images)
    size = model_input_size(model)
    model_cfg = {**(getattr(model, "pretrained_cfg", None) or {}), "input_size": size}
    dataset = build_dataset(spec, args.split, training=False, img_size=size[1], model_cfg=model_cfg)
    with torch.no_grad():
        loader = DataLoader(dataset, batch_size=args.batch_size)
        report = measure(reference, model, Batches(loader, f"Measuring on {min(args.limit, len(dataset))} images"))
    report_skipped(dataset)
    return report


def _write_report(args: FidelityArgs, report: Any) -> None:
    if args.json_out is not None:
        write_json(report.to_dict(), args.json_out)
    if args.plot is not None:
        try:
            report.plot(args.plot)
        except ImportError as exc:  # matplotlib missing: what to install
            fail(str(exc), 2)
        console.print(f"wrote {args.plot}")


def layers_table(report) -> Table:
    """Per-layer relative error of a FidelityReport's attention outputs, teacher-forced and free-running."""
    table = Table(title="Per-layer relative error of the attention output", title_justify="left")
    for column in ("layer", "teacher-forced", "free-running"):
        table.add_column(column, justify="right" if column != "layer" else "left", overflow="fold")
    for name, e, f in zip(report.layers, report.layer_error, report.layer_error_free, strict=True):
        table.add_row(name, f"{e:.4f}", f"{f:.4f}")
    return table


def measured_table(report) -> Table:
    """A FidelityReport's summary and the number of images it was measured on."""
    table = summary_table(report.summary(), "Summary")
    table.add_row("images", str(report.num_images))
    return table


def diffusion_fidelity(model, reference, data: str | None, limit: int, json_out: Path | None) -> None:
    """`fidelity` of a diffusers transformer: per-layer attention error and noise/velocity-prediction error on
    `limit` latents (the folder `data` of .pt/.safetensors, or random ones) at random timesteps and conditions."""
    import torch

    from vca_patch.data import DatasetError
    from vca_patch.eval.fidelity import diffusion_fidelity as measure

    where = f"latents of {data}" if data else "random latents"
    with console.status(f"Measuring on {limit} {where}..."), torch.no_grad():
        try:
            report = measure(reference, model, latents=data, count=limit)
        except ValueError as exc:  # the latents' shapes do not fit the model: the user's data
            raise DatasetError(str(exc)) from exc
    table = Table(title="Per-layer relative error of the attention output", title_justify="left")
    for column in ("layer", "teacher-forced", "free-running"):
        table.add_column(column, justify="right" if column != "layer" else "left")
    for name, e, f in zip(report["layers"], report["layer_error"], report["layer_error_free"], strict=True):
        table.add_row(name, f"{e:.4f}", f"{f:.4f}")
    console.print(table)
    keys = ("prediction_error", "objective_student", "objective_teacher", "mean_layer_error", "max_layer_error")
    console.print(summary_table({k: report[k] for k in keys}, f"Fidelity to the original ({report['prediction']})"))
    console.print(f"{report['latents']} {where}, random timesteps and conditions", highlight=False)
    if json_out is not None:
        write_json(report, json_out)


def summary_table(summary: dict[str, float], title: str = "Fidelity to the original") -> Table:
    """A two-column table of a FidelityReport.summary()."""
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column(style="bold", overflow="fold")
    table.add_column(justify="right", overflow="fold")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), f"{value:.4f}")
    return table


def calibrated_targets() -> tuple[str, ...]:
    """The registered targets that `calibrate_for_convert` calibrates (those that declare calibration options),
    which --calibration-data, --split, --eval-split and --grow-tokens apply to; read when a command runs, so a
    target registered later counts too."""
    return tuple(name for name, cls in CONFIG_TYPES.items() if cls.calibration_options is not None)


def calibrate_for_convert(
    net,
    data: Path | None,
    kind: str | None,
    images: int,
    probe,
    *,
    split: str = "train",
    eval_split: str = "test",
    grow_tokens: float | None = None,
    skip_bad_images: bool = False,
) -> tuple[dict[str, float], str]:
    """Calibrate a freshly patched VCA model on `images` images of split `split` of `data` (when given) and
    measure it (on `eval_split` of the same data, else on `probe`). Returns (summary, where measured).

    An ImageFolder's splits are its sub-folders (aliases such as val/validation resolved); a flat folder of class
    sub-folders is split 4 : 1 instead. Two split names that resolve to the same folder are refused. `grow_tokens`:
    see `calibrate` (the layers it rebuilds are named on the console)."""
    import torch
    from torch.utils.data import DataLoader, Subset

    from vca_patch.core.model_io import model_input_size
    from vca_patch.core.patch_state import get_patch_state
    from vca_patch.data import build_dataset
    from vca_patch.eval.fidelity import fidelity as measure
    from vca_patch.recovery import calibrate

    if data is None:
        with console.status("Measuring fidelity..."), torch.no_grad():
            return measure(None, net, [probe]).summary(), f"{len(probe)} random probe images"
    state = get_patch_state(net)
    handler = handler_for(state.config) if state is not None else None
    if handler is None or not any(handler.calibrates(state.config, m) for m in net.modules()):
        fail("--calibration-data applies to conversions whose target calibrates (VCA)", 2)
    spec = data_spec(kind, str(data), eval_split, None, "--calibration-kind", skip_bad_images=skip_bad_images)
    spec.train_split = split
    check_calibration_splits(Path(data), spec.kind, split, eval_split)
    size = model_input_size(net)
    cfg = {**(getattr(net, "pretrained_cfg", None) or {}), "input_size": size}
    # training=True: the train split (spec.augment is "none": eval transforms), disjoint from the held-out one
    train = build_dataset(spec, "train", training=True, img_size=size[1], model_cfg=cfg)
    held_out = build_dataset(spec, eval_split, training=False, img_size=size[1], model_cfg=cfg)
    calib = DataLoader(Subset(train, range(min(images, len(train)))), batch_size=CALIBRATION_BATCH)
    probe_set = DataLoader(Subset(held_out, range(min(images, len(held_out)))), batch_size=64)
    layers = sum(1 for m in net.modules() if handler.calibrates(state.config, m))
    fitting = LayerProgress(layers)
    reading = Batches(calib, f"Reading {len(calib.dataset)} calibration images", then=fitting.start)  # then the fits
    with torch.no_grad():
        try:
            report = calibrate(net, reading, grow_tokens=grow_tokens, progress=fitting)
        finally:
            fitting.close()
        if report.grown:
            grown = ", ".join(f"block {block}: n = {n}" for block, n in sorted(report.grown.items()))
            console.print(f"Calibration gave more contrast tokens to {grown}", highlight=False)
        where = f"{min(images, len(held_out))} held-out images of {data}"
        summary = measure(None, net, Batches(probe_set, f"Measuring on {len(probe_set.dataset)} images")).summary()
    report_skipped(train, held_out)
    return summary, where


def check_calibration_splits(root: Path, kind: str | None, split: str, eval_split: str) -> None:
    """Exit with one line when an ImageFolder lacks either split, or both name one sub-folder (calibration would be
    measured on its own images). Other data kinds pass (their loaders check their splits)."""
    from vca_patch.data import infer_kind
    from vca_patch.data.imagefolder import split_folder

    if (kind or infer_kind(root)) != "imagefolder":
        return
    train, held_out = split_folder(root, split), split_folder(root, eval_split)
    if train is not None and train == held_out:
        fail(
            f"--split {split} and --eval-split {eval_split} are both {train}: calibration would be measured on its "
            "own images; name another held-out split",
            2,
        )
