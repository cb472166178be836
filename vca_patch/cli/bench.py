"""`vca-patch bench`: original and patched models side by side over a sweep of resolutions."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from vca_patch.cli.bench_timing import BenchTiming
from vca_patch.cli.common import DEVICE_HELP, console, fail, parse_layers, prepare_cpu_kernel, resolve_device
from vca_patch.core.install import install_hint
from vca_patch.core.paths import check_output
from vca_patch.core.sizes import MAX_DEPTH, MAX_IMG_SIZE, activation_bytes, check_bound, check_memory
from vca_patch.targets.base import CONFIG_TYPES, TargetConfig


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


def bench(
    model: Annotated[
        str,
        typer.Argument(
            help="timm model name (random weights), e.g. deit_small_patch16_224, or a diffusion transformer shape: "
            "dit-xl-2, dit-l-2, dit-b-2, dit-s-2 (diffusers, sizes in image px: latent /8, 256-2048 by default)"
        ),
    ],
    resolutions: Annotated[str, typer.Option(help="Square input sizes in pixels")] = "224,512,1024,2048",
    batch: Annotated[int, typer.Option(help="Images per forward pass")] = 1,
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, or bfloat16/float16 autocast")] = "float32",
    target: Annotated[str, typer.Option(help="Targets to bench beside the original, comma-separated")] = "vca",
    depth: Annotated[int | None, typer.Option(help="Override the model's number of blocks")] = None,
    layers: Annotated[str | None, typer.Option(help="Blocks to patch, e.g. '0-5,8' (default: all)")] = None,
    repeats: Annotated[int, typer.Option(help="Timed runs per variant, at least (median reported)")] = 5,
    min_time: Annotated[
        float, typer.Option(help="More runs until each variant has this many seconds timed (steadier medians)")
    ] = 1.0,
    warmup: Annotated[int, typer.Option(help="Untimed runs per variant first")] = 1,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None,
    memory: Annotated[bool, typer.Option(help="Measure peak memory of inference and of a training step")] = True,
    unfused: Annotated[bool, typer.Option(help="Also bench the original with explicit softmax attention")] = True,
    unfused_max_tokens: Annotated[int, typer.Option(help="Skip the explicit-softmax original above this")] = 4200,
    unfused_max_mib: Annotated[
        float, typer.Option(help="Skip it where its softmax tensors would pass this many MiB (see the README)")
    ] = 4096,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write all numbers to this JSON file")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a latency/memory plot (PNG; needs matplotlib)")] = None,
    use_compile: Annotated[
        bool, typer.Option("--compile", help="Time torch.compile'd models (inductor; memory is measured eager)")
    ] = False,
    cpu_kernel: Annotated[
        bool, typer.Option(help="VCA's fused CPU kernel for float32 inference (--no-cpu-kernel: composite path)")
    ] = True,
) -> None:
    """Latency, throughput, peak memory and analytic MACs of MODEL, original vs patched, per resolution."""

    from vca_patch.bench import BenchError, BenchSettings, build_variants, check_resolutions, model_shape, run_sweep
    from vca_patch.bench.hierarchical import family
    from vca_patch.bench.report import crossover_lines, ratios_table, results_table, write_json, write_plot
    from vca_patch.bench.sweep import DTYPES
    from vca_patch.cli.bench_hierarchical import bench_hierarchical

    if dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}", 2)
    for option, out in (("--json", json_path), ("--plot", plot)):
        if out is not None:  # before minutes of measuring: a folder, a missing folder or a file in the way
            check_output(out, kind="file", option=option)
    from vca_patch.bench.diffusion import DIFFUSION_MODELS

    timing = BenchTiming(
        batch=batch, device=device, dtype=dtype, repeats=repeats, min_time=min_time, warmup=warmup, threads=threads
    )

    if model in DIFFUSION_MODELS:  # a diffusers DiT shape: latent token counts, one denoising step per call
        from vca_patch.cli.bench_diffusion import bench_diffusion

        default = resolutions == "224,512,1024,2048"
        return bench_diffusion(
            model, None if default else _parse_ints(resolutions, "--resolutions"),
            _target_configs(target, parse_layers(layers)), timing, depth=depth, cpu_kernel=cpu_kernel,
            json_path=json_path,
        )  # fmt: skip
    if family(model) is not None:  # Swin / PVTv2: one grid per stage, measured by its own sweep
        default = resolutions == "224,512,1024,2048"
        return bench_hierarchical(
            model, None if default else _parse_ints(resolutions, "--resolutions"), timing, json_path=json_path
        )
    device = str(resolve_device(device))
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail(f"--plot needs matplotlib: {install_hint('bench')}", 2)
    try:
        settings = BenchSettings(
            resolutions=_parse_ints(resolutions, "--resolutions"),
            batch=batch,
            device=device,
            dtype=dtype,
            warmup=warmup,
            repeats=repeats,
            min_time=min_time,
            memory=memory,
            unfused_max_tokens=unfused_max_tokens if unfused else 0,
            unfused_max_mib=unfused_max_mib,
            threads=threads,
            compile=use_compile,
            cpu_kernel=cpu_kernel,
        )
    except BenchError as exc:  # names the setting: say it as the option
        raise BenchError(f"--{str(exc).replace('_', '-')}") from None
    if depth is not None and depth < 1:
        fail(f"--depth must be at least 1 block, got {depth}", 2)
    if depth is not None:
        check_bound(depth, "--depth", 1, MAX_DEPTH)
    configs = _target_configs(target, parse_layers(layers))
    model_args = {"depth": depth} if depth is not None else {}
    if device == "cpu" and dtype == "float32" and cpu_kernel and any(type(c).cpu_kernel() is not None for c in configs):
        prepare_cpu_kernel()
    with console.status(f"Building {model} and its variants..."):
        variants = build_variants(model, configs, model_args=model_args, unfused=unfused)
    try:
        check_resolutions(model_shape(variants[0].model), settings.resolutions)
    except BenchError as exc:  # names the option and the model
        raise BenchError(f"--resolutions: {model}: {exc}") from None
    _check_memory(model, model_shape(variants[0].model), settings.resolutions[-1], batch, device)
    with console.status("Measuring...") as status:
        # Progress replaces itself in the status line; what was skipped stays on screen.
        result = run_sweep(
            variants, settings, log=lambda m: console.print(m.strip()) if "skipped" in m else status.update(m)
        )
    result["meta"]["model"] = model
    result["meta"]["model_args"] = model_args
    console.print(results_table(result))
    console.print(ratios_table(result))
    for line in crossover_lines(result):
        console.print(line)
    didb = next((v for v in variants if v.target == "didb" and v.name == "didb"), None)
    if didb is not None and device == "cpu":  # the binarised Linears three ways (the XNOR kernel is CPU-only)
        from vca_patch.bench.binary_linears import binary_linears_table, compare_binary_linears

        tokens = batch * result["results"][0]["tokens"]
        result["didb_linears"] = compare_binary_linears(
            didb.model, tokens, warmup=warmup, repeats=repeats, min_time=min_time
        )
        console.print(binary_linears_table(result["didb_linears"]))
    if device == "cpu" and result["meta"]["malloc"] == "default" and max(settings.resolutions) >= 1024:
        console.print(
            "[dim]Large CPU tensors fault in 4 KiB pages under glibc's default malloc, a noisy cost shared by both"
            " models; GLIBC_TUNABLES=glibc.malloc.hugetlb=1 backs them with huge pages.[/]"
        )
    if json_path is not None:
        write_json(result, json_path)
        console.print(f"[bold green]Wrote[/] {json_path}")
    if plot is not None:
        write_plot(result, plot)
        console.print(f"[bold green]Wrote[/] {plot}")
