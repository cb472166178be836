"""What an adapter tells surgery about one model family."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from vca_patch.families.library import ModelLibrary
from vca_patch.families.site import AttentionSite, SkippedSite
from vca_patch.families.verify import TOLERANCE, verification_error
from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.layout import TokenLayout, close_scope, open_scope, recorded_layout, scoped_layout


def attention_dropout_note(module: nn.Module) -> str | None:
    """The report's note when `module` applies dropout to its attention weights (VCA has none), else None."""
    for name in ("attn_drop", "attention_dropout", "dropout"):
        value = getattr(module, name, None)
        p = value.p if isinstance(value, nn.Dropout) else value if isinstance(value, float) else 0.0
        if p > 0:
            return f"attention dropout (p={p:g}) dropped: VCA has no attention-weight dropout (training only)"
    return None


def remove_hooks(model: nn.Module, hook_types: tuple[type, ...], *, pre: bool = False) -> list[Any]:
    """Remove every forward hook (`pre`: forward pre-hook) of `hook_types` from the model's modules; the hooks."""
    removed = []
    for module in model.modules():
        hooks = module._forward_pre_hooks if pre else module._forward_hooks
        for key, hook in list(hooks.items()):
            if isinstance(hook, hook_types):
                del hooks[key]
                if pre:
                    module._forward_pre_hooks_with_kwargs.pop(key, None)
                else:
                    module._forward_hooks_with_kwargs.pop(key, None)
                    module._forward_hooks_always_called.pop(key, None)
                removed.append(hook)
    return removed


class LayoutTracker:
    """The token layout of a patched model's current forward call (see `attention.layout`).

    A forward hook on the model's embedding module opens the call's layout scope; `LayoutScopeEnd`, a hook on
    the model itself, closes it when the forward returns or raises. A callable object rather than a closure,
    so `copy.deepcopy(model)` gives the copy a tracker (and scopes) of its own.
    """

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        # The layout of the call being traced by torch.compile / torch.export (dynamo cannot trace a context
        # variable): a plain attribute, set by this hook and read by the layers within the same traced call, so
        # the traced graph carries the layout as the (symbolic) shapes it is derived from; None outside one.
        self.traced: TokenLayout | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        layout = self.adapter.layout_from_embedding(module, args, kwargs, output)
        if torch.compiler.is_compiling():
            self.traced = layout
        else:
            open_scope(self, layout)

    def current(self) -> TokenLayout:
        """The layout of the forward this call belongs to; a clear error outside one."""
        if torch.compiler.is_compiling():
            layout = self.traced if self.traced is not None else scoped_layout(self)
        else:
            layout = scoped_layout(self)
        if layout is None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            layout = recorded_layout()  # a recomputation under gradient checkpointing
        if layout is None:
            raise RuntimeError(
                "no token layout for this call: a patched layer takes it from its model's forward (the patch "
                "embedding sets the grid). Call the whole model, pass layout=TokenLayout(...), or use "
                "`with state.tracker.scope(layout):`; under gradient checkpointing, checkpoint modules whose "
                "output depends on the patched attention (e.g. whole blocks)"
            )
        return layout

    @property
    def layout(self) -> TokenLayout | None:
        """The layout of the current scope in this context, or None."""
        return scoped_layout(self)

    @layout.setter
    def layout(self, layout: TokenLayout | None) -> None:
        if layout is None:
            close_scope(self)
        else:
            open_scope(self, layout)

    @contextmanager
    def scope(self, layout: TokenLayout) -> Iterator[None]:
        """Run the block with `layout` as this model's layout (for layers called one by one)."""
        previous = scoped_layout(self)
        open_scope(self, layout)
        try:
            yield
        finally:
            self.layout = previous


class LayoutScopeEnd:
    """Forward hook (always called) on a patched model: its forward's layout scope ends with it."""

    def __init__(self, tracker: LayoutTracker) -> None:
        self.tracker = tracker

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling():
            self.tracker.traced = None
        else:
            close_scope(self.tracker)


