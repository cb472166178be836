"""The Differential-Transformer λ re-parameterisation used by both VCA stages."""

from __future__ import annotations

import math

import torch
from torch import nn


def lambda_init_for_depth(layer_index: int) -> float:
    """λ_init(l) = 0.8 − 0.6·exp(−0.3·l), with l the 0-based block index."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


def _at_least_float32(dtype: torch.dtype | None) -> torch.dtype:
    return torch.promote_types(dtype or torch.get_default_dtype(), torch.float32)


class DifferentialLambda(nn.Module):
    """λ = exp(⟨λ_q1, λ_k1⟩) − exp(⟨λ_q2, λ_k2⟩) + λ_init + δ: one scalar, computed in float32.

    The four vectors have the head dimension and are shared by all heads. They are kept in at least float32
    whatever the model's dtype (`model.to(torch.bfloat16)` leaves them, and so λ, unchanged), like the other
    sensitive scalars of mixed-precision training. δ, a fixed buffer, absorbs the float32 rounding residue of a
    zero-λ init, so that λ starts at exactly 0; it is 0 otherwise.
    """

    def __init__(self, head_dim: int, lambda_init: float, device=None, dtype=None) -> None:
        super().__init__()
        self.lambda_init = lambda_init
        dd = {"device": device, "dtype": _at_least_float32(dtype)}
        self.q1 = nn.Parameter(torch.empty(head_dim, **dd))
        self.k1 = nn.Parameter(torch.empty(head_dim, **dd))
        self.q2 = nn.Parameter(torch.empty(head_dim, **dd))
        self.k2 = nn.Parameter(torch.empty(head_dim, **dd))
        self.register_buffer("offset", torch.zeros((), **dd))
        self._cached: tuple[tuple[tuple[int, int], ...], torch.Tensor] | None = None
        self.reset_random()

    def forward(self) -> torch.Tensor:
        """λ as a 0-d tensor of at least float32 precision.

        Without autograd the value is cached until a vector changes (in place, or moved to a new tensor):
        ten small ops per layer and stage are most of VCA's overhead on short sequences.
        """
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self._compute()
        key = tuple((p.data_ptr(), p._version) for p in (*self.vectors(), self.offset))
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self._compute())
        return self._cached[1]

    def vectors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(λ_q1, λ_k1, λ_q2, λ_k2)."""
        return self.q1, self.k1, self.q2, self.k2

    def _compute(self) -> torch.Tensor:
        dtype = _at_least_float32(self.q1.dtype)
        q1, k1, q2, k2 = (p.to(dtype) for p in self.vectors())
        return torch.exp(torch.dot(q1, k1)) - torch.exp(torch.dot(q2, k2)) + self.lambda_init + self.offset.to(dtype)

    def _apply(self, fn, recurse: bool = True):
        """Device moves apply; casts below float32 do not (the values are kept exactly)."""
        kept = {name: t.detach().clone() for name, t in (*self._parameters.items(), *self._buffers.items())}
        super()._apply(fn, recurse)
        with torch.no_grad():
            for name, tensor in (*self._parameters.items(), *self._buffers.items()):
                if tensor is not None and tensor.dtype in (torch.float16, torch.bfloat16):
                    tensor.data = kept[name].to(tensor.device)
        self._cached = None
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, *args) -> None:
        """Checkpoints written before δ existed load with δ = 0; loaded values are kept in float32."""
        state_dict.setdefault(prefix + "offset", torch.zeros(()))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, *args)

    @torch.no_grad()
    def reset_random(self, std: float = 0.1) -> None:
        """The paper's init: every vector from N(0, std²)."""
        for p in (self.q1, self.k1, self.q2, self.k2):
            p.normal_(0.0, std)
        self.offset.zero_()

    @torch.no_grad()
    def reset_to_zero_lambda(self, std: float = 0.1) -> None:
        """Random non-zero vectors (so λ keeps a gradient) adjusted so that λ = 0, exactly.

        Needs ⟨λ_q2, λ_k2⟩ = ln(exp⟨λ_q1, λ_k1⟩ + λ_init). λ_q2 is rescaled when that takes a
        modest positive factor, else shifted along λ_k2 (the factor explodes near ⟨λ_q2, λ_k2⟩ = 0);
        δ then takes the float32 rounding residue (~1e-7).
        """
        self.reset_random(std)
        if self.q1.is_meta:
            return
        q1, k1, q2, k2 = (p.double() for p in (self.q1, self.k1, self.q2, self.k2))
        target = math.log(math.exp(float(q1 @ k1)) + self.lambda_init)
        current = float(q2 @ k2)
        factor = target / current if current != 0.0 else math.inf
        if 0.1 <= factor <= 10.0:
            q2 = q2 * factor
        else:
            q2 = q2 + (target - current) * k2 / float(k2 @ k2)
        self.q2.copy_(q2.to(self.q2.dtype))
        self.offset.copy_(-self._compute())
        self._cached = None

    def extra_repr(self) -> str:
        return f"head_dim={self.q1.numel()}, lambda_init={self.lambda_init:.4f}"
