"""The registered targets' compute kernels (their handlers' `cpu_kernel`), switched and reported together: bench
code reaches VCA's fused CPU kernel (or any target's) only through the registry, never a target module."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from vca_patch.targets import CONFIG_TYPES, handler_for


def cpu_kernels() -> dict[str, Any]:
    """{target name: its CPU kernel} of every registered target that has one (a kernel shared by a subclass's
    target is listed once, under the first name)."""
    kernels: dict[str, Any] = {}
    for name, config_cls in CONFIG_TYPES.items():
        kernel = handler_for(config_cls).cpu_kernel(config_cls)
        if kernel is not None and all(kernel is not k for k in kernels.values()):
            kernels[name] = kernel
    return kernels


@contextmanager
def use_cpu_kernels(enabled: bool) -> Iterator[None]:
    """Every target's CPU kernel forced off inside the block (False), or left at its default (True)."""
    with ExitStack() as stack:
        for kernel in cpu_kernels().values():
            stack.enter_context(kernel.use(enabled))
        yield


def cpu_kernel_status() -> dict[str, str]:
    """Report lines, {"<target>_cpu_kernel": status} (e.g. "vca_cpu_kernel": "fused" or why VCA ran its
    composite path); no kernel is built."""
    return {f"{name}_cpu_kernel": kernel.status() for name, kernel in cpu_kernels().items()}
