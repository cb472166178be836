"""`patch_model` / `unpatch_model`: find attention, build VCA from its weights, swap in place."""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vca_patch.core.errors import ConfigError, NothingToPatchError, PatchError
from vca_patch.core.patch_state import STATE_ATTR, get_patch_state
from vca_patch.families import AttentionSite, LayoutTracker, ModelAdapter, SkippedSite, adapter_for
from vca_patch.layers.carried import CarriedAttention, VariantRequired
from vca_patch.layers.carried_module import keep_block_original, restore_block_edit
from vca_patch.layers.layout import close_scope
from vca_patch.surgery.report import PatchedSite, PatchReport
from vca_patch.targets import CONFIG_TYPES, default_config
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.handler import handler_for


@dataclass
class PatchState:
    """Kept on a patched model (as `model.vca_patch_state`): enough to save, reload and undo."""

    adapter: ModelAdapter
    config: TargetConfig
    report: PatchReport
    tracker: LayoutTracker
    originals: dict[str, Any]  # path -> the replaced module (or what the adapter's install returned, see _install)
    block_originals: dict[str, nn.Module] = field(default_factory=dict)  # path -> module a block edit replaced
    block_forwards: list[str] = field(default_factory=list)  # paths of blocks given a forward (block_forwards)


def _count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _select(sites: list[AttentionSite], config: TargetConfig) -> tuple[list[AttentionSite], list[SkippedSite]]:
    """Apply config.layers, config.include and config.exclude; a selection must match something."""
    available = sorted({s.layer_index for s in sites})
    if config.layers is not None:
        missing = [i for i in config.layers if i not in available]
        if missing:
            raise PatchError(
                f"layers {missing} are out of range: this model's attention blocks are {available[0]}..{available[-1]}"
            )
    chosen, others = [], []
    for site in sites:
        if config.layers is not None and site.layer_index not in config.layers:
            others.append(SkippedSite(site.path, site.class_name, "not in config.layers"))
        elif config.include is not None and not re.search(config.include, site.path):
            others.append(SkippedSite(site.path, site.class_name, f"does not match include {config.include}"))
        elif config.exclude is not None and re.search(config.exclude, site.path):
            others.append(SkippedSite(site.path, site.class_name, f"matches exclude {config.exclude}"))
        else:
            chosen.append(site)
    if not chosen:
        raise PatchError(
            "the selection (layers/include/exclude) matches no attention module; available: "
            + ", ".join(s.path for s in sites)
        )
    return chosen, others


