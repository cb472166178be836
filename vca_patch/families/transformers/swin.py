"""Hugging Face transformers Swin (`SwinModel`, `SwinForImageClassification`, `SwinBackbone`): window attention
converted to `WindowedVCA` in stages 1…S−1 (the paper's AAAB), as timm's (`timm_swin`).

`SwinAttention` (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `relative_position_bias`) is called on the windows of
its `SwinLayer` and returns `(output, weights)`. A pre-hook on each patched `SwinLayer` records the call's grid
(`input_dimensions`), window and shift — after `set_shift_and_window_size`, which the layer itself applies — and
the replacement rebuilds the full grid from the windows (`RecordingClamp` records it again when gradient
checkpointing recomputes the layer, where hooks do not run). transformers pads the grid before the cyclic shift
(timm shifts, then pads), so the windows are read with `PaddedShiftWindowCall`. Modes (`VCAConfig.swin_mode`):
"residual" (default; the window attention kept, its `relative_position_bias` module carried whole under its name,
plus a zero-gated global VCA branch: exact at init) and "global" (approximate: the bias, window locality and shift
mask dropped). The last stage stays window softmax attention.

`Swinv2Model`: the site is `attention.self` (`Swinv2SelfAttention`: `query`, `key`, `value`, `logit_scale`,
`continuous_position_bias_mlp`); its output projection `attention.output.dense` stays where it is, after the
replacement (whose own projection is the identity: the residual gate then acts before `dense`). Cosine attention
is kept as in timm's SwinV2 (`timm_swin`). `Swinv2Layer` never clamps its window at run time; its `maybe_pad`,
called first in every forward (recomputations included), records the call's grid (`RecordingPad`).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from vca_patch.families.base import AttentionSite, ModelAdapter, SkippedSite, remove_hooks
from vca_patch.families.call_shims import TupleOutput
from vca_patch.families.timm.swin import LAST_STAGE_REASON, note_global_mode, window_attention_error
from vca_patch.families.transformers.staged import HFStagedAdapter
from vca_patch.families.verify import on_meta, record_verdict
from vca_patch.layers.cosine_window_carry import CarriedCosineWindowAttention
from vca_patch.layers.fused_qkv import SplitQKV
from vca_patch.layers.layout import TokenLayout, as_size
from vca_patch.layers.staged_carry import CarriedWindowAttention
from vca_patch.layers.window_call import WindowCall, WindowCallEnd, WindowCallOwner, close_window_call, open_window_call
from vca_patch.layers.window_terms import PassThroughProjection
from vca_patch.layers.windows import pad_grid, window_partition

_SWIN_MODULE = "transformers.models.swin.modeling_swin"
_SWINV2_MODULE = "transformers.models.swinv2.modeling_swinv2"
_SITE = re.compile(r"(?:^|\.)layers\.(\d+)\.blocks\.(\d+)\.attention(\.self)?$")
_SITE_CLASSES = {"SwinAttention": False, "Swinv2SelfAttention": True}  # class -> the site is `attention.self`
_IGNORED_KWARGS = ("output_attentions", "output_hidden_states", "return_dict", "layout")


class PaddedShiftWindowCall(WindowCall):
    """A window call of transformers' `SwinLayer`: the grid padded to whole windows first, then rolled by `shift`."""

    def windows_to_grid(self, windows: torch.Tensor) -> torch.Tensor:
        grid = self.merge_windows(windows)
        if any(self.shift):
            grid = torch.roll(grid, shifts=self.shift, dims=(1, 2))
        return grid[:, : self.grid[0], : self.grid[1]].contiguous()

    def grid_to_windows(self, grid: torch.Tensor) -> torch.Tensor:
        padded = pad_grid(grid, self.padded)
        if any(self.shift):
            padded = torch.roll(padded, shifts=(-self.shift[0], -self.shift[1]), dims=(1, 2))
        windows = window_partition(padded, self.window)  # [B, nW, kh·kw, C]
        return windows.reshape(-1, windows.shape[-2], windows.shape[-1])


def _window_and_shift(block: nn.Module, grid: tuple[int, int]) -> tuple[int, int]:
    """The window and shift `SwinLayer` uses on `grid` (it clamps both when the grid is no larger than a window)."""
    if min(grid) <= block.window_size:
        return as_size(min(grid)), 0
    return int(block.window_size), int(block.shift_size)


