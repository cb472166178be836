"""Running a CLI command and checking it ends in one `error:` line with every input file unchanged."""

from __future__ import annotations

import hashlib
from pathlib import Path

from typer.testing import CliRunner

from vca_patch.cli.app import app

runner = CliRunner()


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (the folder itself when a file), by relative path."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def run_unchanged(args: list[str], inputs: list[Path]):
    before = {k: v for p in inputs for k, v in digest(p).items()}
    result = runner.invoke(app, args)
    after = {k: v for p in inputs for k, v in digest(p).items()}
    assert after == before, "an input file changed"
    return result


def one_error_line(result, code: int, *needles: str) -> str:
    text = result.output.strip()
    assert result.exit_code == code, text
    assert ("Traceback" not in text and result.exception is None) or isinstance(result.exception, SystemExit), text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == text.splitlines()[-1], text
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]
