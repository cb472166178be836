"""What the planner needs to know about a model: blocks, widths, prefix tokens, patch size, and how to run it."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.surgery import inspect_model
from vca_patch.targets.base import plan_space


class PlanError(ConfigError):
    """The planner cannot plan or apply as asked (bad budget, data or plan file); nothing was written."""


@dataclass(frozen=True)
class ModelInfo:
    """A single-grid ViT as the planner sees it (timm VisionTransformer or transformers Dinov2Model)."""

    depth: int
    dim: int
    num_heads: int
    num_prefix_tokens: int
    patch: int
    linear_macs_per_token: float  # per block: Σ in·out of its Linear layers
    block_paths: tuple[str, ...]
    norm_path: str  # the final norm after the last block

    def grid(self, resolution: int) -> tuple[int, int]:
        if resolution < self.patch or resolution % self.patch:
            raise PlanError(f"resolution {resolution} is not a positive multiple of the patch size {self.patch}")
        side = resolution // self.patch
        return side, side

    def tokens(self, resolution: int) -> int:
        grid = self.grid(resolution)
        return self.num_prefix_tokens + grid[0] * grid[1]

    def expect(self) -> dict[str, int]:
        return {"depth": self.depth, "dim": self.dim, "num_heads": self.num_heads}

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [model.get_submodule(p) for p in self.block_paths]


_FINAL_NORMS = ("norm", "layernorm")  # timm VisionTransformer, transformers Dinov2Model


def model_info(model: nn.Module) -> ModelInfo:
    """Read `model` (refusing one token merging cannot convert, with the reason)."""
    try:
        report = inspect_model(model, plan_space().survey_config())
    except ValueError as error:
        raise PlanError(f"the planner needs a model token merging can convert: {error}") from error
    if not report.patched:  # nothing to convert: every candidate skipped, with why
        reasons = "; ".join(f"{s.path or type(model).__name__}: {s.reason}" for s in report.skipped[:3])
        raise PlanError(f"the planner needs a model token merging can convert; {type(model).__name__}: {reasons}")
    sites = sorted(report.patched, key=lambda s: s.layer_index)
    blocks = tuple(s.path.rpartition(".")[0] for s in sites)
    block = model.get_submodule(blocks[0])
    linear = sum(m.in_features * m.out_features for m in block.modules() if isinstance(m, nn.Linear))
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    norm = next((name for name in _FINAL_NORMS if isinstance(getattr(model, name, None), nn.Module)), None)
    if conv is None or report.layout is None or norm is None:
        raise PlanError(f"{type(model).__name__}: no patch convolution, token layout or final norm the planner knows")
    return ModelInfo(
        depth=len(sites),
        dim=sites[0].dim,
        num_heads=sites[0].num_heads,
        num_prefix_tokens=report.layout.num_prefix_tokens,
        patch=int(conv.kernel_size[0]),
        linear_macs_per_token=float(linear),
        block_paths=blocks,
        norm_path=norm,
    )


def block_inputs(model: nn.Module, info: ModelInfo, images: torch.Tensor) -> list[torch.Tensor]:
    """The original model's hidden states entering each block (and, last, leaving the last one), one forward."""
    states: list[torch.Tensor] = []
    handles = [b.register_forward_pre_hook(lambda m, args: states.append(args[0].detach())) for b in info.blocks(model)]
    handles.append(info.blocks(model)[-1].register_forward_hook(lambda m, args, out: states.append(out.detach())))
    try:
        with torch.no_grad():
            from vca_patch.eval.final_tokens import final_tokens

            final_tokens(model, images)
    finally:
        for handle in handles:
            handle.remove()
    return states


@torch.no_grad()
def run_blocks(
    model: nn.Module, info: ModelInfo, start: int, stop: int, hidden: torch.Tensor, resolution: int
) -> torch.Tensor:
    """The hidden state leaving block `stop` - 1 from `hidden` entering block `start` (blocks start..stop-1, inside
    the model's token-layout scope when it is patched)."""
    from vca_patch.layers.layout import TokenLayout
    from vca_patch.surgery import get_patch_state

    state = get_patch_state(model)
    scope = state.tracker.scope(TokenLayout(info.num_prefix_tokens, info.grid(resolution))) if state else nullcontext()
    with scope:
        x = hidden
        for block in info.blocks(model)[start:stop]:
            x = block(x)
        return x


@torch.no_grad()
def run_from(model: nn.Module, info: ModelInfo, start: int, hidden: torch.Tensor, resolution: int) -> torch.Tensor:
    """Final normed tokens from the hidden state entering block `start` (blocks start.., then the final norm)."""
    x = run_blocks(model, info, start, info.depth, hidden, resolution)
    return model.get_submodule(info.norm_path)(x)