class SwinLayerWindowHook(WindowCallOwner):
    """Forward pre-hook on a transformers `SwinLayer`: opens the call's `WindowCall` scope."""

    def __call__(self, block: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        dims = args[1] if len(args) > 1 else kwargs["input_dimensions"]
        always_partition = args[2] if len(args) > 2 else kwargs.get("always_partition", False)
        grid = (as_size(dims[0]), as_size(dims[1]))
        if always_partition:
            window, shift = int(block.window_size), int(block.shift_size)
        else:
            window, shift = _window_and_shift(block, grid)
        open_window_call(self, PaddedShiftWindowCall(grid, (window, window), (shift, shift)))


class RecordingClamp:
    """Instance override of `SwinLayer.set_shift_and_window_size`: runs the layer's own method, then opens the
    call's window scope from the clamped window and shift.

    The layer calls it first in its forward, also when gradient checkpointing recomputes that forward during
    backward, where module hooks do not run (transformers checkpoints `forward`, not `__call__`).
    """

    def __init__(self, block: nn.Module, hook: SwinLayerWindowHook) -> None:
        self.block, self.hook = block, hook

    def __call__(self, input_resolution: tuple[int, int]) -> None:
        type(self.block).set_shift_and_window_size(self.block, input_resolution)
        grid = (as_size(input_resolution[0]), as_size(input_resolution[1]))
        window, shift = as_size(self.block.window_size), as_size(self.block.shift_size)
        open_window_call(self.hook, PaddedShiftWindowCall(grid, (window, window), (shift, shift)))


class RecordingPad:
    """Instance override of `Swinv2Layer.maybe_pad`: opens the call's window scope from the unpadded grid, then runs
    the layer's own method (the first thing its forward does, also when gradient checkpointing recomputes it)."""

    def __init__(self, block: nn.Module, hook: SwinLayerWindowHook) -> None:
        self.block, self.hook = block, hook

    def __call__(self, hidden_states: torch.Tensor, height: int, width: int):
        window, shift = as_size(self.block.window_size), as_size(self.block.shift_size)
        grid = (as_size(height), as_size(width))
        open_window_call(self.hook, PaddedShiftWindowCall(grid, (window, window), (shift, shift)))
        return type(self.block).maybe_pad(self.block, hidden_states, height, width)


class SwinLayerWindowEnd(WindowCallEnd):
    """Forward hook (always called) on a `SwinLayer`: its window-call scope ends with it."""


class SwinCallShim:
    """Forward pre-hook: `attention(windows, attention_mask, **kwargs)` -> `layer(windows, mask)`; a keyword that
    asks for something the replacement cannot give (attention weights, ...) is an error naming it."""

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        x = args[0] if args else kwargs.pop("hidden_states")
        mask = args[1] if len(args) > 1 else kwargs.pop("attention_mask", None)
        if len(args) > 2:  # Swinv2Attention calls self(hidden_states, attention_mask, output_attentions)
            kwargs["output_attentions"] = args[2]
        asked = sorted(k for k, v in kwargs.items() if k not in _IGNORED_KWARGS and v is not None and v is not False)
        if asked or kwargs.get("output_attentions"):
            raise TypeError(
                f"{type(module).__name__} (patched by vca_patch) cannot apply the call argument(s) "
                f"{', '.join(asked) or 'output_attentions'}: VCA has no per-window attention weights"
            )
        return (x, mask), {}


def _block_path(site_path: str) -> str:
    """The `SwinLayer`/`Swinv2Layer` holding a site (`...blocks.j.attention` or `...blocks.j.attention.self`)."""
    return site_path.removesuffix(".self").rpartition(".")[0]


class HFSwinAdapter(HFStagedAdapter):
    """Converts transformers Swin window attention to `WindowedVCA`; see the module docstring."""

    name = "hf-swin"

    def __init__(self) -> None:
        super().__init__()
        self._hooks: dict[str, SwinLayerWindowHook] = {}  # SwinLayer path -> its hook

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return type(model).__module__ in (_SWIN_MODULE, _SWINV2_MODULE)

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        sites: list[AttentionSite] = []
        skipped: list[SkippedSite] = []
        last = len(model.config.depths) - 1
        index = 0
        for path, attn in model.named_modules():
            match = _SITE.search(path)
            nested = _SITE_CLASSES.get(type(attn).__name__)
            if match is None or nested is None or nested != bool(match.group(3)):
                continue
            stage = int(match.group(1))
            if stage == last and last > 0:
                skipped.append(SkippedSite(path, type(attn).__name__, LAST_STAGE_REASON))
            else:
                block = model.get_submodule(_block_path(path))
                grid = tuple(int(g) for g in block.input_resolution)
                window, _ = _window_and_shift(block, grid)
                settings = {"stage": stage, "grid": list(grid), "window": [window, window]}
                dim = (attn.query if nested else attn.q_proj).in_features
                sites.append(self.staged_site(path, attn, index, dim, attn.num_attention_heads, stage, settings, grid))
            index += 1
        return sites, skipped

    def embedding_module(self, model: nn.Module) -> nn.Module:
        return next(m for m in model.modules() if type(m).__name__ in ("SwinEmbeddings", "Swinv2Embeddings"))

    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout:
        _, dims = output  # (tokens, (height, width)): stage 1's grid
        return TokenLayout(0, (as_size(dims[0]), as_size(dims[1])))

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        size, patch = model.config.image_size, model.config.patch_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        patch = (patch, patch) if isinstance(patch, int) else tuple(patch)
        return TokenLayout(0, (size[0] // patch[0], size[1] // patch[1]))

    def carry(self, site: AttentionSite) -> CarriedWindowAttention:
        attn = site.module
        stage, settings, grid = self._stages[site.path]
        if type(attn).__name__ == "Swinv2SelfAttention":  # its output projection stays outside, in attention.output
            return CarriedCosineWindowAttention(
                qkv=SplitQKV(attn, ("query", "key", "value")), proj=PassThroughProjection(attn.all_head_size),
                num_heads=attn.num_attention_heads, head_dim=attn.attention_head_size, stage=stage, settings=settings,
                grid=grid, logit_scale=attn.logit_scale, position_mlp=attn.continuous_position_bias_mlp,
                coords_table=attn.relative_coords_table, position_index=attn.relative_position_index,
                cosine_names=("logit_scale", "continuous_position_bias_mlp"),
            )  # fmt: skip
        bias = attn.relative_position_bias
        return CarriedWindowAttention(
            qkv=SplitQKV(attn), proj=attn.o_proj, proj_name="o_proj", num_heads=attn.num_attention_heads,
            head_dim=attn.head_dim, stage=stage, settings=settings, grid=grid,
            bias_table=bias.relative_position_bias_table,
            bias_index=bias.relative_position_index, bias_module=bias, bias_module_name="relative_position_bias",
        )  # fmt: skip

    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        """The layer calls `attention(windows, mask)` as before; the replacement reads the grid from the
        `SwinLayer`'s hook (installed with the layout tracker) and returns `(output, None)`."""
        hook = self._hooks.setdefault(_block_path(site.path), SwinLayerWindowHook())
        replacement.window_source = hook.current
        replacement.register_forward_pre_hook(SwinCallShim(), with_kwargs=True)
        replacement.register_forward_hook(TupleOutput())
        note_global_mode(replacement, site)

    def install_layout_tracker(self, model: nn.Module):
        tracker = super().install_layout_tracker(model)
        for block_path, hook in self._hooks.items():
            block = model.get_submodule(block_path)
            block.register_forward_hook(SwinLayerWindowEnd(hook), always_call=True)
            if hasattr(block, "set_shift_and_window_size"):  # Swin
                block.register_forward_pre_hook(hook, with_kwargs=True)
                block.set_shift_and_window_size = RecordingClamp(block, hook)
            else:  # Swinv2
                block.maybe_pad = RecordingPad(block, hook)
        return tracker

    @staticmethod
    def remove_layout_tracker(model: nn.Module) -> None:
        ModelAdapter.remove_layout_tracker(model)
        for module in model.modules():
            if isinstance(module.__dict__.get("set_shift_and_window_size"), RecordingClamp):
                del module.__dict__["set_shift_and_window_size"]
            if isinstance(module.__dict__.get("maybe_pad"), RecordingPad):
                close_window_call(module.__dict__.pop("maybe_pad").hook)
        for hook in remove_hooks(model, (SwinLayerWindowHook,), pre=True):
            close_window_call(hook)
        remove_hooks(model, (SwinLayerWindowEnd,))

    @torch.no_grad()
    def verify(self, site: AttentionSite) -> AttentionSite:
        """The module must equal window attention built from its q/k/v, bias table and o_proj (Swinv2: cosine scores,
        logit scale and CPB, no projection), under a mask."""
        module = site.module
        if on_meta(module):
            return site
        v2 = hasattr(module, "window_size")
        window = math.prod(module.window_size) if v2 else module.relative_position_bias.window_area
        error = window_attention_error(module, self.carry(site), site.dim, window, lambda m, x, mask: m(x, mask)[0])
        return record_verdict(site, error, "window attention")
