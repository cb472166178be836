"""Docs that stay true: every repository path and `vca_patch.*` module that a page or a docstring names exists.

Pages and docstrings name files (`vca_patch/cli/convert.py`, `benchmarks/front.py`, `recipes/*.yaml`, results
under `benchmarks/results/`) and modules (`vca_patch.targets.vca.layer`); a rename or a removed file leaves them
pointing nowhere. Brace patterns (`planner_{224,518}.json`) are expanded; globs are skipped.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("vca_patch/**/*.py"),
           *ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("examples/**/*.py")]  # fmt: skip
TOP = "vca_patch|benchmarks|examples|recipes|tests|docs"
PATH = re.compile(rf"(?<![\w./{{}}-])((?:{TOP})/[\w./{{}},*-]*[\w}}*])")
MODULE = re.compile(r"(?<![\w./])(vca_patch(?:\.[A-Za-z_]\w*)+)")
# named as what a run writes, not as a file of the repository
WRITTEN = {"benchmarks/results/gpu_check.json": "benchmarks/gpu_check.py writes it on a GPU machine"}
NOT_MODULES = {"vca_patch.plugins": "the logger that reports a plug-in failing to load"}


def expand(path: str) -> list[str]:
    """`a_{1,2}.json` -> [`a_1.json`, `a_2.json`] (each brace group expanded)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def exists(path: str) -> bool:
    """A file or folder of the repository (a named module may leave out `.py`; a recipe its `.yaml`)."""
    target = ROOT / path.rstrip("./")
    return any(p.exists() for p in (target, target.with_name(target.name + ".py"),
                                     target.with_name(target.name + ".yaml")))  # fmt: skip


def resolves(dotted: str) -> bool:
    """`vca_patch.a.b.name`: its longest module prefix is a module of the package, and the rest (if any) is a
    name that module's source defines or imports."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        spec = importlib.util.find_spec(".".join(parts[:cut])) if _is_module(parts[:cut]) else None
        if spec is not None:
            rest = parts[cut:]
            return not rest or re.search(rf"\b{re.escape(rest[0])}\b", Path(spec.origin).read_text()) is not None
    return False


def _is_module(parts: list[str]) -> bool:
    base = ROOT.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def named(pattern: re.Pattern) -> list[tuple[str, str]]:
    """(file, name) for every match of `pattern` in the pages and sources, without globs."""
    return sorted({(str(source.relative_to(ROOT)), match.group(1)) for source in SOURCES
                   for match in pattern.finditer(source.read_text()) if "*" not in match.group(1)})  # fmt: skip


def test_every_named_repository_path_exists():
    missing = [(where, path) for where, path in named(PATH) if path not in WRITTEN
               and not all(exists(p) for p in expand(path))]  # fmt: skip
    assert not missing, "\n".join(f"{where} names {path}, which does not exist" for where, path in missing)


def test_every_named_module_resolves():
    missing = [(where, name) for where, name in named(MODULE) if name not in NOT_MODULES and not resolves(name)]
    assert not missing, "\n".join(f"{where} names {name}, which is no module or name there" for where, name in missing)


@pytest.mark.parametrize(("named_path", "found"), [("benchmarks/front.py", True), ("benchmarks/no_such.py", False),
                                                    ("benchmarks/results/planner_{224,518}.json", True),
                                                    ("benchmarks/results/planner_{224,999}.json", False)])  # fmt: skip
def test_the_check_tells_a_missing_path(named_path, found):
    assert all(exists(p) for p in expand(named_path)) is found


def test_the_check_tells_a_missing_module():
    assert resolves("vca_patch.targets.vca.config.VCAConfig") and resolves("vca_patch.surgery")
    assert not resolves("vca_patch.targets.vca.no_such") and not resolves("vca_patch.surgery.NoSuchName")


HISTORY = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|\b[Ii]ssue #?\d+|\b[Rr]un [A-H]\b")
RESULT_PAGES = [ROOT / "README.md", *ROOT.glob("docs/results/*.md")]


def test_results_pages_hold_results_not_history():
    """No commit hashes, issue numbers or run letters: a page says what was measured and how to rerun it."""
    found = [(page.name, match.group(0)) for page in RESULT_PAGES for match in HISTORY.finditer(page.read_text())]
    assert not found, found


def test_the_history_check_finds_a_hash_an_issue_and_a_run_letter():
    text = "main at 619bd8f; issue #42 asked; in run B it read; run a recipe, 1,369 tokens and 2026-12-04 stay"
    assert [m.group(0) for m in HISTORY.finditer(text)] == ["619bd8f", "issue #42", "run B"]
