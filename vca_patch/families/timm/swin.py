"""timm Swin (`swin_*`) and SwinV2 (`swinv2_*`): shifted-window attention converted to `WindowedVCA` in stages
1…S−1 (the paper's AAAB).

The replacement stays where `WindowAttention` was and is called on the block's windows; a hook on each patched
block records the call's grid, window and shift (`WindowCall`), from which the layer rebuilds the full grid. The
last stage stays window softmax attention. Modes (`VCAConfig.swin_mode`): "residual" (default; the window
attention kept, its bias table and shift mask included, plus a zero-gated global VCA branch: exact at init) and
"global" (global VCA on the stage's full grid; the relative-position bias, window locality and shift mask are
dropped: approximate). λ_init follows the global block index over all stages. SwinV2's cosine attention keeps its
form (logit scale carried, normalised queries pooled); its continuous position bias (`cpb_mlp`) is kept by the
residual mode and dropped by the global one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.families.base import AttentionSite, ModelAdapter, SkippedSite, remove_hooks
from vca_patch.families.timm.base import describe_timm_base
from vca_patch.families.timm.staged import TimmStagedAdapter
from vca_patch.families.verify import Probe, eval_mode, on_meta, record_verdict, relative_error
from vca_patch.layers.cosine_window_carry import CarriedCosineWindowAttention
from vca_patch.layers.fused_qkv import QKVWithSeparateBias
from vca_patch.layers.layout import TokenLayout
from vca_patch.layers.staged_carry import CarriedWindowAttention
from vca_patch.layers.window_call import WindowCall, WindowCallEnd, WindowCallOwner, close_window_call, open_window_call

_RECORDED_ARGS = ("num_classes", "global_pool")
_MODULES = ("timm.models.swin_transformer", "timm.models.swin_transformer_v2")
LAST_STAGE_REASON = "last stage stays window attention (the paper's placement: VCA in stages 1-3)"
GLOBAL_MODE_NOTE = (
    "swin_mode='global': relative-position bias, window locality and shift mask dropped "
    "(global VCA over the stage's full grid)"
)
COSINE_GLOBAL_MODE_NOTE = (
    "swin_mode='global': continuous position bias (CPB MLP), window locality and shift mask dropped "
    "(global cosine VCA over the stage's full grid)"
)


class BlockWindowHook(WindowCallOwner):
    """Forward pre-hook on a Swin block: opens the call's `WindowCall` scope (grid of its [B, H, W, C] input)."""

    def __call__(self, block: nn.Module, args: tuple) -> None:
        x = args[0]
        call = WindowCall((x.shape[1], x.shape[2]), tuple(block.window_size), tuple(block.shift_size))  # no int()
        open_window_call(self, call)


class BlockWindowEnd(WindowCallEnd):
    """Forward hook (always called) on a Swin block: its window-call scope ends with it."""


def note_global_mode(replacement: nn.Module, site: AttentionSite) -> None:
    """Say in the site's notes (so the report calls it approximate, and strict refuses it) when the replacement
    runs `swin_mode='global'`, dropping the window bias (SwinV2: its CPB), locality and shift mask."""
    note = COSINE_GLOBAL_MODE_NOTE if replacement.cosine else GLOBAL_MODE_NOTE
    if replacement.mode == "global" and note not in site.notes:
        site.notes.append(note)


def reference_window_attention(carried: CarriedWindowAttention, x: torch.Tensor, mask: torch.Tensor | None):
    """W-MSA from `carried`'s weights, written out: softmax(s·q·kᵀ + bias + mask)·v, proj. x [B·nW, N, C].
    SwinV2 (`CarriedCosineWindowAttention`): softmax(L·q̂·k̂ᵀ + 16σ(CPB) + mask)·v, L = exp(min(logit_scale, ln 100))."""
    B_, N, _ = x.shape
    M, d = carried.num_heads, carried.head_dim
    q, k, v = carried.qkv(x).view(B_, N, 3, M, d).permute(2, 0, 3, 1, 4).unbind(0)
    if isinstance(carried, CarriedCosineWindowAttention):
        coords = carried.coords_table.to(x.dtype)  # a buffer: a float32 copy of a half module re-creates it
        table = 16 * torch.sigmoid(carried.position_mlp(coords).reshape(-1, M))
        bias = table[carried.position_index.reshape(-1)].reshape(N, N, M).permute(2, 0, 1)
        scale = torch.clamp(carried.logit_scale, max=math.log(100.0)).exp()  # [M, 1, 1]
        logits = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)) * scale + bias
    else:
        bias = carried.bias_table[carried.bias_index.reshape(-1)].reshape(N, N, M).permute(2, 0, 1)
        logits = (q @ k.transpose(-1, -2)) * d**-0.5 + bias
    if mask is not None:
        logits = (logits.view(-1, mask.shape[0], M, N, N) + mask[None, :, None]).view(B_, M, N, N)
    return carried.proj((torch.softmax(logits, -1) @ v).transpose(1, 2).reshape(B_, N, M * d))


