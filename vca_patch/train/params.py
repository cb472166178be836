"""Parameter groups of a patched model, and its target's parameter guard and trace (the target handler's hooks
`parameter_groups` / `guard_parameters` / `parameter_trace`; the groups a target may fill are those its recipe keys
declare, `target_keys.parameter_group_names`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from vca_patch.layers.carried_module import CarriesOriginal
from vca_patch.surgery import get_patch_state
from vca_patch.targets.handler import handler_for
from vca_patch.train import target_keys
from vca_patch.train.recipe import TrainSpec


def group_names() -> list[str]:
    """The group names: "new", each parameter group a registered target declares (VCA: "lambda"), "carried",
    "rest"."""
    return ["new", *target_keys.parameter_group_names(), "carried", "rest"]


def parameter_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """{"new": parameters the target added, then each declared target group (`group_names`): those the target's
    `parameter_groups` hook puts there (VCA's "lambda": its λ vectors; empty for other targets), "carried": the
    original modules' own parameters (attention q/k/v/proj and their norms; the weights a block edit carries, e.g.
    DIDB's binarised fc1/fc2), "rest": everything else}, each a list of (name, parameter). Carried parameters are
    recognised by identity with the replaced modules' parameters, or, in a block edit that carries its original
    (`CarriesOriginal`), by its `carried_names`."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {g: [] for g in group_names()}
    state = get_patch_state(model)
    own_group = _target_groups(model, state)
    sites = [path + "." for path in state.originals] if state is not None else []
    edits = {path + ".": model.get_submodule(path) for path in state.block_originals} if state is not None else {}
    replaced = [*state.originals.values(), *state.block_originals.values()] if state is not None else []
    carried = {id(p) for original in replaced if isinstance(original, nn.Module) for p in original.parameters()}
    carried |= _carried_in_place(model, state, sites)
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


def _carried_in_place(model: nn.Module, state: Any, sites: list[str]) -> set[int]:
    """Ids of the parameters a site kept when its adapter swapped an implementation in place (diffusers
    processors): all but those of the holder of new parameters its adapter names (`ModelAdapter.new_parameters`)."""
    carried: set[int] = set()
    for path in sites:
        module = model.get_submodule(path[:-1])
        new = state.adapter.new_parameters(module)
        if new is not None:
            own = {id(p) for p in new.parameters()}
            carried |= {id(p) for p in module.parameters() if id(p) not in own}
    return carried


def _target_groups(model: nn.Module, state: Any) -> dict[int, str]:
    """{id(parameter): group} from the target's `parameter_groups` hook; only groups a recipe stage can set."""
    if state is None:
        return {}
    found: dict[int, str] = {}
    declared = ["new", *target_keys.parameter_group_names()]
    for group, params in handler_for(state.config).parameter_groups(state.config, model).items():
        if group not in declared:
            raise ValueError(
                f"target {state.config.target!r}: parameter group {group!r} is not one of {declared}; a target "
                "declares its groups' learning rates in its recipe keys (`TargetConfig.recipe_options`)"
            )
        found.update({id(p): group for p in params})
    return found


def _target_config(model: nn.Module) -> Any:
    state = get_patch_state(model)
    return state.config if state is not None else None


def guard_parameters(model: nn.Module, train: TrainSpec) -> int:
    """The patched model's target guard (its handler's `guard_parameters`) with the target's keys of the recipe's
    `train` section (VCA: λ into [0, lambda_max] under `lambda_guard: clamp`); how many moved."""
    config = _target_config(model)
    if config is None:
        return 0
    options = target_keys.target_options(config, "train", train.options)
    return handler_for(config).guard_parameters(config, model, options)


def parameter_trace(model: nn.Module) -> dict[str, Any]:
    """The target's parameter health values for an evaluation record (its handler's `parameter_trace`)."""
    config = _target_config(model)
    return handler_for(config).parameter_trace(config, model) if config is not None else {}
