"""Cost of a plan: tokens per block, the FLOP model's MACs, and a latency model from measured block timings.

The token arithmetic, the per-block MAC counts and every config timed here come from the plan space
(`targets.base.plan_space()`: token merging's, with VCA and MANO blocks)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from vca_patch.bench.timing import median, time_interleaved
from vca_patch.eval.final_tokens import final_tokens
from vca_patch.layers.layout import TokenLayout
from vca_patch.layers.macs import AttentionShape
from vca_patch.planner.model_info import ModelInfo
from vca_patch.surgery import get_patch_state, patch_model
from vca_patch.targets.base import TargetConfig, plan_space


def token_counts(info: ModelInfo, resolution: int, schedule: Sequence[int]) -> list[int]:
    """Tokens entering each block under a merge schedule (r per block; the plan space's `tokens_removed`)."""
    space, tokens, counts = plan_space(), info.tokens(resolution), []
    for i in range(info.depth):
        counts.append(tokens)
        tokens -= space.tokens_removed(tokens, info.num_prefix_tokens, schedule[i] if i < len(schedule) else 0)
    return counts


def plan_macs(
    info: ModelInfo,
    resolution: int,
    schedule: Sequence[int],
    vca_layers: dict[int, int],
    mano_layers: dict[int, int] | None = None,
    *,
    local_window: int = 0,
) -> float:
    """MACs of the blocks (FLOP model of bench/flops.py: 2·N²·C softmax, token-wise Linears, and each VCA(n) or
    MANO(k) block's count from the plan space's block kinds: VCA's with its local term of `local_window` when > 0,
    training-free MANO's at window k)."""
    space = plan_space()
    shape = AttentionShape(info.num_prefix_tokens, info.grid(resolution), info.dim, info.num_heads)
    blocks = {i: (space.kind(kind), value) for kind, layers in (("mano", mano_layers), ("vca", vca_layers))
              for i, value in (layers or {}).items()}  # fmt: skip
    total = 0.0
    for i, tokens in enumerate(token_counts(info, resolution, schedule)):
        total += tokens * info.linear_macs_per_token
        if i in blocks:
            kind, value = blocks[i]
            total += kind.macs(shape, value, local_window=local_window)
        else:
            total += 2.0 * tokens**2 * info.dim
    return total


@dataclass
class LatencyTable:
    """Measured batch-1 seconds: one softmax block at several token counts, one VCA block per n and one MANO block
    per window k at the full grid, the rest of the model (embedding, final norm), and the whole original model.
    `local_window`: the VCA blocks were timed with that local term (0: none). `merge_overhead_s`: what a merging
    block costs over a softmax block at each of those token counts (the bipartite matching, the merge, proportional
    attention and undoing the merge at the unmerge); empty: not measured (no overhead counted)."""

    original_s: float
    other_s: float
    softmax_tokens: list[int]
    softmax_s: list[float]
    vca_s: dict[int, float] = field(default_factory=dict)
    mano_s: dict[int, float] = field(default_factory=dict)
    merge_overhead_s: list[float] = field(default_factory=list)
    local_window: int = 0

    def block_s(
        self, tokens: int, contrast_tokens: int | None = None, window: int | None = None, merges: bool = False
    ) -> float:
        if contrast_tokens is not None:
            return self.vca_s[contrast_tokens]
        if window is not None:
            return self.mano_s[window]
        seconds = float(np.interp(tokens, self.softmax_tokens, self.softmax_s))
        if merges and self.merge_overhead_s:
            seconds += float(np.interp(tokens, self.softmax_tokens, self.merge_overhead_s))
        return seconds

    def ratio(
        self,
        info: ModelInfo,
        resolution: int,
        schedule: Sequence[int],
        vca_layers: dict[int, int],
        mano_layers: dict[int, int] | None = None,
    ) -> float:
        """Predicted latency of a plan over the original's."""
        counts = token_counts(info, resolution, schedule)
        mano_layers = mano_layers or {}
        merges = [i < len(schedule) and schedule[i] > 0 for i in range(len(counts))]
        blocks = sum(self.block_s(t, vca_layers.get(i), mano_layers.get(i), merges[i]) for i, t in enumerate(counts))
        return (self.other_s + blocks) / self.original_s

    def faster_mano_windows(self) -> list[int]:
        """The measured MANO windows whose block beats a softmax block at the full grid. MANO blocks come before the
        first merge, on the full grid, so a slower window can never save latency: the search would never pick it."""
        full = self.softmax_s[int(np.argmax(self.softmax_tokens))]
        return sorted(k for k, seconds in self.mano_s.items() if seconds < full)

    def to_dict(self) -> dict:
        return {
            "original_ms": 1e3 * self.original_s,
            "other_ms": 1e3 * self.other_s,
            "softmax_block_ms": {t: 1e3 * s for t, s in zip(self.softmax_tokens, self.softmax_s, strict=True)},
            "vca_block_ms": {n: 1e3 * s for n, s in self.vca_s.items()},
            "vca_local_window": self.local_window,
            "mano_block_ms": {k: 1e3 * s for k, s in self.mano_s.items()},
            "merge_overhead_ms": {t: 1e3 * s for t, s in zip(self.softmax_tokens, self.merge_overhead_s, strict=False)},
        }


@torch.no_grad()
def measure_latency_table(
    model: nn.Module,
    info: ModelInfo,
    resolution: int,
    contrast_tokens: Sequence[int],
    *,
    mano_windows: Sequence[int] = (),
    repeats: int = 3,
    unmerge: str = "copy",
    min_time: float = 0.0,
    local_window: int = 0,
) -> LatencyTable:
    """Time the original model, its first block at a few token counts (softmax, and merging one token with
    `unmerge`: the matching's overhead) and that block as VCA(n) (with a local term of `local_window` when > 0) and
    as MANO(k) at the full grid; each `repeats` times at least, and until it has `min_time` seconds timed."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    full = info.tokens(resolution)
    prefix = info.num_prefix_tokens
    counts = sorted({max(prefix + 2, round(prefix + (full - prefix) * f)) for f in (1, 0.6, 0.35, 0.2, 0.1, 0.04)})
    block = info.blocks(model)[0]
    inputs = {t: torch.randn(1, t, info.dim, device=device, dtype=dtype) for t in counts}
    fns = {f"softmax:{t}": (lambda x=x: block(x)) for t, x in inputs.items()}
    image = torch.randn(1, 3, resolution, resolution, device=device, dtype=dtype)
    fns["original"] = lambda: final_tokens(model, image)
    x_full = torch.randn(1, full, info.dim, device=device, dtype=dtype)
    layout = TokenLayout(prefix, info.grid(resolution))
    # (config of a converted twin, {timing name: input of its first block}); merging one token, timed at every
    # token count, costs the matching's overhead alone
    space = plan_space()
    kinds = ((space.kind("vca"), contrast_tokens, local_window), (space.kind("mano"), mano_windows, 0))
    converted: list[tuple[TargetConfig, dict[str, torch.Tensor]]] = [
        (kind.config(value, [0], calibrate=None, local_window=window), {f"{kind.name}:{value}": x_full})
        for kind, values, window in kinds
        for value in values
    ]
    merging = space.schedule_config([1] + [0] * (info.depth - 1), unmerge=unmerge)
    converted.append((merging, {f"merge:{t}": x for t, x in inputs.items()}))
    twins = []  # kept alive while timing
    for config, timed in converted:
        twin = copy.deepcopy(model)
        patch_model(twin, config)
        twins.append(twin)
        twin_block, tracker = info.blocks(twin)[0], get_patch_state(twin).tracker
        if config is merging:  # its block does the end-of-model work too (the unmerge)
            space.mark_timed_block(twin_block)
        for key, x in timed.items():

            def run(b=twin_block, t=tracker, x=x):
                with t.scope(layout):
                    return b(x)

            fns[key] = run
    times = time_interleaved(fns, device, warmup=1, repeats=repeats, min_time=min_time)
    seconds = {name: median(samples) for name, samples in times.items()}
    softmax = [seconds[f"softmax:{t}"] for t in counts]
    other = max(0.0, seconds["original"] - info.depth * softmax[-1])
    overhead = [max(0.0, seconds[f"merge:{t}"] - s) for t, s in zip(counts, softmax, strict=True)]
    return LatencyTable(
        seconds["original"], other, counts, softmax, {n: seconds[f"vca:{n}"] for n in contrast_tokens},
        {k: seconds[f"mano:{k}"] for k in mano_windows}, overhead, local_window,
    )  # fmt: skip
