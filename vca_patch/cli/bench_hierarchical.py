"""`vca-patch bench` for hierarchical ViTs (timm Swin, PVTv2): original vs VCA modes vs MANO, side by side."""

from __future__ import annotations

from pathlib import Path

from vca_patch.cli.bench_timing import BenchTiming
from vca_patch.cli.common import console, fail, prepare_cpu_kernel

DEFAULT_RESOLUTIONS = [224, 512, 1024]  # 2048 px is a 512×512 stage-1 grid: minutes per forward on CPU


def bench_hierarchical(
    model: str,
    resolutions: list[int] | None,
    timing: BenchTiming,
    *,
    json_path: Path | None,
) -> None:
    """Run and print the hierarchical sweep (`bench.hierarchical`); CPU float32 only."""
    import torch

    from vca_patch.bench.hierarchical import hierarchical_table, run_hierarchical_sweep
    from vca_patch.bench.report import write_json

    if timing.device != "cpu" or timing.dtype != "float32":
        fail(
            "bench of hierarchical models (Swin, PVTv2) runs on cpu in float32 only, "
            f"got {timing.device} {timing.dtype}",
            2,
        )
    if timing.threads:
        torch.set_num_threads(timing.threads)
    prepare_cpu_kernel()
    with console.status(f"Measuring {model}...") as status:
        result = run_hierarchical_sweep(
            model, resolutions or DEFAULT_RESOLUTIONS, batch=timing.batch, warmup=timing.warmup,
            repeats=timing.repeats, min_time=timing.min_time,
            log=lambda m: console.print(m.strip()) if "skipped" in m else status.update(m),
        )  # fmt: skip
    console.print(hierarchical_table(result))
    console.print(f"[dim]{result['meta']['finding']}[/]")
    if json_path is not None:
        write_json(result, json_path)
        console.print(f"[bold green]Wrote[/] {json_path}")