@torch.no_grad()
def window_attention_error(
    module: nn.Module,
    carried: CarriedWindowAttention,
    dim: int,
    window: int,
    call: Callable[[nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> float:
    """Largest relative error of `call(module, windows, mask)` against `reference_window_attention`, without and
    under a random mask, on random [2·3, window, dim] windows (a half-precision module checked in float32)."""
    probe = Probe.of(module, carried)
    x = probe.randn(2 * 3, window, dim)
    mask = torch.where(torch.rand(3, window, window, generator=probe.generator) < 0.3, -100.0, 0.0).to(x)
    with eval_mode(probe.module):
        errors = []
        for m in (None, mask):
            expected = call(probe.module, x, m)
            got = reference_window_attention(probe.carried, x, m)
            errors.append(relative_error(got, expected))
    return max(errors)


class TimmSwinAdapter(TimmStagedAdapter):
    """Converts timm Swin window attention to `WindowedVCA`; see the module docstring."""

    name = "timm-swin"

    def __init__(self) -> None:
        super().__init__()
        self._hooks: dict[str, BlockWindowHook] = {}  # block path -> its hook, for the built replacements

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return type(model).__module__ in _MODULES and hasattr(model, "layers")

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        sites: list[AttentionSite] = []
        skipped: list[SkippedSite] = []
        index, last = 0, len(model.layers) - 1
        for i, stage in enumerate(model.layers):
            for j, block in enumerate(stage.blocks):
                path, attn = f"layers.{i}.blocks.{j}.attn", block.attn
                if i == last and last > 0:
                    skipped.append(SkippedSite(path, type(attn).__name__, LAST_STAGE_REASON))
                else:
                    settings = {"stage": i, "grid": list(block.input_resolution), "window": list(block.window_size)}
                    grid = tuple(block.input_resolution)
                    sites.append(
                        self.staged_site(path, attn, index, attn.qkv.in_features, attn.num_heads, i, settings, grid)
                    )
                index += 1
        return sites, skipped

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        return TokenLayout(0, tuple(int(g) for g in model.patch_embed.grid_size))

    def carry(self, site: AttentionSite) -> CarriedWindowAttention:
        attn = site.module
        stage, settings, grid = self._stages[site.path]
        if hasattr(attn, "logit_scale"):  # SwinV2: qkv + q_bias/v_bias, cosine attention, CPB
            qkv = attn.qkv if attn.q_bias is None else QKVWithSeparateBias(attn)
            return CarriedCosineWindowAttention(
                qkv=qkv, proj=attn.proj, num_heads=attn.num_heads,
                head_dim=attn.qkv.out_features // 3 // attn.num_heads, proj_drop=attn.proj_drop, stage=stage,
                settings=settings, grid=grid, logit_scale=attn.logit_scale, position_mlp=attn.cpb_mlp,
                coords_table=attn.relative_coords_table, position_index=attn.relative_position_index,
            )  # fmt: skip
        return CarriedWindowAttention(
            qkv=attn.qkv, proj=attn.proj, num_heads=attn.num_heads,
            head_dim=attn.qkv.out_features // 3 // attn.num_heads, proj_drop=attn.proj_drop, stage=stage,
            settings=settings, grid=grid, bias_table=attn.relative_position_bias_table,
            bias_index=attn.relative_position_index,
        )  # fmt: skip

    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        """The block calls `attn(windows, mask=...)` as before; the replacement reads the grid from its block's
        hook (installed with the layout tracker)."""
        block_path = site.path.rpartition(".")[0]
        hook = self._hooks.setdefault(block_path, BlockWindowHook())
        replacement.window_source = hook.current
        note_global_mode(replacement, site)

    def install_layout_tracker(self, model: nn.Module):
        tracker = super().install_layout_tracker(model)
        for block_path, hook in self._hooks.items():
            block = model.get_submodule(block_path)
            block.register_forward_pre_hook(hook)
            block.register_forward_hook(BlockWindowEnd(hook), always_call=True)
        return tracker

    @staticmethod
    def remove_layout_tracker(model: nn.Module) -> None:
        ModelAdapter.remove_layout_tracker(model)
        for hook in remove_hooks(model, (BlockWindowHook,), pre=True):
            close_window_call(hook)
        remove_hooks(model, (BlockWindowEnd,))

    @torch.no_grad()
    def verify(self, site: AttentionSite) -> AttentionSite:
        """The module must equal window attention built from its qkv, bias table (SwinV2: cosine scores, logit scale
        and CPB) and proj, under a shift mask."""
        module = site.module
        if on_meta(module):
            return site
        window = module.window_size[0] * module.window_size[1]
        error = window_attention_error(module, self.carry(site), site.dim, window, lambda m, x, mask: m(x, mask=mask))
        return record_verdict(site, error, "window attention")

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        args = {key: getattr(model, key) for key in _RECORDED_ARGS if hasattr(model, key)}
        embed = model.patch_embed
        args["img_size"] = list(embed.img_size)
        args["in_chans"] = embed.proj.in_channels
        if getattr(embed, "dynamic_img_size", False):
            args["dynamic_img_size"] = True
        return describe_timm_base(model, args)
