"""--force replaces only what vca-patch wrote: an empty folder or a vca-patch output, never a user's files, the
home or current folder, a Hub cache, a parent of an input, what a symlink points to, or a device or FIFO. Each
refusal is one `error:` line before any model is built, and every user file is byte-identical afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import vca_patch
from tests.support.cli import digest, one_error_line, run_unchanged
from tests.support.models import tiny
from vca_patch import patch_model
from vca_patch.core.atomic import (
    CHECKPOINT_NAMES,
    EXPORT_SUFFIXES,
    PLAN_FORMAT,
    SPATIAL_TOKENS_FORMAT,
    SPATIAL_TOKENS_NAMES,
    OutputExistsError,
    UnsafeOutputError,
    check_output_dir,
    unowned_entries,
)

CONVERT = ["convert", "deit_tiny_patch16_224", "--no-pretrained"]  # refused before the model is built
BENCH = ["bench", "deit_tiny_patch16_224", "--depth", "1", "--resolutions", "32", "--repeats", "1", "--warmup", "0",
         "--min-time", "0", "--no-memory", "--no-unfused"]  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A small converted checkpoint, as `vca-patch convert` writes it."""
    model, args = tiny()
    patch_model(model)
    return vca_patch.save_pretrained(model, tmp_path_factory.mktemp("force") / "ckpt", model_args=args)


def _user_folder(root: Path) -> Path:
    """A folder of the user's: a file and a sub-folder with a file."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "notes.txt").write_text("mine")
    (root / "Documents").mkdir()
    (root / "Documents" / "thesis.tex").write_text("\\documentclass{article}")
    return root


def _copy(src: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in src.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _refused(args: list[str], kept: list[Path], code: int, *needles: str) -> str:
    """Run the CLI; it exits `code` with one error line holding `needles`, and every file under `kept` is unchanged."""
    return one_error_line(run_unchanged(args, kept), code, *needles)


def test_force_refuses_the_home_folder(tmp_path, monkeypatch):
    home = _user_folder(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    _refused([*CONVERT, "-o", str(home), "--force"], [home], 2, "is your home folder", "sub-folder")
    _refused([*CONVERT, "-o", str(tmp_path), "--force"], [home], 2, "holds your home folder")


def test_force_refuses_the_current_folder(tmp_path, monkeypatch):
    work = _user_folder(tmp_path / "work")
    monkeypatch.chdir(work)
    for output in (".", str(work), ".."):
        _refused([*CONVERT, "-o", output, "--force"], [work], 2, "current folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # no staging or lock file left


def test_force_refuses_a_folder_with_a_foreign_file_naming_what_is_there(tmp_path):
    out = _user_folder(tmp_path / "out")
    for i in range(5):
        (out / f"photo{i}.jpg").write_bytes(b"\xff\xd8")
    line = _refused([*CONVERT, "-o", str(out), "--force"], [out], 2, "holds what vca-patch did not write")
    assert "Documents/, notes.txt, photo0.jpg, photo1.jpg and 3 more" in line
    _refused([*CONVERT, "-o", str(out)], [out], 2, "not empty", "holds what vca-patch did not write")


def test_force_refuses_a_previous_checkpoint_with_a_user_file_beside_it(tmp_path, ckpt):
    out = _copy(ckpt, tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    _refused([*CONVERT, "-o", str(out), "--force"], [out], 2, "did not write: notes.txt")


def test_force_never_follows_a_symlink_to_a_users_folder(tmp_path, ckpt):
    mine = _copy(ckpt, tmp_path / "mine")  # even a vca-patch checkpoint: the link's target is never replaced
    link = tmp_path / "link"
    link.symlink_to(mine)
    _refused([*CONVERT, "-o", str(link), "--force"], [mine], 2, "is a symbolic link to", "never followed")
    assert link.is_symlink()


def test_force_refuses_a_hub_cache_and_anything_in_it(tmp_path, monkeypatch):
    hf_home = tmp_path / "hf"
    snapshot = hf_home / "hub" / "models--acme--vit" / "snapshots" / "abc"
    _user_folder(snapshot)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    cases = {hf_home: "is the Hugging Face cache", hf_home / "hub": "is the Hugging Face cache",
             snapshot: "is inside the Hugging Face cache", tmp_path: "holds the Hugging Face cache"}  # fmt: skip
    for output, where in cases.items():
        _refused([*CONVERT, "-o", str(output), "--force"], [hf_home], 2, where)


def test_an_input_resolved_through_links_is_never_replaced(tmp_path, monkeypatch):
    """A model folder whose files are links (a Hub snapshot, wherever its cache is): the folder the links point
    into holds the input."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    blobs = tmp_path / "cache" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc").write_bytes(b"weights")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").symlink_to(blobs / "abc")
    args = ["convert", str(snapshot), "--no-pretrained", "-o", str(blobs), "--force"]
    _refused(args, [blobs], 2, "holds the MODEL folder's model.safetensors (a link to")
    _refused(["convert", str(snapshot / "."), "-o", str(snapshot / "sub" / ".."), "--force"], [blobs], 2,
             "is the MODEL folder")  # fmt: skip


def test_force_refuses_a_parent_of_an_input(tmp_path):
    parent = tmp_path / "models"
    parent.mkdir()
    (parent / "w.safetensors").write_bytes(b"weights")
    _refused([*CONVERT, "--weights", str(parent / "w.safetensors"), "-o", str(parent), "--force"], [parent], 2,
             "holds the --weights file")  # fmt: skip


