"""Issue #51: one registry style (vca_patch/core/registry.py) for targets, families, formats, plan spaces, MAC counts
and bench extras, and entry-point discovery of installed plug-ins (a broken one reported in one line, skipped)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import textwrap
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
import tomllib

import vca_patch
from vca_patch.bench.extras import BENCH_EXTRAS, BenchExtra, register_bench_extra, unregister_bench_extra
from vca_patch.cli.target_options import target_config, target_options
from vca_patch.core.errors import ConfigError
from vca_patch.core.formats import FORMATS, register_format, unregister_format
from vca_patch.core.registry import Registry, RegistryError
from vca_patch.families import ADAPTERS, FAMILY_GROUP
from vca_patch.layers.macs import ATTENTION_MACS, register_attention_macs, unregister_attention_macs
from vca_patch.targets import CONFIG_TYPES, TargetConfig, VCAConfig, register_target, unregister_target
from vca_patch.targets.base import TARGET_GROUP

ROOT = Path(__file__).resolve().parents[2]


class Thing:
    pass


class OtherThing:
    pass


def test_register_refuses_another_object_and_repeats_the_same_as_a_no_op():
    registry: Registry[type] = Registry("thing")
    assert registry.register("a", Thing) is Thing
    assert registry.register("a", Thing) is Thing and list(registry) == ["a"]  # the same object again: no-op
    with pytest.raises(RegistryError, match=r"thing 'a' is already registered \(.*Thing\); unregister it first"):
        registry.register("a", OtherThing)
    with pytest.raises(RegistryError, match="non-empty string name"):
        registry.register("", Thing)
    assert registry.unregister("a") is Thing and "a" not in registry
    with pytest.raises(RegistryError, match=r"unknown thing 'a'; known: \[\]"):
        registry.unregister("a")


def test_order_and_the_registered_context_manager():
    registry: Registry[type] = Registry("thing", default_before="last")
    registry.register("last", Thing)
    registry.register("first", OtherThing)  # the default: before "last"
    registry.register("zero", Thing, before="first")
    assert list(registry) == ["zero", "first", "last"]
    with pytest.raises(RegistryError, match="before='nope' is not a registered thing"):
        registry.register("x", Thing, before="nope")
    with registry.registered("temp", OtherThing):
        assert registry["temp"] is OtherThing
    assert "temp" not in registry
    with registry.registered("zero", Thing):  # already there: left in place afterwards
        pass
    assert registry["zero"] is Thing


def _install_fake_distribution(root: Path, name: str, entry_points: str, modules: dict[str, str]) -> None:
    """A distribution as pip leaves it: a .dist-info folder (METADATA, entry_points.txt) beside its modules."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for module in [m for m in sys.modules if m.startswith("fakeplug")]:
        del sys.modules[module]


def test_discovery_skips_a_broken_plugin_in_one_line_and_keeps_the_others(site, caplog):
    _install_fake_distribution(
        site, "fake-things",
        """
        [test.things]
        good = fakeplug_good:Good
        broken = fakeplug_missing:Broken
        bad-value = fakeplug_good:not_a_thing
        """,
        {"fakeplug_good": "class Good:\n    pass\nnot_a_thing = 3\n"},
    )  # fmt: skip

    def check(name: str, obj: object) -> None:
        if not isinstance(obj, type):
            raise RegistryError(f"thing {name!r}: expected a class, got {obj!r}")

    registry: Registry[type] = Registry("thing", group="test.things", check=check)
    with caplog.at_level(logging.WARNING, logger="vca_patch.plugins"):
        assert list(registry) == ["good"]  # the first read discovers; the broken ones are skipped
    assert registry.distribution("good") == "fake-things"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert any("broken = fakeplug_missing:Broken of fake-things 1.0" in line and "ModuleNotFoundError" in line
               for line in lines)  # fmt: skip
    assert any("bad-value = fakeplug_good:not_a_thing" in line and "expected a class" in line for line in lines)
    assert "ModuleNotFoundError" in registry.unknown("broken") and "known: good" in registry.unknown("broken")
    caplog.clear()
    assert "good" in registry and not caplog.records  # discovered once per process


def test_a_plugin_target_from_its_entry_point_reaches_from_dict_and_the_cli(site):
    """A config class that does not register itself: its entry point registers it (no deprecation warning)."""
    _install_fake_distribution(
        site, "fake-target",
        f"""
        [{TARGET_GROUP}]
        fake-scale = fakeplug_target:FakeScaleConfig
        fake-broken = fakeplug_target:Missing
        """,
        {"fakeplug_target": """
            from dataclasses import dataclass, field
            from typing import ClassVar
            from vca_patch.targets import TargetConfig

            @dataclass
            class FakeScaleConfig(TargetConfig):
                target: ClassVar[str] = "fake-scale"
                scale: float = field(default=1.0, metadata={"cli": "--fake-scale", "help": "a scale"})
            """},
    )  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            CONFIG_TYPES.discover()
            config = TargetConfig.from_dict({"target": "fake-scale", "scale": 2.0})
        assert type(config).__module__ == "fakeplug_target" and config.scale == 2.0
        assert CONFIG_TYPES.distribution("fake-scale") == "fake-target"
        values = {option.param: option.default for option in target_options()}  # every option, as the CLI gives
        assert target_config("fake-scale", {**values, "target_fake_scale": 3.0}).scale == 3.0
        with pytest.raises(ConfigError, match=r"unknown target 'fake-broken'.*did not load: AttributeError"):
            TargetConfig.from_dict({"target": "fake-broken"})
        with pytest.raises(ConfigError, match=r"got 'fake-broken' \(the plug-in 'fake-broken' is installed but did"):
            target_config("fake-broken", {})
    finally:
        unregister_target("fake-scale")
        CONFIG_TYPES.failures.pop("fake-broken", None)


