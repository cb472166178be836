"""The hooks a target's handler gives, grouped into runtime-checkable protocols.

A target is a config (plain data: a `TargetConfig` dataclass) and a handler (its behaviour: a `TargetHandler`
subclass registered for the config's type, `vca_patch.targets.handler`). Every hook takes the config first (the
config class, for the hooks listed in `CLASS_HOOKS`). `TargetHandler` implements every protocol here but
`PackedForm`, with the defaults each hook's docstring gives, so a handler overrides only what its target needs;
shared code reaches an optional form with `isinstance(handler, PackedForm)` instead of looking a name up.

Only `SurgeryHooks.build_layer` is required (its default raises NotImplementedError); every other hook is optional.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class SurgeryHooks(Protocol):
    """What `patch_model` asks of a target: the replacement layers and what reports and checkpoints record."""

    def build_layer(self, config: Any, carried: Any, layer_index: int) -> nn.Module:
        """Required. The replacement for one attention module, reusing `carried` (a `CarriedAttention`) and
        initialised. Default: NotImplementedError."""
        ...

    def builds_variant(self, config_cls: type, carried: Any) -> bool:
        """Whether `build_layer` builds a variant of its own for `carried`, a carry that refuses a generic layer
        (`VariantRequired`: hierarchical stages, joint streams); surgery names the targets that do when another is
        refused one. Default: False."""
        ...

    def layer_settings(self, config: Any, layer: nn.Module) -> dict[str, Any]:
        """JSON-safe per-layer facts recorded in reports and checkpoints. Default: {}."""
        ...

    def as_built(self, config: Any, model: nn.Module) -> Any:
        """`config` with its automatic choices replaced by what `model`'s patched layers got, as saved in a
        checkpoint, so a reload rebuilds the same layers. Default: `config` itself (no automatic choices)."""
        ...

    def block_edits(self, config: Any, block: nn.Module, attention_name: str, layer_index: int) -> dict[str, nn.Module]:
        """Replacements for other modules of the site's block, {path inside `block`: new module}, built without
        changing `block`; surgery swaps them in with the attention and `unpatch_model` restores them. Default: {}."""
        ...

    def block_forwards(self, config: Any, blocks: dict[int, tuple[nn.Module, str]]) -> dict[int, Any]:
        """Replacement forwards for whole blocks, {block index: callable}, given every patched site's {block index:
        (block, attention name)}; `unpatch_model` removes them. Default: {} (token merging uses it)."""
        ...


@runtime_checkable
class CardHooks(Protocol):
    """What the model card asks of a target."""

    def card_section(self, config_cls: type, data: dict[str, Any]) -> tuple[str, str, str]:
        """(attention name, one-paragraph description, conversion-table rows) of a checkpoint's model card, from its
        config.json `config` block `data`. Default: the config class's summary line and every non-selection
        setting."""
        ...


@runtime_checkable
class PackingHooks(Protocol):
    """Whether a patched model is held in the target's packed form (see `PackedForm`)."""

    def is_packed(self, config: Any, model: nn.Module) -> bool:
        """Whether `model` (patched with `config`) is held packed, which then is the only form it saves
        (`save_pretrained(..., packed=True)`). Default: False (no packed form)."""
        ...


@runtime_checkable
class PackedForm(Protocol):
    """Optional, not implemented by `TargetHandler`: a packed checkpoint form (DIDB: binarised Linears as sign bits
    and scales). `save_pretrained(..., packed=True)` and `convert --packed` save `packed_state_dict`, loading a
    packed folder calls `load_packed`; shared code asks `isinstance(handler_for(config), PackedForm)`, so a handler
    implements all three or none."""

    def pack(self, config: Any, model: nn.Module) -> nn.Module:
        """Hold `model`'s modules packed, in place."""
        ...

    def packed_state_dict(self, config: Any, model: nn.Module) -> dict[str, Any]:
        """`model`'s state dict in the packed form (the model is not changed)."""
        ...

    def load_packed(self, config: Any, model: nn.Module, state_dict: dict[str, Any], source: str) -> None:
        """Put a freshly built `model` into the packed form of `state_dict` (ValueError when it does not fit)."""
        ...


@runtime_checkable
class CalibrationHooks(Protocol):
    """What `vca_patch.calibrate` asks of a target: its options, which layers it fits in closed form, and how, and
    how a layer whose error stays high grows."""

    def calibration_settings(self, config_cls: type, options: dict[str, Any]) -> Any:
        """`options` (keywords of `vca_patch.calibrate`) as an instance of the config class's
        `calibration_options`, the others at their defaults; ConfigError naming a bad key. Default: that check, and
        None for a target that declares no options (and was given none)."""
        ...

    def calibrates(self, config: Any, layer: nn.Module) -> bool:
        """Whether `layer` (patched in by `config`) has a closed-form calibration. Default: False."""
        ...

    def calibrate_layer(
        self, config: Any, layer: nn.Module, capture: Any, teacher: Any, measure: Any, options: Any
    ) -> dict:
        """Fit `layer` in place, teacher-forced; the report's facts for it. Default: ConfigError (none)."""
        ...

    def grown_tokens(self, config: Any, tokens: int, num_patches: int) -> int:
        """The next token count for a calibrated layer whose error stays high. Default: `tokens` (no growth)."""
        ...

    def with_more_tokens(self, config: Any, grow: dict[int, int]) -> Any:
        """`config` with the token counts of `grow` ({block index: count}). Default: ConfigError (cannot grow)."""
        ...


@runtime_checkable
class RecipeHooks(Protocol):
    """What the recipe engine asks of a target: per-stage state, parameter groups, a guard and a health trace."""

    def check_stage_state(self, config: Any, state: dict[str, Any]) -> None:
        """Refuse a recipe stage's `target_state` the target cannot apply. Default: any non-empty one."""
        ...

    def apply_stage_state(self, config: Any, model: nn.Module, state: dict[str, Any]) -> None:
        """Put `model` into `state` at a recipe stage's start. Default: `check_stage_state` (only {} passes)."""
        ...

    def parameter_groups(self, config: Any, model: nn.Module) -> dict[str, list[nn.Parameter]]:
        """The target's parameters trained in groups of their own, by group name. Default: {}."""
        ...

    def guard_parameters(self, config: Any, model: nn.Module, options: Any) -> int:
        """Project constrained parameters back into range after an optimizer step; how many moved. Default: 0."""
        ...

    def parameter_trace(self, config: Any, model: nn.Module) -> dict[str, Any]:
        """Health values of the target's parameters for each evaluation record. Default: {}."""
        ...


@runtime_checkable
class KernelHooks(Protocol):
    """What bench and the CLI ask of a target's compute kernel."""

    def cpu_kernel(self, config_cls: type) -> Any:
        """The target's compute kernel (`available()`, `status()`, `use(enabled)`), or None (default)."""
        ...


HOOK_PROTOCOLS: tuple[type, ...] = (
    SurgeryHooks, CardHooks, PackingHooks, CalibrationHooks, RecipeHooks, KernelHooks,
)  # fmt: skip
# Called with the config class, not an instance.
CLASS_HOOKS = ("builds_variant", "card_section", "calibration_settings", "cpu_kernel")


def hook_names(protocol: type) -> tuple[str, ...]:
    """The hooks `protocol` declares, in declaration order."""
    return tuple(name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_"))


HOOKS: tuple[str, ...] = tuple(name for protocol in HOOK_PROTOCOLS for name in hook_names(protocol))
PACKED_FORM_HOOKS: tuple[str, ...] = hook_names(PackedForm)
