"""Atomic file and folder writes: readers see the old content or the new, never half of it; and the checks that
keep an output from landing on what a user would lose (an input, the current folder, a foreign folder)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


class OutputExistsError(FileExistsError):
    """The output folder exists and is not empty, and overwriting was not asked for."""


class UnsafeOutputError(ValueError):
    """The output would replace or write into something the user keeps: an input, or the current folder."""


def _holds_cwd(path: Path) -> bool:
    cwd = Path.cwd().resolve()
    return path == cwd or path in cwd.parents


def check_output_dir(path: Path, *, overwrite: bool) -> None:
    """Refuse a file, the current folder (or one holding it), and a non-empty existing folder unless `overwrite`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"{path} exists and is not a folder")
    resolved = path.resolve()
    if _holds_cwd(resolved):
        raise UnsafeOutputError(
            f"output {path} is the current folder{'' if resolved == Path.cwd().resolve() else ' or holds it'}; "
            "it is replaced as a whole, so pass a new sub-folder (e.g. -o ./converted)"
        )
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputExistsError(f"{path} is not empty; choose another folder or pass --force (overwrite=True)")


def check_output_outside_inputs(output: Path, inputs: Mapping[str, Path | None], *, replaces: bool) -> None:
    """Refuse an output that is, or is inside, one of `inputs` (name -> path); with `replaces` (the output folder
    is replaced as a whole) also one that holds an input."""
    out = Path(output).resolve()
    for name, path in inputs.items():
        if path is None:
            continue
        src = Path(path).resolve()
        if out == src or src in out.parents:
            raise UnsafeOutputError(
                f"output {output} is {'the' if out == src else 'inside the'} {name} {path}: writing it would "
                "change the input; choose an output folder outside it"
            )
        if replaces and out in src.parents:
            raise UnsafeOutputError(
                f"output {output} holds the {name} {path}, which replacing the folder would delete; "
                "choose an output folder that does not contain it"
            )


def foreign_entries(path: Path, owned: Collection[str]) -> list[str]:
    """The names in folder `path` that are not in `owned` (sorted; sub-folders end in "/"); [] if it is absent."""
    path = Path(path)
    if not path.is_dir():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir() if p.name not in owned)


def current_umask() -> int:
    """The process's umask (read from /proc where it can be, without changing it; else set and restored)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def public_mode(path: Path | str, *, folder: bool = False) -> None:
    """Give a temporary file (0600) or folder (0700) the mode a plain open/mkdir would: 0666/0777 less the umask."""
    os.chmod(path, (0o777 if folder else 0o666) & ~current_umask())


def _public_tree(root: Path) -> None:
    """Give `root` and everything under it the modes a plain open/mkdir would (executable files stay executable)."""
    mask = current_umask()
    for entry in [root, *root.rglob("*")]:
        if entry.is_symlink():
            continue
        mode = 0o777 if entry.is_dir() or entry.stat().st_mode & 0o100 else 0o666
        os.chmod(entry, mode & ~mask)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        public_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_file(path: Path | str, *, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path` to write (by any writer, e.g. matplotlib); on success it replaces
    `path` in one rename, with the mode a plain open would give; on any error it is removed and `path` is kept."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        public_mode(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold off Ctrl-C and SIGTERM for the block (they are delivered, and raise, right after it): a cleanup that
    an interrupt would leave half done (a staging folder half removed) runs to its end."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def staged_directory(dest: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `dest` in one rename.

    On any error, Ctrl-C or SIGTERM (any BaseException; the CLI turns SIGTERM into KeyboardInterrupt) the temporary
    folder is removed and `dest` is left as it was; no staging or `.old-` folder is ever left behind (the swap and
    the cleanup run with interrupts held off until they are done). The current folder (or one holding it) is
    refused: it cannot be renamed away safely.
    """
    dest = Path(os.path.abspath(dest))  # "." or "a/.." have no name of their own; a symlink stays the link
    check_output_dir(dest, overwrite=overwrite)
    if not dest.parent.is_dir():  # missing parents are never made: a typo would scatter folders
        raise UnsafeOutputError(f"cannot write {dest}: folder {dest.parent} does not exist (create it first)")
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
    trash: Path | None = None
    try:
        public_mode(stage, folder=True)
        yield stage
        _public_tree(stage)  # writers that stage privately (mkstemp, safetensors): the umask's modes, as open() gives
        with signals_deferred():
            trash = _swap_in(stage, dest)
    finally:
        with signals_deferred():
            shutil.rmtree(stage, ignore_errors=True)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)


def _swap_in(stage: Path, dest: Path) -> Path | None:
    """Rename `stage` to `dest`, the old `dest` moved to a trash folder first (returned, to remove) and put back if
    the rename fails."""
    if not dest.exists():
        os.replace(stage, dest)
        return None
    trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    try:
        os.replace(dest, trash / dest.name)
        os.replace(stage, dest)
    except BaseException:
        if not dest.exists() and (trash / dest.name).exists():
            os.replace(trash / dest.name, dest)  # put the old folder back
        shutil.rmtree(trash, ignore_errors=True)
        raise
    return trash
