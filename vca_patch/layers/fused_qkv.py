"""q/k/v projections stored in other layouts, read as one fused qkv projection from the module that holds them.

A view is not a module: it keeps the owner and the attribute names only, and looks the members up on every use,
so it always reads what the owner holds now (after `model.to()`, `load_state_dict(assign=True)`, parameters
replaced on conversion, `copy.deepcopy`, DataParallel replicas) and adds no state-dict key of its own: the
carried weights keep the names the original attention module gave them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

Member = nn.Module | nn.Parameter | None


def carried_member(owner: nn.Module, name: str) -> Member:
    """owner's submodule or parameter `name`, registered ones first (a replacement layer may have a method of
    that name, e.g. `output`); an attribute otherwise."""
    if name in owner._modules:
        return owner._modules[name]
    if name in owner._parameters:
        return owner._parameters[name]
    return getattr(owner, name)


def _is_plain(linear: nn.Module) -> bool:
    """An nn.Linear itself (no subclass, wrapper or parametrization) without forward hooks."""
    return type(linear) is nn.Linear and not (linear._forward_hooks or linear._forward_pre_hooks)


class _Holder(nn.Module):
    """The owner of a view built from loose modules and parameters (`of`)."""


class FusedQKVView:
    """A fused qkv projection, output channels ordered (q | k | v), computed from `owner`'s members `names`.

    Linear-like: `in_features`, `out_features`, `weight`, `bias`, `x -> qkv(x)`. Subclasses say how the members
    combine.
    """

    default_names: ClassVar[tuple[str, ...]]

    def __init__(self, owner: nn.Module, names: Sequence[str] | None = None, *, check: bool = True) -> None:
        self.owner = owner
        self.names = tuple(names) if names is not None else self.default_names
        if check:
            if len(self.names) != len(self.default_names):
                raise ValueError(f"{type(self).__name__} needs {len(self.default_names)} names, got {self.names}")
            self._check()

    @classmethod
    def of(cls, *members: Member) -> FusedQKVView:
        """A view over loose members (held by a fresh container under the default names)."""
        holder = _Holder()
        for name, member in zip(cls.default_names, members, strict=True):
            setattr(holder, name, member)
        return cls(holder)

    def bind(self, owner: nn.Module) -> FusedQKVView:
        """The same view on another owner that holds the members under the same names."""
        return type(self)(owner, self.names, check=False)

    def members(self) -> list[tuple[str, Member]]:
        """(name, module or parameter) as the owner holds them now."""
        return [(name, carried_member(self.owner, name)) for name in self.names]

    def linears(self) -> list[nn.Module]:
        """The projection modules among the members."""
        return [m for _, m in self.members() if isinstance(m, nn.Module)]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Every parameter the view reads."""
        for _, member in self.members():
            if isinstance(member, nn.Module):
                yield from member.parameters(recurse)
            elif member is not None:
                yield member

    @property
    def in_features(self) -> int:
        return self.linears()[0].in_features

    @property
    def out_features(self) -> int:
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """[3·C_out, C_in], the fused weight."""
        raise NotImplementedError

    @property
    def bias(self) -> torch.Tensor | None:
        """[3·C_out] or None, the fused bias."""
        raise NotImplementedError

    def projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of q, k and v."""
        raise NotImplementedError

    def _check(self) -> None:
        """Refuse members that do not make a fused qkv projection."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[..., C_in] -> [..., 3·C_out]."""
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.names)} of {type(self.owner).__name__})"


class SplitQKV(FusedQKVView):
    """Three Linear layers of the owner (under their own names) computed as one fused qkv matmul.

    A projection without bias (e.g. BEiT's k_proj) contributes zeros to the fused bias. When any projection is
    not a plain hook-free nn.Linear (a LoRA wrapper, a hooked module), each runs as the module it is.
    """

    default_names = ("q_proj", "k_proj", "v_proj")

    def _check(self) -> None:
        if len(self.linears()) != 3:
            raise ValueError(f"{self.names} of {type(self.owner).__name__} must be three modules")
        q_proj, k_proj, v_proj = self.linears()
        if not q_proj.in_features == k_proj.in_features == v_proj.in_features:
            raise ValueError("q/k/v projections must read the same width")
        if not q_proj.out_features == k_proj.out_features == v_proj.out_features:
            raise ValueError("q/k/v projections must have the same width")

    @property
    def out_features(self) -> int:
        return 3 * self.linears()[0].out_features

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([p.weight for p in self.linears()])

    @property
    def bias(self) -> torch.Tensor | None:
        projections = self.linears()
        if all(p.bias is None for p in projections):
            return None
        return torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections])

    def projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [(p.weight, p.bias) for p in self.linears()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projections = self.linears()
        if all(_is_plain(p) for p in projections):
            return F.linear(x, self.weight, self.bias)
        return torch.cat([p(x) for p in projections], dim=-1)


class QKVWithSeparateBias(FusedQKVView):
    """The owner's bias-free fused qkv Linear plus separate q and v biases (k has none), as in BEiT and EVA."""

    default_names = ("qkv", "q_bias", "v_bias")

    def _check(self) -> None:
        if len(self.linears()) != 1:
            raise ValueError(f"{self.names[0]} of {type(self.owner).__name__} must be a module")
        if self.linears()[0].bias is not None:
            raise ValueError("qkv already has a bias")

    @property
    def out_features(self) -> int:
        return self.linears()[0].out_features

    def _biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return carried_member(self.owner, self.names[1]), carried_member(self.owner, self.names[2])

    @property
    def weight(self) -> torch.Tensor:
        return self.linears()[0].weight

    @property
    def bias(self) -> torch.Tensor | None:
        q_bias, v_bias = self._biases()
        if q_bias is None:
            return None
        return torch.cat([q_bias, torch.zeros_like(q_bias), v_bias])

    def projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of q, k and v (views of the fused weight; k has no bias)."""
        w_q, w_k, w_v = self.weight.split(self.out_features // 3)
        q_bias, v_bias = self._biases()
        if q_bias is None:  # as `bias`: no q bias, no bias at all
            return [(w_q, None), (w_k, None), (w_v, None)]
        return [(w_q, q_bias), (w_k, None), (w_v, v_bias)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.linears()[0]
        if _is_plain(qkv):
            return F.linear(x, qkv.weight, self.bias)
        bias = self.bias
        return qkv(x) if bias is None else qkv(x) + bias


def qkv_linears(qkv: nn.Module | FusedQKVView) -> list[nn.Module] | None:
    """The projection modules a fused qkv projection runs: [qkv] for a Linear, the view's modules, or None."""
    if isinstance(qkv, FusedQKVView):
        return qkv.linears()
    return [qkv] if isinstance(qkv, nn.Linear) else None


def qkv_projections(qkv: nn.Module | FusedQKVView) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """(weight, bias) of q, k and v that compute what a fused qkv projection does, split along its output;
    None for an unknown module (or a view over modules that are not Linear layers)."""
    if isinstance(qkv, FusedQKVView):
        return qkv.projections() if all(isinstance(m, nn.Linear) for m in qkv.linears()) else None
    if isinstance(qkv, nn.Linear):
        width = qkv.out_features // 3
        biases = (None,) * 3 if qkv.bias is None else qkv.bias.split(width)
        return list(zip(qkv.weight.split(width), biases, strict=True))
    return None


def query_projection(qkv: nn.Module | FusedQKVView) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) that compute q alone from a fused qkv projection, or None for an unknown module."""
    projections = qkv_projections(qkv)
    return None if projections is None else projections[0]
