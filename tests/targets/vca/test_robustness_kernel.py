"""Every fused-kernel entry validates its shapes: an empty batch returns an empty batch (it used to divide by zero,
SIGFPE), and tensors that do not fit raise one clear error instead of reading out of bounds."""

import subprocess
import sys
import textwrap

import pytest
import torch

from tests.support.reference.vca import reference_vca
from tests.support.vca import randomised
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.vca import fused_cpu
from vca_patch.targets.vca.layer import VisualContrastAttention

pytestmark = pytest.mark.skipif(not fused_cpu.kernel_available(), reason=f"kernel: {fused_cpu.kernel_status()}")


def _layer(**options) -> VisualContrastAttention:
    return randomised(VisualContrastAttention(32, 4, contrast_grid=(3, 3), layer_index=2, **options)).eval()


def _heads(batch: int, tokens: int = 50) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(batch, 4, tokens, 8) for _ in range(3))


def test_an_empty_batch_in_a_fresh_interpreter_returns_an_empty_batch():
    """In a subprocess: a regression kills that interpreter (SIGFPE), not the test session."""
    script = textwrap.dedent(
        """
        import torch
        from vca_patch.layers.layout import TokenLayout
        from vca_patch.targets.vca import VisualContrastAttention, fused_cpu
        assert fused_cpu.kernel_available()
        layer = VisualContrastAttention(32, 4, contrast_grid=(3, 3)).eval()
        q, k, v = (torch.randn(0, 4, 50, 8) for _ in range(3))
        with torch.no_grad():
            out = layer(torch.randn(0, 50, 32), layout=TokenLayout(1, (7, 7)))
            raw = torch.ops.vca_patch.attend_cpu(q, k, v, 1, 7, 7, None, None, *layer.kernel_arguments())
        print(tuple(out.shape), tuple(raw.shape))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "(0, 50, 32) (0, 50, 32)"


@pytest.mark.parametrize("qk_norm", [False, True], ids=["into-q", "normed-qk"])  # both of attend_fused's paths
def test_empty_batch_matches_the_composite_path(qk_norm):
    layer = _layer(prefix_readout="exact")
    if qk_norm:
        layer.q_norm, layer.k_norm = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)
    x = torch.randn(0, 50, 32)
    calls = []
    original = fused_cpu.attend_cpu_into_q if not qk_norm else fused_cpu.attend_cpu
    name = original.__name__
    setattr(fused_cpu, name, lambda *a: calls.append(1) or original(*a))
    try:
        with torch.no_grad():
            fused = layer(x, layout=TokenLayout(1, (7, 7)))
    finally:
        setattr(fused_cpu, name, original)
    with torch.no_grad(), fused_cpu.use_kernel(False):
        composite = layer(x, layout=TokenLayout(1, (7, 7)))
    assert calls == [1]  # the kernel's entry ran
    assert fused.shape == composite.shape == (0, 50, 32)


def test_a_nonempty_batch_after_an_empty_one_still_matches_the_float64_reference():
    layer = _layer()
    with torch.no_grad():
        layer(torch.randn(0, 50, 32), layout=TokenLayout(1, (7, 7)))
        x = torch.randn(2, 50, 32)
        got = layer(x, layout=TokenLayout(1, (7, 7)))
    expected = reference_vca(layer, x, 1, (7, 7))
    assert (got.double() - expected).norm() / expected.norm() < 2e-6


def test_the_op_refuses_tensors_that_do_not_fit():
    args = _layer().kernel_arguments()
    q, k, v = _heads(1)
    with pytest.raises(RuntimeError, match=r"tokens \(50\) must be prefix \+ H·W \(2 \+ 7×7\)"):
        torch.ops.vca_patch.attend_cpu(q, k, v, 2, 7, 7, None, None, *args)
    with pytest.raises(RuntimeError, match="q, k and v must have one shape"):
        torch.ops.vca_patch.attend_cpu(q, k, v[:, :, :49], 1, 7, 7, None, None, *args)
    with pytest.raises(RuntimeError, match="embed_pos must be a contiguous float32 CPU tensor of 288 elements"):
        wide = randomised(VisualContrastAttention(64, 8, contrast_grid=(3, 3))).kernel_arguments()
        torch.ops.vca_patch.attend_cpu(q, k, v, 1, 7, 7, None, None, *wide)


def test_the_python_entries_answer_an_empty_batch_and_leave_validation_to_the_op():
    q, k, v = _heads(1)
    with pytest.raises(RuntimeError, match="q, k and v must have one shape"):
        fused_cpu.attend_cpu(q, k, v[:, :, :49], 1, 7, 7, None, None, *_layer().kernel_arguments())
    empty_tokens = torch.randn(0, 50, 32)
    q0 = empty_tokens.view(0, 50, 4, 8).transpose(1, 2)
    _, k0, v0 = _heads(0)
    assert fused_cpu.attend_cpu_into_q(empty_tokens, q0, k0, v0) is empty_tokens
    assert fused_cpu.attend_cpu(q0, k0, v0).shape == (0, 50, 32)
    with pytest.raises(RuntimeError, match="q, k and v must have one shape"):  # an empty batch is checked too
        fused_cpu.attend_cpu(q0, k0, v0[:, :, :49], 1, 7, 7, None, None, *_layer().kernel_arguments())
