"""Differential-informative binary attention (DIBA) with high-fidelity similarity (HFSC), after DIDB-ViT
(Gao et al., arXiv 2507.02222). Exact forms the paper does not give here are documented choices (docs: README).

For tokens x [B, N, C] with N = P prefix + H·W grid tokens, per head:

    x_L, x_H = HaarSplit(x)                         undecimated Haar, prefix tokens all low band
    Q_b, K_b = BinLinear_qk(x_b)  (b ∈ {L, H}),  V = BinLinear_v(x)        binary weights and activations
    S = s·(α_L Q_L K_Lᵀ + α_H Q_H K_Hᵀ)             learnable per-head band weights α, s = d^-1/2
    A = softmax(S);  w_ij = 1[N·A_ij/τ ≥ 1/2]       binary attention (STE of clamp(N·A/τ, 0, 1)); τ = 2: A ≥ 1/N
    k_i = Σ_j w_ij  (= |Υ_i|)
    u_i = (1 − k_i)·v_i + Σ_{j∈Υ_i} v_j  +  γ·Σ_{j∈Φ_i} (v_j − v_i)         Φ_i: the 8-neighbourhood on the grid
    o_i = u_i / max(k_i, 1)   (normalize=True)  or  u_i
    y = BinLinear_proj(o)

Prefix tokens have no neighbours (their local term is 0). With every binarisation off, hfsc off and no local
term, A is used as is and o = Σ_j A_ij v_j: the original softmax attention.

With binary weights and inputs, v = I ⊙ s + b per channel (I = sign(x)·sign(W)ᵀ an exact integer, s = c·α) and
u_i = b + s ⊙ ((1 − k_i)·I_i + Σ_{j∈Υ_i} I_j + γ·Σ_{j∈Φ_i} (I_j − I_i)), since the weights of u sum to 1: the
counts, the selection and the neighbour sums are then integers, exact in any summation order (float32: while
N·in_features < 2²⁴), so an update that is 0 stays exactly 0 and sign(0) = 0 in every backend. Summed as floats,
it left rounding residues (±5e-10) whose sign depended on the order: eager, inductor and onnxruntime then fed
different ±c inputs to the binary proj.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.layers.carried import CarriedAttentionLayer, CarriedLayerOptions
from vca_patch.layers.fused_qkv import FusedQKVView
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.didb.binary import BinaryWeight, binary_forward, binary_product
from vca_patch.targets.didb.haar import haar_split

if TYPE_CHECKING:
    from typing_extensions import Unpack


def _rows(weight: torch.Tensor | BinaryWeight, start: int, stop: int) -> torch.Tensor | BinaryWeight:
    return weight.rows(start, stop) if isinstance(weight, BinaryWeight) else weight[start:stop]


def binarize_attention(attn: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """{0, 1} attention weights: 1[N·A/τ ≥ 1/2] forward (exactly 0 or 1), the gradient of clamp(N·A/τ, 0, 1)
    backward.

    attn [B, M, N, N] (rows sum to 1), threshold τ [M] (> 0).
    """
    n = attn.shape[-1]
    soft = (attn * n / threshold.view(1, -1, 1, 1).to(attn.dtype)).clamp(0, 1)
    return (soft >= 0.5).to(soft.dtype) + (soft - soft.detach())


def _window_sum(grid: torch.Tensor) -> torch.Tensor:
    """Σ over the 3×3 window around each cell inside the grid, [..., H, W, d] -> the same shape: shifted adds of
    the zero-padded grid (exact for integer values in any backend; no pooling window baked in by exporters)."""
    padded = F.pad(grid, (0, 0, 1, 1, 1, 1))
    rows = padded[..., :-2, :, :] + padded[..., 1:-1, :, :] + padded[..., 2:, :, :]
    return rows[..., :-2, :] + rows[..., 1:-1, :] + rows[..., 2:, :]


def neighbour_difference(v: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """Σ_{j∈Φ_i} (v_j − v_i) over the 8-neighbourhood inside the grid; 0 for prefix tokens. v [B, M, N, d]."""
    B, M, _, d = v.shape
    P, (H, W) = layout.num_prefix_tokens, layout.grid
    grid = v[:, :, P:].reshape(B, M, H, W, d)
    cells = _window_sum(torch.ones(1, 1, H, W, 1, device=v.device, dtype=v.dtype))  # |Φ_i| + 1
    diff = (_window_sum(grid) - cells * grid).reshape(B, M, H * W, d)
    return torch.cat([torch.zeros_like(v[:, :, :P]), diff], dim=2)


class DIDBAttention(CarriedAttentionLayer):
    """Binary multi-head attention over `P + H·W` tokens reusing an attention module's q/k/v/proj (see module doc).

    Args:
        binary: which of the two Linears ("qkv", "proj") are binarised; the others stay real.
        binarize_weights / binarize_activations: binarise those Linears' weights / inputs (switchable later).
        binarize_attention: binary {0, 1} attention weights (False: the softmax weights, for ablations).
        hfsc: Haar-band similarity (False: one similarity from x).
        local: add the 8-neighbour differential term.
        normalize: divide the update by max(k_i, 1) (a positive per-token factor; False: the paper's raw sum).
        act_clip_init, band_init, threshold_init, local_init: initial c, (α_L, α_H), τ, γ.
        **carried: `CarriedAttentionLayer`'s options (head_dim, dim_out, qkv/proj to reuse, ...).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        binary: tuple[str, ...] = ("qkv", "proj"),
        binarize_weights: bool = True,
        binarize_activations: bool = True,
        binarize_attention: bool = True,
        hfsc: bool = True,
        local: bool = True,
        normalize: bool = True,
        act_clip_init: float = 1.0,
        band_init: tuple[float, float] = (1.0, 1.0),
        threshold_init: float = 2.0,
        local_init: float = 1.0,
        **carried: Unpack[CarriedLayerOptions],
    ) -> None:
        super().__init__(dim, num_heads, **carried)
        if not threshold_init > 0:
            raise ValueError(f"threshold_init must be positive, got {threshold_init}")
        unknown = set(binary) - {"qkv", "proj"}
        if unknown:
            raise ValueError(f"binary names Linears of the attention, 'qkv' and 'proj'; got {sorted(unknown)}")
        self.binary = tuple(binary)
        self.binarize_weights, self.binarize_activations = binarize_weights, binarize_activations
        self.binarize_attention, self.hfsc, self.local, self.normalize = binarize_attention, hfsc, local, normalize
        self.inits = {
            "act_clip": float(act_clip_init),
            "band": tuple(float(b) for b in band_init),
            "threshold": float(threshold_init),
            "local": float(local_init),
        }
        dd, M = self.factory_kwargs, num_heads
        self.qkv_clip = nn.Parameter(torch.empty(3, **dd))  # c for the inputs x, x_L, x_H of qkv
        self.proj_clip = nn.Parameter(torch.empty((), **dd))
        self.band_weight = nn.Parameter(torch.empty(2, M, **dd)) if hfsc else None  # (α_L, α_H) per head
        self.attn_threshold = nn.Parameter(torch.empty(M, **dd)) if binarize_attention else None  # τ
        self.local_weight = nn.Parameter(torch.empty(M, **dd)) if local else None  # γ
        self.reset_didb_parameters()

    @torch.no_grad()
    def reset_didb_parameters(self) -> None:
        """Set the parameters DIDB adds (never qkv/proj) to their initial values."""
        self.qkv_clip.fill_(self.inits["act_clip"])
        self.proj_clip.fill_(self.inits["act_clip"])
        if self.band_weight is not None:
            self.band_weight[0].fill_(self.inits["band"][0])
            self.band_weight[1].fill_(self.inits["band"][1])
        if self.attn_threshold is not None:
            self.attn_threshold.fill_(self.inits["threshold"])
        if self.local_weight is not None:
            self.local_weight.fill_(self.inits["local"])

    def _weight(self, name: str) -> torch.Tensor | BinaryWeight:
        """The fused qkv or the proj weight: packed (didb/packed.py), binarised from the latent weight, or real."""
        linear = self.qkv if name == "qkv" else self.proj
        modules = linear.linears() if isinstance(linear, FusedQKVView) else [linear]
        if all(hasattr(m, "binary_weight") for m in modules):  # PackedBinaryLinear members
            return BinaryWeight.cat([m.binary_weight() for m in modules])
        if self.binarize_weights and name in self.binary:
            return BinaryWeight.from_weight(linear.weight)
        return linear.weight

    def _linear(
        self,
        name: str,
        x: torch.Tensor,
        weight: torch.Tensor | BinaryWeight,
        bias: torch.Tensor | None,
        clip: torch.Tensor,
    ) -> torch.Tensor:
        clip = clip if self.binarize_activations and name in self.binary else None
        return binary_forward(x, weight, bias, clip, allow_kernel=not self.training)

    def _values(
        self, x: torch.Tensor, weight: torch.Tensor | BinaryWeight, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(V, s, b) per head [B, M, N, d], [1, M, 1, d], [1, M, 1, d] | None: with binary weights and inputs V is
        the integer I (v = I ⊙ s + b), else V = v and s = b = None."""
        if not (self.binarize_activations and "qkv" in self.binary and isinstance(weight, BinaryWeight)):
            return self._heads(self._linear("qkv", x, weight, bias, self.qkv_clip[0])), None, None
        integer, scale = binary_product(x, weight, self.qkv_clip[0], allow_kernel=not self.training)
        per_head = (1, self.num_heads, 1, self.head_dim)
        return self._heads(integer), scale.view(per_head), None if bias is None else bias.view(per_head)

    def _update(
        self, attn: torch.Tensor, x: torch.Tensor, layout: TokenLayout, weight: torch.Tensor | BinaryWeight,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """The DIBA update o [B, M, N, d] from the attention weights [B, M, N, N] (see the module doc)."""
        values, scale, shift = self._values(x, weight, bias)
        count = attn.sum(dim=-1, keepdim=True)  # k_i = |Υ_i| (1 for softmax weights)
        out = (1 - count) * values + attn @ values
        if self.local_weight is not None:
            out = out + self.local_weight.to(x.dtype).view(1, -1, 1, 1) * neighbour_difference(values, layout)
        if scale is not None:  # back from the integer combination: the weights of u sum to 1, so b passes as is
            out = out * scale if shift is None else out * scale + shift
        return out / count.clamp(min=1) if self.normalize else out

    def forward_tokens(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """x: [B, N, C] -> [B, N, C']."""
        A = self.attn_dim
        weight, bias = self._weight("qkv"), self.qkv.bias
        w_qk, w_v = _rows(weight, 0, 2 * A), _rows(weight, 2 * A, 3 * A)
        b_qk, b_v = (None, None) if bias is None else (bias[: 2 * A], bias[2 * A :])

        def qk(inputs: torch.Tensor, clip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, k = self._linear("qkv", inputs, w_qk, b_qk, clip).split(A, dim=-1)
            return self.q_norm(self._heads(q)), self.k_norm(self._heads(k))

        if self.band_weight is not None:
            low, high = haar_split(x, layout.num_prefix_tokens, layout.grid)
            (q_l, k_l), (q_h, k_h) = qk(low, self.qkv_clip[1]), qk(high, self.qkv_clip[2])
            alpha = self.band_weight.to(x.dtype).view(2, 1, -1, 1, 1)
            scores = alpha[0] * (q_l @ k_l.transpose(-1, -2)) + alpha[1] * (q_h @ k_h.transpose(-1, -2))
        else:
            q, k = qk(x, self.qkv_clip[0])
            scores = q @ k.transpose(-1, -2)
        attn = (scores * self.scale).softmax(dim=-1)  # [B, M, N, N]
        if self.attn_threshold is not None:
            attn = binarize_attention(attn, self.attn_threshold.clamp(min=1e-3))

        out = self.norm_and_gate(x, self._merge_heads(self._update(attn, x, layout, w_v, b_v)))
        y = self._linear("proj", out, self._weight("proj"), self.proj.bias, self.proj_clip)
        return self.proj_drop(y)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, head_dim={self.head_dim}, binary={self.binary}, "
            f"binarize_weights={self.binarize_weights}, binarize_activations={self.binarize_activations}, "
            f"binarize_attention={self.binarize_attention}, "
            f"hfsc={self.hfsc}, local={self.local}, normalize={self.normalize}"
        )
