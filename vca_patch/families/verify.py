"""Verify a matched module: a plain softmax attention built from its extracted weights must reproduce it."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from vca_patch.layers.carried import CarriedAttention

if TYPE_CHECKING:
    from vca_patch.families.site import AttentionSite

TOLERANCE = 1e-4  # relative error, float32


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """`module` in eval mode inside the block (no dropout while it is probed), its own mode restored after."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def record_verdict(site: AttentionSite, error: float, reference: str) -> AttentionSite:
    """Mark `site` verified when `error` (relative, against the `reference` named in the note) is within TOLERANCE."""
    site.verified = error < TOLERANCE
    if not site.verified:
        site.notes.append(f"reference {reference} differs by {error:.2g} (relative)")
    return site


def reference_softmax_attention(carried: CarriedAttention, x: torch.Tensor) -> torch.Tensor:
    """Multi-head softmax self-attention from `carried`'s weights, written out: [B, N, C] -> [B, N, C_out]."""
    B, N, _ = x.shape
    M, d = carried.num_heads, carried.head_dim
    q, k, v = carried.qkv(x).view(B, N, 3, M, d).permute(2, 0, 3, 1, 4).unbind(0)  # [B, M, N, d]
    q, k = carried.q_norm(q), carried.k_norm(k)
    weights = torch.softmax((q @ k.transpose(-1, -2)) * d**-0.5, dim=-1)  # [B, M, N, N]
    out = carried.norm((weights @ v).transpose(1, 2).reshape(B, N, M * d))
    if carried.gate is not None:
        out = out * carried.gate(x).sigmoid()
    return carried.proj(out)


def float32_copy(module: nn.Module, carried: CarriedAttention) -> tuple[nn.Module, CarriedAttention]:
    """A half-precision module (and the carried modules it shares) as one float32 copy, for verification; a
    float32/float64 module as it is. Verifying in float32 judges structure, not bf16/fp16 rounding."""
    if next(module.parameters()).dtype not in (torch.float16, torch.bfloat16):
        return module, carried
    module, carried = copy.deepcopy((module, carried))  # one copy: shared submodules stay shared
    return module.float(), carried


def on_meta(module: nn.Module) -> bool:
    """Whether `module` has no weights to probe (the meta device): verification then records no verdict."""
    return next(module.parameters()).is_meta


@dataclass(frozen=True)
class Probe:
    """A module and its carried modules as verification probes them (float32 at least, `float32_copy`), with the
    seeded generator every random probe input is drawn from, in order."""

    module: nn.Module
    carried: CarriedAttention
    generator: torch.Generator

    @classmethod
    def of(cls, module: nn.Module, carried: CarriedAttention) -> Probe:
        module, carried = float32_copy(module, carried)
        return cls(module, carried, torch.Generator().manual_seed(0))

    @property
    def weight(self) -> torch.Tensor:
        """A parameter of the probed module: the device and dtype probe inputs take."""
        return next(self.module.parameters())

    def randn(self, *shape: int) -> torch.Tensor:
        """Standard-normal probe input of `shape`, drawn from the generator, on the module's device and dtype."""
        return torch.randn(*shape, generator=self.generator).to(self.weight)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """‖got − expected‖ / ‖expected‖ (the denominator floored at 1e-12)."""
    return float((got - expected).norm() / expected.norm().clamp_min(1e-12))


@torch.no_grad()
def verification_error(
    module: nn.Module, carried: CarriedAttention, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]
) -> float | None:
    """Relative error between `call(module, x)` and the reference on a random probe (None on the meta device).

    Both run in float32 at least: a half-precision module (and the carried modules it shares) is checked on a
    float32 copy, so the verdict is about structure, not bf16/fp16 rounding (~4e-3 for bf16).
    """
    if on_meta(module):
        return None
    probe = Probe.of(module, carried)
    x = probe.randn(2, 1 + 4 * 4, carried.dim)
    with eval_mode(probe.module):
        expected = call(probe.module, x)
    return relative_error(reference_softmax_attention(probe.carried, x), expected)
