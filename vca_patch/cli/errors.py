"""The CLI's one error boundary: every command runs inside `guarded`, which turns vca-patch's own errors into one
`error:` line and its exit code, any other exception into one `internal error:` line (the stack with --debug), and
Ctrl-C into one line and exit 130. Commands raise; they do not catch and print.

Exit codes: 2 for what the user gave (options, config, checkpoint, data, recipe, plan, output path); 1 for what
could not be done with valid input (the Hub, an unknown model, weights that do not fit, a model that cannot be
patched, training that diverged) and for internal errors; 130 for an interrupt (Ctrl-C), 143 for SIGTERM and 129
for SIGHUP, which are handled like Ctrl-C: they raise KeyboardInterrupt in the main thread, so staging folders are
removed, locks released and a finetune's metrics.json marked interrupted with its resume step. A command `hold`s
context managers (an output folder's lock) for its whole run: they are released when it ends, however it ends.

Faults of the operating system that a user can fix (a full disk, a file-size limit, a name too long, no permission,
a read-only file system, a dangling link, a closed or full standard output) are one `error:` line too, saying what
happened and what to do (`os_fault`); a locale that cannot encode "·" or "×" gets ASCII stand-ins (`prepare_process`).
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import functools
import logging
import os
import re
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import typer
from rich.markup import escape
from typer.exceptions import TyperException

F = TypeVar("F", bound=Callable[..., Any])
DEBUG_ENV = "VCA_PATCH_DEBUG"


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread so that it unwinds like Ctrl-C; exit 128 + `signum`."""

    def __init__(self, message: str = "terminated (SIGTERM)", signum: int = signal.SIGTERM) -> None:
        super().__init__(message)
        self.signum = signum


# The signals that stop a command like Ctrl-C (SIGINT raises KeyboardInterrupt by itself), and their lines.
TERMINATING = {signal.SIGTERM: "terminated (SIGTERM)"}
if hasattr(signal, "SIGHUP"):
    TERMINATING[signal.SIGHUP] = "terminated (SIGHUP: the terminal or session closed)"

_terminated_by: int | None = None  # set by the handler: the exit code is 128 + it; a second signal is ignored
_scopes: list[contextlib.ExitStack] = []  # the running command's held context managers


def _on_terminate(signum: int, frame: Any) -> None:
    global _terminated_by
    if _terminated_by is not None:
        return  # already unwinding: let the cleanup finish (SIGKILL still stops the process)
    _terminated_by = signum
    raise Terminated(TERMINATING.get(signum, f"terminated (signal {signum})"), signum)


def install_signal_handlers() -> dict[int, Any]:
    """SIGTERM and SIGHUP raise `Terminated` in the main thread, SIGINT KeyboardInterrupt (Python's own); the
    handlers they replace. Outside the main thread nothing is changed ({})."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {signum: signal.signal(signum, _on_terminate) for signum in TERMINATING}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    return previous


@contextlib.contextmanager
def _signals_as_interrupt() -> Any:
    """SIGINT, SIGTERM and SIGHUP raise in the main thread for the block (the previous handlers restored after)."""
    global _terminated_by
    _terminated_by = None
    previous = install_signal_handlers()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def hold(manager: AbstractContextManager) -> Any:
    """Enter `manager` until the running command ends (however it ends); its value. Outside a command: until
    the process exits."""
    if not _scopes:
        import atexit

        stack = contextlib.ExitStack()
        atexit.register(stack.close)
        return stack.enter_context(manager)
    return _scopes[-1].enter_context(manager)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exit 2: what the user gave is wrong (imported when an error needs classifying, not at start)."""
    from vca_patch.bench.errors import BenchError
    from vca_patch.bench.report import PlotUnavailableError
    from vca_patch.checkpoint.delta import DeltaError
    from vca_patch.checkpoint.folder import CheckpointError
    from vca_patch.core.atomic import OutputExistsError, UnsafeOutputError
    from vca_patch.core.errors import ConfigError, UnsafeConfigError
    from vca_patch.data.errors import DatasetError
    from vca_patch.hub.errors import InvalidRepoIdError
    from vca_patch.train.recipe import RecipeError

    return (ConfigError, UnsafeConfigError, CheckpointError, DeltaError, DatasetError, RecipeError, BenchError,
            PlotUnavailableError, OutputExistsError, UnsafeOutputError, InvalidRepoIdError)  # fmt: skip
    # a target's own errors derive from ConfigError (bad input: DIDB's PackedFormatError) or PatchError