def test_a_fifo_or_device_is_never_replaced_by_a_file(tmp_path):
    fifo = tmp_path / "nul"
    os.mkfifo(fifo)
    for option in ("--json", "--plot"):
        _refused([*BENCH, option, str(fifo)], [], 2, f"{option} {fifo} is a FIFO", "not a regular file")
    assert fifo.is_fifo()
    if Path("/dev/null").is_char_device():
        _refused([*BENCH, "--json", "/dev/null"], [], 2, "is a character device")


def test_export_never_overwrites_a_file_or_a_fifo(tmp_path, ckpt):
    notes = tmp_path / "notes.pt2"
    notes.write_text("my notes")
    _refused(["export", str(ckpt), "-o", str(notes)], [notes, ckpt], 2, "exists; pass --force to replace it")
    fifo = tmp_path / "nul"
    os.mkfifo(fifo)
    _refused(["export", str(ckpt), "-o", str(fifo), "--force"], [notes, ckpt], 2, "is a FIFO")
    link = tmp_path / "link.pt2"
    link.symlink_to(notes)
    _refused(["export", str(ckpt), "-o", str(link), "--force"], [notes, ckpt], 2, "is a symbolic link")
    assert fifo.is_fifo() and link.is_symlink()


def test_force_replaces_an_empty_folder_and_a_previous_checkpoint(tmp_path, ckpt):
    model, args = tiny()
    patch_model(model)
    empty = tmp_path / "empty"
    empty.mkdir()
    check_output_dir(empty, overwrite=False)
    vca_patch.save_pretrained(model, empty, model_args=args)
    previous = _copy(ckpt, tmp_path / "previous")
    (previous / "model.pt2").write_bytes(b"an export")  # vca-patch export's files go with it
    before = digest(previous)
    with pytest.raises(OutputExistsError, match=r"holds a vca-patch output.*pass --force"):
        check_output_dir(previous, overwrite=False)
    vca_patch.save_pretrained(model, previous, model_args=args, overwrite=True, metadata={"run": 2})
    assert json.loads((previous / "config.json").read_text())["metadata"] == {"run": 2}
    assert digest(previous) != before and sorted(p.name for p in previous.iterdir()) == sorted(CHECKPOINT_NAMES - {
        "delta.safetensors"})  # fmt: skip
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name or ".staging-" in p.name]


def test_what_counts_as_a_vca_patch_output(tmp_path, ckpt):
    downloaded = tmp_path / "downloaded"  # a Hub model saved locally: the same names, not vca-patch's config
    downloaded.mkdir()
    for name in ("config.json", "model.safetensors", "README.md"):
        (downloaded / name).write_text('{"architectures": ["ViTModel"]}')
    assert unowned_entries(downloaded) == ["README.md", "config.json", "model.safetensors"]
    linked = tmp_path / "linked"  # a checkpoint whose files are links (a Hub snapshot): links are never ours
    linked.mkdir()
    for f in ckpt.iterdir():
        (linked / f.name).symlink_to(f)
    assert unowned_entries(linked) == sorted(f.name for f in ckpt.iterdir())
    exports = tmp_path / "exports"
    exports.mkdir()
    (exports / "m.pt2").write_bytes(b"zip")
    (exports / "m.onnx").write_bytes(b"proto")
    (exports / "plan.json").write_text(json.dumps({"format": PLAN_FORMAT, "config": {}}))
    (exports / "other.json").write_text("{}")
    assert unowned_entries(exports) == ["other.json"]
    with pytest.raises(UnsafeOutputError, match=r"did not write: other\.json"):
        check_output_dir(exports, overwrite=True)


def test_a_llava_sp_folder_is_a_vca_patch_output(tmp_path):
    from vca_patch.formats.llava_sp import save_spatial_tokens
    from vca_patch.targets.llava_sp import SpatialTokensConfig, add_spatial_tokens
    from vca_patch.targets.llava_sp.tiny import tiny_llava, tiny_processor

    model = tiny_llava()
    add_spatial_tokens(model, SpatialTokensConfig())
    folder = save_spatial_tokens(model, tmp_path / "sp", processor=tiny_processor())
    assert unowned_entries(folder) == []  # the LLaVA's and processor's own files included
    save_spatial_tokens(model, folder, overwrite=True)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(UnsafeOutputError, match=r"did not write: notes\.txt"):
        save_spatial_tokens(model, folder, overwrite=True)


def test_the_owned_names_are_the_ones_vca_patch_writes():
    from vca_patch.checkpoint.folder import CARD_NAME, CONFIG_NAME, FORMS
    from vca_patch.export import FORMATS
    from vca_patch.planner.plan_file import FORMAT
    from vca_patch.targets.llava_sp.config import SpatialTokensConfig
    from vca_patch.targets.llava_sp.io import CONFIG_FILE, VISION_PATCH_FILE, WEIGHTS_FILE

    assert {CONFIG_NAME, CARD_NAME, *FORMS.values()} == CHECKPOINT_NAMES
    assert {CONFIG_FILE, WEIGHTS_FILE, VISION_PATCH_FILE} == SPATIAL_TOKENS_NAMES
    assert {f".{f}" for f in FORMATS} == set(EXPORT_SUFFIXES) and FORMAT == PLAN_FORMAT
    assert SpatialTokensConfig.format == SPATIAL_TOKENS_FORMAT
