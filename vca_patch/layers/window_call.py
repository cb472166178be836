"""How one call of a windowed block partitioned its grid, and the per-call scope a window layer reads it from.

A shifted-window block (Swin) rolls its H×W grid by `shift`, pads it to whole windows and hands its attention
the windows only. The block's own forward (a hook of the adapter's) opens a scope with these facts; the window
layer reads them to rebuild the full grid from the windows and to partition its output back. A context variable,
as for `layout`: threads and model copies each see their own call. Under torch.compile / torch.export (dynamo
cannot trace a context variable's mutation) the call is a plain attribute of its owner (`traced`), set by the
block's hook within the traced call and read by its layer: the graph carries the grid as the (symbolic) shapes it
is derived from, and no lookup keyed by the owner runs in traced code.
"""

from __future__ import annotations

from collections.abc import Hashable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vca_patch.layers.windows import pad_grid, window_merge, window_partition


@dataclass(frozen=True)
class WindowCall:
    """The block input's grid (H, W), its window (kh, kw) and its cyclic shift (sh, sw)."""

    grid: tuple[int, int]
    window: tuple[int, int]
    shift: tuple[int, int] = (0, 0)

    @property
    def padded(self) -> tuple[int, int]:
        (H, W), (kh, kw) = self.grid, self.window
        return -(-H // kh) * kh, -(-W // kw) * kw  # integer ceil: stays a symbolic size under torch.compile

    @property
    def num_windows(self) -> int:
        (Hp, Wp), (kh, kw) = self.padded, self.window
        return (Hp // kh) * (Wp // kw)

    def merge_windows(self, windows: torch.Tensor) -> torch.Tensor:
        """[B·nW, kh·kw, C] windows -> the padded [B, Hp, Wp, C] grid they tile (still shifted, still padded); a
        clear error when their count or size is not this call's."""
        kh, kw = self.window
        if windows.shape[1] != kh * kw or windows.shape[0] % self.num_windows:
            raise ValueError(
                f"got {tuple(windows.shape[:2])} window tokens, expected (B·{self.num_windows}, {kh * kw}) for a "
                f"{self.grid[0]}x{self.grid[1]} grid in {kh}x{kw} windows"
            )
        return window_merge(windows.view(-1, self.num_windows, kh * kw, windows.shape[-1]), self.padded, self.window)

    def windows_to_grid(self, windows: torch.Tensor) -> torch.Tensor:
        """[B·nW, kh·kw, C] windows of the shifted, padded grid -> the block's [B, H, W, C] grid (a copy)."""
        H, W = self.grid
        grid = self.merge_windows(windows)[:, :H, :W]
        return torch.roll(grid, shifts=self.shift, dims=(1, 2)) if any(self.shift) else grid.contiguous()

    def grid_to_windows(self, grid: torch.Tensor) -> torch.Tensor:
        """Inverse of `windows_to_grid`: [B, H, W, C] -> [B·nW, kh·kw, C] (padding rows zero)."""
        if any(self.shift):
            grid = torch.roll(grid, shifts=(-self.shift[0], -self.shift[1]), dims=(1, 2))
        windows = window_partition(pad_grid(grid, self.padded), self.window)  # [B, nW, kh·kw, C]
        return windows.reshape(-1, windows.shape[-2], windows.shape[-1])


_CALLS: ContextVar[dict[Hashable, WindowCall] | None] = ContextVar("vca_patch_window_calls", default=None)


def open_window_call(owner: Hashable, call: WindowCall) -> None:
    """Make `call` the current window call of `owner` (a block's hook) in this context; while torch.compile traces,
    the owner's plain attribute `traced` instead."""
    if torch.compiler.is_compiling():
        owner.traced = call
    else:
        _CALLS.set({**(_CALLS.get() or {}), owner: call})


def close_window_call(owner: Hashable) -> None:
    if torch.compiler.is_compiling():
        owner.traced = None
        return
    calls = _CALLS.get() or {}
    if owner in calls:
        _CALLS.set({k: v for k, v in calls.items() if k is not owner})


def current_window_call(owner: Hashable) -> WindowCall | None:
    if torch.compiler.is_compiling():
        call = getattr(owner, "traced", None)
        if call is not None:
            return call
    return (_CALLS.get() or {}).get(owner)


class WindowCallOwner:
    """Owns a windowed block's window-call scope (subclasses are the block's pre-hooks that open it): `current` is
    the call it opened in this context, or None; a replacement reads it as its `window_source`."""

    traced: WindowCall | None = None  # the call being traced by torch.compile / torch.export (see the module doc)

    def current(self) -> WindowCall | None:
        return current_window_call(self)


class WindowCallEnd:
    """Forward hook (register it with `always_call=True`) on a windowed block: `hook`'s window-call scope ends with
    the block's call."""

    def __init__(self, hook: WindowCallOwner) -> None:
        self.hook = hook

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        close_window_call(self.hook)
