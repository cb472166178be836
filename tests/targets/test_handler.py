"""Issue #51 item 4: a target's config is data, its behaviour a handler registered for the config's type
(`vca_patch.targets.handler`); a plug-in written against the hooks-on-the-config API keeps working, deprecated."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vca_patch
from tests.support.models import tiny
from vca_patch.core.errors import ConfigError
from vca_patch.core.registry import RegistryError
from vca_patch.layers.carried import CarriedAttention, CarriedAttentionLayer
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets import (
    DIDBConfig,
    MANOConfig,
    MergeConfig,
    TargetConfig,
    TargetHandler,
    VCAConfig,
    handler_for,
    register_handler,
    register_target,
    unregister_handler,
    unregister_target,
)
from vca_patch.targets.handler import LegacyConfigHandler
from vca_patch.targets.mano import MANOHandler
from vca_patch.targets.protocols import (
    CalibrationHooks,
    CardHooks,
    KernelHooks,
    PackedForm,
    PackingHooks,
    RecipeHooks,
    SurgeryHooks,
)
from vca_patch.targets.vca import VCAHandler

# Every behaviour hook a config carried before handlers: none of them may live on TargetConfig any more.
BEHAVIOUR_HOOKS = [
    "build_layer", "layer_settings", "as_built", "block_edits", "block_forwards", "check_stage_state",
    "apply_stage_state", "card_section", "is_packed", "pack", "packed_state_dict", "load_packed",
    "calibration_settings", "calibrates", "calibrate_layer", "grown_tokens", "with_more_tokens", "cpu_kernel",
    "parameter_groups", "guard_parameters", "parameter_trace",
]  # fmt: skip
LEGACY = "test-legacy-hooks"


class PlainAttention(CarriedAttentionLayer):
    """The carried softmax attention, unchanged: a patched model computes what the original did."""

    def __init__(self, *args: Any, tag: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = float(tag)

    def forward_tokens(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        q, k, v = self._qkv_heads(x)
        out = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, scale=self.scale)
        return self.proj_drop(self.proj(self.norm_and_gate(x, self._merge_heads(out))))


def _legacy_config() -> type[TargetConfig]:
    """A plug-in written against the old API: its hooks are methods of the config class, and no handler."""

    @register_target
    @dataclass
    class LegacyHooksConfig(TargetConfig):
        """Softmax attention, tagged."""

        target: ClassVar[str] = LEGACY
        tag: float = field(default=1.0)

        def build_layer(self, carried: CarriedAttention, layer_index: int) -> nn.Module:
            return PlainAttention.from_carried(carried, tag=self.tag)

        def layer_settings(self, layer: nn.Module) -> dict[str, Any]:
            return {"tag": layer.tag}

        def check_stage_state(self, state: dict[str, Any]) -> None:
            if set(state) - {"tag"}:
                raise ConfigError(f"{LEGACY} switches only 'tag', got {sorted(state)}")

        @classmethod
        def card_section(cls, config: dict[str, Any]) -> tuple[str, str, str]:
            name, intro, rows = super().card_section(config)  # the default, through the deprecated forwarder
            return name, intro + " Legacy.", rows

    return LegacyHooksConfig


@pytest.fixture
def legacy() -> Iterator[type[TargetConfig]]:
    config_cls = _legacy_config()
    try:
        yield config_cls
    finally:
        unregister_target(LEGACY)


def _deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_target_config_defines_none_of_the_behaviour_hooks():
    """The base config is data: each hook name it still answers is a deprecated forwarder from a base class."""
    assert not set(BEHAVIOUR_HOOKS) & set(vars(TargetConfig))
    for name in BEHAVIOUR_HOOKS:
        assert name not in vars(VCAConfig) and name not in vars(MergeConfig) and name not in vars(DIDBConfig)
    forwarders = [name for name in BEHAVIOUR_HOOKS if name not in ("pack", "packed_state_dict", "load_packed")]
    assert all(getattr(TargetConfig, name).forwards_to_handler for name in forwarders)
    assert not hasattr(TargetConfig(), "pack") and hasattr(DIDBConfig(), "pack")  # only where the handler packs


def test_the_base_handler_implements_every_hook_protocol_but_the_packed_form():
    handler = handler_for(TargetConfig)
    assert type(handler) is TargetHandler
    for protocol in (SurgeryHooks, CardHooks, PackingHooks, CalibrationHooks, RecipeHooks, KernelHooks):
        assert isinstance(handler, protocol), protocol.__name__
    assert not isinstance(handler, PackedForm) and isinstance(handler_for(DIDBConfig), PackedForm)
    with pytest.raises(NotImplementedError):
        handler.build_layer(TargetConfig(), None, 0)
    with pytest.raises(ConfigError, match=r"target '' \(TargetConfig\) has no closed-form calibration"):
        handler.calibrate_layer(TargetConfig(), nn.Identity(), None, None, None, None)


def test_the_handler_registry_refuses_a_takeover_and_unregisters():
    assert register_handler(VCAConfig)(VCAHandler) is VCAHandler  # the same class again: a no-op
    assert handler_for(VCAConfig) == VCAHandler() and type(handler_for(MANOConfig)) is MANOHandler

    class Other(TargetHandler):
        pass

    with pytest.raises(RegistryError, match=r"target handler '.*VCAConfig' is already registered \(.*VCAHandler\)"):
        register_handler(VCAConfig)(Other)
    with pytest.raises(RegistryError, match="decorates a TargetHandler subclass"):
        register_handler(VCAConfig)(object)
    assert type(handler_for(VCAConfig)) is VCAHandler

    @dataclass
    class Fresh(TargetConfig):
        pass

    register_handler(Fresh)(Other)
    try:
        assert type(handler_for(Fresh())) is Other
    finally:
        assert type(unregister_handler(Fresh)) is Other
    assert type(handler_for(Fresh)) is TargetHandler  # no handler, no hooks of its own: the defaults
    with pytest.raises(RegistryError, match="unknown target handler"):
        unregister_handler(Fresh)


def test_a_subclass_of_a_target_config_gets_its_parents_handler():
    @dataclass
    class Tweaked(VCAConfig):
        contrast_tokens: int = 4

    model, _ = tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # nothing legacy here
        assert handler_for(Tweaked) is handler_for(VCAConfig) is handler_for(Tweaked())
        report = vca_patch.patch_model(model, Tweaked())
    assert [site.settings["contrast_tokens"] for site in report.patched] == [4, 4]


def test_a_legacy_plugin_with_hooks_on_its_config_still_converts_with_one_deprecation_warning(legacy):
    model, _ = tiny()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = vca_patch.patch_model(model, legacy(tag=2.0))
        vca_patch.patch_model(tiny()[0], legacy())  # the same class again: no second warning
        handler = handler_for(legacy)
    messages = _deprecations(caught)
    assert len(messages) == 1, messages
    assert "LegacyHooksConfig defines target hooks on its config class" in messages[0]
    assert "register_handler(LegacyHooksConfig)" in messages[0]
    assert [site.settings for site in report.patched] == [{"tag": 2.0}, {"tag": 2.0}]
    assert all(isinstance(model.get_submodule(site.path), PlainAttention) for site in report.patched)
    with torch.no_grad():
        assert torch.allclose(model(x), expected, atol=1e-5)
    assert isinstance(handler, LegacyConfigHandler) and not isinstance(handler, PackedForm)
    assert handler.layer_settings(legacy(), model.blocks[0].attn) == {"tag": 2.0}


def test_a_legacy_plugin_falls_back_to_the_defaults_which_call_its_own_hooks(legacy):
    """A hook the legacy config does not define is the default; a default that asks another hook (apply_stage_state
    checks with check_stage_state) asks the config's own; a config hook calling super() reaches the default."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        handler, config = handler_for(legacy), legacy()
        model = nn.Linear(2, 2)
        assert handler.as_built(config, model) is config and handler.parameter_groups(config, model) == {}
        handler.apply_stage_state(config, model, {"tag": 1})  # its own check accepts it (the default would not)
        with pytest.raises(ConfigError, match=f"{LEGACY} switches only 'tag'"):
            handler.apply_stage_state(config, model, {"weights": True})
        name, intro, rows = handler.card_section(legacy, {"target": LEGACY, "tag": 3.0})
    assert name == LEGACY.upper() and rows == "| tag | 3.0 |"
    assert intro == f"vca-patch's {LEGACY.upper()} target (Softmax attention, tagged). Legacy."


