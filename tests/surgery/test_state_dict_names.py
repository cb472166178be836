"""A patched model keeps its carried weights under their original state-dict keys (timm, transformers, generic),
so deltas hold only new tensors, peft finds q_proj/v_proj by name, and the fused-qkv views follow the layer."""

from __future__ import annotations

import copy
import json

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import vca_patch
from tests.support.custom_models import PlainViT
from vca_patch import MANOConfig, VCAConfig, patch_model, unpatch_model
from vca_patch.layers.fused_qkv import QKVWithSeparateBias, SplitQKV
from vca_patch.surgery import get_patch_state
from vca_patch.targets.vca import fused_cpu

transformers = pytest.importorskip("transformers")

# Top-level names of the members each target adds to a layer; every other key of a patched model is the original's.
NEW_MEMBERS = {
    "vca": {"contrast_embed_pos", "contrast_embed_neg", "stage2_temperature", "lambda1", "lambda2", "stage1_norm"}
    | {"stage2_norm", "dwc", "token_gain"},
    "mano": {"down", "up", "up_gain"},
}
TARGETS = {"vca": VCAConfig(contrast_tokens=4, init="paper"), "mano": MANOConfig(window=2, init="random")}
SMALL_HF = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
    "image_size": 32, "patch_size": 8,
}  # fmt: skip


