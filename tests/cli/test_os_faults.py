"""Faults of the operating system a user can fix end in one `error:` line saying what happened and what to do, with
the partial output removed: a full disk, a quota, a file-size limit, a name too long, no permission, a read-only
file system, a link loop, a dangling link, a failing device, a closed or full standard output, a locale that cannot
encode "·" or "×". A bug (any other error) stays an `internal error:` line."""

from __future__ import annotations

import errno
import io
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from tests.support.cli import one_error_line, run_unchanged, runner
from tests.support.paths import ROOT
from vca_patch.cli.app import app
from vca_patch.cli.errors import OS_FAULTS, encode_safely, guarded, os_fault, report

CONVERT = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "32", "--contrast-tokens", "4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "100"}
FAULTS = {  # errno -> exit code and words the line must hold (what happened, what to do)
    errno.ENOSPC: (1, "no space left on the device", "free space there"),
    errno.EDQUOT: (1, "disk quota exceeded", "within your quota"),
    errno.EFBIG: (1, "largest size allowed", "ulimit -f"),
    errno.ENAMETOOLONG: (2, "file name too long", "choose a shorter name"),
    errno.EACCES: (2, "permission denied", "change its permissions"),
    errno.EPERM: (2, "operation not permitted", "choose a file or folder you own"),
    errno.EROFS: (2, "read-only", "writable file system"),
    errno.ELOOP: (2, "symbolic links", "fix or remove the link"),
    errno.EIO: (1, "input/output error", "check the device"),
}