def _swap(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def _install(adapter: ModelAdapter, model: nn.Module, path: str, new: nn.Module, target: str) -> Any:
    """Put `new` (built for the target named `target`) in place of the attention at `path`; returns what
    `_uninstall` needs to undo it.

    By default the module is swapped (the original kept on the replacement for `.to()` and unpatching). An adapter
    whose library swaps attention *implementations* inside a module it keeps (diffusers processors) defines
    `install_replacement(model, path, new, *, target) -> saved` and `remove_replacement(model, path, saved)`
    instead; `target` (to name what holds the new parameters) reaches only an installer that takes it, so one
    written before, `install_replacement(model, path, new)`, keeps working.
    """
    install = getattr(adapter, "install_replacement", None)
    if install is None:
        old = _swap(model, path, new)
        new.keep_original(old)
        return old
    if _takes_keyword(install, "target"):
        return install(model, path, new, target=target)
    return install(model, path, new)


def _takes_keyword(fn: Any, name: str) -> bool:
    """Whether `fn` accepts the keyword argument `name` (a parameter of that name, or **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: call it the old way
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == name and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in parameters
    )


def _uninstall(adapter: ModelAdapter, model: nn.Module, path: str, saved: Any) -> None:
    """Undo `_install`: the original module (with the current carried weights) or the adapter's own undo."""
    remove = getattr(adapter, "remove_replacement", None)
    if remove is not None:
        remove(model, path, saved)
        return
    model.get_submodule(path).restore_into(saved)  # parameters replaced since patching (assign=True, ...)
    _swap(model, path, saved)


def _block_edits(model: nn.Module, config: TargetConfig, site: AttentionSite) -> dict[str, nn.Module]:
    """The handler's block_edits for the site's block (the module holding it), as {model path: new module}."""
    block_path, _, name = site.path.rpartition(".")
    block = model.get_submodule(block_path) if block_path else model
    edits = handler_for(config).block_edits(config, block, name, site.layer_index)
    for rel in edits:
        if not rel or rel == name or rel.startswith(name + "."):
            raise PatchError(f"{type(config).__name__}.block_edits may not replace the attention itself ({rel!r})")
        block.get_submodule(rel)  # it must exist
    return {(block_path + "." if block_path else "") + rel: new for rel, new in edits.items()}


def _block_forwards(model: nn.Module, config: TargetConfig, sites: list[AttentionSite]) -> dict[str, Any]:
    """The handler's block_forwards for the sites' blocks, as {block path: forward}."""
    paths: dict[int, str] = {}
    blocks: dict[int, tuple[nn.Module, str]] = {}
    for site in sites:
        block_path, _, name = site.path.rpartition(".")
        paths[site.layer_index] = block_path
        blocks[site.layer_index] = (model.get_submodule(block_path) if block_path else model, name)
    forwards = handler_for(config).block_forwards(config, blocks)
    return {paths[index]: forward for index, forward in forwards.items()}


def _checked_config(config: Any) -> TargetConfig:
    """`config` if it is a target config instance (None: the default target's); else a ConfigError saying what to
    pass (an instance, not the class; a dict or a target name through TargetConfig.from_dict)."""
    if config is None:
        return default_config()
    if isinstance(config, TargetConfig):
        return config
    if isinstance(config, type) and issubclass(config, TargetConfig):
        raise ConfigError(f"config is the class {config.__name__}; pass an instance: {config.__name__}()")
    raise ConfigError(
        f"config must be a target config such as VCAConfig() or MANOConfig(), got {type(config).__name__} "
        f"{config!r:.60}; a dict or a target name: TargetConfig.from_dict({{'target': 'vca', ...}})"
    )


def _fitted(adapter: ModelAdapter, model: nn.Module, config: TargetConfig) -> tuple[TargetConfig, list[str]]:
    """`config.fit_grid` at the model's patch grid, where the adapter knows it (the rule the CLI applies too), and
    its notes on the defaults it fitted."""
    try:
        layout = adapter.default_layout(model)
    except Exception:  # a layout this adapter cannot read here: the sites' own checks say what is wrong
        layout = None
    return (config, []) if layout is None else config.fit_grid(tuple(layout.grid))


def _plan(model: nn.Module, config: TargetConfig, strict: bool):
    """Find, verify, select and build every replacement without touching the model; with the config fitted to
    the model's grid (`_fitted`)."""
    config.validate()
    adapter = adapter_for(model)
    if adapter is None:
        raise NothingToPatchError(
            f"no adapter knows {type(model).__module__}.{type(model).__name__}; supported: timm ViT-style models and "
            "Hugging Face transformers vision encoders, or models whose attention passes generic verification"
        )
    config, notes = _fitted(adapter, model, config)
    try:
        found, skipped = adapter.find_sites(model)
    except Exception as error:  # an unexpected model: say why instead of a traceback from inside a library
        raise NothingToPatchError(
            f"the {adapter.name} adapter could not read {type(model).__name__}: {_error_text(error)}"
        ) from error
    sites = []
    for site in found:
        try:
            site = adapter.verify(site)
        except Exception as error:  # e.g. a module whose call convention the probe does not fit
            skipped.append(SkippedSite(site.path, site.class_name, f"verification raised {_error_text(error)}"))
            continue
        if site.verified is False:
            skipped.append(SkippedSite(site.path, site.class_name, f"verification failed: {'; '.join(site.notes)}"))
        else:
            sites.append(site)
    if not sites:
        listed = "; ".join(f"{s.path} [{s.class_name}]: {s.reason}" for s in skipped) or "none found"
        raise NothingToPatchError(
            f"{type(model).__name__} has no attention module that can be converted ({listed})", skipped
        )
    chosen, unselected = _select(sites, config)
    params_before = _count_params(model)
    handler = handler_for(config)
    replacements: dict[str, nn.Module] = {}
    block_edits: dict[str, dict[str, nn.Module]] = {}  # site path -> {module path: new module}
    built = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        for site in chosen:
            try:
                replacements[site.path] = handler.build_layer(config, adapter.carry(site), site.layer_index)
                adapter.adapt_call(replacements[site.path], site)
                block_edits[site.path] = _block_edits(model, config, site)
                built.append(site)
            except (ConfigError, PatchError):  # the user's settings: refused whole, nothing changed
                raise
            except Exception as error:  # one module the target cannot be built for: skip it, say why
                replacements.pop(site.path, None)
                block_edits.pop(site.path, None)
                unselected.append(
                    SkippedSite(site.path, site.class_name, f"could not build the replacement: {_build_error(error)}")
                )
    if not built:
        listed = "; ".join(f"{s.path}: {s.reason}" for s in unselected)
        raise NothingToPatchError(f"no replacement could be built ({listed})", skipped + unselected)
    if strict:  # after the build: a layer may add what it approximates (e.g. Swin's global mode) to the notes
        refused = [f"{s.path}: {'; '.join(s.notes) or 'not verified'}" for s in built if s.notes or not s.verified]
        if refused:
            raise PatchError("strict mode refuses approximate or unverified conversions: " + "; ".join(refused))
    return config, notes, adapter, built, skipped + unselected, replacements, block_edits, params_before


def _error_text(error: Exception) -> str:
    """One line: the exception's type and first line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def _build_error(error: Exception) -> str:
    """Why a replacement could not be built, one line: `_error_text`, or for a carry that refuses a generic layer
    (`VariantRequired`) its reason and the registered targets that build a variant for it."""
    if not isinstance(error, VariantRequired):
        return _error_text(error)
    targets = _variant_targets(error.carried)
    return f"{error} ({'targets that do: ' + ', '.join(targets) if targets else 'no registered target does'})"


def _variant_targets(carried: CarriedAttention) -> list[str]:
    """The registered targets whose handler builds a variant of its own for `carried` (`builds_variant`)."""
    return sorted(
        name for name, config_cls in CONFIG_TYPES.items() if handler_for(config_cls).builds_variant(config_cls, carried)
    )


def _report(adapter, model, config, chosen, skipped, replacements, block_edits, params_before) -> PatchReport:
    def edits_added(site: AttentionSite) -> int:  # called before the edits are swapped in
        edits = block_edits.get(site.path, {})
        return sum(_count_params(new) - _count_params(model.get_submodule(path)) for path, new in edits.items())

    patched = [
        PatchedSite(
            path=site.path,
            original_class=site.class_name,
            layer_index=site.layer_index,
            dim=site.dim,
            num_heads=site.num_heads,
            settings=handler_for(config).layer_settings(config, replacements[site.path]),
            params_added=_count_params(replacements[site.path]) - _count_params(site.module) + edits_added(site),
            notes=site.notes,
            verified=site.verified,
        )
        for site in chosen
    ]
    params_after = params_before + sum(s.params_added for s in patched)
    layout = adapter.default_layout(model)
    return PatchReport(adapter.name, patched, skipped, params_before, params_after, layout, config.target)


def inspect_model(model: nn.Module, config: TargetConfig | None = None, *, strict: bool = False) -> PatchReport:
    """Dry run: the report `patch_model` would give, leaving the model exactly as it is."""
    config = _checked_config(config)
    config, _, adapter, chosen, skipped, replacements, block_edits, params_before = _plan(model, config, strict)
    _block_forwards(model, config, chosen)  # its checks
    return _report(adapter, model, config, chosen, skipped, replacements, block_edits, params_before)


def patch_model(model: nn.Module, config: TargetConfig | None = None, *, strict: bool = False) -> PatchReport:
    """Replace the model's softmax self-attention with `config`'s target (default VCA), in place.

    Every matched module is verified against a reference softmax attention built from its weights
    (unless the adapter knows it is an approximation, which the report says), and every replacement is
    built before any is swapped in, so an error leaves the model untouched. `strict=True` refuses
    approximate or unverified conversions. Returns what was patched and what was skipped, and why.
    """
    config = _checked_config(config)
    if get_patch_state(model) is not None:
        raise PatchError("model is already patched; call vca_patch.unpatch_model(model) first")
    config, notes, adapter, chosen, skipped, replacements, block_edits, params_before = _plan(model, config, strict)
    for note in notes:  # a default fitted to the grid (the CLI prints the same note)
        warnings.warn(f"vca_patch: {note}", UserWarning, stacklevel=2)
    forwards = _block_forwards(model, config, chosen)

    tracker = adapter.install_layout_tracker(model)
    originals: dict[str, Any] = {}
    block_originals: dict[str, nn.Module] = {}
    try:
        # Before anything is installed: an adapter that installs into the original module (a processor) grows it.
        report = _report(adapter, model, config, chosen, skipped, replacements, block_edits, params_before)
        for path, new in replacements.items():
            new.layout_source = tracker.current
            originals[path] = _install(adapter, model, path, new, config.target)
        for path, new in (item for edits in block_edits.values() for item in edits.items()):
            block_originals[path] = _swap(model, path, new)
            keep_block_original(new, block_originals[path])
        for path, forward in forwards.items():
            (model.get_submodule(path) if path else model).forward = forward
    except BaseException:
        for path in forwards:
            (model.get_submodule(path) if path else model).__dict__.pop("forward", None)
        for path, old in block_originals.items():
            _swap(model, path, old)
        for path, old in originals.items():
            _uninstall(adapter, model, path, old)
        adapter.remove_layout_tracker(model)
        raise

    close_scope(tracker)  # the report's probe of the native layout is no forward of the model's
    state = PatchState(adapter, config, report, tracker, originals, block_originals, list(forwards))
    model.__dict__[STATE_ATTR] = state
    return report


def unpatch_model(model: nn.Module) -> nn.Module:
    """Put the original attention modules back (with the current q/k/v/proj weights) and drop VCA."""
    state = get_patch_state(model)
    if state is None:
        raise PatchError("model is not patched by vca_patch")
    for path, original in state.originals.items():
        _uninstall(state.adapter, model, path, original)
    for path, original in state.block_originals.items():  # block edits (the handler's block_edits)
        restore_block_edit(model.get_submodule(path), original)
        _swap(model, path, original)
    for path in state.block_forwards:  # block forwards (the handler's block_forwards)
        (model.get_submodule(path) if path else model).__dict__.pop("forward", None)
    state.adapter.remove_layout_tracker(model)
    del model.__dict__[STATE_ATTR]
    return model


def patched_layers(model: nn.Module) -> dict[str, Any]:
    """Per-layer map of a patched model: module path -> its patch record (JSON-safe)."""
    state = get_patch_state(model)
    if state is None:
        raise PatchError("model is not patched by vca_patch")
    return {
        s.path: {"layer_index": s.layer_index, "original_class": s.original_class, **s.settings}
        for s in state.report.patched
    }
