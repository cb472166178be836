"""Merging blocks: a block's forward with token merging between its attention and its MLP (LayerScale kept).

Surgery sets a `MergingForward` as the block's `forward` (an instance attribute, removed by `unpatch_model`; the
block's modules and state-dict keys stay as they are). The blocks of one model share a `MergeState`: the sizes of
the current tokens and, for each original token, the current token it went into. The first merging block of a
forward starts it afresh; the last one gives every original token back ("unmerge"), so the model's output has all N
tokens again (dense heads read every patch; a CLS read-out is unchanged, prefix tokens never merge):
- "copy" (ToMe's, the default): each original token gets the final value of the token it went into;
- "residual": that value plus what merging took from the token, the difference between its residual stream and its
  group's mean at each merge. Blocks are residual, so a token's own part of the stream passes through them; giving
  it back makes merged patches differ again. Each merge keeps only its 2r merged rows; the unmerge undoes the merges
  last to first (one row copy per merge), a little more time than the copy's single one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.targets.merge.matching import add_rows_, bipartite_soft_matching, take_rows


@dataclass(frozen=True)
class BlockFamily:
    """Names of a pre-norm block's parts: x += drop1(ls1(attn(norm1(x)))); x += drop2(ls2(mlp(norm2(x))))."""

    norm1: str
    attn: str
    ls1: str
    drop1: str
    norm2: str
    mlp: str
    ls2: str
    drop2: str
    mask_arguments: tuple[str, ...]  # call arguments that carry an attention mask (must be None)


FAMILIES = {
    "timm.models.vision_transformer.Block": BlockFamily(
        "norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2", ("attn_mask",)
    ),
    "transformers.models.dinov2.modeling_dinov2.Dinov2Layer": BlockFamily(
        "norm1",
        "attention",
        "layer_scale1",
        "drop_path",
        "norm2",
        "mlp",
        "layer_scale2",
        "drop_path",
        ("attention_mask",),
    ),
}


def block_family(block: nn.Module, attention_name: str) -> BlockFamily:
    """The family of `block`, refusing blocks whose forward merging does not know."""
    name = f"{type(block).__module__}.{type(block).__name__}"
    family = FAMILIES.get(name)
    if family is None or family.attn != attention_name:
        raise ConfigError(
            f"token merging knows the blocks of timm VisionTransformer and transformers Dinov2Model, not {name} "
            f"(attention {attention_name!r}); supported: " + ", ".join(sorted(FAMILIES))
        )
    return family


class MergeState(threading.local):
    """Per-forward token state shared by one model's merging blocks (per thread)."""

    def __init__(self) -> None:
        self.reset()

    def __reduce__(self):  # copies and pickles start empty (a thread-local holds nothing worth keeping)
        return (MergeState, ())

    def __deepcopy__(self, memo: dict) -> MergeState:
        return MergeState()

    def reset(self) -> None:
        self.size: torch.Tensor | None = None  # (B, N', 1), float32 or wider: original tokens in each current token
        self.source: torch.Tensor | None = None  # (B, N): current token of each original token
        # "residual" unmerge, per merge: (positions (B, N_k), rows (B, 2r), taken (B, 2r, C)): where each token went,
        # the tokens that merged (A sources, then B destinations) and what merging took from each of them (a B token
        # appears once per A token it took: `TokenMerge.merge_residual`)
        self.steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.kept: list[int] = []  # tokens after each block of the last forward (for reports)
        self.keys: torch.Tensor | None = None  # the last merging attention's keys (B, heads, N', head_dim)


class MergingForward:
    """The forward of one merging block; `r` tokens merge after its attention (0: proportional attention only).
    `residual`: the last block's unmerge gives each token back what merging took from it (see the module notes)."""

    def __init__(
        self,
        block: nn.Module,
        family: BlockFamily,
        r: int,
        first: bool,
        last: bool,
        state: MergeState,
        residual: bool = False,
    ):
        self.block, self.family, self.r, self.first, self.last, self.state = block, family, r, first, last, state
        self.residual = residual

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        family, block, state = self.family, self.block, self.state
        masks = [args[0]] if args else []
        masks += [kwargs.get(name) for name in family.mask_arguments]
        if any(m is not None for m in masks) or kwargs.get("is_causal"):
            raise ValueError("token merging takes no attention mask (merging changes the token count)")
        if self.first:
            state.reset()
        elif state.size is not None and state.size.shape[1] != x.shape[1]:
            raise RuntimeError("merging blocks must run in order, from the model's first block, in one forward")
        part = block.get_submodule
        attn = part(family.attn)
        if not hasattr(attn, "attend"):  # the original attention put back for a while (calibration's capture)
            state.reset()
            return type(block).forward(block, x, *args, **kwargs)
        attn.__dict__["merge_state"] = state  # sizes in, keys out (a plain attribute: no module, no state-dict key)
        state.keys = None
        h = attn(part(family.norm1)(x))
        h = h[0] if isinstance(h, tuple) else h  # transformers' attention returns (output, weights)
        keys, state.keys = state.keys, None
        x = x + part(family.drop1)(part(family.ls1)(h))
        if self.r > 0:
            if state.size is None:
                batch, tokens = x.shape[:2]
                precision = torch.promote_types(x.dtype, torch.float32)  # sizes count tokens: not in half
                state.size = torch.ones(batch, tokens, 1, device=x.device, dtype=precision)
                state.source = torch.arange(tokens, device=x.device).expand(batch, -1)
            prefix = attn.layout_source().num_prefix_tokens  # the token layout of this forward (surgery sets it)
            merge = bipartite_soft_matching(keys.sum(dim=1), self.r, prefix)  # ToMe's metric: keys over heads
            positions = merge.positions()  # (B, N_k): where each current token goes
            if self.residual:  # only merged tokens differ from where they went: keep what merging took from those
                merged, state.size, rows, taken = merge.merge_residual(x, state.size)
                state.steps.append((positions, rows, taken))
            else:
                merged, state.size = merge.merge(x, state.size)
            state.source = positions.gather(1, state.source)
            x = merged
        x = x + part(family.drop2)(part(family.ls2)(part(family.mlp)(part(family.norm2)(x))))
        if not torch.compiler.is_compiling():  # a report; int() of a traced size would pin the token count
            state.kept.append(int(x.shape[1]))
        if self.last and state.source is not None:
            x = residual_unmerge(x, state.steps) if self.residual else unmerge(x, state.source)
            state.size = state.source = None
            state.steps = []
        return x


def unmerge(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """ToMe's unmerge: each original token gets the merged token it went into, (B, N', C), (B, N) -> (B, N, C)."""
    return take_rows(x, source)


def residual_unmerge(x: torch.Tensor, steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Every original token back with what each merge took from it: the merges undone last to first, each copying
    tokens back to where they were (N_{k+1} -> N_k) and adding `taken` to the tokens that merged there.
    Exactly the merged token plus the sum over merges of (its stream before the merge - its group's mean), computed
    on 2r rows per merge instead of all N."""
    for positions, rows, taken in reversed(steps):
        x = add_rows_(take_rows(x, positions), rows, taken)  # in place on a new tensor
    return x
