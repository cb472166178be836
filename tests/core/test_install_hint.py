"""Install hints name commands that work: an extra's packages (vca-patch is not on PyPI), read from the metadata."""

from __future__ import annotations

import re

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.support.paths import ROOT
from vca_patch.core.install import extra_requirements, install_hint

EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_each_extra_hint_installs_the_extras_packages(extra):
    def parsed(requirements: list[str]) -> set[tuple[str, str]]:
        return {(r.name, str(r.specifier)) for r in map(Requirement, requirements)}

    assert parsed(extra_requirements(extra)) == parsed(EXTRAS[extra])
    hint = install_hint(extra)
    assert hint.startswith("pip install ") and "vca-patch[" not in hint
    assert all(f"'{p}'" in hint for p in extra_requirements(extra)) and f"'.[{extra}]'" in hint


def test_an_unknown_extra_points_at_the_clone():
    assert install_hint("no-such-extra") == "pip install -e '.[no-such-extra]' in the vca-patch clone"


def test_no_message_in_the_package_tells_users_to_pip_install_vca_patch_from_an_index():
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "vca_patch").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"pip install (-U )?'vca-patch\[", line)
    ]
    assert offenders == []


def test_a_missing_library_error_carries_the_working_command(monkeypatch):
    import sys

    from vca_patch.core.hub_access import UnknownModelError
    from vca_patch.families.transformers.load import load_transformers_model

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(UnknownModelError) as caught:
        load_transformers_model("acme/some-vit", pretrained=False)
    assert caught.value.args[0].endswith(f"install it with {install_hint('hf')}")
    assert "pip install 'transformers>=5'" in caught.value.args[0]
