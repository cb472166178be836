"""`vca-patch bench dit-xl-2`: a diffusion transformer's denoising step, original SDPA vs converted, per image size."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from vca_patch.cli.bench_timing import BenchTiming
from vca_patch.cli.common import console, prepare_cpu_kernel, resolve_device
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.handler import handler_for


def bench_diffusion(
    model: str,
    resolutions: list[int] | None,
    configs: list[TargetConfig],
    timing: BenchTiming,
    *,
    depth: int | None,
    cpu_kernel: bool,
    json_path: Path | None,
) -> None:
    """Time MODEL (a `bench.diffusion.DIFFUSION_MODELS` shape, random weights) and print the crossover."""
    from vca_patch.bench.diffusion import (
        DEFAULT_RESOLUTIONS,
        DiffusionBenchSettings,
        check_diffusion_bench,
        crossover_text,
        diffusion_table,
        run_diffusion_bench,
    )
    from vca_patch.bench.report import write_json

    device = str(resolve_device(timing.device))
    settings = DiffusionBenchSettings(
        resolutions=list(resolutions or DEFAULT_RESOLUTIONS), **{**asdict(timing), "device": device},
        cpu_kernel=cpu_kernel,
    )  # fmt: skip
    check_diffusion_bench(model, settings, depth)  # before the kernel build and the models
    if (
        device == "cpu"
        and timing.dtype == "float32"
        and cpu_kernel
        and any(handler_for(c).cpu_kernel(type(c)) is not None for c in configs)
    ):
        prepare_cpu_kernel()
    with console.status(f"Measuring {model}...") as status:
        result = run_diffusion_bench(model, configs, settings, depth=depth, log=status.update)
    console.print(diffusion_table(result))
    for line in crossover_text(result):
        console.print(line, highlight=False)
    if json_path is not None:
        write_json(result, json_path)
        console.print(f"[bold green]Wrote[/] {json_path}")
