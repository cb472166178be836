"""The CLI's one error boundary: every command runs inside `guarded`, which turns vca-patch's own errors into one
`error:` line and its exit code, any other exception into one `internal error:` line (the stack with --debug), and
Ctrl-C into one line and exit 130. Commands raise; they do not catch and print.

Exit codes: 2 for what the user gave (options, config, checkpoint, data, recipe, plan, output path); 1 for what
could not be done with valid input (the Hub, an unknown model, weights that do not fit, a model that cannot be
patched, training that diverged) and for internal errors; 130 for an interrupt (Ctrl-C), 143 for SIGTERM, which
is handled like Ctrl-C: it raises KeyboardInterrupt in the main thread, so staging folders are removed, locks
released and a finetune's metrics.json marked interrupted with its resume step. A command `hold`s context managers
(an output folder's lock) for its whole run: they are released when it ends, however it ends."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
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
    """SIGTERM, raised in the main thread so that it unwinds like Ctrl-C."""


_terminating = False  # set by the SIGTERM handler: the exit code is 143, a second SIGTERM is ignored during cleanup
_scopes: list[contextlib.ExitStack] = []  # the running command's held context managers


def _on_sigterm(signum: int, frame: Any) -> None:
    global _terminating
    if _terminating:
        return  # already unwinding: let the cleanup finish (SIGKILL still stops the process)
    _terminating = True
    raise Terminated("terminated (SIGTERM)")


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM raises Terminated in the main thread for the block (the previous handler restored after it)."""
    global _terminating
    _terminating = False
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
        return 143 if _terminating or isinstance(exc, Terminated) else 130
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
    from vca_patch.cli.common import err_console

    if debug_enabled():
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    code = exit_code(exc)
    if isinstance(exc, KeyboardInterrupt):
        message = str(exc).strip() or "interrupted (Ctrl-C)"
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    elif code is not None:
        message = _worker_message(str(exc).strip()) or type(exc).__name__
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    else:
        code = 1
        hint = "" if debug_enabled() else "; rerun with --debug to see where (and please report it)"
        detail = _line(str(exc)) or "(no message)"
        err_console.print(
            f"[bold red]internal error:[/] {escape(type(exc).__name__)}: {escape(detail)}{hint}",
            highlight=False,
            soft_wrap=True,
        )
    return code


def guarded(command: F) -> F:
    """`command` inside the error boundary (its signature kept, so typer still reads its options)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _sigterm_as_interrupt(), contextlib.ExitStack() as scope:
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
)


def silence_library_warnings() -> None:
    """Hide torch/timm/transformers warnings that mean nothing to a user of the CLI (not with --debug)."""
    if debug_enabled():
        return
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found, ..."
    for category, message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
