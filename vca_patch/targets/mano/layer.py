"""Multipole Attention (MANO; Colagrande et al., arXiv 2507.02748, ICCV 2025 Workshops).

Windowed softmax attention at several resolutions of the patch grid, combined in a V-cycle:

    X⁰ = grid(x),  X^ℓ = D(X^{ℓ−1})                       coarsened level inputs      [B, C, H_ℓ, W_ℓ]
    Y^ℓ = WA(X^ℓ)                                          shared windowed attention   [B, C', H_ℓ, W_ℓ]
    Z^{L−1} = Y^{L−1},  Z^ℓ = Y^ℓ + w_ℓ·U(Z^{ℓ+1}),  w_ℓ = 1/(L−1−ℓ)                   output Z⁰

WA is the original attention's q/k/v/proj applied to k×k windows (one SDPA call per level, batched
over batch, heads and windows). D is a shared r×r stride-r conv or average pool, U a shared
transposed conv or nearest upsampling (with a learnable per-channel gain γ on the coarse
correction). Levels divide any H×W grid with ceiling division; where a window does not tile a
level the level is zero-padded and the padded keys are masked out of the softmax, padded queries
cropped. Prefix tokens (CLS, distillation, registers), docs/mano.md §5.5 option A ("global"):
prefix queries attend to every token exactly; level-0 grid queries attend to their window keys
plus the prefix keys in one softmax; coarse levels see grid tokens only. "separate" (option B)
keeps grid queries away from the prefix keys. With U = 0 (or γ = 0) the layer is exactly the
original attention restricted to level-0 windows; with a window covering the grid it is exactly
the original attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.layers.carried import CarriedAttentionLayer, CarriedLayerOptions
from vca_patch.layers.layout import TokenLayout, grid_to_tokens
from vca_patch.layers.sdpa import scaled_dot_product_attention
from vca_patch.layers.windows import pad_grid, window_key_mask, window_merge, window_partition
from vca_patch.targets.mano.levels import Level, plan_levels, vcycle_weights

if TYPE_CHECKING:
    from typing_extensions import Unpack

DownMode = Literal["conv", "avg"]
UpMode = Literal["conv", "nearest"]
PrefixMode = Literal["global", "separate"]
InitMode = Literal["preserve", "multipole", "random"]


class MultipoleAttention(CarriedAttentionLayer):
    """Multi-head Multipole Attention over `num_prefix_tokens + H·W` tokens.

    Args:
        dim: input channels C.
        num_heads: heads M.
        head_dim: per-head width d (default dim // num_heads).
        dim_out: output channels C' (default dim).
        window: window side k (clipped to a level's side where the side is smaller).
        rate: coarsening factor r ≥ 2 of D and U.
        levels: number of levels L, or None to pick per grid the fewest whose coarsest grid fits one window.
        down: "conv" (shared Conv2d(C, C, r, stride r, no bias)) or "avg" (r×r average pool).
        up: "conv" (shared ConvTranspose2d(C', C', r, stride r, no bias)) or "nearest" (with gain γ ∈ R^C').
        prefix: "global" (prefix keys join every level-0 window) or "separate" (grid never sees them).
        pad: pad levels that the rate/window do not divide (False: raise instead).
        qkv, proj: existing fused q/k/v (a Linear or a `FusedQKVView`) and output projections to reuse (built fresh
            when None); registered under their own names. These, head_dim, dim_out, qkv_bias, proj_bias and
            proj_drop are `CarriedAttentionLayer`'s options.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        window: int = 7,
        rate: int = 2,
        levels: int | None = None,
        down: DownMode = "conv",
        up: UpMode = "conv",
        prefix: PrefixMode = "global",
        pad: bool = True,
        **carried: Unpack[CarriedLayerOptions],
    ) -> None:
        if down not in ("conv", "avg"):
            raise ValueError(f"down must be 'conv' or 'avg', got {down!r}")
        if up not in ("conv", "nearest"):
            raise ValueError(f"up must be 'conv' or 'nearest', got {up!r}")
        if prefix not in ("global", "separate"):
            raise ValueError(f"prefix must be 'global' or 'separate', got {prefix!r}")
        if rate < 2:
            raise ValueError(f"rate must be an integer ≥ 2, got {rate}")
        if window < 1:
            raise ValueError(f"window must be a positive integer, got {window}")
        if levels is not None and levels < 1:
            raise ValueError(f"levels must be ≥ 1 or None (auto), got {levels}")
        super().__init__(dim, num_heads, **carried)
        self.window, self.rate, self.levels = window, rate, levels
        self.down_mode, self.up_mode, self.prefix, self.pad = down, up, prefix, pad

        # New MANO parameters, on the device and dtype of the carried weights.
        dd = self.factory_kwargs
        C, C_out = self.qkv.in_features, self.proj.out_features
        self.down = nn.Conv2d(C, C, rate, stride=rate, bias=False, **dd) if down == "conv" else None
        self.up = nn.ConvTranspose2d(C_out, C_out, rate, stride=rate, bias=False, **dd) if up == "conv" else None
        self.up_gain = nn.Parameter(torch.zeros(C_out, **dd)) if up == "nearest" else None
        self._vanish_cache: tuple[tuple[int, int], bool] | None = None  # ((U address, version), U == 0)
        self.reset_mano_parameters("preserve")

    @torch.no_grad()
    def reset_mano_parameters(self, mode: InitMode = "preserve") -> None:
        """Initialise the parameters MANO adds (never qkv/proj).

        "preserve": average-pool-equivalent D, zero U (γ = 0 with nearest): the layer starts as the
            original attention restricted to level-0 windows; U (γ) still receives gradient.
        "multipole": average-pool-equivalent D, nearest-equivalent U (γ = 1): the full V-cycle.
        "random": PyTorch's default conv init (γ = 1), as when training from scratch.
        """
        if mode not in ("preserve", "multipole", "random"):
            raise ValueError(f"init mode must be 'preserve', 'multipole' or 'random', got {mode!r}")
        r = self.rate
        if self.down is not None:
            if mode == "random":
                self.down.reset_parameters()
            else:  # W[o, i] = δ_oi / r²
                self.down.weight.zero_()
                self.down.weight[range(self.down.out_channels), range(self.down.in_channels)] = 1.0 / (r * r)
        if self.up is not None:
            if mode == "random":
                self.up.reset_parameters()
            else:  # W[i, o] = δ_io (nearest) or 0
                self.up.weight.zero_()
                if mode == "multipole":
                    self.up.weight[range(self.up.in_channels), range(self.up.out_channels)] = 1.0
        if self.up_gain is not None:
            self.up_gain.fill_(0.0 if mode == "preserve" else 1.0)

    def plan(self, grid: tuple[int, int]) -> list[Level]:
        """Per-level grids, windows and padding for an H×W patch grid."""
        return plan_levels(grid, self.window, self.rate, self.levels, self.pad)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, C] -> q, k, v, each [B, M, T, d], with the carried q/k norms applied."""
        q, k, v = self._qkv_heads(x)
        return self.q_norm(q), self.k_norm(k), v

    def _project(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-head outputs [B, M, T, d] and the tokens they came from [B, T, C] -> [B, T, C']."""
        return self.proj(self.norm_and_gate(x, self._merge_heads(o)))

    def _window_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        level: Level,
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Grid q/k/v [B, M, H*W, d] -> windowed attention output [B, M, H*W, d].

        `prefix_kv` ([B, M, P, d] each) are appended to every window's keys/values (one softmax).
        """
        B, M, _, d = q.shape
        (H, W), window, padded = level.grid, level.window, level.padded

        def windows(t: torch.Tensor) -> torch.Tensor:  # [B, M, H*W, d] -> [B*M, nW, kh*kw, d]
            return window_partition(pad_grid(t.reshape(B * M, H, W, d), padded), window)

        qw, kw, vw = windows(q), windows(k), windows(v)
        P = 0
        if prefix_kv is not None:
            P = prefix_kv[0].shape[2]
            nW = qw.shape[1]
            pk, pv = (t.reshape(B * M, 1, P, d).expand(-1, nW, -1, -1) for t in prefix_kv)
            kw, vw = torch.cat([kw, pk], dim=2), torch.cat([vw, pv], dim=2)  # [B*M, nW, kh*kw + P, d]
        mask = window_key_mask((H, W), padded, window, P, device=q.device)  # [nW, 1, kh*kw + P] or None
        o = scaled_dot_product_attention(qw, kw, vw, attn_mask=mask, scale=self.scale)  # [B*M, nW, kh*kw, d]
        o = window_merge(o, padded, window)[:, :H, :W]  # [B*M, H, W, d]
        return o.reshape(B, M, H * W, d)

    def _down(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, C, ⌈H/r⌉, ⌈W/r⌉]; conv: zero padding; avg: mean of the real cells."""
        r = self.rate
        if self.down is None:
            return F.avg_pool2d(x, r, stride=r, ceil_mode=True)
        H, W = x.shape[-2:]
        return self.down(F.pad(x, (0, -W % r, 0, -H % r)))

    def _up(self, z: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[B, C', h, w] -> [B, C', r·h, r·w] cropped to `size`."""
        if self.up is None:
            z = z.repeat_interleave(self.rate, dim=-2).repeat_interleave(self.rate, dim=-1)
        else:
            z = self.up(z)
        return z[..., : size[0], : size[1]]

    def forward_tokens(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """x: [B, N, C] with N = prefix + H·W tokens -> [B, N, C']."""
        B, _, C = x.shape
        P, (H, W) = layout.num_prefix_tokens, layout.grid
        levels = self.plan(layout.grid)

        # Level 0: prefix queries read every token; grid queries read their window (+ prefix keys).
        q, k, v = self._qkv(x)  # [B, M, N, d] each
        prefix_kv = (k[:, :, :P], v[:, :, :P]) if P and self.prefix == "global" else None
        o = self._window_attention(q[:, :, P:], k[:, :, P:], v[:, :, P:], levels[0], prefix_kv)  # [B, M, H*W, d]
        if P:
            o = torch.cat([scaled_dot_product_attention(q[:, :, :P], k, v, scale=self.scale), o], dim=2)
        y = self._project(o, x)  # [B, N, C']
        if len(levels) == 1 or self.coarse_levels_vanish():
            return self.proj_drop(y)

        correction = self.coarse_correction(x[:, P:].transpose(1, 2).reshape(B, C, H, W), levels)  # [B, C', H, W]
        y = torch.cat([y[:, :P], y[:, P:] + grid_to_tokens(correction)], dim=1)
        return self.proj_drop(y)

    def coarse_levels_vanish(self) -> bool:
        """Whether the coarse levels add exactly nothing and no gradient needs them: U = 0 (γ = 0 with nearest U),
        as after the "preserve" init, with U (γ) frozen or autograd off. The forward then skips them (half a
        block's time): the output and every gradient are those of the full V-cycle."""
        multiplier = self.up_gain if self.up is None else self.up.weight
        if (torch.is_grad_enabled() and multiplier.requires_grad) or multiplier.device.type == "meta":
            return False
        if torch.compiler.is_compiling():  # traced: no cache; the full V-cycle is traced (exactly the same output)
            return False
        key = (multiplier.data_ptr(), multiplier._version)  # in-place updates bump the version
        if self._vanish_cache is None or self._vanish_cache[0] != key:
            self._vanish_cache = (key, not bool(multiplier.detach().any()))
        return self._vanish_cache[1]

    def coarse_correction(self, x_level: torch.Tensor, levels: list[Level]) -> torch.Tensor:
        """The coarse levels' V-cycle term w₀·U(Z¹) (times γ with nearest U) on the level-0 grid: x [B, C, H, W] ->
        [B, C', H, W]. Each level coarsens the one above, attends within its windows and projects (grid tokens)."""
        B = x_level.shape[0]
        coarse: list[torch.Tensor] = []
        for level in levels[1:]:
            x_level = self._down(x_level)  # [B, C, H_ℓ, W_ℓ]
            tokens = grid_to_tokens(x_level)  # [B, H_ℓ*W_ℓ, C]
            y_level = self._project(self._window_attention(*self._qkv(tokens), level), tokens)  # [B, H_ℓ*W_ℓ, C']
            coarse.append(y_level.transpose(1, 2).reshape(B, y_level.shape[-1], *level.grid))  # B may be 0

        # V-cycle, coarse to fine: Z^ℓ = Y^ℓ + w_ℓ·U(Z^{ℓ+1}); the caller adds the level-0 term.
        weights = vcycle_weights(len(levels))
        z = coarse[-1]
        for index in range(len(levels) - 2, 0, -1):
            z = coarse[index - 1] + weights[index] * self._up(z, levels[index].grid)
        correction = weights[0] * self._up(z, levels[0].grid)  # [B, C', H, W]
        if self.up_gain is not None:
            correction = correction * self.up_gain.view(1, -1, 1, 1).to(correction.dtype)
        return correction

    def extra_repr(self) -> str:
        levels = "auto" if self.levels is None else self.levels
        return (
            f"heads={self.num_heads}, head_dim={self.head_dim}, window={self.window}, rate={self.rate}, "
            f"levels={levels}, down={self.down_mode!r}, up={self.up_mode!r}, prefix={self.prefix!r}, pad={self.pad}"
        )
