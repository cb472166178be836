"""Independent float64 Multipole Attention, written from docs/mano.md with plain einsum/softmax.

Shares no code with vca_patch.targets.mano.layer: windows are cut by index loops and truncated at the
grid edge (the module pads and masks instead), conv/deconv are einsums over r×r blocks, and the
levels are combined with the unrolled V-cycle Z⁰ = Σ_ℓ c_ℓ·U^ℓ(Y^ℓ), c_ℓ = (L−1−ℓ)!/(L−1)!,
rather than the module's recursion. q/k norms, the pre-proj norm and the gate are taken as identity.
"""

from __future__ import annotations

import math

import torch


def _levels(grid: tuple[int, int], window: int, rate: int, levels: int | None) -> list[tuple[int, int]]:
    sides = [tuple(grid)]
    while (levels is None and max(sides[-1]) > window) or (levels is not None and len(sides) < levels):
        h, w = sides[-1]
        sides.append((math.ceil(h / rate), math.ceil(w / rate)))
    return sides


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, M*d] -> [B, M, T, d]."""
    B, T, _ = t.shape
    return t.reshape(B, T, heads, -1).permute(0, 2, 1, 3)


def _attend(q, k, v, scale):
    """q [B, M, Tq, d], k/v [B, M, Tk, d] -> [B, M, Tq, d]."""
    return torch.einsum("bmqk,bmkd->bmqd", torch.softmax(torch.einsum("bmqd,bmkd->bmqk", q, k) * scale, -1), v)


def _window_level(p, x_grid, prefix_x, window, heads):
    """Grid tokens [B, h, w, C] (+ prefix tokens [B, P, C] joining every window) -> [B, h, w, C'] (with proj)."""
    B, h, w, C = x_grid.shape
    kh, kw = min(window, h), min(window, w)
    tokens = x_grid.reshape(B, h * w, C)
    qkv = tokens @ p["qkv_w"].T + p["qkv_b"]
    q, k, v = (_heads(t, heads) for t in qkv.chunk(3, dim=-1))
    if prefix_x is not None and prefix_x.shape[1]:
        pqkv = prefix_x @ p["qkv_w"].T + p["qkv_b"]
        _, pk, pv = (_heads(t, heads) for t in pqkv.chunk(3, dim=-1))
    else:
        pk = pv = None
    scale = q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    for i0 in range(0, h, kh):
        for j0 in range(0, w, kw):
            idx = [i * w + j for i in range(i0, min(i0 + kh, h)) for j in range(j0, min(j0 + kw, w))]
            kk, vv = k[:, :, idx], v[:, :, idx]
            if pk is not None:
                kk, vv = torch.cat([pk, kk], 2), torch.cat([pv, vv], 2)
            out[:, :, idx] = _attend(q[:, :, idx], kk, vv, scale)
    o = out.permute(0, 2, 1, 3).reshape(B, h * w, -1) @ p["proj_w"].T + p["proj_b"]
    return o.reshape(B, h, w, -1)


def _down(p, x, rate, mode):
    """[B, h, w, C] -> [B, ⌈h/r⌉, ⌈w/r⌉, C]: zero-padded conv, or mean over the real cells of each block."""
    B, h, w, C = x.shape
    H2, W2 = math.ceil(h / rate), math.ceil(w / rate)
    padded = x.new_zeros(B, H2 * rate, W2 * rate, C)
    padded[:, :h, :w] = x
    blocks = padded.reshape(B, H2, rate, W2, rate, C)
    if mode == "conv":
        return torch.einsum("oiab,nhawbi->nhwo", p["down_w"], blocks)
    count = x.new_zeros(H2 * rate, W2 * rate)
    count[:h, :w] = 1
    count = count.reshape(H2, rate, W2, rate).sum((1, 3))
    return blocks.sum((2, 4)) / count[None, :, :, None]


def _up(p, z, size, rate, mode):
    """[B, h, w, C'] -> [B, r·h, r·w, C'] cropped to size: transposed conv or nearest."""
    B, h, w, C = z.shape
    if mode == "conv":
        out = torch.einsum("ioab,nhwi->nhawbo", p["up_w"], z).reshape(B, h * rate, w * rate, C)
    else:
        rows = torch.arange(h * rate) // rate
        cols = torch.arange(w * rate) // rate
        out = z[:, rows][:, :, cols]
    return out[:, : size[0], : size[1]]


def reference_mano(module, x, num_prefix, grid, *, levels_override: int | None = None):
    """Float64 MANO of `module`'s weights and settings on x [B, P + H·W, C] -> [B, P + H·W, C']."""
    p = {
        "qkv_w": module.qkv.weight.double(),
        "qkv_b": module.qkv.bias.double(),
        "proj_w": module.proj.weight.double(),
        "proj_b": module.proj.bias.double(),
        "down_w": None if module.down is None else module.down.weight.double(),
        "up_w": None if module.up is None else module.up.weight.double(),
    }
    heads, window, rate = module.num_heads, module.window, module.rate
    x = x.double()
    B, _, C = x.shape
    P = num_prefix
    H, W = grid
    sides = _levels(grid, window, rate, module.levels if levels_override is None else levels_override)
    L = len(sides)
    prefix_x, grid_x = x[:, :P], x[:, P:].reshape(B, H, W, C)

    # Prefix queries: full attention over all tokens.
    qkv = x @ p["qkv_w"].T + p["qkv_b"]
    q, k, v = (_heads(t, heads) for t in qkv.chunk(3, dim=-1))
    prefix_out = _attend(q[:, :, :P], k, v, q.shape[-1] ** -0.5)  # [B, M, P, d]
    prefix_out = prefix_out.permute(0, 2, 1, 3).reshape(B, P, q.shape[1] * q.shape[3])
    prefix_out = prefix_out @ p["proj_w"].T + p["proj_b"]

    # Level outputs Y^ℓ (prefix keys only at level 0, option "global").
    joined = prefix_x if module.prefix == "global" else None
    ys = [_window_level(p, grid_x, joined, window, heads)]
    level_x = grid_x
    for _ in range(1, L):
        level_x = _down(p, level_x, rate, module.down_mode)
        ys.append(_window_level(p, level_x, None, window, heads))

    # Unrolled V-cycle with the closed-form coefficients.
    total = ys[0]
    for level in range(1, L):
        c = math.factorial(L - 1 - level) / math.factorial(L - 1)
        term = ys[level]
        for target in range(level - 1, -1, -1):
            term = _up(p, term, sides[target], rate, module.up_mode)
        if module.up_gain is not None:
            term = term * module.up_gain.double()
        total = total + c * term
    return torch.cat([prefix_out, total.reshape(B, H * W, -1)], dim=1)