def test_a_subclass_that_changes_a_default_does_not_take_over_its_parents_name():
    @dataclasses.dataclass
    class Tweaked(VCAConfig):
        contrast_tokens: int = 4

    assert CONFIG_TYPES["vca"] is VCAConfig
    assert type(TargetConfig.from_dict({"target": "vca"})) is VCAConfig
    assert type(Tweaked.from_dict({"target": "vca"})) is Tweaked and Tweaked().contrast_tokens == 4
    with pytest.raises(RegistryError, match="target 'vca' is already registered"):
        register_target(Tweaked)
    with pytest.raises(ConfigError, match="config is for target 'mano', not 'vca'"):
        Tweaked.from_dict({"target": "mano"})

    class Redeclared(VCAConfig):
        target: ClassVar[str] = "vca"

    with pytest.warns(UserWarning, match="declares target 'vca', which VCAConfig holds: it is not registered"):
        assert CONFIG_TYPES["vca"] is VCAConfig


def test_a_config_saves_its_version_refuses_a_newer_one_and_upgrades_an_older_one():
    """A checkpoint written by a newer plug-in fails in one line naming the distribution and both versions; an
    older one (or one saved before versions were: none means 1) goes through the config class's `upgrade`."""
    assert VCAConfig().to_dict()["version"] == VCAConfig.version == 1
    assert TargetConfig.from_dict(VCAConfig(local_window=7).to_dict()) == VCAConfig(local_window=7)
    assert TargetConfig.from_dict({"target": "vca", "contrast_tokens": 9}) == VCAConfig(contrast_tokens=9)
    with pytest.raises(ConfigError, match=r"'vca' config is version 2, newer than this installation's VCAConfig "
                       r"\(version 1, from vca-patch\): upgrade vca-patch \(pip install -U vca-patch\)"):  # fmt: skip
        TargetConfig.from_dict({"target": "vca", "version": 2})
    for bad in (0, "1", True, 1.0):
        with pytest.raises(ConfigError, match="version must be a positive integer"):
            TargetConfig.from_dict({"target": "vca", "version": bad})

    @dataclasses.dataclass
    class Renamed(TargetConfig):  # version 2 renamed its field `width` to `window`
        target: ClassVar[str] = "renamed-toy"
        version: ClassVar[int] = 2
        window: int = 3

        @classmethod
        def upgrade(cls, data: dict, version: int) -> dict:
            return {("window" if k == "width" else k): v for k, v in data.items()}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        register_target(Renamed)
    try:
        assert TargetConfig.from_dict({"target": "renamed-toy", "version": 1, "width": 5}) == Renamed(window=5)
        assert TargetConfig.from_dict(Renamed(window=4).to_dict()) == Renamed(window=4)
    finally:
        unregister_target("renamed-toy")


def test_registration_by_subclassing_still_works_with_a_deprecation_warning():
    class Legacy(TargetConfig):
        target: ClassVar[str] = "test-legacy"

    try:
        with pytest.warns(DeprecationWarning, match="'test-legacy'.*registered by subclassing.*register_target"):
            assert CONFIG_TYPES["test-legacy"] is Legacy
    finally:
        unregister_target("test-legacy")

    @register_target
    class Decorated(TargetConfig):  # the documented way: no warning at all
        target: ClassVar[str] = "test-decorated"

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert CONFIG_TYPES["test-decorated"] is Decorated
    finally:
        unregister_target("test-decorated")


def test_built_ins_are_declared_as_entry_points_and_their_discovery_changes_nothing():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    for group, registry in ((TARGET_GROUP, CONFIG_TYPES), (FAMILY_GROUP, ADAPTERS)):
        from importlib.metadata import EntryPoint

        points = [EntryPoint(name, value, group) for name, value in declared[group].items()]
        assert sorted(p.name for p in points) == sorted(registry)  # every built-in, nothing else
        before = list(registry)
        for point in points:
            assert registry.register(point.name, point.load()) is registry[point.name]  # the same class: a no-op
        assert list(registry) == before


def test_the_other_registries_refuse_a_takeover_and_unregister():
    fmt = next(iter(FORMATS.values()))
    assert register_format(fmt) is fmt
    with pytest.raises(RegistryError, match=r"checkpoint format .* is already registered"):
        register_format(dataclasses.replace(fmt, marker="other.json"))

    def macs(shape, config=None):
        return 1.0

    with pytest.raises(RegistryError, match="MAC count 'vca' is already registered"):
        register_attention_macs("vca")(macs)
    register_attention_macs("test-macs")(macs)
    assert unregister_attention_macs("test-macs") is macs and "test-macs" not in ATTENTION_MACS

    extra = BenchExtra("test", lambda *a, **k: {}, lambda numbers: None)
    register_bench_extra("test-extra", extra)
    try:
        with pytest.raises(RegistryError, match="bench extra 'test-extra' is already registered"):
            register_bench_extra("test-extra", BenchExtra("other", extra.measure, extra.table))
    finally:
        assert unregister_bench_extra("test-extra") is extra
    assert "test-extra" not in BENCH_EXTRAS
    assert unregister_format(fmt.name) is fmt
    register_format(fmt)
    assert vca_patch.core.formats.format_of_model(object()) is None
