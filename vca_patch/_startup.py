"""What the `vca-patch` command needs before its first import: importing vca-patch (torch, timm) takes seconds, and
a Ctrl-C, SIGTERM or SIGHUP in those seconds must end in one line, not a `KeyboardInterrupt` traceback; and a
standard stream the caller closed (`vca-patch ... >&-`) must not hand its descriptor to the first file opened.

`prepare()` runs when this module is imported, first in `vca_patch/__init__.py`, and does nothing unless this
process is the CLI (`vca-patch` or `python -m vca_patch`): a library user's signal handlers and streams are never
touched. The CLI's own handlers (`vca_patch.cli.errors`) replace these once it runs."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

_STARTING = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
if hasattr(signal, "SIGHUP"):
    _STARTING[signal.SIGHUP] = "SIGHUP"


def is_cli() -> bool:
    """Whether this process is the vca-patch command: the `vca-patch` script or `python -m vca_patch`."""
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1] == "vca_patch"
    return bool(sys.argv) and os.path.basename(sys.argv[0]) in ("vca-patch", "vca-patch.exe")


def _exit_while_starting(signum: int, frame: Any) -> None:
    """Nothing is written while importing, so there is nothing to clean up: one line, exit 128 + the signal."""
    name = _STARTING.get(signum, f"signal {signum}")
    with contextlib.suppress(OSError):  # stderr closed or gone with the terminal: the exit code still says it
        os.write(2, f"error: interrupted ({name}) while starting; nothing was done\n".encode())
    os._exit(128 + signum)


def reopen_closed_streams() -> None:
    """Point standard descriptors 0-2 the caller closed at /dev/null (stdout then discards; the first file opened
    would otherwise get descriptor 1 and receive what is printed), and give Python a stream for each."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY)
        if null != fd:  # a lower descriptor was closed too and took it: it is reopened on its own turn
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, encoding="utf-8", closefd=False))  # noqa: SIM115 (the process's)


def prepare() -> None:
    """For the CLI only: one line and exit on a signal while importing; closed standard streams reopened."""
    if not is_cli():
        return
    reopen_closed_streams()
    for signum in _STARTING:
        signal.signal(signum, _exit_while_starting)


prepare()
