"""The Python examples of the README and the docs site are valid Python, formatted as the project's code is (ruff
format, line 120)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess

import pytest

from tests.support.paths import ROOT

ROOT = ROOT
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [
    (f"{page.relative_to(ROOT)}#{i}", code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S))
]


def test_the_readme_and_the_docs_have_python_examples():
    assert any(name.startswith("README.md") for name, _ in BLOCKS)
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_python_example_parses_and_is_formatted(name, code):
    ast.parse(code)
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    result = subprocess.run(
        [ruff, "format", "--line-length", "120", "--diff", "-"], input=code, capture_output=True, text=True
    )
    assert result.returncode == 0, f"python block {name} is not ruff-formatted:\n{result.stdout}"
