"""DIDB's binarised Linears three ways, side by side: the original float Linear, the float emulation of the binary
Linear (the training path) and the packed XNOR-popcount kernel — latency on the block's token matrix and weight
memory, per Linear shape and summed over the model."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from rich.table import Table
from torch import nn

from vca_patch.bench.extras import BenchExtra, register_bench_extra
from vca_patch.bench.timing import median, time_interleaved

FORMS = ("float Linear", "float emulation", "packed xnor")


def _shapes(model: nn.Module) -> Counter:
    """(in_features, out_features, bias) -> how many binarised Linears of the DIDB-patched `model` have it."""
    from vca_patch.targets.didb.packed import _slots

    shapes: Counter = Counter()
    for slot in _slots(model):
        m = slot.module
        shapes[m.in_features, m.out_features, m.bias is not None] += 1
    return shapes


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@torch.no_grad()
def compare_binary_linears(
    model: nn.Module,
    rows: int,
    *,
    warmup: int = 1,
    repeats: int = 5,
    min_time: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Time each binarised Linear shape of a DIDB-patched float `model` on `rows` tokens (float32, CPU) in the three
    forms; memory = weight (or sign bits + scales) and bias bytes. Also checks kernel == emulation bit for bit."""
    from vca_patch.targets.didb import kernel
    from vca_patch.targets.didb.binary import BinaryWeight, binary_forward
    from vca_patch.targets.didb.packed import pack_weight

    g = torch.Generator().manual_seed(seed)
    shapes, per_shape, identical = _shapes(model), [], True
    uses_kernel, clip = kernel.kernel_available(), torch.ones(())
    for (k, o, has_bias), count in sorted(shapes.items()):
        w = torch.randn(o, k, generator=g) * k**-0.5
        b = torch.randn(o, generator=g) * 0.02 if has_bias else None
        x = torch.randn(rows, k, generator=g)
        dense, packed = BinaryWeight.from_weight(w), pack_weight(w)
        fns = {
            FORMS[0]: lambda x=x, w=w, b=b: nn.functional.linear(x, w, b),
            FORMS[1]: lambda x=x, d=dense, b=b, c=clip: binary_forward(x, d, b, c),
            FORMS[2]: lambda x=x, p=packed, b=b, c=clip: binary_forward(x, p, b, c, allow_kernel=True),
        }
        identical &= torch.equal(fns[FORMS[1]](), fns[FORMS[2]]())
        times = time_interleaved(fns, torch.device("cpu"), warmup=warmup, repeats=repeats, min_time=min_time)
        memory = {
            FORMS[0]: _bytes(w, b),
            FORMS[1]: _bytes(w, b, clip),  # the latent float weights stay: emulation saves nothing
            FORMS[2]: _bytes(packed.words, packed.nonzero, packed.scale, b, clip),
        }
        per_shape.append(
            {
                "in_features": k,
                "out_features": o,
                "count": count,
                "latency_ms": {f: median(times[f]) * 1e3 for f in FORMS},
                "weight_bytes": memory,
            }
        )
    total = {
        "latency_ms": {f: sum(s["count"] * s["latency_ms"][f] for s in per_shape) for f in FORMS},
        "weight_bytes": {f: sum(s["count"] * s["weight_bytes"][f] for s in per_shape) for f in FORMS},
    }
    return {
        "rows": rows,
        "kernel": kernel.kernel_status() if uses_kernel else f"{kernel.kernel_status()} (packed = emulation)",
        "threads": torch.get_num_threads(),
        "kernel_equals_emulation": bool(identical),
        "shapes": per_shape,
        "total": total,
    }


def binary_linears_table(result: dict[str, Any]) -> Table:
    """Latency and weight memory per shape and in total, with ratios over the float Linear."""
    exact = "bit-identical to the emulation" if result["kernel_equals_emulation"] else "DIFFERS from the emulation"
    table = Table(
        title=f"DIDB binarised Linears · {result['rows']} tokens · {result['threads']} threads · "
        f"{result['kernel']} ({exact})",
        title_justify="left",
    )
    columns = ["Linear", "count", *(f"{f} ms" for f in FORMS), "emul ×", "xnor ×"]
    for column in [*columns, *(f"{f} KiB" for f in FORMS), "xnor mem ×"]:
        table.add_column(column, justify="left" if column == "Linear" else "right")

    def row(name: str, count: str, lat: dict[str, float], mem: dict[str, int]) -> None:
        base, base_mem = lat[FORMS[0]], mem[FORMS[0]]
        table.add_row(
            name,
            count,
            *(f"{lat[f]:.3f}" for f in FORMS),
            f"{lat[FORMS[1]] / base:.2f}",
            f"{lat[FORMS[2]] / base:.2f}",
            *(f"{mem[f] / 1024:.1f}" for f in FORMS),
            f"{mem[FORMS[2]] / base_mem:.3f}",
        )

    for s in result["shapes"]:
        row(f"{s['in_features']}→{s['out_features']}", str(s["count"]), s["latency_ms"], s["weight_bytes"])
    total = result["total"]
    row("all (sum)", str(sum(s["count"] for s in result["shapes"])), total["latency_ms"], total["weight_bytes"])
    return table


register_bench_extra("didb", BenchExtra("didb_linears", compare_binary_linears, binary_linears_table, ("cpu",)))
