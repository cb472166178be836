"""q/k/v projections stored in other layouts, presented as one fused qkv projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SplitQKV(nn.Module):
    """Three Linear layers (kept as they are, under their own names) computed as one fused qkv matmul.

    Output channels are ordered (q | k | v) like a fused `qkv` Linear; a projection without bias
    (e.g. BEiT's k_proj) contributes zeros to the fused bias.
    """

    def __init__(self, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear) -> None:
        super().__init__()
        if not q_proj.in_features == k_proj.in_features == v_proj.in_features:
            raise ValueError("q/k/v projections must read the same width")
        if not q_proj.out_features == k_proj.out_features == v_proj.out_features:
            raise ValueError("q/k/v projections must have the same width")
        self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj
        self.in_features = q_proj.in_features
        self.out_features = 3 * q_proj.out_features

    @property
    def weight(self) -> torch.Tensor:
        """[3·C_out, C_in], the fused weight."""
        return torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])

    @property
    def bias(self) -> torch.Tensor | None:
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if all(p.bias is None for p in projections):
            return None
        return torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections])

    def projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of q, k and v."""
        return [(p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., C_in] -> [..., 3·C_out]."""
        return F.linear(x, self.weight, self.bias)


class QKVWithSeparateBias(nn.Module):
    """A bias-free fused qkv Linear plus separate q and v biases (k has none), as in BEiT and EVA."""

    def __init__(self, qkv: nn.Linear, q_bias: nn.Parameter | None, v_bias: nn.Parameter | None) -> None:
        super().__init__()
        if qkv.bias is not None:
            raise ValueError("qkv already has a bias")
        self.qkv = qkv
        self.q_bias, self.v_bias = q_bias, v_bias
        self.in_features, self.out_features = qkv.in_features, qkv.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.qkv.weight

    @property
    def bias(self) -> torch.Tensor | None:
        if self.q_bias is None:
            return None
        return torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])

    def projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of q, k and v (views of the fused weight; k has no bias)."""
        w_q, w_k, w_v = self.qkv.weight.split(self.out_features // 3)
        if self.q_bias is None:  # as `bias`: no q bias, no bias at all
            return [(w_q, None), (w_k, None), (w_v, None)]
        return [(w_q, self.q_bias), (w_k, None), (w_v, self.v_bias)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., C_in] -> [..., 3·C_out]."""
        return F.linear(x, self.qkv.weight, self.bias)


def qkv_projections(qkv: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """(weight, bias) of q, k and v that compute what a fused qkv projection does, split along its output;
    None for an unknown module."""
    if isinstance(qkv, (SplitQKV, QKVWithSeparateBias)):
        return qkv.projections()
    if isinstance(qkv, nn.Linear):
        width = qkv.out_features // 3
        biases = (None,) * 3 if qkv.bias is None else qkv.bias.split(width)
        return list(zip(qkv.weight.split(width), biases, strict=True))
    return None


def query_projection(qkv: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) that compute q alone from a fused qkv projection, or None for an unknown module."""
    projections = qkv_projections(qkv)
    return None if projections is None else projections[0]
