"""VCA's fused CPU kernel (`csrc/vca_attend_cpu.cpp`): Stage I, Stage II, both RMSNorms, the depthwise conv and
the optional local term as one op for float32 inference.

On short sequences the composite path is ~25 small ATen calls per layer, each paying a cold dispatch (2-3x
its hot time); the kernel runs them as one parallel region and makes VCA as fast as softmax attention at
224 px. It is compiled on first use with torch's C++ extension loader (a C++ compiler and ninja; 10–30 s,
once, cached under TORCH_EXTENSIONS_DIR) and registered as `torch.ops.vca_patch.attend_cpu` (and
`attend_cpu_into_q`, the same with o written over q's dead buffer, for eager inference). Without a
compiler, or with VCA_PATCH_CPU_KERNEL=0, VCA keeps its composite path (same numbers, slower on small grids).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from vca_patch.core.cpu_extension import LazyCppExtension, failure_reason

ENV_SWITCH = "VCA_PATCH_CPU_KERNEL"
_SOURCE = Path(__file__).with_name("csrc") / "vca_attend_cpu.cpp"
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}

_logger = logging.getLogger(__name__)
_state: dict[str, object] = {"fake_registered": False}


def _capability() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _CAPABILITY_FLAGS else "DEFAULT"


def _build() -> None:
    from torch.utils.cpp_extension import load

    capability = _capability()
    flags = ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    _logger.info("compiling VCA's fused CPU kernel (first use only, 10–30 s)")
    load(
        name=f"vca_patch_attend_cpu_{capability.lower()}",
        sources=[str(_SOURCE)],
        extra_cflags=flags + _CAPABILITY_FLAGS.get(capability, []),
        is_python_module=False,  # the library registers torch.ops.vca_patch.attend_cpu
        verbose=False,
    )
    if not _state["fake_registered"]:  # shapes for torch.compile: the op is an opaque call in a traced graph
        torch.library.register_fake("vca_patch::attend_cpu")(_fake_attend)
        torch.library.register_fake("vca_patch::attend_cpu_into_q")(_fake_attend_into_q)
        torch.library.register_fake("vca_patch::neighbourhood_cpu")(_fake_neighbourhood)
        _state["fake_registered"] = True


def _fake_attend(q: torch.Tensor, *args: object) -> torch.Tensor:
    batch, heads, tokens, head_dim = q.shape
    return q.new_empty(batch, tokens, heads * head_dim)


def _fake_attend_into_q(q: torch.Tensor, *args: object) -> None:
    return None


def _fake_neighbourhood(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_prefix: int, H: int, W: int,
                        *args: object) -> torch.Tensor:  # fmt: skip
    return q.new_empty(q.shape[0], H * W, q.shape[1] * q.shape[3])


_EXTENSION = LazyCppExtension(
    _build,
    ENV_SWITCH,
    what="VCA's fused CPU kernel",
    kernel="fused",
    fallback="composite",
    unavailable="using the composite path, slower on small grids. A C++ compiler and `pip install ninja` enable it;",
)
_reason = failure_reason


@torch.compiler.assume_constant_result  # traced as a constant: no guard on the environment, no graph break
def kernel_available() -> bool:
    """Whether the kernel is (or can now be) loaded; compiles it on the first call. Never raises."""
    return _EXTENSION.available()


def kernel_status() -> str:
    """One line for reports: "fused", "composite (disabled)" or "composite (<why>)". Does not build."""
    return _EXTENSION.status()


def use_kernel(enabled: bool) -> AbstractContextManager[None]:
    """Force the kernel off (or back to the default) inside the block: for tests and A/B benchmarks."""
    return _EXTENSION.use(enabled)


class CpuKernel:
    """The kernel as `VCAHandler.cpu_kernel` hands it to shared code (bench, CLI): the functions above."""

    def available(self) -> bool:
        return kernel_available()

    def status(self) -> str:
        return kernel_status()

    def use(self, enabled: bool) -> AbstractContextManager[None]:
        return use_kernel(enabled)


CPU_KERNEL = CpuKernel()


def _empty_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """An empty batch of well-formed heads: answered here, without the op. Anything else goes to the op, whose
    C++ entry validates every shape, dtype and stride (and also returns an empty batch)."""
    return q.dim() == 4 and q.shape[0] == 0 and k.shape == q.shape and v.shape == q.shape


def attend_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object) -> torch.Tensor:
    """torch.ops.vca_patch.attend_cpu (see the C++ source for the arguments); call `kernel_available()` first.
    An empty batch returns an empty [0, N, C] output, as the composite path does."""
    if _empty_batch(q, k, v):
        _, heads, tokens, head_dim = q.shape
        return q.new_empty(0, tokens, heads * head_dim)
    return torch.ops.vca_patch.attend_cpu(q, k, v, *args)


def attend_cpu_into_q(
    q_tokens: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object
) -> torch.Tensor:
    """`attend_cpu` with o written over q, whose dense [B, N, C] buffer `q_tokens` then holds o and is returned;
    q is its [B, M, N, d] head view. For eager inference, where q is dead after the op: one fresh tensor less."""
    if _empty_batch(q, k, v):
        return q_tokens
    torch.ops.vca_patch.attend_cpu_into_q(q, k, v, *args)
    return q_tokens


def neighbourhood_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_prefix: int,
    H: int,
    W: int,
    kernel: int,
    scale: float,
    q_bias: torch.Tensor | None = None,
    v_bias: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch.ops.vca_patch.neighbourhood_cpu: VCA's local term for float32 inference (q, k, v [B, M, N, d] with a
    unit channel stride) -> [B, H·W, M·d], token-major; call `kernel_available()` first.

    q_bias, v_bias: [M·d] biases not yet added to q and v (k's bias cancels in the softmax), out_scale: a [M·d] gain
    on the result; each is folded into the op, which spares the layer a pass over q and two over the result."""
    return torch.ops.vca_patch.neighbourhood_cpu(q, k, v, num_prefix, H, W, kernel, scale, q_bias, v_bias, out_scale)
