"""Teacher forcing inside the student's own forward, for layers that only run inside their block.

A hierarchical model's patched layer (a PVT stage's reduction VCA, a Swin stage's windowed VCA) takes its grid,
windows and shift from the block and model hooks around it, so it cannot be called alone on the teacher's
input as a ViT layer can (its adapter says so: `ModelAdapter.layers_run_alone`). Here one forward of the student
runs with each patched layer's input replaced by the teacher's input of the same site (`teacher_attention`), and
records each layer's output. `layer_outputs` applies the one rule: each layer alone where the adapter allows it,
else this forced forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vca_patch.families.call_shims import _TOKEN_NAMES, attention_output
from vca_patch.layers.layout import TokenLayout
from vca_patch.surgery import PatchError, get_patch_state


def layers_run_alone(student: nn.Module) -> bool:
    """Whether the patched `student`'s layers can be called one by one with `layout=` (its adapter's rule)."""
    state = get_patch_state(student)
    if state is None:
        raise PatchError("model is not patched by vca_patch; call vca_patch.patch_model(model) first")
    return bool(getattr(state.adapter, "layers_run_alone", True))


def forced_forward(
    student: nn.Module, captured: dict[str, tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor
) -> dict[str, torch.Tensor]:
    """{site path: the student layer's output on the teacher's input of that site}, from one forward on `x`.

    Runs under the caller's grad mode: with gradients on, each output's graph reaches only its own layer's
    parameters (the swapped-in input is the teacher's), so a loss on them trains each layer on the teacher's input.
    """
    outputs: dict[str, torch.Tensor] = {}

    def swap_input(module: nn.Module, args: tuple, kwargs: dict[str, Any], path: str) -> tuple[tuple, dict]:
        tokens = captured[path][0]
        if args:
            return (tokens.to(args[0]), *args[1:]), kwargs
        name = next(n for n in _TOKEN_NAMES if n in kwargs)
        return args, {**kwargs, name: tokens.to(kwargs[name])}

    def record(module: nn.Module, args: tuple, output: Any, path: str) -> None:
        outputs[path] = attention_output(output)

    handles = []
    try:
        for path in captured:
            layer = student.get_submodule(path)
            handles.append(
                layer.register_forward_pre_hook(
                    lambda m, a, k, path=path: swap_input(m, a, k, path), with_kwargs=True, prepend=True
                )
            )
            handles.append(layer.register_forward_hook(lambda m, a, o, path=path: record(m, a, o, path)))
        student(x)
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(set(captured) - set(outputs))
    if missing:
        raise RuntimeError(f"teacher forcing: the student's forward never called {missing}")
    return outputs


def layer_outputs(
    student: nn.Module,
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    layout: TokenLayout | Callable[[], TokenLayout],
) -> dict[str, torch.Tensor]:
    """Each patched layer's output on the teacher's input of its site, under the caller's grad mode.

    Where the adapter's layers run alone (ViTs), each is called on its captured input with `layout=` (a layout,
    or a callable giving it, called only on this path); else one forced forward of the student on `x`."""
    if not layers_run_alone(student):
        return forced_forward(student, captured, x)
    layout = layout() if callable(layout) else layout
    return {p: attention_output(student.get_submodule(p)(inp, layout=layout)) for p, (inp, _) in captured.items()}