def _run_errors() -> tuple[type[BaseException], ...]:
    """Exit 1: valid input, but it could not be done (Hub, model, weights, patching, training)."""
    from vca_patch.core.errors import PatchError
    from vca_patch.core.hub_access import HubUnavailableError, UnknownModelError
    from vca_patch.core.weights import WeightsMismatchError
    from vca_patch.hub.errors import HubError
    from vca_patch.train.engine import TrainingDiverged

    return (
        WeightsMismatchError,
        HubUnavailableError,
        UnknownModelError,
        HubError,
        PatchError,
        TrainingDiverged,
    )  # fmt: skip  (LLaVA-SP's SpatialTokensError is a PatchError)


def exit_code(exc: BaseException) -> int | None:
    """The exit code of one of vca-patch's own errors; None for any other exception."""
    if isinstance(exc, KeyboardInterrupt):
        signum = exc.signum if isinstance(exc, Terminated) else _terminated_by
        return 130 if signum is None else 128 + signum
    try:
        from vca_patch.hub.errors import InvalidRepoIdError

        user, run = _user_errors(), _run_errors()
    except Exception:  # a broken import must not hide the original error
        return None
    if isinstance(exc, InvalidRepoIdError):  # a HubError too, but the user's typo
        return 2
    if isinstance(exc, run):
        return 1
    if isinstance(exc, user):
        return 2
    return None


def _line(text: str) -> str:
    """The first non-empty line of `text`."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _worker_message(text: str) -> str:
    """The original message of an error that a DataLoader worker raised: torch re-raises it in the main process with
    the same type and "Caught X in DataLoader worker process N. Original Traceback ... X: message" as its text."""
    if not text.startswith("Caught ") or "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    name, sep, message = last.partition(": ")
    return message.strip() if sep and " " not in name else text


def report(exc: BaseException) -> int:
    """Print one line for `exc` on stderr (the stack first with --debug) and return its exit code."""
    if debug_enabled():
        with contextlib.suppress(OSError):
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    code = exit_code(exc)
    fault = (os_fault(exc) or _network_fault(exc)) if code is None else None
    if isinstance(exc, StdoutError):
        _discard_stdout()  # what is still buffered for it would fail again when Python exits
    if isinstance(exc, KeyboardInterrupt):
        _print_error("error:", str(exc).strip() or "interrupted (Ctrl-C)")
    elif code is not None:
        _print_error("error:", _worker_message(str(exc).strip()) or type(exc).__name__)
    elif fault is not None:
        code, message = fault
        _print_error("error:", message)
    else:
        code = 1
        hint = "" if debug_enabled() else "; rerun with --debug to see where (and please report it)"
        detail = _line(str(exc)) or "(no message)"
        _print_error("internal error:", f"{type(exc).__name__}: {detail}{hint}")
    return code


def _print_error(label: str, message: str) -> None:
    """`label message` as one line on stderr; a stderr that cannot be written (closed, full, a terminal gone with
    SIGHUP) loses the line but never raises from the error boundary itself."""
    from vca_patch.cli.common import err_console

    with contextlib.suppress(OSError):
        err_console.print(f"[bold red]{label}[/] {escape(message)}", highlight=False, soft_wrap=True)


# -- operating-system faults ---------------------------------------------------------------------------------------

_REMOVED = "; any partial output was removed"
_PATH_SHOWN = 120  # characters of a path in a message (a 4096-byte one is cut in the middle)
# errno -> (exit code, what happened, what to do): faults of the machine (space, size limits) exit 1, of the path
# the user gave (its name, permissions, file system) exit 2.
OS_FAULTS: dict[int, tuple[int, str, str]] = {
    errno.ENOSPC: (1, "no space left on the device", "free space there, or write to another disk, and run again"),
    errno.EDQUOT: (1, "disk quota exceeded", "free space within your quota, or write to another disk"),
    errno.EFBIG: (1, "a file grew past the largest size allowed (a file-size limit, `ulimit -f`, or the file "
                  "system's maximum)", "raise the limit (`ulimit -f unlimited`) or write to another file system"),
    errno.ENAMETOOLONG: (2, "file name too long (at most 255 bytes a name and 4096 a path on most file systems)",
                         "choose a shorter name or a shorter path"),
    errno.EACCES: (2, "permission denied", "choose a file or folder you may read and write, or change its "
                   "permissions"),
    errno.EPERM: (2, "operation not permitted", "choose a file or folder you own, or change its permissions"),
    errno.EROFS: (2, "the file system is read-only", "write to a folder on a writable file system"),
    errno.ELOOP: (2, "too many levels of symbolic links (a link loop)", "fix or remove the link"),
    errno.EIO: (1, "input/output error (a failing disk, a removed drive or a lost network mount)",
                "check the device and run again"),
}  # fmt: skip
_RUST_ERRNO = re.compile(r"\(os error (\d+)\)")  # safetensors (Rust) says "I/O error: ... (os error 27)"


def _fault_errno(exc: BaseException) -> int | None:
    """The errno of an OSError, or of a library's I/O error that names one in its text (safetensors)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    found = _RUST_ERRNO.search(str(exc)) if type(exc).__name__ == "SafetensorError" else None
    return int(found.group(1)) if found else None


