"""The XNOR-popcount CPU kernel for packed binary Linears (`csrc/xnor_gemm_cpu.cpp`), float32 inference.

`xnor_linear(x, signs, nonzero, scale, bias)` computes y = (sign(x)·sign(W)ᵀ)·scale + bias from packed sign words,
bit for bit what the float emulation computes (the ±1 dot product is an exact integer in both). Compiled on first
use with torch's C++ extension loader (a C++ compiler and ninja; ~10-20 s, once, cached under
TORCH_EXTENSIONS_DIR); without them, or with VCA_PATCH_DIDB_KERNEL=0, packed layers run the float emulation (same
numbers, no speed-up). Under `make test` (VCA_PATCH_REQUIRE_CPU_KERNEL=1) the tests fail rather than skip without it.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from vca_patch.core.cpu_extension import LazyCppExtension

ENV_SWITCH = "VCA_PATCH_DIDB_KERNEL"
_SOURCE = Path(__file__).with_name("csrc") / "xnor_gemm_cpu.cpp"

_logger = logging.getLogger(__name__)
_state: dict[str, object] = {"fake_registered": False}


def _has_vpopcnt() -> bool:
    """AVX-512 VPOPCNTDQ (vectorised 64-bit popcount), read from /proc/cpuinfo where there is one."""
    try:
        return "avx512_vpopcntdq" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _build() -> None:
    from torch.utils.cpp_extension import load

    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-ffp-contract=off"]  # y = dot·scale + bias rounds twice, as in the float emulation
    if capability == "AVX512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mpopcnt"]
        if _has_vpopcnt():
            flags.append("-mavx512vpopcntdq")
    elif capability == "AVX2":
        flags += ["-mavx2", "-mpopcnt"]
    suffix = capability.lower() + ("_vpopcnt" if "-mavx512vpopcntdq" in flags else "")
    _logger.info("compiling the DIDB XNOR-popcount CPU kernel (first use only)")
    load(name=f"vca_patch_didb_xnor_{suffix}", sources=[str(_SOURCE)], extra_cflags=flags, is_python_module=False)
    if not _state["fake_registered"]:  # shapes for torch.compile: the op is an opaque call in a traced graph
        torch.library.register_fake("vca_patch_didb::xnor_linear")(_fake_xnor_linear)
        _state["fake_registered"] = True


def _fake_xnor_linear(x: torch.Tensor, signs: torch.Tensor, *args: object) -> torch.Tensor:
    return x.new_empty(x.shape[0], signs.shape[0])


_EXTENSION = LazyCppExtension(
    _build,
    ENV_SWITCH,
    what="the DIDB XNOR CPU kernel",
    kernel="xnor",
    fallback="float emulation",
    unavailable="packed binary Linears use the float emulation (same numbers, slower). A C++ compiler and "
    "`pip install ninja` enable it;",
)


@torch.compiler.assume_constant_result  # traced as a constant: no guard on the environment, no graph break
def kernel_available() -> bool:
    """Whether the kernel is (or can now be) loaded; compiles it on the first call. Never raises."""
    return _EXTENSION.available()


def kernel_status() -> str:
    """One line for reports: "xnor", "float emulation (disabled)" or "float emulation (<why>)". Does not build."""
    return _EXTENSION.status()


def use_kernel(enabled: bool) -> AbstractContextManager[None]:
    """Force the kernel off (or back to the default) inside the block: for tests and A/B benchmarks."""
    return _EXTENSION.use(enabled)


def xnor_linear(
    x: torch.Tensor,
    signs: torch.Tensor,
    nonzero: torch.Tensor | None,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """[..., K] float32 -> [..., O]: (sign(x)·sign(W)ᵀ)·scale + bias, W given as int64 words [O, ceil(K/64)]
    (`signs`, and `nonzero` when W has zeros). Call `kernel_available()` first."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.ops.vca_patch_didb.xnor_linear(rows, signs, nonzero, scale.contiguous(), bias)
    return y.view(*x.shape[:-1], signs.shape[0])
