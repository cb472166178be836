"""The bit format of a packed binary Linear: sign bits (1 ⇔ W < 0) and nonzero bits, LSB first, each row padded with
0 bits to whole 64-bit words (see `packed` for the state-dict keys)."""

from __future__ import annotations

import math

import torch


def packed_width(in_features: int) -> int:
    """Bytes per row of `weight_signs` for `in_features` columns (whole 64-bit words)."""
    return 8 * math.ceil(in_features / 64)


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """bool [O, K] -> uint8 [O, 8·⌈K/64⌉], LSB first, zero padding."""
    rows, cols = flags.shape
    padded = torch.zeros(rows, packed_width(cols) * 8, dtype=torch.uint8, device=flags.device)
    padded[:, :cols] = flags
    weights = 2 ** torch.arange(8, device=flags.device, dtype=torch.uint8)
    return (padded.view(rows, -1, 8) * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 [O, B] -> bool [O, in_features]."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    shifted = torch.bitwise_right_shift(bits.unsqueeze(-1), shifts)  # not `>>`: ONNX exporters lack its overload
    return (shifted & shifted.new_ones(())).view(bits.shape[0], -1)[:, :in_features].bool()  # a uint8 1


def as_words(bits: torch.Tensor) -> torch.Tensor:
    """uint8 [O, 8·W] -> int64 words [O, W] (the same bytes; little-endian hosts)."""
    return bits.view(torch.int64)


def unpack_signs(
    words: torch.Tensor, nonzero: torch.Tensor | None, in_features: int, *, dtype: torch.dtype
) -> torch.Tensor:
    """Dense sign(W) ∈ {−1, 0, 1} [O, K] from int64 sign words (and nonzero words)."""
    nonzero_bits = None if nonzero is None else nonzero.view(torch.uint8)
    return signs_from_bits(words.view(torch.uint8), nonzero_bits, in_features, dtype=dtype)


def signs_from_bits(
    bits: torch.Tensor, nonzero: torch.Tensor | None, in_features: int, *, dtype: torch.dtype
) -> torch.Tensor:
    """Dense sign(W) ∈ {−1, 0, 1} [O, K] from uint8 sign bits (and nonzero bits): byte shifts only, no
    reinterpreting view (which exporters to ONNX cannot write)."""
    signs = 1 - 2 * unpack_bits(bits, in_features).to(dtype)
    return signs if nonzero is None else signs * unpack_bits(nonzero, in_features).to(dtype)


def all_nonzero_words(out_features: int, in_features: int, device: torch.device) -> torch.Tensor:
    """Nonzero words of a weight without zeros: every real column set."""
    ones = torch.ones(out_features, in_features, dtype=torch.bool, device=device)
    return as_words(pack_bits(ones))
