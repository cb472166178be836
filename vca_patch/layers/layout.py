"""Token layout of a vision transformer sequence: prefix tokens followed by a patch grid.

The layout belongs to one forward call, never to the model: a patched model's patch embedding opens a
*layout scope* (a context variable, so threads, DataParallel replicas and nested models each see their own)
that the model's forward closes. Layers that run during backward under gradient checkpointing find the
layout of the forward they recompute in the autograd graph: every layer records it on its output's
`grad_fn.metadata`, and a recomputation walks up from the autograd node being run to the nearest record.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLayout:
    """`num_prefix_tokens` tokens (CLS, distillation, registers) then an H×W grid, row-major."""

    num_prefix_tokens: int
    grid: tuple[int, int]

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_patches

    def check(self, num_tokens: int) -> None:
        """Raise a clear error when a sequence of `num_tokens` does not fit this layout."""
        if num_tokens != self.num_tokens:
            raise ValueError(
                f"sequence has {num_tokens} tokens but the layout expects "
                f"{self.num_prefix_tokens} prefix + {self.grid[0]}x{self.grid[1]} patches = "
                f"{self.num_tokens}; token dropping or merging before attention is not supported"
            )


def as_size(value: int | torch.SymInt | torch.Tensor) -> int:
    """A grid size as an int, kept symbolic under torch.compile / torch.export (`int()` on a symbolic size would
    specialise the traced graph to the size seen: one recompile per resolution, a grid baked into an export)."""
    return value if isinstance(value, (int, torch.SymInt)) else int(value)


_SCOPES: ContextVar[dict[Hashable, TokenLayout] | None] = ContextVar("vca_patch_layout_scopes", default=None)
_GRAPH_KEY = "vca_patch.layout"
_GRAPH_SEARCH_LIMIT = 4096  # autograd nodes visited at most when a recomputation looks for its layout


def open_scope(owner: Hashable, layout: TokenLayout) -> None:
    """Make `layout` the current layout of `owner` (a patched model's tracker) in this context."""
    _SCOPES.set({**(_SCOPES.get() or {}), owner: layout})


def close_scope(owner: Hashable) -> None:
    """End `owner`'s layout scope in this context (no-op when none is open)."""
    scopes = _SCOPES.get() or {}
    if owner in scopes:
        _SCOPES.set({k: v for k, v in scopes.items() if k is not owner})


def scoped_layout(owner: Hashable) -> TokenLayout | None:
    """`owner`'s layout in the current context, else None."""
    return (_SCOPES.get() or {}).get(owner)


def record_layout(output: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """Record `layout` on `output`'s autograd node (for the recomputation of gradient checkpointing); output."""
    node = None if torch.compiler.is_compiling() else output.grad_fn  # compiled graphs are not recomputed so
    if node is not None:
        node.metadata[_GRAPH_KEY] = layout
    return output


def recorded_layout() -> TokenLayout | None:
    """During backward, the layout recorded nearest above the autograd node being run (breadth first); else None.

    That node belongs to the graph of the forward being recomputed, and so do all nodes above it except
    parameter leaves (AccumulateGrad), which are never searched: a layout found there is that forward's.
    """
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    frontier, seen = [node], {node}
    while frontier and len(seen) < _GRAPH_SEARCH_LIMIT:
        parents = []
        for current in frontier:
            layout = current.metadata.get(_GRAPH_KEY)
            if layout is not None:
                return layout
            for parent, _ in current.next_functions:
                if parent is not None and parent not in seen and type(parent).__name__ != "AccumulateGrad":
                    seen.add(parent)
                    parents.append(parent)
        frontier = parents
    return None


def resolve_layout(
    owner: str,
    num_tokens: int,
    layout: TokenLayout | None,
    source: Callable[[], TokenLayout] | None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> TokenLayout:
    """The layout a grid attention module runs with: the one passed, else its source's; checked against N."""
    if attn_mask is not None or is_causal:
        raise ValueError(f"{owner} supports neither attention masks nor causal attention")
    if layout is None:
        if source is None:
            raise ValueError(
                f"{owner} needs the token layout: pass layout=TokenLayout(...) or patch the model with "
                "vca_patch.patch_model"
            )
        layout = source()
    layout.check(num_tokens)
    return layout


def tokens_to_grid(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """[B, M, N, d] per-head tokens -> [B, M*d, H, W] grid of the patch rows (channel = m*d + j)."""
    B, M, _, d = x.shape
    H, W = layout.grid
    patches = x[:, :, layout.num_prefix_tokens :]  # [B, M, H*W, d]
    return patches.transpose(-1, -2).reshape(B, M * d, H, W)


def grid_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H*W, C]."""
    return x.flatten(2).transpose(1, 2)
