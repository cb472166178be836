"""`vca-patch bench`: original and patched models side by side over a sweep of resolutions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from vca_patch.cli.bench_timing import BenchTiming
from vca_patch.cli.common import DEVICE_HELP, console, fail, parse_layers, prepare_cpu_kernel, resolve_device
from vca_patch.cli.target_options import split_options, typer_command
from vca_patch.core.install import install_hint
from vca_patch.core.paths import check_output
from vca_patch.core.sizes import MAX_DEPTH, MAX_IMG_SIZE, activation_bytes, check_bound, check_memory
from vca_patch.targets.base import CONFIG_TYPES, TargetConfig
from vca_patch.targets.handler import handler_for


def _parse_ints(spec: str, option: str) -> list[int]:
    try:
        values = sorted({int(v) for v in spec.split(",") if v.strip()})
    except ValueError:
        raise typer.BadParameter(f"{spec!r} is not a comma-separated list of integers", param_hint=option) from None
    if not values or values[0] < 1:
        raise typer.BadParameter("give positive integers, e.g. 224,512", param_hint=option)
    if option == "--resolutions":  # before anything is built: sizes whose tensors no machine holds
        check_bound(values[-1], option, 1, MAX_IMG_SIZE)
    return values


def _target_configs(spec: str, layers: list[int] | None) -> list[TargetConfig]:
    configs = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        config_cls = CONFIG_TYPES.get(name)
        if config_cls is None:
            fail(f"unknown target {name!r}; known: {', '.join(sorted(CONFIG_TYPES))}", 2)
        fields = {f.name for f in dataclasses.fields(config_cls)}
        configs.append(config_cls(layers=layers) if "layers" in fields else config_cls())
    if not configs:
        fail("--target names no target", 2)
    return configs


def _check_memory(model: str, shape: Any, resolution: int, batch: int, device: str) -> None:
    """The largest resolution's activations (fused attention: no N² matrix) against this machine's memory."""
    (ph, pw), side = shape.patch_size, resolution
    tokens = shape.num_prefix_tokens + (side // ph) * (side // pw)
    estimate = activation_bytes(tokens, shape.dim, shape.depth, batch)
    check_memory(estimate, f"{model} at {side} px ({tokens} tokens, batch {batch})", device=device,
                 hint="bench smaller --resolutions or a smaller --batch")  # fmt: skip


DEFAULT_RESOLUTIONS = "224,512,1024,2048"


@dataclass
class BenchArgs:
    """`bench`'s options."""

    model: Annotated[
        str,
        typer.Argument(
            help="timm model name (random weights), e.g. deit_small_patch16_224, or a diffusion transformer shape: "
            "dit-xl-2, dit-l-2, dit-b-2, dit-s-2 (diffusers, sizes in image px: latent /8, 256-2048 by default)"
        ),
    ]
    resolutions: Annotated[str, typer.Option(help="Square input sizes in pixels")] = DEFAULT_RESOLUTIONS
    batch: Annotated[int, typer.Option(help="Images per forward pass")] = 1
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu"
    dtype: Annotated[str, typer.Option(help="float32, or bfloat16/float16 autocast")] = "float32"
    target: Annotated[str, typer.Option(help="Targets to bench beside the original, comma-separated")] = "vca"
    depth: Annotated[int | None, typer.Option(help="Override the model's number of blocks")] = None
    layers: Annotated[str | None, typer.Option(help="Blocks to patch, e.g. '0-5,8' (default: all)")] = None
    repeats: Annotated[int, typer.Option(help="Timed runs per variant, at least (median reported)")] = 5
    min_time: Annotated[
        float, typer.Option(help="More runs until each variant has this many seconds timed (steadier medians)")
    ] = 1.0
    warmup: Annotated[int, typer.Option(help="Untimed runs per variant first")] = 1
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None
    memory: Annotated[bool, typer.Option(help="Measure peak memory of inference and of a training step")] = True
    unfused: Annotated[bool, typer.Option(help="Also bench the original with explicit softmax attention")] = True
    unfused_max_tokens: Annotated[int, typer.Option(help="Skip the explicit-softmax original above this")] = 4200
    unfused_max_mib: Annotated[
        float, typer.Option(help="Skip it where its softmax tensors would pass this many MiB (see the README)")
    ] = 4096
    json_path: Annotated[Path | None, typer.Option("--json", help="Write all numbers to this JSON file")] = None
    plot: Annotated[Path | None, typer.Option(help="Write a latency/memory plot (PNG; needs matplotlib)")] = None
    force: Annotated[bool, typer.Option("--force", help="Replace --json / --plot files that exist")] = False
    use_compile: Annotated[
        bool, typer.Option("--compile", help="Time torch.compile'd models (inductor; memory is measured eager)")
    ] = False
    cpu_kernel: Annotated[
        bool, typer.Option(help="VCA's fused CPU kernel for float32 inference (--no-cpu-kernel: composite path)")
    ] = True

    def explicit_resolutions(self) -> list[int] | None:
        """The --resolutions given, None for the default (the diffusion and hierarchical sweeps have their own)."""
        return None if self.resolutions == DEFAULT_RESOLUTIONS else _parse_ints(self.resolutions, "--resolutions")


