"""Where the repository's files are, for tests at any depth of tests/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
EXAMPLES = ROOT / "examples"
BENCHMARKS = ROOT / "benchmarks"
FIXTURES = ROOT / "tests" / "fixtures"
