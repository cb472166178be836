"""Benchmarks of hierarchical ViTs (timm Swin, PVTv2): the original vs each VCA mode vs MANO, per resolution.

The ViT sweep (`sweep.py`) counts MACs analytically from one token grid; a hierarchical model has one grid per
stage, windows or a spatial reduction, so here the MACs are *counted* while the model runs
(`torch.utils.flop_counter`, VCA on its composite path so every matmul and SDPA call is seen) and the latency is
timed interleaved as in the ViT sweep. Random weights: every variant of one resolution shares the original's.

What to expect (and what the rows show): against Swin's window attention, already linear in image area, VCA
buys global context, not speed (the residual mode adds its branch to the window attention; global mode costs
about what W-MSA costs). PVT's spatial reduction is quadratic in image area at a fixed ratio (N²/R² keys·queries),
so the kept-reduction VCA ("carry") gets cheaper than it as the input grows; at 224 px the reduced key sets are
tiny and the two cost about the same.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.table import Table
from torch import nn
from torch.utils import flop_counter

from vca_patch.bench.errors import BenchError
from vca_patch.bench.kernels import cpu_kernel_status, use_cpu_kernels
from vca_patch.bench.timing import median, time_interleaved
from vca_patch.targets.base import TargetConfig

FAMILIES = {"swin": "swin", "pvt_v2": "pvt"}  # timm name prefix -> family
# The variants each family is measured in besides the original: name -> (registered target, config fields). Built
# through the target registry (`TargetConfig.from_dict`): benching another target is one more entry here.
VARIANTS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "swin": {
        "vca-residual": ("vca", {"swin_mode": "residual"}),
        "vca-global": ("vca", {"swin_mode": "global"}),
        "mano": ("mano", {}),
    },
    "pvt": {
        "vca-carry": ("vca", {"pvt_mode": "carry"}),
        "vca-paper": ("vca", {"pvt_mode": "paper"}),
        "mano": ("mano", {}),
    },
}
FINDINGS = {
    "swin": "Swin's window attention is already linear in image area: VCA buys global context, not speed "
    "(residual adds a global branch beside the windows; global mode drops the windows, bias and shifts).",
    "pvt": "PVT's spatial reduction attends N queries to N/R² keys, quadratic in image area: the reduction-kept "
    "VCA ('carry') stays linear and gets cheaper than it as the input grows; the paper mode drops the reduction.",
}


def _register_cpu_sdpa_flops() -> None:
    """Count CPU SDPA calls (torch's flop counter knows only the CUDA kernels' aten ops)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if op in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(op, get_raw=True)
    def _cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def family(model_name: str) -> str | None:
    """ "swin" or "pvt" for a timm Swin / PVTv2 name (`*_li` included: bench says it cannot be converted), else None."""
    return next((fam for prefix, fam in FAMILIES.items() if model_name.startswith(prefix)), None)


def variant_configs(fam: str) -> dict[str, TargetConfig | None]:
    """The variants a family is measured in: the original (None), then each of `VARIANTS[fam]`'s configs."""
    built = {name: TargetConfig.from_dict({"target": t, **kw}) for name, (t, kw) in VARIANTS[fam].items()}
    return {"original": None, **built}


def build_base(model_name: str, px: int, *, seed: int = 0, model_args: dict[str, Any] | None = None) -> nn.Module:
    """Random-weight timm model for `px`-pixel inputs (Swin is built for its input size, PVT takes any)."""
    import timm

    kwargs = dict(model_args or {})
    if family(model_name) == "swin":
        kwargs["img_size"] = px
    torch.manual_seed(seed)
    return timm.create_model(model_name, pretrained=False, **kwargs).eval()


@torch.no_grad()
def counted_gmacs(model: nn.Module, x: torch.Tensor) -> float:
    """1e9 MACs of one forward, counted op by op (matmuls, convolutions, SDPA) on VCA's composite path."""
    _register_cpu_sdpa_flops()
    with use_cpu_kernels(False), flop_counter.FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops() / 2 / x.shape[0] / 1e9


@dataclass
class HierarchicalRow:
    """One variant at one resolution; ratios over the original at that resolution. Times in ms."""

    variant: str
    resolution: int
    stage1_tokens: int
    gmacs: float | None = None
    latency_ms: float | None = None
    mac_ratio: float | None = None
    latency_ratio: float | None = None
    skipped: str | None = None  # why the variant could not be built (e.g. MANO on PVT)


def _skip_reason(error: Exception, limit: int = 200) -> str:
    """Why a variant could not be built, for its row: the last refused site's reason (a `NothingToPatchError`
    lists them), else the error's first line, cut at `limit` characters."""
    skipped = getattr(error, "skipped", None)
    reason = skipped[-1].reason if skipped else (str(error).splitlines() or [type(error).__name__])[0]
    reason = reason.removeprefix("could not build the replacement: ")
    return reason[:limit] + ("…" if len(reason) > limit else "")


