"""Bit-packed binary Linears: sign bits + per-output-channel scales instead of latent float weights.

Format (per binarised Linear, state-dict keys next to its `bias`): `weight_signs` uint8 [O, 8·⌈K/64⌉], bit j of
byte b of a row is input column 8·b + j (LSB first; rows padded with 0 bits to whole 64-bit words), 1 ⇔ W < 0;
`weight_scale` [O] (the weight's dtype) α = mean |W| per row; `weight_nonzero` (same layout, 1 ⇔ W ≠ 0) only when
the weight has exact zeros (sign 0). About 32× smaller than float32 for those Linears.

`pack_binary(model)` turns a DIDB-patched model's binarised Linears into `PackedBinaryLinear`s (the latent float
weights are released); they compute exactly what the float emulation computed (α and sign(W) are kept as they were),
with the XNOR-popcount kernel in eval mode without autograd, the float emulation otherwise. `unpack_binary(model)`
goes back to trainable latent weights W = α ⊙ sign(W) (the latent magnitudes are not stored).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from vca_patch.core.errors import ConfigError, PatchError
from vca_patch.core.patch_state import get_patch_state
from vca_patch.layers.carried_module import CarriesOriginal
from vca_patch.layers.fused_qkv import FusedQKVView
from vca_patch.targets.didb.attention import DIDBAttention
from vca_patch.targets.didb.binary import BinaryLinear, BinaryWeight, binary_forward
from vca_patch.targets.didb.bits import as_words, pack_bits, packed_width, signs_from_bits, unpack_bits

PACKED_KEYS = ("weight_signs", "weight_scale", "weight_nonzero")


class PackedFormatError(ConfigError):
    """Packed tensors that do not describe a binarised Linear of the model."""


class PackedBinaryLinear(CarriesOriginal, nn.Module):
    """A Linear with weights α ⊙ sign(W) held as packed sign bits + scales (see the module doc).

    With `act_clip` (a former BinaryLinear) its inputs are binarised too (c·sign x) while `binarize_activations`;
    without, it is a Linear with binary weights and real inputs (a former carried q/k/v/proj Linear, whose
    DIDBAttention binarises the inputs itself). `weight` is the dense α ⊙ sign(W), computed on access.
    """

    carried_names = ("weight_signs", "weight_scale", "weight_nonzero", "bias")

    def __init__(
        self,
        weight: BinaryWeight,
        bias: nn.Parameter | None,
        act_clip: nn.Parameter | None = None,
        *,
        binarize_activations: bool = True,
    ) -> None:
        super().__init__()
        if weight.words is None:
            raise ValueError("PackedBinaryLinear needs packed sign words")
        self.in_features, self.out_features = weight.in_features, weight.scale.shape[0]
        self.register_buffer("weight_signs", weight.words.view(torch.uint8))
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("weight_nonzero", None if weight.nonzero is None else weight.nonzero.view(torch.uint8))
        self.bias = bias
        self.act_clip = act_clip
        self.binarize_activations = binarize_activations

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: nn.Parameter | None, **kwargs) -> PackedBinaryLinear:
        """Pack a latent weight W [O, K]: α = mean |W| per row (as the float emulation computes it), sign bits."""
        return cls(pack_weight(weight.detach()), bias, **kwargs)

    def binary_weight(self) -> BinaryWeight:
        """α and the signs: as packed words for the XNOR kernel; traced (compile, export), as dense signs unpacked
        from the stored bytes (the kernel does not run there, and ONNX has no reinterpreting int64 view)."""
        if torch.compiler.is_compiling():
            scale = self.weight_scale
            signs = signs_from_bits(self.weight_signs, self.weight_nonzero, self.in_features, dtype=scale.dtype)
            return BinaryWeight(scale, self.in_features, dense_signs=signs)
        nonzero = None if self.weight_nonzero is None else as_words(self.weight_nonzero)
        return BinaryWeight(self.weight_scale, self.in_features, words=as_words(self.weight_signs), nonzero=nonzero)

    @property
    def weight(self) -> torch.Tensor:
        """The dense binary weight α ⊙ sign(W) [O, K] (computed)."""
        return self.binary_weight().dense()

    def linear_view(self) -> PackedBinaryLinear:
        """The same packed weights and bias as a Linear with real inputs (what unpatching puts back)."""
        return PackedBinaryLinear(self.binary_weight(), self.bias)

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear with the latent weight α ⊙ sign(W) (the bias shared). Its recomputed mean |W| may
        differ from α in the last bit (no latent magnitudes are stored), which can flip downstream signs."""
        dense = self.weight.detach()
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(dense.clone())
        linear.bias = self.bias
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = self.act_clip if self.act_clip is not None and self.binarize_activations else None
        return binary_forward(x, self.binary_weight(), self.bias, clip, allow_kernel=not self.training)

    def extra_repr(self) -> str:
        extra = f", binarize_activations={self.binarize_activations}" if self.act_clip is not None else ""
        zeros = self.weight_nonzero is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, zeros={zeros}{extra}"


