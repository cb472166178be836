"""The planner searches a registered plan space (token merging's, `targets/merge/plan_space.py`):
every config it builds, the token arithmetic, the MAC counts and the plan's config type come from there, and
planner/, train/, recovery/ and cli/ import no target's package."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import vca_patch
from tests.support.planner import RES, synthetic_info
from vca_patch.core.errors import ConfigError
from vca_patch.layers.macs import AttentionShape
from vca_patch.planner import Candidate, PlanError, load_plan, plan_config, save_plan
from vca_patch.planner.costs import plan_macs, token_counts
from vca_patch.targets.base import PLAN_SPACES, PlanSpace, plan_space, register_plan_space, unregister_plan_space
from vca_patch.targets.mano.macs import mano_attention_macs
from vca_patch.targets.merge.plan_space import MANO_BLOCKS, VCA_BLOCKS, MergePlanSpace
from vca_patch.targets.vca.macs import vca_attention_macs

PACKAGE = Path(vca_patch.__file__).parent
TARGET_PACKAGES = ("vca", "mano", "didb", "merge")


def _target_imports(folder: str) -> list[str]:
    """`module: imported name` for every import of a target package in vca_patch/<folder>/ (LLaVA-SP's convert
    path in cli/ aside, which another change owns)."""
    found = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}: {n}" for n in names if _is_target(n)]
    return found


def _is_target(module: str) -> bool:
    parts = module.split(".")
    return parts[:2] == ["vca_patch", "targets"] and len(parts) > 2 and parts[2] in TARGET_PACKAGES


@pytest.mark.parametrize("folder", ["planner", "train", "recovery", "cli"])
def test_upper_layers_import_no_target_package(folder):
    assert _target_imports(folder) == []


@pytest.fixture
def spaces() -> Iterator[dict[str, PlanSpace]]:
    kept = dict(PLAN_SPACES)
    try:
        yield PLAN_SPACES
    finally:
        PLAN_SPACES.clear()
        PLAN_SPACES.update(kept)


def test_the_planner_reads_the_registered_space(spaces):
    assert isinstance(plan_space(), MergePlanSpace) and plan_space("merge") is plan_space()
    assert plan_space().config_type is vca_patch.MergeConfig and plan_space().kind_names == ["vca", "mano"]
    info = synthetic_info()
    assert token_counts(info, RES, [5, 5, 5, 5]) == [17, 12, 7, 4]  # bipartite matching: at most half the patches

    class NoMerging(MergePlanSpace):
        def tokens_removed(self, tokens: int, prefix: int, r: int) -> int:
            return 0

    with pytest.raises(ValueError, match="plan space 'merge' is already registered"):
        register_plan_space(NoMerging())  # another space for a target that has one: refused
    assert register_plan_space(plan_space()) is plan_space()  # the same space again: a no-op
    unregister_plan_space("merge")
    register_plan_space(NoMerging())
    assert token_counts(info, RES, [5, 5, 5, 5]) == [17, 17, 17, 17]
    with pytest.raises(ConfigError, match=r"no plan space for target 'nope'; registered: \['merge'\]"):
        plan_space("nope")
    with pytest.raises(ConfigError, match="plan space for unknown target 'nope'"):
        register_plan_space(type("Nope", (MergePlanSpace,), {"target": "nope"})())
    register_plan_space(type("VCASpace", (MergePlanSpace,), {"target": "vca"})())
    with pytest.raises(ConfigError, match=r"2 plan spaces are registered \(\['merge', 'vca'\]\): name the target"):
        plan_space()


def test_block_kinds_count_the_macs_the_targets_count():
    info = synthetic_info()
    shape = AttentionShape(1, info.grid(RES), info.dim, info.num_heads)
    for k in (2, 3, 4):  # training-free MANO skips its coarse levels
        assert MANO_BLOCKS.macs(shape, k, local_window=0) == mano_attention_macs(1, (4, 4), 64, window=k, coarse=False)
    for window in (0, 3):
        expected = vca_attention_macs(shape, 4, exact_prefix=True, local_window=window)
        assert VCA_BLOCKS.macs(shape, 4, local_window=window) == expected
    schedule, counts = [0, 0, 3, 3], token_counts(info, RES, [0, 0, 3, 3])
    linear = sum(n * info.linear_macs_per_token for n in counts)
    softmax = sum(2.0 * n * n * info.dim for n in counts[2:])
    mixed = vca_attention_macs(shape, 4, exact_prefix=True, local_window=3) + mano_attention_macs(
        1, (4, 4), 64, window=2, coarse=False
    )
    assert plan_macs(info, RES, schedule, {0: 4}, {1: 2}, local_window=3) == pytest.approx(linear + softmax + mixed)


def test_plan_configs_come_from_the_space():
    info = synthetic_info()
    candidate = Candidate([0, 0, 3, 3], {0: 4}, mano_layers={1: 2}, local_window=3)
    expect = {"depth": 4, "dim": 64, "num_heads": 4}
    assert plan_config(candidate, info, unmerge="residual") == vca_patch.MergeConfig(
        schedule=[0, 0, 3, 3], vca_layers={0: 4}, mano_layers={1: 2}, expect=expect, unmerge="residual",
        vca={"token_magnitude": True, "local_window": 3},
    )  # fmt: skip
    assert plan_config(candidate, info, calibrate=False).vca == {"local_window": 3}
    assert plan_config(Candidate([0, 2, 2, 2]), info).vca == {}  # merging alone: no VCA options
    layer = VCA_BLOCKS.config(16, [2], calibrate=False, local_window=5)
    assert layer == vca_patch.VCAConfig(contrast_tokens=16, layers=[2], token_magnitude=False, local_window=5)
    assert MANO_BLOCKS.config(7, [1], calibrate=True, local_window=5) == vca_patch.MANOConfig(window=7, layers=[1])
    with pytest.raises(ConfigError, match=r"local_window must be 0 \(none\) or an odd window side"):
        plan_space().check_settings(local_window=4)


def test_a_plan_file_holds_the_spaces_config_type(tmp_path):
    path = save_plan(tmp_path / "plan.json", vca_patch.VCAConfig(), {})
    with pytest.raises(PlanError, match=r"a plan's config is a merge config \(target 'merge'\), got target 'vca'"):
        load_plan(path)
    plan = vca_patch.MergeConfig(schedule=[0, 2], vca_layers={0: 4})
    assert load_plan(save_plan(tmp_path / "merge.json", plan, {})) == plan
    assert plan_space().plan_sizes(plan, None) == (2, 4)