class ModelAdapter(ABC):
    """Knows one model family: where its attention is, its token layout, how to rebuild it."""

    name: str
    # The hooks of the model library this family rebuilds (guard checks, loading by name, card task); None: its
    # models convert but cannot be saved / reloaded (see families/library.py).
    library: ModelLibrary | None = None
    # Whether a patched layer can be called alone on its input tokens (with `layout=`), as fidelity and attention
    # transfer do. False where it takes its grid/windows/shift from hooks on its block (PVT stages, Swin windows):
    # those are measured by teacher forcing inside one forward of the model (`train.forced`).
    layers_run_alone: bool = True
    # Whether the model is probed, calibrated and measured on images. False (diffusion transformers): `convert`
    # refuses `--calibration-data` and measures with `probe_fidelity`, `fidelity` measures denoising steps.
    takes_images: bool = True
    # The title of `inspect`'s table of `describe_sites` rows.
    sites_title: str = "Attention sites"

    @classmethod
    @abstractmethod
    def applies_to(cls, model: nn.Module) -> bool: ...

    @abstractmethod
    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]: ...

    @abstractmethod
    def embedding_module(self, model: nn.Module) -> nn.Module:
        """The module whose forward fixes the token layout of the current input."""

    @abstractmethod
    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout: ...

    @abstractmethod
    def carry(self, site: AttentionSite) -> CarriedAttention:
        """The site's q/k/v/proj (and norms, gate, dropout) for a replacement to reuse."""

    @abstractmethod
    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        """JSON-safe description from which `create_base` rebuilds the unpatched model."""

    @classmethod
    @abstractmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        """Rebuild the unpatched architecture (random weights) from `describe_base`'s output."""

    def call_original(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run an original attention module on [B, N, C] tokens, returning [B, N, C_out]."""
        return module(x)

    @abstractmethod
    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        """Make `replacement` accept the family's call convention (hooks on the replacement only)."""

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        """The token layout at the model's native input size, when it has one."""
        return None

    def verify(self, site: AttentionSite) -> AttentionSite:
        """Check the site against a reference softmax attention built from its weights; records the outcome."""
        error = verification_error(site.module, self.carry(site), self.call_original)
        site.verified = None if error is None else error < TOLERANCE
        if site.verified is False:
            site.notes.append(f"reference softmax attention differs by {error:.2g} (relative)")
        return site

    @classmethod
    def probe_inputs(cls, model: nn.Module, batch_size: int, seed: int) -> Any:
        """What `convert` feeds the model to measure what a conversion changes: by default a random image batch
        at the model's input size (`core.model_io.probe_batch`), drawn from `seed`."""
        from vca_patch.core.model_io import probe_batch

        return probe_batch(model, batch_size, seed)

    @classmethod
    def predict(cls, model: nn.Module, inputs: Any) -> torch.Tensor:
        """The model's prediction on `probe_inputs`' `inputs`, compared before and after conversion: `model(x)`."""
        return model(inputs)

    @classmethod
    def probe_fidelity(
        cls, model: nn.Module, inputs: Any, prediction: dict[str, float], batch_size: int
    ) -> tuple[dict[str, float], str] | None:
        """For a model that `takes_images` is False for: `convert`'s fidelity summary of the patched model on its
        probe `inputs` (`prediction`: `compare_outputs` of the predictions) and what it was measured on. None (the
        default): `convert` calibrates and measures on images instead."""
        return None

    @classmethod
    def describe_sites(cls, model: nn.Module) -> list[dict[str, str]]:
        """Rows {"module", "kind", "tokens"} for an extra `inspect` table (titled `sites_title`) saying what each
        attention module is and the tokens it sees; [] (the default): no extra table."""
        return []

    @classmethod
    def new_parameters(cls, module: nn.Module) -> nn.Module | None:
        """For an adapter that installs replacements in place (`install_replacement`): the child of the kept site
        `module` that holds the replacement's new parameters, so that `train.params` groups every other parameter
        of the site as carried; None (the default): the site's module was replaced as a whole."""
        return None

    def install_layout_tracker(self, model: nn.Module) -> LayoutTracker:
        tracker = LayoutTracker(self)
        self.embedding_module(model).register_forward_hook(tracker, with_kwargs=True)
        model.register_forward_hook(LayoutScopeEnd(tracker), always_call=True)
        return tracker

    @staticmethod
    def remove_layout_tracker(model: nn.Module) -> None:
        for hook in remove_hooks(model, (LayoutTracker, LayoutScopeEnd)):
            close_scope(hook.tracker if isinstance(hook, LayoutScopeEnd) else hook)