def run_hierarchical_sweep(
    model_name: str,
    resolutions: list[int],
    *,
    batch: int = 1,
    warmup: int = 1,
    repeats: int = 3,
    min_time: float = 0.0,
    variants: list[str] | None = None,
    model_args: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every variant of a timm Swin / PVTv2 model at every resolution (CPU, float32; the fused VCA kernel
    where it applies). Returns a JSON-safe {"meta", "rows"}."""
    from vca_patch.surgery import patch_model

    fam = family(model_name)
    if fam is None:
        raise BenchError(f"{model_name} is not a timm Swin or PVTv2 model")
    configs = variant_configs(fam)
    if variants is not None:
        unknown = sorted(set(variants) - set(configs))
        if unknown:
            raise BenchError(f"unknown variant(s) {unknown} for {fam}; known: {sorted(configs)}")
        configs = {name: config for name, config in configs.items() if name == "original" or name in variants}
    rows: list[HierarchicalRow] = []
    pvt_base = build_base(model_name, 0, model_args=model_args) if fam == "pvt" else None  # PVT takes any size
    for px in resolutions:
        base = pvt_base if pvt_base is not None else build_base(model_name, px, model_args=model_args)
        x = torch.randn(batch, 3, px, px, generator=torch.Generator().manual_seed(px))
        with torch.no_grad():
            grid = base.patch_embed(x).shape[1:3]  # NHWC: stage 1's grid
        models: dict[str, nn.Module] = {}
        for name, config in configs.items():
            row = HierarchicalRow(name, px, int(grid[0] * grid[1]))
            rows.append(row)
            try:
                model = base if config is None else copy.deepcopy(base)
                if config is not None:
                    patch_model(model, config)
            except Exception as error:  # e.g. MANO on PVT's reduction: say why, keep measuring the others
                row.skipped = _skip_reason(error)
                log(f"  {name} skipped at {px}px: {row.skipped}")
                continue
            models[name] = model.eval()
            row.gmacs = counted_gmacs(model, x)
        log(f"timing {px}px: {', '.join(models)}")

        def forward(model: nn.Module, x: torch.Tensor = x) -> Callable[[], object]:
            def run() -> object:
                with torch.inference_mode():
                    return model(x)

            return run

        timed = time_interleaved(
            {name: forward(m) for name, m in models.items()}, torch.device("cpu"), warmup=warmup, repeats=repeats,
            min_time=min_time,
        )  # fmt: skip
        here = [r for r in rows if r.resolution == px]
        original = next(r for r in here if r.variant == "original")
        for row in here:
            if row.variant in timed:
                row.latency_ms = median(timed[row.variant]) * 1e3
        for row in here:
            if row.gmacs is not None and original.gmacs:
                row.mac_ratio = row.gmacs / original.gmacs
            if row.latency_ms is not None and original.latency_ms:
                row.latency_ratio = row.latency_ms / original.latency_ms
    meta = {
        "model": model_name,
        "family": fam,
        "batch": batch,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "variants": {name: config and config.to_dict() for name, config in configs.items()},
        **cpu_kernel_status(),  # "vca_cpu_kernel": ...
        "finding": FINDINGS[fam],
        "torch": torch.__version__,
    }
    return {"meta": meta, "rows": [asdict(r) for r in rows]}


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def hierarchical_table(result: dict[str, Any]) -> Table:
    """One row per resolution and variant: stage-1 tokens, latency and counted MACs, both over the original."""
    meta = result["meta"]
    title = (
        f"{meta['model']} · cpu · float32 · batch {meta['batch']} · {meta['threads']} threads · "
        f"median of {meta['repeats']} · MACs counted per op"
    )
    table = Table(title=title, title_justify="left")
    for column in ("px", "stage-1 tokens", "variant", "latency ms", "latency ratio", "GMACs", "MAC ratio"):
        table.add_column(column, justify="left" if column == "variant" else "right", overflow="fold")
    previous = None
    for r in result["rows"]:
        px = str(r["resolution"]) if r["resolution"] != previous else ""
        previous = r["resolution"]
        if r["skipped"]:
            table.add_row(px, "", r["variant"], f"[yellow]skipped[/]: {r['skipped']}", "", "", "")
            continue
        ratio = r["latency_ratio"]
        style = "" if r["variant"] == "original" or ratio is None else "green" if ratio < 1 else "yellow"
        table.add_row(
            px, str(r["stage1_tokens"]) if px else "", r["variant"], _fmt(r["latency_ms"], ".1f"),
            f"[{style}]{_fmt(ratio, '.2f')}[/]" if style else _fmt(ratio, ".2f"), _fmt(r["gmacs"], ".2f"),
            _fmt(r["mac_ratio"], ".2f"),
        )  # fmt: skip
    return table