def _short_path(path: Any) -> str:
    """A path for one line: as given, or its start and its end when longer than `_PATH_SHOWN` characters."""
    text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
    if len(text) <= _PATH_SHOWN:
        return text
    return f"{text[:50]}...{text[-50:]} ({len(os.fsencode(text))} bytes)"


def _dangling(path: Any) -> str | None:
    """The target of `path` when it is a symbolic link to nothing, else None."""
    try:
        if os.path.islink(path) and not os.path.exists(path):
            return os.readlink(path)
    except (OSError, TypeError, ValueError):
        pass
    return None


def os_fault(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) for a fault of the operating system a user can fix, or None (a bug stays an internal
    error): the errnos of `OS_FAULTS`, a dangling symbolic link, standard output closed or full (`StdoutError`)."""
    if isinstance(exc, StdoutError):
        return 1, _stdout_message(exc)
    code = _fault_errno(exc)
    filename = getattr(exc, "filename", None)
    where = f": {_short_path(filename)}" if filename is not None else ""
    if code == errno.ENOENT and filename is not None and _dangling(filename) is not None:
        return 2, (f"{_short_path(filename)} is a symbolic link to {_dangling(filename)}, which does not exist; "
                   "fix the link or name another path")  # fmt: skip
    if code not in OS_FAULTS:
        return None
    status, what, todo = OS_FAULTS[code]
    return status, f"{what}{where}; {todo}{_REMOVED}"


def _network_fault(exc: BaseException) -> tuple[int, str] | None:
    """(1, one line naming the endpoint) for a connection error or timeout a library raised on the way to the Hub
    (or another endpoint), or None."""
    from vca_patch.core.hub_access import network_failure

    message = network_failure(exc)
    return None if message is None else (1, message)


# -- standard output and the locale ------------------------------------------------------------------------------


class StdoutError(OSError):
    """Standard output could not be written: its reader closed the pipe (`| head`), or its device is full.
    `finished`: the command had done its work (the fault came when its last output was flushed)."""

    finished = False


def _stdout_message(exc: StdoutError) -> str:
    """What happened to standard output, whether the command's work was kept, and what to do."""
    if exc.errno == errno.EPIPE:
        what = "standard output was closed by its reader (e.g. `| head`) before vca-patch finished printing"
        todo = "pipe it to a reader that reads to the end, or redirect it to a file"
    else:
        reason = OS_FAULTS[exc.errno][1] if exc.errno in OS_FAULTS else (exc.strerror or "an I/O error")
        what = f"cannot write to standard output: {reason} (e.g. `> /dev/full`)"
        todo = "redirect it to a file on a disk with space, or to /dev/null"
    done = "the command finished; what it printed last was lost" if exc.finished else f"the command stopped{_REMOVED}"
    return f"{what}: {done}; {todo}"


