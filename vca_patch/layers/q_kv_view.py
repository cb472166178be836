"""A query Linear and a fused key/value Linear (PVT's `q` and `kv`) read as one fused qkv projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vca_patch.layers.fused_qkv import FusedQKVView, _is_plain


class QAndKV(FusedQKVView):
    """The owner's `q` Linear (C_in -> C) and `kv` Linear (C_in -> 2C, k then v), as a qkv projection (q | k | v)."""

    default_names = ("q", "kv")

    def _check(self) -> None:
        if len(self.linears()) != 2:
            raise ValueError(f"{self.names} of {type(self.owner).__name__} must be two modules")
        q, kv = self.linears()
        if q.in_features != kv.in_features or kv.out_features != 2 * q.out_features:
            raise ValueError("kv must read q's input and produce twice q's width (k then v)")

    @property
    def out_features(self) -> int:
        return 3 * self.linears()[0].out_features

    @property
    def weight(self) -> torch.Tensor:
        q, kv = self.linears()
        return torch.cat([q.weight, kv.weight])

    @property
    def bias(self) -> torch.Tensor | None:
        q, kv = self.linears()
        if q.bias is None and kv.bias is None:
            return None
        q_bias = q.bias if q.bias is not None else q.weight.new_zeros(q.out_features)
        kv_bias = kv.bias if kv.bias is not None else kv.weight.new_zeros(kv.out_features)
        return torch.cat([q_bias, kv_bias])

    def projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        q, kv = self.linears()
        (w_k, w_v), (b_k, b_v) = kv.weight.chunk(2), (None, None) if kv.bias is None else kv.bias.chunk(2)
        return [(q.weight, q.bias), (w_k, b_k), (w_v, b_v)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, kv = self.linears()
        if _is_plain(q) and _is_plain(kv):
            return F.linear(x, self.weight, self.bias)
        return torch.cat([q(x), kv(x)], dim=-1)
