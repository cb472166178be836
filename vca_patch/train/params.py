"""Parameter groups of a patched model and the λ guard that keeps λ in [0, λ_max]."""

from __future__ import annotations

import math

import torch
from torch import nn

from vca_patch.families.diffusers.processor import NEW_PARAMETERS
from vca_patch.layers.carried_module import CarriesOriginal
from vca_patch.surgery import get_patch_state
from vca_patch.targets.vca.differential_lambda import DifferentialLambda
from vca_patch.targets.vca.layer import VisualContrastAttention

GROUPS = ("new", "lambda", "carried", "rest")
LAMBDA_ROUNDOFF = 1e-5  # float32 round-off of λ after a clamp: the guard leaves λ within this of its bounds


def parameter_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """{"new": parameters the target added (VCA, MANO, DIDB, ...), "lambda": VCA's λ vectors, "carried": the
    original modules' own parameters (attention q/k/v/proj and their norms; the weights a block edit carries, e.g.
    DIDB's binarised fc1/fc2), "rest": everything else}, each a list of (name, parameter). Carried parameters are
    recognised by identity with the replaced modules' parameters, or, in a block edit that carries its original
    (`CarriesOriginal`), by its `carried_names`."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {g: [] for g in GROUPS}
    state = get_patch_state(model)
    sites = [path + "." for path in state.originals] if state is not None else []
    edits = {path + ".": model.get_submodule(path) for path in state.block_originals} if state is not None else {}
    replaced = [*state.originals.values(), *state.block_originals.values()] if state is not None else []
    carried = {id(p) for original in replaced if isinstance(original, nn.Module) for p in original.parameters()}
    for path in sites:  # an adapter that swapped an implementation in place (diffusers processors): all but `vca`
        module = model.get_submodule(path[:-1])
        new = module._modules.get(NEW_PARAMETERS)
        if new is not None:
            own = {id(p) for p in new.parameters()}
            carried |= {id(p) for p in module.parameters() if id(p) not in own}
    for name, p in model.named_parameters():
        prefix = next((v for v in sites if name.startswith(v)), None)
        edit = next((v for v in edits if name.startswith(v)), None) if prefix is None else None
        if prefix is None and edit is None:
            groups["rest"].append((name, p))
        elif id(p) in carried:
            groups["carried"].append((name, p))
        elif edit is not None:
            module = edits[edit]
            own = isinstance(module, CarriesOriginal) and name[len(edit) :] in module.carried_names
            groups["carried" if own else "new"].append((name, p))
        elif name[len(prefix) :].removeprefix(NEW_PARAMETERS + ".").startswith(("lambda1.", "lambda2.")):
            groups["lambda"].append((name, p))
        else:
            groups["new"].append((name, p))
    return groups


@torch.no_grad()
def clamp_lambda(lam: DifferentialLambda, low: float = 0.0, high: float = 0.95, value: float | None = None) -> bool:
    """Project λ = exp⟨q1,k1⟩ − exp⟨q2,k2⟩ + λ_init back into [low, high] by moving q2 along k2.

    Returns True when it had to move. The vectors stay non-zero, so λ keeps its gradient. `value`: λ if
    already read.
    """
    value = float(lam()) if value is None else value
    if low - LAMBDA_ROUNDOFF <= value <= high + LAMBDA_ROUNDOFF:  # a previous clamp's round-off is no violation
        return False
    goal = min(max(value, low), high)
    q1, k1, q2, k2 = (p.double() for p in (lam.q1, lam.k1, lam.q2, lam.k2))
    rest = math.exp(float(q1 @ k1)) + lam.lambda_init - goal  # = exp⟨q2, k2⟩ at the goal, > 0 here
    target = math.log(rest)
    norm2 = float(k2 @ k2)
    if norm2 < 1e-20:
        return False
    q2 = q2 + (target - float(q2 @ k2)) * k2 / norm2
    lam.q2.copy_(q2.to(lam.q2.dtype))
    return True


@torch.no_grad()
def guard_lambdas(model: nn.Module, high: float) -> int:
    """Clamp every VCA layer's λ₁, λ₂ into [0, high]; returns how many were moved. Reads all λ in one transfer."""
    lams = [lam for m in vca_layers(model) for lam in (m.lambda1, m.lambda2)]
    if not lams:
        return 0
    values = torch.stack([lam().reshape(()).double() for lam in lams]).tolist()
    return sum(clamp_lambda(lam, 0.0, high, value) for lam, value in zip(lams, values, strict=True))


def lambda_trace(model: nn.Module) -> list[list[float]]:
    """[[λ₁, λ₂] per VCA layer] for health logs."""
    return [list(m.lambdas()) for m in vca_layers(model)]


def vca_layers(model: nn.Module) -> list[VisualContrastAttention]:
    """The VCA layers of `model`: its modules, and the layers diffusers attention processors hold (outside the
    module tree, bound to the attention module's parameters at each call)."""
    found = []
    for m in model.modules():
        layer = m if isinstance(m, VisualContrastAttention) else getattr(getattr(m, "processor", None), "layer", None)
        if isinstance(layer, VisualContrastAttention):
            found.append(layer)
    return found
