"""Packed binary Linears: the bit format, the XNOR-popcount CPU kernel, packed checkpoints and their errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import vca_patch
from tests.support.models import tiny, trained_a_little
from vca_patch import DIDBConfig
from vca_patch.bench.binary_linears import compare_binary_linears
from vca_patch.checkpoint import CheckpointError
from vca_patch.surgery import PatchError
from vca_patch.targets.didb import PackedBinaryLinear, is_packed, kernel, pack_binary, set_binarization, unpack_binary
from vca_patch.targets.didb.binary import BinaryWeight, binary_forward
from vca_patch.targets.didb.packed import pack_bits, pack_weight

ODD = [(1, 3, 2), (63, 5, 4), (64, 7, 3), (65, 4, 5), (130, 9, 6), (200, 17, 7)]  # (in, out, rows)


def _signs_with_zeros(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g)
    t[torch.rand(*shape, generator=g) < 0.1] = 0.0  # sign(0) = 0 must count as nothing
    return t


def _popcount_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """n − 2·popcount(x XOR w) over the columns both have nonzero, from the packed bytes, with Python ints."""

    def words(t: torch.Tensor) -> tuple[list[int], list[int]]:
        signs, nonzero = pack_bits(t < 0), pack_bits(t != 0)
        as_int = [lambda row: int.from_bytes(bytes(row.tolist()), "little")]
        return [as_int[0](r) for r in signs], [as_int[0](r) for r in nonzero]

    (xs, xm), (ws, wm) = words(x), words(w)
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float64)
    for r in range(x.shape[0]):
        for o in range(w.shape[0]):
            both = xm[r] & wm[o]
            out[r, o] = bin(both).count("1") - 2 * bin((xs[r] ^ ws[o]) & both).count("1")
    return out


def _kernel() -> None:
    if not kernel.kernel_available():
        if os.environ.get("VCA_PATCH_REQUIRE_CPU_KERNEL") == "1":  # `make test` sets it: no silent skip there
            pytest.fail(f"VCA_PATCH_REQUIRE_CPU_KERNEL=1, but the XNOR kernel is unavailable: {kernel.kernel_status()}")
        pytest.skip(f"the XNOR CPU kernel is not available here: {kernel.kernel_status()}")


@pytest.mark.parametrize(("k", "o", "rows"), ODD)
def test_xnor_popcount_on_packed_bits_equals_the_sign_matmul(k, o, rows):
    x, w = _signs_with_zeros((rows, k), k), _signs_with_zeros((o, k), k + 1)
    expected = torch.sign(x).double() @ torch.sign(w).double().T
    assert torch.equal(_popcount_reference(x, w), expected)  # the bit format itself (no kernel)
    _kernel()
    packed = pack_weight(w)
    one = torch.ones(o)
    got = kernel.xnor_linear(x, packed.words, packed.nonzero, one, None)  # scale 1: the integer dot products
    assert torch.equal(got.double(), expected)
    no_zero = w + (w == 0).float()  # a weight without zeros: no nonzero plane is stored
    assert pack_weight(no_zero).nonzero is None
    got = kernel.xnor_linear(x, pack_weight(no_zero).words, None, one, None)
    assert torch.equal(got.double(), torch.sign(x).double() @ torch.sign(no_zero).double().T)


def test_bit_layout_is_lsb_first_with_zero_padding():
    w = torch.ones(2, 70)
    w[0, 0] = w[0, 9] = w[1, 69] = -1.0
    bits = pack_weight(w).words.view(torch.uint8)
    assert bits.shape == (2, 16)  # two 64-bit words per row
    assert bits[0, :2].tolist() == [0b1, 0b10] and bits[0, 2:].sum() == 0
    assert bits[1, 8].item() == 0b100000 and bits[1].sum() == 0b100000  # column 69 = word 1, bit 5


@pytest.mark.parametrize("has_bias", [True, False])
def test_kernel_matches_the_float_emulation_bit_for_bit_with_scales_and_bias(has_bias):
    _kernel()
    w, x = _signs_with_zeros((37, 150), 3) * 0.1, torch.randn(2, 9, 150) * 2
    bias = torch.randn(37) if has_bias else None
    clip = torch.tensor(0.73)
    emulation = binary_forward(x, BinaryWeight.from_weight(w), bias, clip)
    assert torch.equal(binary_forward(x, pack_weight(w), bias, clip, allow_kernel=True), emulation)
    reference = torch.sign(x).double() @ (w.abs().mean(1, keepdim=True) * torch.sign(w)).double().T * 0.73
    reference = reference + (bias.double() if has_bias else 0)
    torch.testing.assert_close(emulation.double(), reference, atol=2e-5, rtol=1e-5)


def _didb(seed: int = 0, **kwargs) -> tuple[nn.Module, dict]:
    torch.manual_seed(seed)
    model, args = tiny(**kwargs)
    vca_patch.patch_model(model, DIDBConfig())
    trained_a_little(model, "act_clip", "qkv_clip", "proj_clip", "band_weight", "mlp.act.")
    return model.eval(), args


def _count_kernel_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = kernel.xnor_linear

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(kernel, "xnor_linear", counted)
    return calls


def test_packed_model_in_eval_mode_equals_the_float_path(monkeypatch):
    _kernel()
    model, _ = _didb(embed_dim=80, num_heads=2)  # 80 and 320 input columns: not whole 64-bit words
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        reference = model(x)
        pack_binary(model)
        calls = _count_kernel_calls(monkeypatch)
        packed = model(x)
        assert len(calls) == 2 * (3 + 1 + 2)  # per block: v, q/k low, q/k high, proj, fc1, fc2
        with kernel.use_kernel(False):
            emulated = model(x)
    assert is_packed(model) and torch.equal(packed, reference) and torch.equal(emulated, reference)
    assert not [n for n, p in model.blocks.named_parameters() if n.endswith(".weight") and p.dim() == 2]
    model.train()  # training mode: the float emulation, gradients reach the clips, inputs and biases
    model(x).sum().backward()
    assert model.blocks[0].mlp.fc1.act_clip.grad is not None and model.blocks[0].attn.qkv_clip.grad is not None


def test_packed_checkpoint_round_trips_bit_identically(tmp_path):
    model, args = _didb()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        reference = model(x)
    vca_patch.save_pretrained(model, tmp_path / "float", model_args=args)
    vca_patch.save_pretrained(model, tmp_path / "packed", model_args=args, packed=True)
    assert not is_packed(model)  # saving packed leaves the model as it was
    meta = json.loads((tmp_path / "packed" / "config.json").read_text())
    assert meta["packed"] is True
    saved = load_file(tmp_path / "packed" / "model.safetensors")
    key = "blocks.0.mlp.fc1"
    assert saved[f"{key}.weight_signs"].dtype == torch.uint8 and f"{key}.weight" not in saved
    linear_bytes = {
        form: sum(t.numel() * t.element_size() for k, t in load_file(tmp_path / form / "model.safetensors").items()
                  if k.startswith(f"{key}.weight"))
        for form in ("float", "packed")
    }  # fmt: skip
    assert linear_bytes["packed"] * 25 < linear_bytes["float"]  # 192·4 bytes/row -> 24 bytes bits + 4 scale
    loaded = vca_patch.from_pretrained(tmp_path / "packed")
    assert is_packed(loaded)
    pack_binary(model)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with torch.no_grad(), kernel.use_kernel(False):  # the float emulation, bit for bit
        assert torch.equal(loaded(x), reference)
    vca_patch.save_pretrained(loaded, tmp_path / "again", model_args=args)  # a packed model saves packed
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert all(torch.equal(again[k], saved[k]) for k in saved) and set(again) == set(saved)
    with pytest.raises(ValueError, match="packed"):
        vca_patch.save_pretrained(loaded, tmp_path / "float2", model_args=args, packed=False)
    with pytest.raises(PatchError, match="pass model_args="):  # not rebuildable: the usual hint, nothing written
        vca_patch.save_pretrained(loaded, tmp_path / "no_args", packed=True)
    assert not (tmp_path / "no_args").exists()


def test_unpack_gives_trainable_latent_weights_and_unpatch_keeps_binary_weights():
    model, _ = _didb()
    x = torch.randn(1, 3, 64, 64)
    pack_binary(model)
    fc1 = model.blocks[0].mlp.fc1
    dense = fc1.weight
    unpack_binary(model)
    assert not is_packed(model) and isinstance(model.blocks[0].mlp.fc1.weight, nn.Parameter)
    assert torch.equal(model.blocks[0].mlp.fc1.weight, dense)  # α ⊙ sign(W) as the latent weight
    model(x).sum().backward()
    assert model.blocks[0].mlp.fc1.weight.grad is not None
    pack_binary(model)
    qkv = model.blocks[0].attn.qkv.binary_weight()
    vca_patch.unpatch_model(model)  # the originals get the binary weights (real inputs), not stale floats
    attn_qkv = model.blocks[0].attn.qkv
    assert isinstance(attn_qkv, PackedBinaryLinear) and attn_qkv.act_clip is None
    h = torch.randn(3, attn_qkv.in_features)
    assert torch.equal(attn_qkv(h), nn.functional.linear(h, qkv.dense(), attn_qkv.bias))
    assert model(x).isfinite().all()


def test_packing_needs_binarised_weights(tmp_path):
    model, args = _didb()
    set_binarization(model, weights=False)
    with pytest.raises(PatchError, match="weights are not binarised"):
        pack_binary(model)
    with pytest.raises(PatchError, match="weights are not binarised"):
        vca_patch.save_pretrained(model, tmp_path / "p", model_args=args, packed=True)
    assert not (tmp_path / "p").exists()
    set_binarization(model, weights=True)
    pack_binary(model)
    with pytest.raises(PatchError, match="unpack_binary"):
        set_binarization(model, weights=False)


def _corrupt(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("blocks.1.attn.qkv.weight_signs"), "marked packed but has no blocks.1.attn.qkv.weight_signs"),
        (
            lambda t: t.update({"blocks.0.mlp.fc2.weight_signs": t["blocks.0.mlp.fc2.weight_signs"].float()}),
            r"blocks.0.mlp.fc2.weight_signs must be uint8 \[80, 40\]",
        ),
        (
            lambda t: t.update({"blocks.0.mlp.fc1.weight_signs": t["blocks.0.mlp.fc1.weight_signs"][:, :8].clone()}),
            r"must be uint8 \[320, 16\]",
        ),
        (lambda t: t["blocks.0.attn.proj.weight_signs"][:, 15].fill_(255), "bits set past column 80"),
        (lambda t: t["blocks.0.attn.proj.weight_scale"].mul_(-1), "finite, non-negative scales"),
    ],
)
def test_bad_packed_files_give_clear_errors(tmp_path, edit, message):
    model, args = _didb(embed_dim=80, num_heads=2)
    vca_patch.save_pretrained(model, tmp_path / "p", model_args=args, packed=True)
    _corrupt(tmp_path / "p", edit)
    with pytest.raises(CheckpointError, match=message):
        vca_patch.from_pretrained(tmp_path / "p")


def test_a_packed_flag_that_is_not_a_boolean_is_refused(tmp_path):
    model, args = _didb()
    vca_patch.save_pretrained(model, tmp_path / "p", model_args=args, packed=True)
    meta_path = tmp_path / "p" / "config.json"
    meta = json.loads(meta_path.read_text())
    meta["packed"] = "yes"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="packed must be true or false"):
        vca_patch.from_pretrained(tmp_path / "p")
    meta["packed"] = False  # packed tensors read as a float checkpoint: the keys are named
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"(?s)missing keys: blocks.0.attn.qkv.weight,.*unexpected.*weight_scale"):
        vca_patch.from_pretrained(tmp_path / "p")


def test_packed_form_of_a_transformers_vit_with_separate_q_k_v():
    _kernel()
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(hidden_size=40, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=72, image_size=32, patch_size=8)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.ViTModel(config).eval()
    vca_patch.patch_model(model, DIDBConfig())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        reference = model(pixel_values=x).last_hidden_state
        pack_binary(model)
        assert torch.equal(model(pixel_values=x).last_hidden_state, reference)
    assert sum(isinstance(m, PackedBinaryLinear) for m in model.modules()) == 2 * 6  # q, k, v, o, fc1, fc2


def test_bench_comparison_reports_the_three_forms():
    model, _ = _didb()
    result = compare_binary_linears(model, rows=17, repeats=1, warmup=0)
    shapes = {(s["in_features"], s["out_features"]): s["count"] for s in result["shapes"]}
    assert shapes == {(192, 576): 2, (192, 192): 2, (192, 768): 2, (768, 192): 2}
    assert result["kernel_equals_emulation"] is True
    memory = result["total"]["weight_bytes"]
    assert memory["packed xnor"] * 20 < memory["float Linear"] <= memory["float emulation"]
    assert all(v > 0 for v in result["total"]["latency_ms"].values())


def test_the_packed_form_is_a_protocol_shared_code_checks(tmp_path):
    """`save_pretrained(..., packed=True)` asks `isinstance(handler_for(config), PackedForm)`: DIDB's handler
    implements it, VCA's does not and is refused in one line; a handler that gives only part of the protocol is not
    a packer either."""
    from vca_patch.targets.handler import TargetHandler, handler_for
    from vca_patch.targets.protocols import PackedForm

    assert isinstance(handler_for(DIDBConfig), PackedForm)
    assert not isinstance(handler_for(vca_patch.VCAConfig), PackedForm)
    half = type("Half", (TargetHandler,), {"packed_state_dict": lambda self, config, model: {}})()
    assert not isinstance(half, PackedForm)
    model, args = tiny()
    vca_patch.patch_model(model, vca_patch.VCAConfig(contrast_tokens=4))
    with pytest.raises(ValueError, match="target 'vca' has no packed checkpoint form"):
        vca_patch.save_pretrained(model, tmp_path / "packed", model_args=args, packed=True)
    assert not (tmp_path / "packed").exists()
