"""The output rule, by property: whatever an output path is relative to the inputs (the same path, inside one, the
folder holding an input file, a sibling, a symlink to an input), no input byte changes; refused outputs are refused
before any work, with one `error:` line. And written files and folders follow the user's umask."""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import vca_patch
from tests.support.models import tiny
from vca_patch import patch_model
from vca_patch.cli import app
from vca_patch.core.atomic import UnsafeOutputError, atomic_file, atomic_write_text, staged_directory
from vca_patch.core.paths import check_output

RELATIONS = ("same", "inside", "parent", "sibling", "symlink", "symlink-inside", "missing-parent")
INPUTS = ("folder", "config", "weights", "data-folder", "image")
PROPERTY = settings(
    max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
RUN_FILES = ("model.safetensors", "config.json", "README.md", "metrics.json", "checkpoints")
runner = CliRunner()


def _digest(root: Path) -> dict[str, str]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _tree(root: Path) -> dict[str, Path]:
    """Small stand-ins for what commands read: a model folder (config, weights, card), a data folder of images."""
    ckpt = root / "inputs" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text('{"format_version": 1}')
    (ckpt / "model.safetensors").write_bytes(b"\x00weights" * 8)
    (ckpt / "README.md").write_text("card")
    data = root / "inputs" / "data" / "test" / "cat"
    data.mkdir(parents=True)
    (data / "a.png").write_bytes(b"\x89PNG not really")
    (root / "work").mkdir()
    return {"folder": ckpt, "config": ckpt / "config.json", "weights": ckpt / "model.safetensors",
            "data-folder": root / "inputs" / "data", "image": data / "a.png"}  # fmt: skip


def _output(root: Path, target: Path, relation: str) -> Path:
    """An output path standing in `relation` to input `target`."""
    if relation == "same":
        return target
    if relation == "inside":
        return target / "out.json"  # under a file: its parent is not a folder; under a folder: inside an input
    if relation == "parent":
        return target.parent
    if relation == "sibling":  # beside the inputs, in none of them
        return root / "work" / f"{target.name}-out"
    if relation == "missing-parent":
        return root / "work" / "no" / "such" / "out"
    link = root / "work" / "link"
    link.symlink_to(target)
    return link if relation == "symlink" else link / "out"


@contextmanager
def _scratch():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


@PROPERTY
@given(
    relation=st.sampled_from(RELATIONS),
    target=st.sampled_from(INPUTS),
    how=st.sampled_from(["file", "folder-replaced", "folder-written-into"]),
)
def test_no_output_path_changes_an_input(relation, target, how):
    with _scratch() as root:
        inputs = _tree(root)
        named = {"MODEL folder": inputs["folder"], "--data": inputs["data-folder"]}
        before = _digest(root / "inputs")
        out = _output(root, inputs[target], relation)
        kind = "file" if how == "file" else "folder"
        try:
            check_output(out, named, kind=kind, replaces=how == "folder-replaced", writes=RUN_FILES)
        except (UnsafeOutputError, FileExistsError) as exc:
            assert str(exc).strip() and "\n" not in str(exc)
            refused = True
        else:
            refused = False
            if how == "file":
                atomic_write_text(out, "{}")
            elif how == "folder-replaced":
                with staged_directory(out, overwrite=True) as stage:
                    (stage / "config.json").write_text("{}")
            else:
                out.mkdir(exist_ok=True)
                for name in RUN_FILES[:-1]:
                    atomic_write_text(out / name, "new")
        after = _digest(root / "inputs")  # files written beside the inputs are not changes to them
        assert {k: after.get(k) for k in before} == before, (relation, target, how)
        if relation in ("same", "symlink", "inside", "missing-parent", "symlink-inside"):
            assert refused, (relation, target, how)  # never an input, inside one, or under a missing folder
        if relation == "sibling":
            assert not refused
        assert not (root / "work" / "no").exists()  # missing parents are never made


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    model, args = tiny()
    patch_model(model)
    return vca_patch.save_pretrained(model, tmp_path_factory.mktemp("property") / "ckpt", model_args=args)


@settings(max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(
    relation=st.sampled_from(["same", "inside", "parent", "symlink", "missing-parent"]),
    name=st.sampled_from(["config.json", "model.safetensors", "README.md"]),
    option=st.sampled_from(["--json", "--plot"]),
)
def test_fidelity_outputs_never_touch_the_checkpoint(ckpt, relation, name, option):
    with _scratch() as root:
        (root / "work").mkdir()
        before = _digest(ckpt)
        out = _output(root, ckpt / name, relation)
        result = runner.invoke(app, ["fidelity", str(ckpt), option, str(out), "--device", "cpu"])
        assert _digest(ckpt) == before
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.output


def test_convert_onto_a_symlink_to_its_model_folder_is_refused(ckpt, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(ckpt)
    before = _digest(ckpt)
    result = runner.invoke(app, ["convert", str(ckpt), "-o", str(link), "--force"])
    assert _digest(ckpt) == before
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "is the MODEL folder" in lines[0], result.output


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_and_folders_follow_the_umask(tmp_path, umask_022):
    atomic_write_text(tmp_path / "a.json", "{}")
    with atomic_file(tmp_path / "b.png") as tmp:
        tmp.write_bytes(b"png")
    with staged_directory(tmp_path / "c") as stage:
        (stage / "x").write_text("x")
    model, args = tiny()
    patch_model(model)
    saved = vca_patch.save_pretrained(model, tmp_path / "ckpt", model_args=args)
    assert _mode(tmp_path / "a.json") == 0o644 and _mode(tmp_path / "b.png") == 0o644
    assert _mode(tmp_path / "c") == 0o755 and _mode(saved) == 0o755
    assert {p.name: _mode(p) for p in saved.iterdir()} == {p.name: 0o644 for p in saved.iterdir()}
    os.umask(0o077)
    atomic_write_text(tmp_path / "private.json", "{}")
    assert _mode(tmp_path / "private.json") == 0o600


def test_an_unexpected_error_is_one_internal_error_line_and_debug_shows_the_stack(monkeypatch, tmp_path):
    import vca_patch.cli.fidelity as fidelity_cli

    def boom(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(fidelity_cli, "resolve_device", boom)
    monkeypatch.delenv("VCA_PATCH_DEBUG", raising=False)
    result = runner.invoke(app, ["fidelity", str(tmp_path)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith("internal error: RuntimeError: boom") and "--debug" in lines[0]
    try:
        debug = runner.invoke(app, ["--debug", "fidelity", str(tmp_path)])
    finally:
        os.environ.pop("VCA_PATCH_DEBUG", None)  # --debug sets it for the process
    assert debug.exit_code == 1 and "Traceback" in debug.output and "internal error" in debug.output


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, tmp_path):
    import vca_patch.cli.fidelity as fidelity_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fidelity_cli, "resolve_device", interrupted)
    monkeypatch.delenv("VCA_PATCH_DEBUG", raising=False)
    result = runner.invoke(app, ["fidelity", str(tmp_path)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 130 and len(lines) == 1 and lines[0].startswith("error: interrupted"), result.output
