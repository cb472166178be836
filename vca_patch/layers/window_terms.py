"""The original shifted-window attention (Swin, SwinV2), carried into a replacement layer and recomputed exactly.

`CarriedWindowTerms` is a mixin for `CarriedAttentionLayer` subclasses that keep the block's window attention as one
of their terms (`WindowedVCA` "residual", `WindowedMultipole` level 0): it takes the relative-position bias table and
its index (Swin: a parameter, or transformers' `relative_position_bias` module whole) or SwinV2's cosine-attention
members (per-head logit scale; CPB MLP with its coordinate table and pair index), under their original names, and
computes W-MSA from them as the original did:

    Swin:    softmax(s·q·kᵀ + B[index] + mask)·v,                 s = d^-1/2
    SwinV2:  softmax(L·q̂·k̂ᵀ + 16σ(CPB(coords))[index] + mask)·v,  L = exp(min(logit_scale, ln 100))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.layers.carried import CarriedAttentionLayer
from vca_patch.layers.sdpa import scaled_dot_product_attention

_MAX_LOG_SCALE = math.log(100.0)  # SwinV2 clamps its logit scale at ln(1/0.01)


class PassThroughProjection(nn.Module):
    """The identity, shaped like a C→C Linear: the `proj` of a layer whose output projection stays in the original
    model, after the replaced module (transformers' Swinv2 applies `attention.output.dense` after `attention.self`).
    No parameters; never carried back onto the original module."""

    stays_outside = True  # `CarriedAttentionLayer.carried_members` leaves it out: nothing to put back

    def __init__(self, features: int) -> None:
        super().__init__()
        self.in_features = self.out_features = features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class CarriedWindowTerms(CarriedAttentionLayer):
    """Mixin: the carried window attention's bias (or cosine members) and `window_attention`; see the module doc."""

    _bias_module_name: str | None = None
    _cosine_names: tuple[str, str | None] | None = None  # (logit scale, CPB MLP or None) of a cosine layer

    def carry_window_bias(self, table: nn.Parameter, index: torch.Tensor) -> None:
        """Take the original relative-position bias table (a parameter) and its index (a non-persistent buffer)."""
        self._carry("relative_position_bias_table", table)
        self.register_buffer("relative_position_index", index, persistent=False)

    def carry_window_bias_module(self, name: str, module: nn.Module) -> None:
        """Take the module that holds the bias table and its index (`relative_position_bias_table`,
        `relative_position_index`) whole, under its original name (transformers' `relative_position_bias`)."""
        self._carry(name, module)
        self._bias_module_name = name

    def carry_cosine_terms(
        self,
        logit_scale: nn.Parameter,
        position_mlp: nn.Module | None,
        coords_table: torch.Tensor | None,
        index: torch.Tensor | None,
        names: tuple[str, str] = ("logit_scale", "cpb_mlp"),
    ) -> None:
        """SwinV2: take the per-head logit scale [M, 1, 1] and (when `position_mlp` is given) the CPB MLP under their
        original `names`, its log-spaced relative coordinates and the pair index (non-persistent buffers)."""
        self._carry(names[0], logit_scale)
        if position_mlp is not None:
            if coords_table is None or index is None:
                raise ValueError("the CPB needs its coordinate table and pair index")
            self._carry(names[1], position_mlp)
            self.register_buffer("relative_coords_table", coords_table, persistent=False)
            self.register_buffer("relative_position_index", index, persistent=False)
        self._cosine_names = (names[0], names[1] if position_mlp is not None else None)

    @property
    def cosine(self) -> bool:
        return self._cosine_names is not None

    def logit_scale(self) -> torch.Tensor:
        """L = exp(min(logit_scale, ln 100)) per head: [M]."""
        return self._parameters[self._cosine_names[0]].clamp(max=_MAX_LOG_SCALE).exp().view(-1)

    def window_bias(self, N: int) -> torch.Tensor:
        """The window attention's pairwise bias [1, M, N, N]: the learned table (Swin) or 16σ(CPB) (SwinV2)."""
        if self.cosine:
            mlp = self._modules[self._cosine_names[1]]
            table = 16 * torch.sigmoid(mlp(self.relative_coords_table).view(-1, self.num_heads))
            index = self.relative_position_index
        elif self._bias_module_name is not None:
            owner = self._modules[self._bias_module_name]
            table, index = owner.relative_position_bias_table, owner.relative_position_index
        else:
            table, index = self._parameters["relative_position_bias_table"], self.relative_position_index
        return table[index.view(-1)].view(N, N, -1).permute(2, 0, 1).unsqueeze(0)

    def window_attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The carried W-MSA on the block's windows x [B·nW, N, C] under its shift mask [nW, N, N] (or None), then
        proj and its dropout: [B·nW, N, C_out] (see the module docstring)."""
        B_, N, _ = x.shape
        M = self.num_heads
        q, k, v = self.qkv(x).view(B_, N, 3, M, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        scale = self.head_dim**-0.5
        if self.cosine:
            q = F.normalize(q, dim=-1) * self.logit_scale().to(q.dtype).view(1, M, 1, 1)
            k, scale = F.normalize(k, dim=-1), 1.0
        bias = self.window_bias(N)  # [1, M, N, N]
        if mask is not None:
            nW = mask.shape[0]
            bias = (bias + mask.to(bias.dtype).unsqueeze(1)).unsqueeze(0).expand(B_ // nW, -1, -1, -1, -1)
            bias = bias.reshape(B_, M, N, N)
        o = scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale)
        return self.proj_drop(self.proj(o.transpose(1, 2).reshape(B_, N, self.attn_dim)))

    def carried_members(self) -> dict:
        members = super().carried_members()
        if "relative_position_bias_table" in self._parameters:
            members["relative_position_bias_table"] = self._parameters["relative_position_bias_table"]
        if self._bias_module_name is not None:
            members[self._bias_module_name] = self._modules[self._bias_module_name]
        if self._cosine_names is not None:
            scale, mlp = self._cosine_names
            members[scale] = self._parameters[scale]
            if mlp is not None:
                members[mlp] = self._modules[mlp]
        return members
