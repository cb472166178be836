"""Joint (image + text) Visual-Contrast Attention: MM-DiT attention (SD3/SD3.5) with the text as exact prefix tokens.

An MM-DiT block attends over one joint sequence of N image tokens and L text tokens, each stream with its own
q/k/v projections, per-head norms and output projection. Converted, the L text tokens are VCA prefix tokens under
the exact read-out: text queries read all L + N keys with plain softmax attention (O(L·N), linear in N: L is
fixed), so the text stream's output is the original's. Image queries run VCA: the contrast tokens are pooled from
the image queries only, Stage I reads all L + N keys (text included), Stage II the 2n contrast tokens, and the
depthwise term reads the image values. Softmax attention does not depend on where in the sequence the text sits
(image first in SD3, text first in Flux), so the layer takes the two streams apart and returns them apart.

Flux's rotary embedding is kept: every query and key is rotated after its norm, and the contrast tokens are
pooled from the rotated image queries ("pooled") or pooled un-rotated and rotated at their cell's centre
("centre"; identical for one-token cells), see `rope_contrast`.

Flux's single-stream blocks attend over one [text; image] sequence with one set of q/k/v projections and norms and
no output projection inside the attention (the block's `proj_out` mixes it with the MLP branch):
`SingleStreamVisualContrastAttention` runs the same joint VCA over that sequence, text as exact prefix tokens.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vca_patch.layers.fused_qkv import query_projection
from vca_patch.layers.grid_pool import adaptive_avg_pool_tokens
from vca_patch.layers.joint_carry import (  # noqa: F401  (re-exported)
    IMAGE_NORMS,
    TEXT_NORMS,
    TEXT_PROJECTIONS,
    CarriedJointAttention,
    CarriedSingleStreamAttention,
    NoOutputProjection,
    rotate,
)
from vca_patch.layers.layout import TokenLayout, record_layout, resolve_layout
from vca_patch.targets.vca.layer import _POOL_INPUT_MIN_RATIO, VisualContrastAttention, _patch_grid

# The text stream's carried members, under the names diffusers' `Attention` holds them.
# How contrast tokens get a rotary embedding (Flux): "centre": pooled from the un-rotated queries, then rotated at
# their cell's centre; "pooled": pooled from the rotated queries.
RopeContrast = Literal["centre", "pooled"]
DEFAULT_ROPE_CONTRAST: RopeContrast = "pooled"  # measured marginally closer to the teacher (VCAConfig.rope_contrast)


class JointVisualContrastAttention(VisualContrastAttention):
    """VCA over image tokens [B, N, C] on an H×W grid plus L text tokens [B, L, C_text] as exact prefix tokens.

    Called as `layer(x, context, layout=None, rotary=None) -> (image_out [B, N, C_out], text_out [B, L, C_text_out])`;
    the layout is the image grid (no prefix). The carried text members keep diffusers' names (`add_q_proj`, ...,
    `norm_q`, `norm_added_q`, `to_add_out`); the image norms `norm_q`/`norm_k` are applied per stream here, so
    the base class's `q_norm`/`k_norm` stay Identity.
    """

    def carry_text(self, carried: CarriedJointAttention) -> None:
        """Take the text stream's modules and the per-stream norms from `carried`."""
        for name in TEXT_PROJECTIONS:
            self._carry(name, getattr(carried, name))
        for name, attr in {**IMAGE_NORMS, **TEXT_NORMS}.items():
            module = getattr(carried, attr)
            if not isinstance(module, nn.Identity):
                self._carry(name, module)
        if carried.to_add_out is not None:
            self._carry("to_add_out", carried.to_add_out)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.prefix_readout = "exact"
        self.rope_contrast: RopeContrast = DEFAULT_ROPE_CONTRAST

    def stream_members(self) -> tuple[str, ...]:
        """Names of the carried text-stream modules and per-stream norms this layer holds."""
        names = (*TEXT_PROJECTIONS, *IMAGE_NORMS, *TEXT_NORMS, "to_add_out")
        return tuple(name for name in names if name in self._modules)

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        module = self._modules.get(name)
        return x if module is None else module(x)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        *,
        layout: TokenLayout | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rotary: (cos, sin) [L + N, d] of the joint sequence, text first (Flux), applied to q and k after the
        norms; the contrast tokens are rotated as `rope_contrast` says."""
        layout = resolve_layout(type(self).__name__, x.shape[1], layout, self.layout_source)
        if layout.num_prefix_tokens:
            raise ValueError(f"{type(self).__name__} takes image tokens only, got {layout.num_prefix_tokens} prefix")
        if context.ndim != 3 or context.shape[0] != x.shape[0]:
            raise ValueError(f"text tokens must be [B, L, C] with B = {x.shape[0]}, got {tuple(context.shape)}")
        L = context.shape[1]
        joint = TokenLayout(L, layout.grid)
        q, k, v = self.project_qkv(x)  # image, [B, M, N, d]
        q, k = self._norm("norm_q", q), self._norm("norm_k", k)
        tq, tk, tv = (self._heads(self._modules[name](context)) for name in TEXT_PROJECTIONS)
        tq, tk = self._norm("norm_added_q", tq), self._norm("norm_added_k", tk)
        q, k, v = (torch.cat(pair, dim=2) for pair in ((tq, q), (tk, k), (tv, v)))  # text first: VCA's prefix
        inputs = JointInputs(x)
        if rotary is not None:
            cos, sin = rotary
            if cos.shape[0] != L + layout.num_patches:
                raise ValueError(f"rotary embedding has {cos.shape[0]} positions for {L} + {layout.num_patches} tokens")
            plain_q = q
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            if self.rope_contrast == "centre":
                inputs = JointInputs(x, plain_q, self.centre_rotary(layout, x.device), rotated=True)
            else:
                inputs = JointInputs(x, rotated=True)
        trains = q.requires_grad or v.requires_grad or self.contrast_embed_pos.requires_grad
        if self.recompute_in_backward and torch.is_grad_enabled() and trains:
            o = checkpoint(self.attend, inputs, q, k, v, joint, use_reentrant=False)
        else:
            o = self.attend(inputs, q, k, v, joint)  # [B, L + N, attn_dim], not yet projected (see `project_out`)
        record_layout(o, layout)  # both streams descend from o: a recomputation under checkpointing finds it
        image = VisualContrastAttention.project_out(self, x, o[:, L:])
        text_out = o[:, :L]
        add_out = self._modules.get("to_add_out")
        if add_out is not None:
            text_out = add_out(text_out)
        return record_layout(image, layout), text_out

    def centre_rotary(self, layout: TokenLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [n, d] at the centres of the contrast cells, from `rotary_embed` on fractional position
        ids (0, row, col): the mean id of each adaptive-pooling window (Flux's image ids are (0, row, col))."""
        embed = self.__dict__.get("rotary_embed")
        if embed is None:
            raise RuntimeError(f"{type(self).__name__} with rope_contrast='centre' needs its model's rotary_embed")
        (H, W), (h, w) = layout.grid, self.contrast_grid
        rows = torch.arange(H, dtype=torch.float32, device=device).view(1, 1, H, 1).expand(1, 1, H, W)
        cols = torch.arange(W, dtype=torch.float32, device=device).view(1, 1, 1, W).expand(1, 1, H, W)
        centres = [F.adaptive_avg_pool2d(ids, (h, w)).flatten() for ids in (rows, cols)]  # [n] each
        ids = torch.stack([torch.zeros_like(centres[0]), *centres], dim=-1)  # [n, 3]
        return embed(ids)

    def apply_token_gain(self, x: JointInputs | torch.Tensor, o: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """The base class's per-token gain (when the layer has one) on the image rows, read from the image input
        (text rows are exact read-out: no gain)."""
        if getattr(self, "token_gain", None) is None:
            return o
        image = x.image if isinstance(x, JointInputs) else x
        prefix = image.new_zeros(image.shape[0], layout.num_prefix_tokens, image.shape[2])  # rows the gain skips
        return super().apply_token_gain(torch.cat([prefix, image], dim=1), o, layout)

    def project_out(self, x: torch.Tensor, o: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Nothing here: `forward` projects each stream with its own output projection."""
        return o

    def contrast_tokens(self, inputs: JointInputs, q: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """t± = t̃ + e± [B, M, 2n, d], t̃ pooled from the image queries only (q: joint queries, text first, norms
        and any rotation applied). With `inputs.plain_q` (rope_contrast "centre"), t̃ is pooled from the
        un-rotated queries and t± are rotated at their cells' centres; else a rotation is pooled with q."""
        x, B, n = inputs.image, q.shape[0], self.num_contrast_tokens
        source = q if inputs.plain_q is None else inputs.plain_q
        large_grid = layout.num_patches >= _POOL_INPUT_MIN_RATIO * self.num_contrast_tokens
        plain = "norm_q" not in self._modules and not inputs.rotated  # a norm or a rotation does not commute
        projection = query_projection(self.qkv) if large_grid and plain else None
        if projection is not None:  # pool the layer input, project n rows (pooling commutes with the affine q)
            pooled = F.linear(adaptive_avg_pool_tokens(x, layout.grid, self.contrast_grid), *projection)
        else:
            pooled = F.adaptive_avg_pool2d(_patch_grid(source, layout), self.contrast_grid)  # [B, C, h, w]
            pooled = pooled.permute(0, 2, 3, 1).reshape(B, n, self.attn_dim)
        embed = torch.cat([self.contrast_embed_pos, self.contrast_embed_neg])  # [2, n, C]
        tokens = (pooled.unsqueeze(1) + embed.to(pooled.dtype)).view(B, 2 * n, self.num_heads, self.head_dim)
        tokens = tokens.transpose(1, 2)  # [B, M, 2n, d]
        if inputs.centre is not None:
            cos, sin = inputs.centre
            tokens = rotate(tokens, cos.repeat(2, 1), sin.repeat(2, 1))
        return tokens


class SingleStreamVisualContrastAttention(JointVisualContrastAttention):
    """Joint VCA over one sequence [B, L + N, C] of L text tokens then N image tokens on an H×W grid, sharing
    q/k/v projections and norms (Flux single-stream blocks).

    Called as `layer(x, layout=None, rotary=None) -> [B, L + N, attn_dim]`, unprojected (the attention has no output
    projection); the layout is the image grid (no prefix) and L = x.shape[1] − H·W. Text rows are exact: they
    read all L + N keys with softmax attention. The norms are carried as `norm_q`/`norm_k` and applied before the
    rotation, as diffusers does.
    """

    single_stream = True  # read by the diffusers family: one sequence, no output projection of its own

    def stream_members(self) -> tuple[str, ...]:
        return tuple(name for name in IMAGE_NORMS if name in self._modules)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        *,
        layout: TokenLayout | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """rotary: (cos, sin) [L + N, d] in the sequence's order, applied to q and k after the norms."""
        owner = type(self).__name__
        if x.ndim != 3:
            raise ValueError(f"{owner} takes [B, L + N, C] tokens, got shape {tuple(x.shape)}")
        if layout is None:
            if self.layout_source is None:
                raise ValueError(f"{owner} needs the image grid: pass layout=TokenLayout(0, (H, W)) or patch the model")
            layout = self.layout_source()
        if layout.num_prefix_tokens:
            raise ValueError(f"{owner} takes the image grid as its layout (no prefix), got {layout}")
        L = x.shape[1] - layout.num_patches
        if L < 0:
            raise ValueError(f"{owner} got {x.shape[1]} tokens, fewer than the {layout.grid} image grid's")
        joint = TokenLayout(L, layout.grid)
        q, k, v = self.project_qkv(x)  # [B, M, L + N, d]
        q, k = self._norm("norm_q", q), self._norm("norm_k", k)
        inputs = JointInputs(x[:, L:])
        if rotary is not None:
            cos, sin = rotary
            if cos.shape[0] != x.shape[1]:
                raise ValueError(f"rotary embedding has {cos.shape[0]} positions for {L} + {layout.num_patches} tokens")
            plain_q = q
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            centre = self.centre_rotary(layout, x.device) if self.rope_contrast == "centre" else None
            inputs = JointInputs(x[:, L:], None if centre is None else plain_q, centre, rotated=True)
        trains = q.requires_grad or v.requires_grad or self.contrast_embed_pos.requires_grad
        if self.recompute_in_backward and torch.is_grad_enabled() and trains:
            o = checkpoint(self.attend, inputs, q, k, v, joint, use_reentrant=False)
        else:
            o = self.attend(inputs, q, k, v, joint)  # [B, L + N, attn_dim]: no output projection
        return record_layout(o, layout)


class JointInputs(NamedTuple):
    """What `attend` passes on to `contrast_tokens` for one call (in place of the layer input)."""

    image: torch.Tensor  # the image stream's input [B, N, C]
    plain_q: torch.Tensor | None = None  # joint queries before rotation (rope_contrast "centre")
    centre: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) [n, d] at the contrast cells' centres
    rotated: bool = False
