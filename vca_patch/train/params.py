"""Parameter groups of a patched model, and its target's parameter guard and trace (the target's hooks:
`TargetConfig.parameter_groups` / `guard_parameters` / `parameter_trace`; VCA's λ in targets/vca/training.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from vca_patch.families.diffusers.processor import NEW_PARAMETERS
from vca_patch.layers.carried_module import CarriesOriginal
from vca_patch.surgery import get_patch_state

GROUPS = ("new", "lambda", "carried", "rest")  # "lambda": the target's own group (a stage's lambda_lr), if any


def parameter_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """{"new": parameters the target added (VCA, MANO, DIDB, ...), "lambda": those the target's `parameter_groups`
    hook puts there (VCA's λ vectors), "carried": the original modules' own parameters (attention q/k/v/proj and
    their norms; the weights a block edit carries, e.g. DIDB's binarised fc1/fc2), "rest": everything else}, each a
    list of (name, parameter). Carried parameters are recognised by identity with the replaced modules' parameters,
    or, in a block edit that carries its original (`CarriesOriginal`), by its `carried_names`."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {g: [] for g in GROUPS}
    state = get_patch_state(model)
    own_group = _target_groups(model, state)
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
        else:
            groups[own_group.get(id(p), "new")].append((name, p))
    return groups


def _target_groups(model: nn.Module, state: Any) -> dict[int, str]:
    """{id(parameter): group} from the target's `parameter_groups` hook; only groups a recipe stage can set."""
    if state is None:
        return {}
    found: dict[int, str] = {}
    for group, params in state.config.parameter_groups(model).items():
        if group not in GROUPS or group in ("carried", "rest"):
            raise ValueError(f"target {state.config.target!r}: parameter group {group!r} is not one of new, lambda")
        found.update({id(p): group for p in params})
    return found


def _target_config(model: nn.Module) -> Any:
    state = get_patch_state(model)
    return state.config if state is not None else None


def guard_parameters(model: nn.Module, high: float) -> int:
    """The patched model's target guard (`TargetConfig.guard_parameters`; VCA: λ into [0, high]); how many moved."""
    config = _target_config(model)
    return config.guard_parameters(model, high) if config is not None else 0


def parameter_trace(model: nn.Module) -> dict[str, Any]:
    """The target's parameter health values for an evaluation record (`TargetConfig.parameter_trace`)."""
    config = _target_config(model)
    return config.parameter_trace(model) if config is not None else {}