def test_a_legacy_subclass_of_a_built_in_keeps_the_built_ins_other_hooks():
    @dataclass
    class Relabelled(VCAConfig):
        def layer_settings(self, layer: nn.Module) -> dict[str, Any]:
            return {"relabelled": layer.num_contrast_tokens}

    model, _ = tiny()
    with pytest.warns(DeprecationWarning, match="Relabelled defines target hooks on its config class"):
        report = vca_patch.patch_model(model, Relabelled(contrast_tokens=4))
    assert [site.settings for site in report.patched] == [{"relabelled": 4}, {"relabelled": 4}]
    handler = handler_for(Relabelled)
    assert isinstance(handler, VCAHandler) and handler.calibrates(Relabelled(), model.blocks[0].attn)


def test_a_deprecated_forwarder_warns_and_returns_the_handlers_answer():
    model, _ = tiny()
    config = VCAConfig(contrast_tokens=4)
    vca_patch.patch_model(model, config)
    layer = model.blocks[0].attn
    with pytest.warns(DeprecationWarning, match=r"VCAConfig.calibrates\(\) is deprecated.*handler_for\(config\)"):
        assert config.calibrates(layer) is True is handler_for(config).calibrates(config, layer)
    with pytest.warns(DeprecationWarning, match=r"VCAConfig.as_built\(\) is deprecated"):
        built = config.as_built(model)
    assert built == handler_for(config).as_built(config, model) and built.token_magnitude is True
    with pytest.warns(DeprecationWarning, match=r"VCAConfig.cpu_kernel\(\) is deprecated.*handler_for\(config_cls\)"):
        assert VCAConfig.cpu_kernel() is handler_for(VCAConfig).cpu_kernel(VCAConfig) is not None
    with pytest.warns(DeprecationWarning, match=r"MANOConfig.card_section\(\) is deprecated"):
        section = MANOConfig.card_section(MANOConfig().to_dict())
    assert section == handler_for(MANOConfig).card_section(MANOConfig, MANOConfig().to_dict())
    assert section[0] == "Multipole Attention (MANO)"
    deprecated = pytest.warns(DeprecationWarning, match=r"TargetConfig.with_more_tokens\(\) is deprecated")
    with deprecated, pytest.raises(ConfigError, match=r"target '' \(TargetConfig\) cannot grow tokens"):
        TargetConfig().with_more_tokens({0: 4})