def pack_weight(weight: torch.Tensor) -> BinaryWeight:
    """α = mean |W| per row and packed sign (and, where W has zeros, nonzero) words of a weight [O, K]."""
    if sys.byteorder != "little":
        raise RuntimeError("packed binary weights need a little-endian host")
    scale = weight.abs().mean(dim=1)
    zero = weight == 0
    nonzero = as_words(pack_bits(~zero)) if bool(zero.any()) else None
    return BinaryWeight(scale, weight.shape[1], words=as_words(pack_bits(weight < 0)), nonzero=nonzero)


# --- which Linears of a patched model are packed ---------------------------------------------------------------


@dataclass
class _Slot:
    """One binarised Linear: its module path, the owner and name it is registered under, and its role."""

    path: str
    owner: nn.Module
    name: str
    module: nn.Module
    role: str  # "attention" (carried q/k/v/proj of a DIDBAttention) or "block" (a BinaryLinear)
    rows: tuple[int, int] | None = None  # its rows of the attention's fused weight (q/k/v members)
    layer: DIDBAttention | None = None


def _qkv_members(layer: DIDBAttention) -> list[tuple[str, nn.Module]]:
    qkv = layer.qkv
    if isinstance(qkv, FusedQKVView):
        return [(name, m) for name, m in qkv.members() if isinstance(m, nn.Module)]
    return [(layer._qkv_layout[1][0], qkv)]


def _slots(model: nn.Module) -> Iterator[_Slot]:
    """Every binarised Linear of a DIDB-patched model (float or packed), in module order."""
    for path, module in model.named_modules():
        if isinstance(module, DIDBAttention) and module.binarize_weights:
            prefix = f"{path}." if path else ""
            if "qkv" in module.binary:
                start = 0
                for name, member in _qkv_members(module):
                    stop = start + member.out_features
                    yield _Slot(prefix + name, module, name, member, "attention", (start, stop), module)
                    start = stop
            if "proj" in module.binary:
                proj = module._proj_name
                yield _Slot(prefix + proj, module, proj, module.proj, "attention", None, module)
        elif isinstance(module, (BinaryLinear, PackedBinaryLinear)) and path:
            if isinstance(module, PackedBinaryLinear) and module.act_clip is None:
                continue  # a carried Linear, listed with its attention layer
            if isinstance(module, BinaryLinear) and not module.binarize_weights:
                continue
            parent, _, name = path.rpartition(".")
            yield _Slot(path, model.get_submodule(parent), name, module, "block")


def _didb_state(model: nn.Module, action: str):
    state = get_patch_state(model)
    if state is None or getattr(state.config, "target", None) != "didb":
        raise PatchError(f"{action} needs a model patched with vca_patch.DIDBConfig")
    if not state.config.weights:
        raise PatchError(
            f"{action}: the weights are not binarised (DIDBConfig.weights=False, the first training stage); the "
            "packed form stores sign bits only: set_binarization(model, weights=True) first"
        )
    return state


def is_packed(model: nn.Module) -> bool:
    """Whether any binarised Linear of `model` is held in packed form."""
    return any(isinstance(m, PackedBinaryLinear) for m in model.modules())


def _install(model: nn.Module, slot: _Slot, new: nn.Module) -> None:
    """Register `new` where slot's module was; keep unpatching consistent (the originals hold `new`'s tensors)."""
    new.train(slot.module.training)
    if slot.role == "attention":
        slot.owner._modules[slot.name] = new
        original = slot.owner.__dict__.get("original_module")
        if original is not None:  # the replaced attention module (for unpatching) holds the new Linear too
            slot.owner.restore_into(original)
        return
    setattr(slot.owner, slot.name, new)
    state = get_patch_state(model)
    if slot.path in state.block_originals:
        if isinstance(new, PackedBinaryLinear):
            original = new.linear_view()
        else:
            original = nn.Linear(new.in_features, new.out_features, bias=False, device="meta")
            original.weight, original.bias = new.weight, new.bias
        new.keep_original(original)
        state.block_originals[slot.path] = original


def _slot_weights(slots: list[_Slot]) -> list[BinaryWeight]:
    """Each slot's binarised weight as the float emulation computes it: a q/k/v member's rows of its attention
    layer's fused weight, binarised whole (α is per row, computed on the same tensor the forward uses)."""
    fused: dict[int, BinaryWeight] = {}
    weights = []
    for slot in slots:
        if slot.rows is None:
            weights.append(pack_weight(slot.module.weight.detach()))
            continue
        key = id(slot.layer)
        if key not in fused:
            fused[key] = pack_weight(slot.layer.qkv.weight.detach())
        weights.append(fused[key].rows(*slot.rows))
    return weights


def _packed_from(slot: _Slot, weight: BinaryWeight) -> PackedBinaryLinear:
    module = slot.module
    if slot.role == "block":
        return PackedBinaryLinear(
            weight, module.bias, module.act_clip, binarize_activations=module.binarize_activations
        )
    return PackedBinaryLinear(weight, module.bias)