class _GuardedStdout:
    """sys.stdout whose write and flush faults are `StdoutError`s, so that the boundary can tell a full or closed
    standard output from a file that could not be written (both raise a bare OSError without a file name)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise StdoutError(exc.errno, exc.strerror) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise StdoutError(exc.errno, exc.strerror) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _stdout_guarded() -> Any:
    """sys.stdout guarded (`_GuardedStdout`) for the block, then flushed (a fault raised there too)."""
    original = sys.stdout
    if original is None or isinstance(original, _GuardedStdout):
        yield
        return
    sys.stdout = _GuardedStdout(original)
    try:
        yield
        try:
            sys.stdout.flush()  # what is still buffered fails here, inside the boundary, not at exit
        except StdoutError as exc:
            exc.finished = True
            raise
    finally:
        sys.stdout = original


def _discard_stdout() -> None:
    """Point standard output's descriptor at /dev/null, so that the flush at exit neither fails nor prints."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stream (tests): nothing to redirect
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


ASCII_STAND_INS = {"·": ".", "×": "x", "–": "-", "—": "-", "−": "-", "…": "...", "≈": "~", "≤": "<=", "≥": ">=",
                   "±": "+/-", "→": "->", "←": "<-", "²": "^2", "³": "^3", "µ": "u", "λ": "lambda", "✓": "ok",
                   "✗": "x", "°": " deg", "’": "'", "‘": "'", "“": '"', "”": '"'}  # fmt: skip
ASCII_ERRORS = "vca-patch-ascii"


def _ascii_stand_in(exc: UnicodeError) -> tuple[str, int]:
    """A codec error handler: characters the stream's encoding lacks become ASCII stand-ins ("×" -> "x"), else "?"."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    text = exc.object[exc.start : exc.end]
    return "".join(ASCII_STAND_INS.get(char, "?") for char in text), exc.end


codecs.register_error(ASCII_ERRORS, _ascii_stand_in)


def encode_safely(stream: Any) -> None:
    """Let `stream` (stdout, stderr) print any text: in a locale whose encoding lacks a character (LC_ALL=C,
    PYTHONIOENCODING=ascii), it is written as an ASCII stand-in instead of raising UnicodeEncodeError."""
    encoding = (getattr(stream, "encoding", None) or "").lower().replace("_", "-")
    if encoding.startswith("utf") or not hasattr(stream, "reconfigure"):
        return
    with contextlib.suppress(ValueError, OSError):  # a stream that cannot be reconfigured keeps its errors
        stream.reconfigure(errors=ASCII_ERRORS)


def prepare_process() -> None:
    """For the `vca-patch` process: SIGTERM and SIGHUP handled like Ctrl-C from now on (also between commands'
    start-up and their boundary) and standard streams that print in any locale."""
    install_signal_handlers()
    encode_safely(sys.stdout)
    encode_safely(sys.stderr)


def guarded(command: F) -> F:
    """`command` inside the error boundary (its signature kept, so typer still reads its options)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _signals_as_interrupt(), _stdout_guarded(), contextlib.ExitStack() as scope:
                _scopes.append(scope)
                try:
                    return command(*args, **kwargs)
                finally:
                    _scopes.remove(scope)
        except (typer.Exit, typer.Abort, TyperException):
            raise  # typer.Exit from `fail`, and typer's own usage errors (BadParameter): already one line
        except (Exception, KeyboardInterrupt) as exc:
            raise typer.Exit(report(exc)) from None

    return wrapper  # type: ignore[return-value]


QUIET_WARNINGS = (  # library warnings that say nothing a user can act on
    (UserWarning, r".*No CUDA runtime is found.*"),
    (UserWarning, r".*CUDA initialization.*"),
    (UserWarning, r".*TypedStorage is deprecated.*"),
    (FutureWarning, r".*"),
    (DeprecationWarning, r".*"),
    (RuntimeWarning, r"Image size \(\d+ pixels\) exceeds limit"),  # PIL's DecompressionBombWarning: read_image
    # refuses such an image in its own error line (more than MAX_IMAGE_PIXELS), or skips it with --skip-bad-images
)


def silence_library_warnings() -> None:
    """Hide torch/timm/transformers warnings that mean nothing to a user of the CLI (not with --debug)."""
    if debug_enabled():
        return
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found, ..."
    for category, message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