def test_the_packed_form_still_answers_on_a_didb_config_deprecated():
    model, _ = tiny()
    config = DIDBConfig()
    vca_patch.patch_model(model, config)
    assert hasattr(config, "pack")  # the packed-form methods answer on a config whose handler has them
    with pytest.warns(DeprecationWarning, match=r"DIDBConfig.is_packed\(\) is deprecated"):
        assert config.is_packed(model) is False
    with pytest.warns(DeprecationWarning, match=r"DIDBConfig.packed_state_dict\(\) is deprecated"):
        state = config.packed_state_dict(model)
    assert state.keys() == handler_for(config).packed_state_dict(config, model).keys()
    with pytest.raises(AttributeError, match="'VCAConfig' object has no attribute 'pack'"):
        VCAConfig().pack  # noqa: B018


def test_merge_composes_vca_and_mano_through_their_handlers():
    model, _ = tiny(depth=3)
    plan = MergeConfig(schedule=[0, 0, 1], vca_layers={0: 4}, mano_layers={1: 2})
    report = vca_patch.patch_model(model, plan)
    settings = [site.settings for site in report.patched]
    assert settings[0] == {"attention": "vca", "contrast_tokens": 4}
    assert settings[1]["attention"] == "mano" and settings[1]["window"] == 2
    assert settings[2] == {"attention": "softmax (proportional)"}
    handler = handler_for(plan)
    assert handler.calibrates(plan, model.blocks[0].attn) and not handler.calibrates(plan, model.blocks[1].attn)
    assert [p.shape for p in handler.parameter_groups(plan, model)["lambda"]] == [
        p.shape for p in handler_for(VCAConfig).parameter_groups(VCAConfig(), model)["lambda"]
    ]
    built = handler.as_built(plan, model)
    assert built.vca["token_magnitude"] is True and dataclasses.replace(built, vca={}) == plan
