"""Peak memory of one call: CUDA allocator statistics, or a live-tensor tracker on CPU.

The CPU allocator keeps no statistics, and the process's resident size moves by megabytes with malloc's
heap policy, oneDNN caches and thread stacks. `cpu_peak_mib` instead watches every tensor the call's ops
create (a dispatch mode, so autograd's backward ops and saved tensors count too) and frees each one's bytes
when its storage dies: the peak of tensor memory allocated during the call, reproducible to the byte. It is
the CPU counterpart of `torch.cuda.max_memory_allocated`; scratch buffers a fused kernel keeps to itself
(SDPA's per-thread blocks, oneDNN workspaces) are not tensors and are not counted.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_MIB = 2**20


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else 0


class LiveTensorBytes(TorchDispatchMode):
    """Tracks the bytes of storages created by ops while active; `peak` is their high-water mark."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _release_dead(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._release_dead()  # before registering, so a reused address is not mistaken for a live storage
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            key = _storage_key(tensor) if isinstance(tensor, torch.Tensor) else 0
            if key and key not in self._live and key not in inputs:  # views and in-place results are not new
                storage = tensor.untyped_storage()
                self._live[key] = (StorageWeakRef(storage), storage.nbytes())
                self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def cpu_peak_mib(fn: Callable[[], object]) -> float:
    """Peak bytes of the tensors fn() allocates (alive at once), in MiB. Only storages created inside fn() are
    counted, so garbage left from before needs no collection (a full gc.collect costs ~0.2 s with torch loaded)."""
    with LiveTensorBytes() as tracker:
        result = fn()
        del result
    return tracker.peak / _MIB


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
    """Peak memory added by fn() on `device` (CUDA allocator, or live CPU tensors), in MiB."""
    return cuda_peak_mib(fn, device) if device.type == "cuda" else cpu_peak_mib(fn)
