"""The README's Python examples are valid Python, formatted as the project's code is (ruff format, line 120)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_example_parses_and_is_formatted(index):
    code = BLOCKS[index]
    ast.parse(code)
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    result = subprocess.run(
        [ruff, "format", "--line-length", "120", "--diff", "-"], input=code, capture_output=True, text=True
    )
    assert result.returncode == 0, f"README python block {index} is not ruff-formatted:\n{result.stdout}"