class NamedAttention(nn.Module):
    """Softmax attention with q/k/v and output Linears under caller-chosen names (generic detection)."""

    def __init__(self, dim: int, heads: int, qkv_names: tuple[str, str, str], out_name: str) -> None:
        super().__init__()
        self.num_heads, self.qkv_names, self.out_name = heads, qkv_names, out_name
        for name in qkv_names:
            setattr(self, name, nn.Linear(dim, dim))
        setattr(self, out_name, nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = (getattr(self, n)(x).view(B, N, self.num_heads, -1).transpose(1, 2) for n in self.qkv_names)
        return getattr(self, self.out_name)(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


class NamedViT(PlainViT):
    def __init__(self, qkv_names: tuple[str, str, str], out_name: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NamedAttention(32, 2, qkv_names, out_name) for _ in range(2))


def _timm(name: str, **kwargs):
    return lambda: timm.create_model(name, pretrained=False, depth=2, **kwargs)


def _hf(config: str, model: str):
    return lambda: getattr(transformers, model)(getattr(transformers, config)(**SMALL_HF))


FAMILIES = {  # name -> (builder, image size, keys of the original that the conversion drops by design)
    "timm-deit": (_timm("deit_tiny_patch16_224", img_size=64), 64, ()),
    "timm-eva02-qv-bias": (_timm("eva02_tiny_patch14_224", img_size=56), 56, ()),
    "timm-eva02-unfused": (_timm("eva02_tiny_patch14_224", img_size=56, qkv_fused=False), 56, ()),
    "timm-vit-qk-norm": (_timm("vit_small_patch16_224", img_size=64, qk_norm=True), 64, ()),
    "timm-beit": (
        _timm("beit_base_patch16_224", img_size=64, embed_dim=64, num_heads=2, use_rel_pos_bias=False),
        64,
        (),
    ),
    "timm-beit-rel-pos": (
        _timm("beit_base_patch16_224", img_size=64, embed_dim=64, num_heads=2),
        64,
        ("blocks.0.attn.relative_position_bias_table", "blocks.1.attn.relative_position_bias_table"),
    ),
    "hf-vit": (_hf("ViTConfig", "ViTModel"), 32, ()),
    "hf-dinov2": (_hf("Dinov2Config", "Dinov2Model"), 32, ()),
    "hf-clip-vision": (_hf("CLIPVisionConfig", "CLIPVisionModel"), 32, ()),
    "hf-siglip-vision": (_hf("SiglipVisionConfig", "SiglipVisionModel"), 32, ()),
    "hf-beit": (_hf("BeitConfig", "BeitModel"), 32, ()),
    "generic-fused": (PlainViT, 32, ()),
    "generic-query-key-value-dense": (lambda: NamedViT(("query", "key", "value"), "dense"), 32, ()),
    "generic-to-q-output": (lambda: NamedViT(("to_q", "to_k", "to_v"), "output"), 32, ()),  # `output`: a VCA method
}
MANO_FAMILIES = ["timm-deit", "timm-eva02-qv-bias", "timm-beit", "hf-vit", "hf-clip-vision", "generic-to-q-output"]
CASES = [(f, "vca") for f in FAMILIES] + [(f, "mano") for f in MANO_FAMILIES]


def _tensor(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.last_hidden_state


def _built(family: str) -> nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[family][0]().eval()
    with torch.no_grad():  # off the init (BEiT's q/v biases start at zero)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _images(family: str, batch: int = 2) -> torch.Tensor:
    size = FAMILIES[family][1]
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def _added_keys(model: nn.Module, target: str) -> set[str]:
    """Keys under a patched layer whose first name there is one the target adds."""
    paths = get_patch_state(model).originals
    return {
        key
        for key in model.state_dict()
        for path in paths
        if key.startswith(path + ".") and key[len(path) + 1 :].split(".")[0] in NEW_MEMBERS[target]
    }


@pytest.mark.parametrize(("family", "target"), CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_patched_keys_are_the_original_keys_plus_the_new_parameters(family, target):
    model = _built(family)
    original = model.state_dict()
    report = patch_model(model, TARGETS[target])
    assert len(report.patched) == 2
    patched = model.state_dict()
    added = _added_keys(model, target)
    parameters = dict(model.named_parameters())  # params_added counts parameters (λ's offset is a buffer)
    added_numel = sum(parameters[k].numel() for k in added if k in parameters)
    dropped_numel = sum(original[k].numel() for k in FAMILIES[family][2])  # counted against the original module
    assert added and added_numel == sum(s.params_added for s in report.patched) + dropped_numel
    assert set(patched) - added == set(original) - set(FAMILIES[family][2])
    for key in set(patched) - added:  # the carried tensors themselves, not copies
        assert patched[key].data_ptr() == original[key].data_ptr() and torch.equal(patched[key], original[key])

    unpatch_model(model)
    restored = model.state_dict()
    assert list(restored) == list(original)
    assert all(restored[k].data_ptr() == v.data_ptr() for k, v in original.items())


@pytest.mark.parametrize(
    ("family", "fused"),
    [("timm-deit", nn.Linear), ("timm-eva02-qv-bias", QKVWithSeparateBias), ("hf-clip-vision", SplitQKV)],
)
def test_layer_qkv_and_proj_read_the_carried_members(family, fused):
    model = _built(family)
    patch_model(model, VCAConfig(contrast_tokens=4))
    for path, original in get_patch_state(model).originals.items():
        layer = model.get_submodule(path)
        assert type(layer.qkv) is fused
        registered = dict(layer.named_children()) | dict(layer.named_parameters(recurse=False))
        assert all(registered[name] is member for name, member in layer.carried_members().items())
        assert layer.proj is (original.out_proj if hasattr(original, "out_proj") else original.proj)
        x = torch.randn(2, 5, layer.qkv.in_features)
        expected = torch.cat([F.linear(x, w, b) for w, b in _qkv_weights(original)], dim=-1)
        torch.testing.assert_close(layer.qkv(x), expected, rtol=0, atol=1e-6)


def _qkv_weights(attn: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of q, k, v straight from an original timm/HF attention module's own attributes."""
    if getattr(attn, "q_proj", None) is not None:  # EVA's fused form sets q_proj = None
        return [(p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    w_q, w_k, w_v = attn.qkv.weight.chunk(3)
    if attn.qkv.bias is not None:
        return list(zip((w_q, w_k, w_v), attn.qkv.bias.chunk(3), strict=True))
    return [(w_q, attn.q_bias), (w_k, None), (w_v, attn.v_bias)]


def test_hf_delta_holds_only_the_new_parameters(tmp_path):
    model = _built("hf-clip-vision")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    save_file(base, str(tmp_path / "base.safetensors"))
    report = patch_model(model, VCAConfig(contrast_tokens=4))
    vca_patch.save_pretrained(model, tmp_path / "delta", form="delta", base_weights=tmp_path / "base.safetensors")

    stored = load_file(str(tmp_path / "delta" / "delta.safetensors"))
    assert set(stored) == _added_keys(model, "vca")
    parameters = dict(model.named_parameters())
    assert sum(t.numel() for k, t in stored.items() if k in parameters) == sum(s.params_added for s in report.patched)
    assert all(stored[k].numel() <= 1 for k in stored if k not in parameters)  # buffers: λ's scalar offsets at most
    info = json.loads((tmp_path / "delta" / "config.json").read_text())["delta"]
    assert (info["added"], info["changed"], info["reused"]) == (len(stored), 0, len(base))

    loaded = vca_patch.from_pretrained(tmp_path / "delta", base_state_dict=base)
    with torch.no_grad():
        assert torch.equal(_tensor(loaded(_images("hf-clip-vision"))), _tensor(model.eval()(_images("hf-clip-vision"))))


def test_peft_finds_and_wraps_q_proj_and_v_proj_of_a_patched_model():
    peft = pytest.importorskip("peft")
    names = {n for n, m in _built("hf-vit").named_modules() if n.endswith(("q_proj", "v_proj"))}
    lora, merged = _built("hf-vit"), _built("hf-vit")  # the same weights
    patch_model(lora, VCAConfig(contrast_tokens=4, init="paper"))
    patch_model(merged, VCAConfig(contrast_tokens=4, init="paper"))
    assert {n for n, m in lora.named_modules() if n.endswith(("q_proj", "v_proj")) and type(m) is nn.Linear} == names

    peft.inject_adapter_in_model(peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]), lora)
    wrapped = {n: m for n, m in lora.named_modules() if isinstance(m, peft.tuners.lora.Linear)}
    assert set(wrapped) == names
    with torch.no_grad():
        for name, module in wrapped.items():  # B starts at 0; a non-zero B makes the adapter count
            module.lora_B["default"].weight.normal_(0, 0.5)
            delta = module.lora_B["default"].weight @ module.lora_A["default"].weight * module.scaling["default"]
            merged.get_submodule(name).weight.add_(delta)
        x = _images("hf-vit")
        out, expected = _tensor(lora(x)), _tensor(merged(x))
    assert (out - expected).abs().max() < 1e-5 * expected.abs().max()  # LoRA runs inside the fused q/k/v view
    assert (out - _tensor(_patched("hf-vit")(x))).abs().max() > 1e-3  # and changes the output


@torch.no_grad()
def _patched(family: str) -> nn.Module:
    model = _built(family)
    patch_model(model, VCAConfig(contrast_tokens=4, init="paper"))
    return model


@pytest.mark.parametrize("family", ["timm-beit", "hf-beit", "timm-eva02-qv-bias"])
def test_views_follow_deepcopy_dtype_conversion_and_assigned_weights(family):
    model = _patched(family)
    x = _images(family)
    with torch.no_grad():
        expected = _tensor(model(x))
        twin = copy.deepcopy(model)
        assert torch.equal(_tensor(twin(x)), expected)
        for path in get_patch_state(model).originals:
            ours, theirs = model.get_submodule(path), twin.get_submodule(path)
            assert all(
                a.data_ptr() != b.data_ptr()
                for a, b in zip(ours.qkv.parameters(), theirs.qkv.parameters(), strict=True)
            )

        torch.__future__.set_overwrite_module_params_on_conversion(True)
        try:
            model.to(torch.float64)  # every parameter replaced by a new Parameter object
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(False)
        assert all(p.dtype == torch.float64 for p in model.parameters())
        torch.testing.assert_close(_tensor(model(x.double())), expected.double(), rtol=0, atol=5e-6)  # err 2e-6

        fresh = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.load_state_dict(fresh, assign=True)
        pointers = {t.data_ptr() for t in fresh.values()}
        for path in get_patch_state(model).originals:
            assert all(p.data_ptr() in pointers for p in model.get_submodule(path).qkv.parameters())
        unpatch_model(model)  # the originals get the assigned tensors back (BEiT's q_bias/v_bias are theirs)
        restored = model.state_dict()
        assert all(restored[k].data_ptr() == fresh[k].data_ptr() for k in restored)


@pytest.mark.skipif(not fused_cpu.kernel_available(), reason=f"kernel: {fused_cpu.kernel_status()}")
@pytest.mark.parametrize("family", ["hf-clip-vision", "timm-beit"])
def test_fused_kernel_runs_on_carried_views_and_steps_aside_for_hooks(family, monkeypatch):
    model = _patched(family)
    calls = []

    def counted(name: str):
        run = getattr(fused_cpu, name)
        return lambda *args: calls.append(name) or run(*args)

    for name in ("attend_cpu", "attend_cpu_into_q"):  # both entries of the fused op
        monkeypatch.setattr(fused_cpu, name, counted(name))
    x = _images(family)
    with torch.no_grad():
        expected = _tensor(model(x))
        assert calls == ["attend_cpu_into_q"] * 2  # plain q/k/v parts: biases folded into the kernel
        layer = model.get_submodule(next(iter(get_patch_state(model).originals)))
        first = layer.qkv.linears()[0]  # q_proj, or BEiT's bias-free qkv
        seen = []
        first.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        out = _tensor(model(x))
    assert len(calls) == 4 and len(seen) == 1  # kernel in both layers; the hooked Linear ran as a module
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
