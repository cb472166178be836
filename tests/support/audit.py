"""The audit harness: one bad input, one run, the same invariants for every case.

A `Case` builds its inputs under a fresh folder (the current folder while it runs) and returns either the argv of
the stock CLI, run in-process through typer's CliRunner, or a Python callable (an API case). `run_case` then
guarantees, for every case alike:

- the run fails: a non-zero exit code (the case's own, when it names one);
- the failure is one clean line: exactly one `error:` line, the last one printed, matching the case's needle, with
  no Python traceback, no `internal error`, no library warning the CLI lets through and no terminal escape codes
  (an API case must raise one of vca-patch's own errors, or an operating-system fault the CLI names, whose text
  is one line);
- every input is byte-identical afterwards: each file's sha256, each symbolic link's target, each FIFO, folder and
  their permission bits under the folder, snapshotted before the run without following links or opening FIFOs;
- nothing is left behind: no entry appears under the folder (a staging or `*.tmp*` file, a lock, a half-written
  output folder) beyond the glob patterns the case lists in `leaves`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import stat
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import one_error_line, runner
from vca_patch.cli.app import app
from vca_patch.cli.errors import exit_code, os_fault

ANSI = re.compile(r"\x1b\[")


@dataclass
class Scene:
    """What a case's setup works with: its folder `tmp` (the current folder during the run), a monkeypatch undone
    after the run, and read-only `sources` (inputs built once per module, copied in with `copy`)."""

    tmp: Path
    mp: pytest.MonkeyPatch
    sources: Mapping[str, Path] = field(default_factory=dict)

    def copy(self, source: str, name: str | None = None) -> Path:
        """A copy of source folder (or file) `source` at tmp/`name` (default: the source's name)."""
        src = self.sources[source]
        dest = self.tmp / (name or src.name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dest)
        else:
            shutil.copyfile(src, dest)
        return dest

    def write(self, relative: str, content: str | bytes) -> Path:
        """A file at tmp/`relative` (its folders made) holding `content`."""
        path = self.tmp / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return path


Setup = Callable[[Scene], "list[str] | Callable[[], Any]"]


@dataclass(frozen=True)
class Case:
    """One audited fault: `setup` builds the inputs and returns the CLI's argv (or a callable for the Python API);
    `needle` is a regular expression searched in the one `error:` line; `code` the exit code (None: any non-zero);
    `leaves` glob patterns (relative to the case's folder) of entries the run may create."""

    id: str
    setup: Setup
    needle: str
    code: int | None = None
    leaves: tuple[str, ...] = ()
    marks: tuple[Any, ...] = ()

    def param(self) -> Any:
        return pytest.param(self, id=self.id, marks=self.marks)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root` by relative path: (kind, permission bits, sha256 or link target). Links are not
    followed (a loop is just a link) and FIFOs and devices are never opened."""
    entries: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            mode = stat.S_IMODE(info.st_mode)
            key = os.path.relpath(path, root)
            if stat.S_ISLNK(info.st_mode):
                entries[key] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                with open(path, "rb") as f:
                    entries[key] = ("file", mode, hashlib.file_digest(f, "sha256").hexdigest())
            elif stat.S_ISDIR(info.st_mode):
                entries[key] = ("folder", mode)
            else:
                entries[key] = ("special", stat.S_IFMT(info.st_mode), mode)
    return entries


def _cli_line(case: Case, argv: list[str]) -> tuple[int, str]:
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")  # as a user's Python shows them, less what the CLI itself silences
        result = runner.invoke(app, argv)
    text = result.output
    assert not shown, f"{case.id}: a library warning reaches the user: {shown[0].category.__name__}: {shown[0].message}"
    assert "Traceback" not in text and "internal error" not in text, f"{case.id}: not one clean line:\n{text}"
    assert not ANSI.search(text), f"{case.id}: escape codes in the output:\n{text!r}"
    assert result.exit_code != 0, f"{case.id}: exit 0:\n{text}"
    return result.exit_code, one_error_line(result, result.exit_code)


def _api_line(case: Case, call: Callable[[], Any]) -> tuple[int, str]:
    try:
        call()
    except Exception as exc:  # classified: one of vca-patch's own errors, or a named OS fault
        code = exit_code(exc)
        fault = os_fault(exc) if code is None else None
        assert code is not None or fault is not None, f"{case.id}: not a vca-patch error: {type(exc).__name__}: {exc}"
        text = str(exc).strip() if fault is None else fault[1]
        assert text and "\n" not in text and "Traceback" not in text, f"{case.id}: not one line: {text!r}"
        return (code if fault is None else fault[0]), f"error: {text}"
    pytest.fail(f"{case.id}: the call returned without an error")


def run_case(case: Case, tmp_path: Path, sources: Mapping[str, Path] | None = None) -> str:
    """Build `case`'s inputs under `tmp_path`, run it there, check the invariants above; the error line."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        mp.delenv("VCA_PATCH_DEBUG", raising=False)  # the plain line, not the stack
        mp.delenv("HF_TOKEN", raising=False)
        target = case.setup(Scene(tmp_path, mp, sources or {}))
        before = snapshot(tmp_path)
        code, line = _api_line(case, target) if callable(target) else _cli_line(case, target)
        after = snapshot(tmp_path)
    if case.code is not None:
        assert code == case.code, f"{case.id}: exit {code}, not {case.code}: {line}"
    assert code != 0
    assert re.search(case.needle, line), f"{case.id}: {case.needle!r} not in: {line}"
    changed = sorted(k for k in before if after.get(k) != before[k])
    assert not changed, f"{case.id}: inputs changed or removed: {changed}"
    added = sorted(k for k in set(after) - set(before) if not any(fnmatch.fnmatch(k, p) for p in case.leaves))
    assert not added, f"{case.id}: left behind: {added}"
    return line
