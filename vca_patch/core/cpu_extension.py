"""A C++ op library compiled on first use, with a fallback path when it cannot be built.

Shared by VCA's fused CPU kernel (`attention/fused_cpu.py`) and DIDB's XNOR kernel (`didb/kernel.py`): each gives
its build function, the environment switch that turns it off, and what it falls back to. Building never raises:
a failure is kept as one line (`failure_reason`) and warned about once.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def failure_reason(error: Exception) -> str:
    """The line that says why: a compiler's `error:` line, or a missing program's, else the exception's last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    cause = next((line for line in lines if "error:" in line or "not found" in line), lines[-1])
    return f"{type(error).__name__}: {cause[:300]}"


class LazyCppExtension:
    """`build()` runs once, on the first `available()` call, unless `env_switch` is "0" or `use(False)` is active.

    kernel / fallback: the names `status()` reports ("fused" / "composite"); unavailable: the warning's text after
    "... could not be built (<why>); " (what runs instead and how to enable the kernel).
    """

    def __init__(self, build: Callable[[], None], env_switch: str, *, what: str, kernel: str, fallback: str,
                 unavailable: str) -> None:  # fmt: skip
        self._build = build
        self.env_switch = env_switch
        self.what, self.kernel, self.fallback, self.unavailable = what, kernel, fallback, unavailable
        self.loaded = False
        self.error: str | None = None
        self._override: bool | None = None
        self._lock = threading.Lock()

    def disabled(self) -> bool:
        return self._override is False or os.environ.get(self.env_switch, "1") == "0"

    def available(self) -> bool:
        """Whether the library is (or can now be) loaded; builds it on the first call. Never raises."""
        if self.disabled():
            return False
        if self.loaded:
            return True
        with self._lock:
            if not self.loaded and self.error is None:
                try:
                    self._build()
                    self.loaded = True
                except Exception as error:  # no compiler, no ninja, a missing symbol: keep the fallback path
                    self.error = failure_reason(error)
                    warnings.warn(
                        f"{self.what} could not be built ({self.error}); {self.unavailable} "
                        f"{self.env_switch}=0 skips it.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        return self.loaded

    def status(self) -> str:
        """One line for reports: the kernel's name, "<fallback> (disabled)" or "<fallback> (<why>)". Never builds."""
        if self.disabled():
            return f"{self.fallback} (disabled)"
        if self.loaded:
            return self.kernel
        return f"{self.fallback} ({self.error})" if self.error else f"{self.kernel} (not built yet)"

    @contextmanager
    def use(self, enabled: bool) -> Iterator[None]:
        """Force the kernel off (or back to the default) inside the block: for tests and A/B benchmarks."""
        previous = self._override
        self._override = None if enabled else False
        try:
            yield
        finally:
            self._override = previous
