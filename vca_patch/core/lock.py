"""A claim on an output folder, so that two runs writing one folder (two `convert`s, two `finetune`s) never mix
their files: the second fails at once with one line naming the first.

The claim is a lock file beside the output, `.NAME.lock`, made with O_CREAT | O_EXCL (atomic on local and NFS
file systems) and holding the claiming process's pid, host and command; it is removed when the claim ends (also
on an error, Ctrl-C or SIGTERM). A lock left by a process that no longer runs (killed with SIGKILL, a power cut)
is recognised by its pid on this host and taken over; the same process may claim a folder it already holds."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vca_patch.core.atomic import UnsafeOutputError, physical


class OutputLockedError(UnsafeOutputError):
    """Another running process is writing the same output folder."""


def lock_path(output: Path | str) -> Path:
    """The lock file of `output`: `.NAME.lock` in its parent folder."""
    output = physical(output)  # the folder the output lands in, as the file system resolves it
    return output.parent / f".{output.name}.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _read(lock: Path) -> dict | None:
    try:
        owner = json.loads(lock.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _stale(owner: dict | None, lock: Path) -> bool:
    """Whether the lock's owner is gone: a dead pid on this host (or an unreadable lock file older than a minute,
    left half-written)."""
    if owner is None:
        try:
            return time.time() - lock.stat().st_mtime > 60
        except OSError:
            return True
    if owner.get("host") != socket.gethostname():
        return False  # another machine's process: its liveness cannot be checked from here
    pid = owner.get("pid")
    return not isinstance(pid, int) or not _alive(pid)


def _describe(owner: dict | None, lock: Path) -> str:
    if owner is None:
        return f"another run (lock file {lock})"
    return f"{owner.get('command', 'another run')} (pid {owner.get('pid')} on {owner.get('host')}, lock file {lock})"


def _claim(lock: Path, command: str) -> str:
    """Create `lock` for this process: "claimed", "held" (this process holds it already) or "none" (the folder
    takes no lock file); an OutputLockedError when a live process holds it."""
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": command})
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = _read(lock)
            if owner is not None and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
                return "held"
            if _stale(owner, lock):
                lock.unlink(missing_ok=True)  # its process is gone: take it over
                continue
            raise OutputLockedError(
                f"{lock.parent / lock.name[1:-5]} is being written by {_describe(owner, lock)}; wait for it to "
                "finish, or choose another output (delete the lock file only if that run has stopped)"
            ) from None
        except OSError:  # a read-only or odd folder: the output checks say what is wrong with it
            return "none"
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(record)
        return "claimed"
    raise OutputLockedError(f"cannot claim {lock.parent / lock.name[1:-5]}: its lock file {lock} keeps reappearing")


def release(lock: Path) -> None:
    """Remove `lock` if this process holds it."""
    owner = _read(lock)
    if owner is not None and owner.get("pid") == os.getpid():
        lock.unlink(missing_ok=True)


@contextmanager
def output_lock(output: Path | str, command: str) -> Iterator[Path | None]:
    """Hold the claim on `output` for the block; an OutputLockedError (one line naming the other run) if another
    live process holds it. A missing parent folder claims nothing (the output checks report it)."""
    lock = lock_path(output)
    state = _claim(lock, command) if lock.parent.is_dir() else "none"
    try:
        yield lock if state != "none" else None
    finally:
        if state == "claimed":
            release(lock)