def _check_plain(slot: _Slot) -> None:
    if slot.role == "attention" and type(slot.module) is not nn.Linear:
        raise PatchError(
            f"{slot.path} is a {type(slot.module).__name__}, not a plain nn.Linear: only plain Linears pack"
        )


@torch.no_grad()
def pack_binary(model: nn.Module) -> nn.Module:
    """Hold every binarised Linear of a DIDB-patched model as packed bits + scales, in place (see module doc)."""
    _didb_state(model, "pack_binary")
    slots = [s for s in _slots(model) if not isinstance(s.module, PackedBinaryLinear)]
    for slot in slots:
        _check_plain(slot)
    weights = _slot_weights(slots)  # all before any module changes
    for slot, weight in zip(slots, weights, strict=True):
        _install(model, slot, _packed_from(slot, weight))
    return model


@torch.no_grad()
def unpack_binary(model: nn.Module) -> nn.Module:
    """Back to trainable latent float weights W = α ⊙ sign(W), in place (the binarised forward is unchanged up to
    float rounding of the recomputed α = mean |W|)."""
    _didb_state(model, "unpack_binary")
    for slot in [s for s in _slots(model) if isinstance(s.module, PackedBinaryLinear)]:
        linear = slot.module.to_linear()
        if slot.role == "block":
            module = slot.module
            new = BinaryLinear.from_linear(linear, binarize_activations=module.binarize_activations)
            new.act_clip = module.act_clip
            _install(model, slot, new)
        else:
            _install(model, slot, linear)
    return model


def packed_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() with every binarised Linear in packed form (the model itself is not changed)."""
    _didb_state(model, "a packed checkpoint")
    state = dict(model.state_dict())
    slots = [s for s in _slots(model) if not isinstance(s.module, PackedBinaryLinear)]
    for slot in slots:
        _check_plain(slot)
    for slot, weight in zip(slots, _slot_weights(slots), strict=True):
        del state[f"{slot.path}.weight"]
        state[f"{slot.path}.weight_signs"] = weight.words.view(torch.uint8)
        state[f"{slot.path}.weight_scale"] = weight.scale
        if weight.nonzero is not None:
            state[f"{slot.path}.weight_nonzero"] = weight.nonzero.view(torch.uint8)
    return state


def _check_bits(key: str, bits: torch.Tensor, out_features: int, in_features: int) -> None:
    width = packed_width(in_features)
    if bits.dtype != torch.uint8 or tuple(bits.shape) != (out_features, width):
        raise PackedFormatError(
            f"{key} must be uint8 [{out_features}, {width}] (sign bits of a {out_features}x{in_features} weight), "
            f"got {bits.dtype} {list(bits.shape)}"
        )
    if in_features % 64 and bool(unpack_bits(bits, width * 8)[:, in_features:].any()):
        raise PackedFormatError(f"{key} has bits set past column {in_features}: not written by vca-patch")


@torch.no_grad()
def load_packed(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Give a freshly built float DIDB model the packed form described by `state_dict` (values copied from it);
    PackedFormatError names the first tensor that does not fit."""
    _didb_state(model, f"the packed checkpoint {source}")
    slots = list(_slots(model))
    weights = []
    for slot in slots:
        _check_plain(slot)
        out_features, in_features = slot.module.out_features, slot.module.in_features
        keys = {name: f"{slot.path}.{name}" for name in PACKED_KEYS}
        missing = [keys[n] for n in ("weight_signs", "weight_scale") if keys[n] not in state_dict]
        if missing:
            raise PackedFormatError(
                f"{source} is marked packed but has no {', '.join(missing)}: the packed tensors of a binarised "
                "Linear are weight_signs and weight_scale"
            )
        signs = state_dict[keys["weight_signs"]]
        _check_bits(keys["weight_signs"], signs, out_features, in_features)
        scale = state_dict[keys["weight_scale"]]
        if not scale.is_floating_point() or tuple(scale.shape) != (out_features,):
            raise PackedFormatError(f"{keys['weight_scale']} must be a float vector [{out_features}], got "
                                    f"{scale.dtype} {list(scale.shape)}")  # fmt: skip
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise PackedFormatError(f"{keys['weight_scale']} must hold finite, non-negative scales (mean |W|)")
        nonzero = state_dict.get(keys["weight_nonzero"])
        if nonzero is not None:
            _check_bits(keys["weight_nonzero"], nonzero, out_features, in_features)
            if bool((signs & ~nonzero).any()):
                raise PackedFormatError(f"{keys['weight_signs']} marks zero weights (weight_nonzero) negative")
        device, dtype = slot.module.weight.device, slot.module.weight.dtype
        words = as_words(signs.to(device).clone())
        nonzero = None if nonzero is None else as_words(nonzero.to(device).clone())
        weights.append(BinaryWeight(scale.to(device, dtype).clone(), in_features, words=words, nonzero=nonzero))
    for slot, weight in zip(slots, weights, strict=True):
        _install(model, slot, _packed_from(slot, weight))