@typer_command(BenchArgs, target_options=False)
def bench(**options: Any) -> None:
    """Latency, throughput, peak memory and analytic MACs of MODEL, original vs patched, per resolution."""
    from vca_patch.bench.diffusion import DIFFUSION_MODELS
    from vca_patch.bench.hierarchical import family

    args, _ = split_options(BenchArgs, options)
    _check_outputs(args)
    timing = BenchTiming(batch=args.batch, device=args.device, dtype=args.dtype, repeats=args.repeats,
                         min_time=args.min_time, warmup=args.warmup, threads=args.threads)  # fmt: skip
    if args.model in DIFFUSION_MODELS:  # a diffusers DiT shape: latent token counts, one denoising step per call
        from vca_patch.cli.bench_diffusion import bench_diffusion

        configs = _target_configs(args.target, parse_layers(args.layers))
        return bench_diffusion(args.model, args.explicit_resolutions(), configs, timing, depth=args.depth,
                               cpu_kernel=args.cpu_kernel, json_path=args.json_path)  # fmt: skip
    if family(args.model) is not None:  # Swin / PVTv2: one grid per stage, measured by its own sweep
        from vca_patch.cli.bench_hierarchical import bench_hierarchical

        return bench_hierarchical(args.model, args.explicit_resolutions(), timing, json_path=args.json_path)
    args.device = str(resolve_device(args.device))
    settings = _settings(args)
    variants, model_args = _variants(args, settings)
    result = _sweep(args, variants, settings, model_args)
    _report(args, result, variants, settings)


def _check_outputs(args: BenchArgs) -> None:
    """The dtype, and --json / --plot before minutes of measuring (a folder, a missing folder, a file in the way)."""
    from vca_patch.bench.sweep import DTYPES

    if args.dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}", 2)
    for option, out in (("--json", args.json_path), ("--plot", args.plot)):
        if out is not None:
            check_output(out, kind="file", force=args.force, option=option)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail(f"--plot needs matplotlib: {install_hint('bench')}", 2)


def _settings(args: BenchArgs) -> Any:
    """The sweep's settings from the options; a bad value is named as its option."""
    from vca_patch.bench import BenchError, BenchSettings

    if args.depth is not None:
        check_bound(args.depth, "--depth", 1, MAX_DEPTH)
    try:
        return BenchSettings(
            resolutions=_parse_ints(args.resolutions, "--resolutions"), batch=args.batch, device=args.device,
            dtype=args.dtype, warmup=args.warmup, repeats=args.repeats, min_time=args.min_time, memory=args.memory,
            unfused_max_tokens=args.unfused_max_tokens if args.unfused else 0, unfused_max_mib=args.unfused_max_mib,
            threads=args.threads, compile=args.use_compile, cpu_kernel=args.cpu_kernel,
        )  # fmt: skip
    except BenchError as exc:  # names the setting: say it as the option
        raise BenchError(f"--{str(exc).replace('_', '-')}") from None


def _variants(args: BenchArgs, settings: Any) -> tuple[list[Any], dict[str, Any]]:
    """The original and one patched copy per target, checked against the resolutions and this machine's memory."""
    from vca_patch.bench import BenchError, build_variants, check_resolutions, model_shape

    configs = _target_configs(args.target, parse_layers(args.layers))
    model_args = {"depth": args.depth} if args.depth is not None else {}
    cpu_float32 = args.device == "cpu" and args.dtype == "float32" and args.cpu_kernel
    if cpu_float32 and any(handler_for(c).cpu_kernel(type(c)) is not None for c in configs):
        prepare_cpu_kernel()
    with console.status(f"Building {args.model} and its variants..."):
        variants = build_variants(args.model, configs, model_args=model_args, unfused=args.unfused)
    shape = model_shape(variants[0].model)
    try:
        check_resolutions(shape, settings.resolutions)
    except BenchError as exc:  # names the option and the model
        raise BenchError(f"--resolutions: {args.model}: {exc}") from None
    _check_memory(args.model, shape, settings.resolutions[-1], args.batch, args.device)
    return variants, model_args


def _sweep(args: BenchArgs, variants: list[Any], settings: Any, model_args: dict[str, Any]) -> dict[str, Any]:
    """Every variant at every resolution; progress in the status line, what was skipped kept on screen."""
    from vca_patch.bench import run_sweep

    with console.status("Measuring...") as status:
        result = run_sweep(
            variants, settings, log=lambda m: console.print(m.strip()) if "skipped" in m else status.update(m)
        )
    result["meta"]["model"] = args.model
    result["meta"]["model_args"] = model_args
    return result


def _report(args: BenchArgs, result: dict[str, Any], variants: list[Any], settings: Any) -> None:
    """The tables, the targets' own measurements (`bench.extras`), a malloc hint, the JSON and the plot."""
    from vca_patch.bench.extras import run_extras
    from vca_patch.bench.report import crossover_lines, ratios_table, results_table, write_json, write_plot

    console.print(results_table(result))
    console.print(ratios_table(result))
    for line in crossover_lines(result):
        console.print(line)
    rows = args.batch * result["results"][0]["tokens"]
    timing = {"warmup": args.warmup, "repeats": args.repeats, "min_time": args.min_time}
    for extra, numbers in run_extras(variants, rows, args.device, **timing):
        result[extra.key] = numbers
        console.print(extra.table(numbers))
    if args.device == "cpu" and result["meta"]["malloc"] == "default" and max(settings.resolutions) >= 1024:
        console.print(
            "[dim]Large CPU tensors fault in 4 KiB pages under glibc's default malloc, a noisy cost shared by both"
            " models; GLIBC_TUNABLES=glibc.malloc.hugetlb=1 backs them with huge pages.[/]"
        )
    for path, write in ((args.json_path, write_json), (args.plot, write_plot)):
        if path is not None:
            write(result, path)
            console.print(f"[bold green]Wrote[/] {path}")
