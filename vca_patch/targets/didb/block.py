"""The MLP of a transformer block, found by structure: its two Linears (fc1 → fc2) and its activation module."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Mish, nn.Tanh, nn.Hardswish, nn.LeakyReLU, nn.PReLU, nn.ELU)


def _is_activation(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, _ACTIVATIONS) or "GELU" in name or name.endswith("Activation")


@dataclass
class BlockMLP:
    """Paths (inside the block) of an MLP's fc1, activation (None when it is no module) and fc2."""

    fc1: str
    act: str | None
    fc2: str


def find_mlp(block: nn.Module, attention_name: str) -> BlockMLP:
    """The block's MLP: exactly two plain Linears outside the attention, chained (fc1.out = fc2.in)."""
    inside = attention_name + "."

    def outside(path: str) -> bool:
        return path != attention_name and not path.startswith(inside)

    linears = [(p, m) for p, m in block.named_modules() if isinstance(m, nn.Linear) and outside(p)]
    if len(linears) != 2:
        found = ", ".join(f"{p} [{type(m).__name__}]" for p, m in linears) or "none"
        raise ValueError(
            f"{type(block).__name__} has no two-Linear MLP outside {attention_name!r} (found {found}); gated or "
            "convolutional MLPs are not supported: exclude 'fc1'/'fc2' from DIDBConfig.binarize"
        )
    (fc1, first), (fc2, second) = linears
    if type(first) is not nn.Linear or type(second) is not nn.Linear or first.out_features != second.in_features:
        raise ValueError(f"{fc1} and {fc2} of {type(block).__name__} are not a plain Linear → Linear MLP")
    acts = [p for p, m in block.named_modules() if p and outside(p) and _is_activation(m)]
    return BlockMLP(fc1, acts[0] if len(acts) == 1 else None, fc2)
