"""Peak memory of one call: CUDA allocator statistics, or the process's RSS high-water mark on CPU.

On CPU, torch allocates from malloc, which tracemalloc does not see. `cpu_peak_mib` makes glibc hand
every block of 64 KiB or more straight to the kernel (mmap) and back on free, trims the heap, resets
the kernel's RSS high-water mark (/proc/self/clear_refs) and reports the rise of VmHWM over the
resident size before the call: the peak of memory touched during the call, whoever allocated it.
The malloc setting stays for the rest of the process, so measure memory after timing.
"""

from __future__ import annotations

import ctypes
import gc
import re
from collections.abc import Callable
from pathlib import Path

import torch

_M_MMAP_THRESHOLD = -3
_MIB = 2**20


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


def cpu_memory_supported() -> bool:
    """True on Linux with glibc and a writable /proc/self/clear_refs."""
    if _libc() is None or not Path("/proc/self/clear_refs").exists():
        return False
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _status_kib("VmHWM")
    except (OSError, RuntimeError):
        return False
    return True


def cpu_peak_mib(fn: Callable[[], object]) -> float:
    """Peak resident memory added while fn() runs, in MiB (Linux + glibc)."""
    libc = _libc()
    if libc is None:
        raise RuntimeError("CPU peak memory needs glibc (Linux)")
    libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    gc.collect()
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    result = fn()
    peak = _status_kib("VmHWM")
    del result
    return (peak - before) / 1024


def cuda_peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Peak bytes allocated by torch on `device` while fn() runs, over what was allocated before, in MiB."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del result
    return (peak - before) / _MIB


def peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Peak memory added by fn() on `device` (CUDA allocator, or CPU RSS high-water mark), in MiB."""
    return cuda_peak_mib(fn, device) if device.type == "cuda" else cpu_peak_mib(fn)