def _vca_patch(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """`python -m vca_patch ARGS` (stdout captured unless given), its stderr as text."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([sys.executable, "-m", "vca_patch", *args], env=kwargs.pop("env", ENV), cwd=ROOT,
                          stderr=subprocess.PIPE, text=True, timeout=300, **kwargs)  # fmt: skip


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("error:", "internal error:", "Traceback"))]


def test_every_named_fault_is_covered():
    assert set(FAULTS) == set(OS_FAULTS)


@pytest.mark.parametrize("code", sorted(FAULTS), ids=lambda c: errno.errorcode[c])
def test_each_os_fault_is_one_line_naming_the_path_and_what_to_do(code):
    status, what, todo = FAULTS[code]
    exc = OSError(code, os.strerror(code), "/data/out/model.safetensors")
    got = os_fault(exc)
    assert got is not None and got[0] == status
    assert what in got[1] and todo in got[1] and "/data/out/model.safetensors" in got[1], got[1]
    assert "partial output was removed" in got[1] and "\n" not in got[1]


def test_an_io_error_that_safetensors_reports_in_its_text_is_named():
    class SafetensorError(Exception):  # safetensors' Rust error: the errno only in its text
        pass

    got = os_fault(SafetensorError("Error while serializing: I/O error: File too large (os error 27)"))
    assert got is not None and got[0] == 1 and "ulimit -f" in got[1]


def test_a_long_path_is_shortened_in_the_line():
    exc = OSError(errno.ENAMETOOLONG, "File name too long", "/d/" + "x" * 5000)
    _, line = os_fault(exc)
    assert len(line) < 400 and "(5003 bytes)" in line, line


def test_a_dangling_link_is_named_with_its_target(tmp_path):
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "gone")
    _, line = os_fault(FileNotFoundError(errno.ENOENT, "No such file or directory", str(link)))
    assert f"{link} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in line


def test_other_errors_stay_internal_errors(capsys):
    assert os_fault(FileNotFoundError(errno.ENOENT, "No such file or directory", "/nowhere/x")) is None
    assert os_fault(OSError(errno.EBADF, "Bad file descriptor")) is None and os_fault(ValueError("bug")) is None
    assert report(OSError(errno.EBADF, "Bad file descriptor")) == 1
    assert capsys.readouterr().err.startswith("internal error: OSError:")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES], ids=errno.errorcode.get)
def test_a_fault_while_saving_a_conversion_leaves_nothing_behind(code, tmp_path, monkeypatch):
    """The weights writer fails half way (a full disk, a file system turned read-only, permissions changed): one
    line, its exit code, and no output, staging folder or lock file left."""
    import vca_patch.checkpoint.folder as folder

    def failing_save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(code, os.strerror(code), filename)

    monkeypatch.setattr(folder, "save_file", failing_save)
    out = tmp_path / "out"
    result = runner.invoke(app, [*CONVERT, "-o", str(out)])
    status, what, todo = FAULTS[code]
    one_error_line(result, status, what, todo, "model.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_name_over_255_bytes_is_refused_before_any_work(tmp_path):
    result = run_unchanged([*CONVERT, "-o", str(tmp_path / ("x" * 300))], [])
    one_error_line(result, 2, "file name too long", "(", "bytes)")
    assert "Attention sites" not in result.output and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 folder regardless")
def test_a_folder_without_write_permission_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        result = runner.invoke(app, [*CONVERT, "-o", str(locked / "out")])
    finally:
        locked.chmod(0o700)
    one_error_line(result, 2, "not writable")
    assert list(locked.iterdir()) == []


SETPRIV = "/usr/bin/setpriv"
WITHOUT_DAC = [SETPRIV, "--bounding-set=-dac_override,-dac_read_search"]


def _can_drop_dac() -> bool:
    """Root here, with a setpriv that may drop the capabilities that let root write anywhere (a container may
    forbid changing the bounding set)."""
    if os.geteuid() != 0 or not os.path.exists(SETPRIV):
        return False
    return subprocess.run([*WITHOUT_DAC, "true"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not _can_drop_dac(), reason="root with a setpriv that can drop dac_override only")
def test_a_folder_without_write_permission_is_one_line_for_root_without_dac_override(tmp_path):
    """As root, the real EACCES: the command runs without the capabilities that let root write anywhere."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    command = [*WITHOUT_DAC, sys.executable, "-m", "vca_patch", *CONVERT, "-o", str(locked / "out")]
    try:
        result = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        locked.chmod(0o700)
    errors = _error_lines(result.stderr)
    assert result.returncode == 2 and len(errors) == 1 and "not writable" in errors[0], result.stderr
    assert list(locked.iterdir()) == []


class _FailingStream(io.StringIO):
    """A standard output whose writes fail with `code` (a closed pipe, a full device)."""

    def __init__(self, code: int) -> None:
        super().__init__()
        self.code = code

    def write(self, text: str) -> int:
        raise OSError(self.code, os.strerror(self.code))

    def fileno(self) -> int:
        raise io.UnsupportedOperation("no descriptor")


@pytest.mark.parametrize(
    ("code", "words"),
    [(errno.EPIPE, "closed by its reader"), (errno.ENOSPC, "cannot write to standard output: no space left")],
)
def test_a_closed_or_full_stdout_is_one_line_not_a_file_fault(code, words, monkeypatch, capsys):
    from vca_patch.cli.common import console

    def prints() -> None:
        console.print("Attention sites · 2×2")

    monkeypatch.setattr(sys, "stdout", _FailingStream(code))
    with pytest.raises(typer.Exit) as stopped:
        guarded(prints)()
    err = capsys.readouterr().err.strip()
    assert stopped.value.exit_code == 1 and err.count("\n") == 0, err
    assert err.startswith("error: ") and words in err and "the command stopped" in err, err


class _ClosedPipe(io.RawIOBase):
    """A pipe whose reader has gone while `broken` (writes raise EPIPE)."""

    broken = True

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.broken:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        return len(data)


def test_stdout_failing_once_the_work_is_done_says_the_work_was_kept(monkeypatch, capsys):
    raw = _ClosedPipe()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8"))
    try:
        with pytest.raises(typer.Exit) as stopped:
            guarded(lambda: sys.stdout.write("done\n"))()  # buffered: it fails when flushed, after the work
    finally:
        raw.broken = False
    err = capsys.readouterr().err.strip()
    assert stopped.value.exit_code == 1 and "the command finished; what it printed last was lost" in err, err


def test_an_ascii_locale_prints_stand_ins_not_a_unicode_error():
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    encode_safely(stream)
    stream.write("Attention sites · 2×2 · 3–5 ≈ 1.0 ✶\n")
    stream.flush()
    assert raw.getvalue().decode("ascii") == "Attention sites . 2x2 . 3-5 ~ 1.0 ?\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_stdout_on_a_full_device_is_one_line(tmp_path):
    with open("/dev/full", "w") as full:
        done = _vca_patch(*CONVERT, "-o", str(tmp_path / "out"), stdout=full)
    assert done.returncode == 1, done.stderr
    assert _error_lines(done.stderr) == [done.stderr.strip().splitlines()[-1]], done.stderr
    assert "cannot write to standard output: no space left" in done.stderr and "Exception ignored" not in done.stderr


def test_a_c_locale_with_ascii_output_runs_and_prints_stand_ins():
    env = {**ENV, "LC_ALL": "C", "LANG": "C", "PYTHONIOENCODING": "ascii"}
    done = _vca_patch("inspect", "deit_tiny_patch16_224", "--img-size", "32", env=env)
    assert done.returncode == 0 and not _error_lines(done.stderr), done.stderr
    assert "Attention sites (dry run: unchanged) . prefix+grid tokens 1+2x2" in done.stdout, done.stdout


@pytest.mark.e2e
def test_a_reader_that_closed_the_pipe_is_one_line(tmp_path):
    read, write = os.pipe()
    os.close(read)  # like `| head -0`: nobody reads
    try:
        done = _vca_patch("inspect", "deit_tiny_patch16_224", "--img-size", "32", stdout=write)
    finally:
        os.close(write)
    assert done.returncode == 1, done.stderr
    assert _error_lines(done.stderr) == [done.stderr.strip().splitlines()[-1]], done.stderr
    assert "closed by its reader" in done.stderr and "Exception ignored" not in done.stderr


@pytest.mark.e2e
def test_a_file_size_limit_while_saving_is_one_line_and_leaves_nothing(tmp_path):
    """A real EFBIG (`ulimit -f`): safetensors reports it as an "(os error 27)" in its text."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    done = _vca_patch(*CONVERT, "-o", str(tmp_path / "out"), preexec_fn=limit)
    assert done.returncode == 1, done.stderr
    assert _error_lines(done.stderr) == [done.stderr.strip().splitlines()[-1]], done.stderr
    assert "largest size allowed" in done.stderr and "ulimit -f" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
@pytest.mark.parametrize("form", ["pt2", "onnx"])
def test_a_file_size_limit_while_exporting_is_one_line_and_leaves_nothing(form, tmp_path):
    """A real EFBIG while writing the export: torch's own zip writer would abort the process (".pt2" is serialised
    in memory and written by Python instead), the ONNX writer's error is named; the checkpoint stays as it was."""
    ckpt = tmp_path / "ckpt"
    assert runner.invoke(app, [*CONVERT, "-o", str(ckpt)]).exit_code == 0
    before = {p: p.read_bytes() for p in ckpt.iterdir()}

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    done = _vca_patch("export", str(ckpt), "-f", form, "-o", str(tmp_path / f"m.{form}"), preexec_fn=limit)
    assert done.returncode == 1, done.stderr
    assert _error_lines(done.stderr) == [done.stderr.strip().splitlines()[-1]], done.stderr
    assert "largest size allowed" in done.stderr and "terminate called" not in done.stderr
    assert sorted(tmp_path.iterdir()) == [ckpt] and {p: p.read_bytes() for p in ckpt.iterdir()} == before
