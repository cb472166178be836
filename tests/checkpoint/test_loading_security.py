"""Hostile config.json files: loading names only model classes and plain options, and follows no written path.

Each hostile checkpoint must fail with an error naming the field, before any model is built, any weights file
is read or fetched, and without writing anything.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import timm
import torch
from huggingface_hub import constants
from safetensors.torch import save_file

import vca_patch
from tests.support.fakehub import FakeHub
from tests.support.hub import point_at
from tests.support.models import tiny
from vca_patch import VCAConfig, patch_model
from vca_patch.checkpoint import delta as delta_module
from vca_patch.checkpoint import folder as checkpoint_module
from vca_patch.checkpoint import load_base_model
from vca_patch.checkpoint.config_guard import (
    UnsafeConfigError,
    check_transformers_config,
    local_name_or_path_removed,
)
from vca_patch.checkpoint.delta import DeltaError
from vca_patch.families.timm.vit import TimmViTAdapter
from vca_patch.families.transformers.vision import HFVisionAdapter

transformers = pytest.importorskip("transformers")

SMALL_HF = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
    "image_size": 32, "patch_size": 8,
}  # fmt: skip


@pytest.fixture(scope="module")
def timm_ckpt(tmp_path_factory) -> Path:
    model, args = tiny()
    patch_model(model, VCAConfig(contrast_tokens=4))
    return vca_patch.save_pretrained(model, tmp_path_factory.mktemp("timm") / "ckpt", model_args=args)


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory) -> Path:
    model = transformers.ViTModel(transformers.ViTConfig(**SMALL_HF)).eval()
    patch_model(model, VCAConfig(contrast_tokens=4))
    return vca_patch.save_pretrained(model, tmp_path_factory.mktemp("hf") / "ckpt")


@pytest.fixture
def nothing_loaded(monkeypatch, tmp_path):
    """Building a model, reading a weights file or touching the Hub cache fails the test; returns a checker."""

    def forbidden(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} was reached for a hostile config.json")

        return fail

    monkeypatch.setattr(TimmViTAdapter, "create_base", classmethod(forbidden("timm create_base")))
    monkeypatch.setattr(HFVisionAdapter, "create_base", classmethod(forbidden("transformers create_base")))
    monkeypatch.setattr(checkpoint_module, "read_state_dict", forbidden("reading the checkpoint weights"))
    monkeypatch.setattr(delta_module, "read_state_dict", forbidden("reading base weights"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path


def _hostile(source: Path, where: Path, edit) -> Path:
    """A copy of checkpoint `source` at `where` with config.json changed by `edit(meta)`."""
    shutil.copytree(source, where)
    meta = json.loads((where / "config.json").read_text())
    edit(meta)
    (where / "config.json").write_text(json.dumps(meta))
    return where


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(folder: Path, root: Path, match: str, error: type[Exception] = UnsafeConfigError) -> None:
    """Loading `folder` raises `error` matching `match`, and nothing under `root` changes."""
    before = _snapshot(root)
    with pytest.raises(error, match=match):
        vca_patch.from_pretrained(folder)
    assert _snapshot(root) == before


# -- class names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["os.system", "__class__", "AutoConfig", "AutoModel", "pipeline", "PreTrainedModel", "ViTConfig", "logging"],
)
def test_transformers_architecture_must_be_an_exported_model_class(hf_ckpt, nothing_loaded, name):
    folder = _hostile(hf_ckpt, nothing_loaded / "c", lambda m: m["base"].update(architecture=name))
    _refused(folder, nothing_loaded, rf"base\.architecture = '{name}' is not allowed: .*PreTrainedModel subclass")


def test_transformers_architecture_must_take_the_config_it_is_given(hf_ckpt, nothing_loaded):
    folder = _hostile(hf_ckpt, nothing_loaded / "c", lambda m: m["base"].update(architecture="Dinov2Model"))
    _refused(folder, nothing_loaded, r"base\.config\.model_type = 'vit'.*Dinov2Model takes a Dinov2Config")


@pytest.mark.parametrize("name", ["os.system", "__class__", "create_model", "not_a_registered_model", "vca_patch"])
def test_timm_architecture_must_be_a_registered_timm_model(timm_ckpt, nothing_loaded, name):
    folder = _hostile(timm_ckpt, nothing_loaded / "c", lambda m: m["base"].update(architecture=name))
    _refused(folder, nothing_loaded, rf"base\.architecture = '{name}' is not allowed: .*registered timm model")
    with pytest.raises(UnsafeConfigError, match=rf"base\.architecture = '{name}'"):  # through timm's entrypoint
        timm.create_model(f"local-dir:{folder}", pretrained=True)


def test_timm_top_level_architecture_must_be_the_vca_patch_entrypoint(timm_ckpt, nothing_loaded):
    folder = _hostile(timm_ckpt, nothing_loaded / "c", lambda m: m.update(architecture="resnet50"))
    _refused(folder, nothing_loaded, r"architecture = 'resnet50' is not allowed: .*names 'vca_patch'")


def test_unknown_adapter_or_mismatched_library_is_refused(timm_ckpt, nothing_loaded):
    folder = _hostile(timm_ckpt, nothing_loaded / "a", lambda m: m.update(adapter="os"))
    _refused(folder, nothing_loaded, r"adapter = 'os' is not allowed: expected one of \[.*'hf-vision'.*'timm-vit'\]")
    folder = _hostile(timm_ckpt, nothing_loaded / "b", lambda m: m["base"].update(library="transformers"))
    _refused(folder, nothing_loaded, r"base\.library = 'transformers'.*timm-vit adapter rebuilds timm models")


# -- timm model_args ------------------------------------------------------------------------------------

FILE_ARGS = [
    ({"checkpoint_path": "/etc/passwd"}, r"checkpoint_path = '/etc/passwd' is not allowed: .*read a file"),
    ({"pretrained_cfg_overlay": {"file": "/etc/passwd"}}, r"pretrained_cfg_overlay = .* is not allowed: .*read a file"),
    ({"pretrained_cfg": {"url": "http://x"}}, r"pretrained_cfg = .* is not allowed"),
    ({"cache_dir": "/tmp"}, r"cache_dir = '/tmp' is not allowed"),
    ({"weights_file": "w.pt"}, r"weights_file = 'w\.pt' is not allowed: .*read a file, URL"),
    ({"norm_layer": "os.system"}, r"norm_layer = 'os\.system' is not allowed: not one of the plain .*img_size"),
    ({"img_size": {"x": 1}}, r"img_size = \{'x': 1\} is not allowed: expected a number, string"),
]


@pytest.mark.parametrize(("extra", "match"), FILE_ARGS, ids=[next(iter(extra)) for extra, _ in FILE_ARGS])
@pytest.mark.parametrize("where", ["base", "top"])
def test_model_args_that_name_files_or_are_not_plain_options_are_refused(
    timm_ckpt, nothing_loaded, extra, match, where
):
    def edit(meta):
        (meta["base"] if where == "base" else meta)["model_args"].update(extra)

    folder = _hostile(timm_ckpt, nothing_loaded / "c", edit)
    field = r"base\.model_args\." if where == "base" else r"(?<!base\.)model_args\."
    _refused(folder, nothing_loaded, field + match)
    # timm passes top-level model_args on to our entrypoint as keywords; the ones timm passes itself it refuses
    timm_own = where == "top" and next(iter(extra)) in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")
    with pytest.raises(TypeError if timm_own else UnsafeConfigError, match="multiple values" if timm_own else match):
        timm.create_model(f"local-dir:{folder}", pretrained=True)


def test_pretrained_cfg_may_not_point_at_weights(timm_ckpt, nothing_loaded):
    folder = _hostile(timm_ckpt, nothing_loaded / "c", lambda m: m["pretrained_cfg"].update(file="/etc/passwd"))
    _refused(folder, nothing_loaded, r"pretrained_cfg\.file = '/etc/passwd' is not allowed")


def test_save_refuses_model_args_that_loading_would_refuse(tmp_path):
    model, args = tiny()
    patch_model(model, VCAConfig(contrast_tokens=4))
    with pytest.raises(UnsafeConfigError, match=r"save_pretrained: base\.model_args\.checkpoint_path"):
        vca_patch.save_pretrained(model, tmp_path / "c", model_args={**args, "checkpoint_path": "/etc/passwd"})
    assert list(tmp_path.iterdir()) == []


def test_load_base_model_takes_only_plain_timm_options(tmp_path):
    with pytest.raises(UnsafeConfigError, match=r"load_base_model: model_args\.checkpoint_path"):
        load_base_model("deit_tiny_patch16_224", pretrained=False, model_args={"checkpoint_path": "/etc/passwd"})
    transformers.ViTModel(transformers.ViTConfig(**SMALL_HF)).save_pretrained(tmp_path / "vit")
    with pytest.raises(ValueError, match="model_args are timm constructor options"):
        load_base_model(str(tmp_path / "vit"), pretrained=False, model_args={"img_size": 64})


def test_img_size_model_arg_builds_dinov2_at_224_and_round_trips(tmp_path):
    model = load_base_model("vit_small_patch14_dinov2", pretrained=False, model_args={"img_size": 224}).eval()
    assert model.patch_embed.grid_size == (16, 16) and model.pos_embed.shape[1] == 1 + 16 * 16
    report = patch_model(model, VCAConfig())
    assert len(report.patched) == 12 and report.layout.grid == (16, 16)
    vca_patch.save_pretrained(model, tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "config.json").read_text())
    assert meta["base"]["architecture"] == "vit_small_patch14_dinov2" and meta["base"]["pretrained_tag"] == "lvd142m"
    assert meta["base"]["model_args"]["img_size"] == [224, 224] == meta["model_args"]["img_size"]
    assert meta["pretrained_cfg"]["input_size"] == [3, 224, 224]
    again = vca_patch.from_pretrained(tmp_path / "c")
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


# -- transformers config --------------------------------------------------------------------------------

HOSTILE_HF = [
    ("auto_map", {"AutoModel": "evil--modeling.Model"}, "custom code"),
    ("trust_remote_code", True, "run code from the Hub"),
    ("attn_implementation", "kernels-community/flash-attn", "no Hub kernels"),
    ("_attn_implementation", "kernels-community/flash-attn", "set attn_implementation instead"),
    ("_name_or_path", "/home/someone/models/vit", "not a local path"),
    ("name_or_path", "./vit", "names a checkpoint"),
    ("use_pretrained_backbone", True, "download backbone weights"),
    ("backbone", "microsoft/resnet-50", "names a checkpoint transformers would load"),
    ("dtype", "load", "torch dtype name"),
    ("torch_dtype", ["float32"], "torch dtype name"),
    ("__dict__", {}, "dunder names"),
    ("index_path", "/data/index.faiss", "name files, folders or URLs"),
    ("quantization_config", {"quant_method": "bitsandbytes"}, "quantizer"),
]


@pytest.mark.parametrize(("key", "value", "why"), HOSTILE_HF)
def test_transformers_config_keys_that_load_code_or_files_are_refused(hf_ckpt, nothing_loaded, key, value, why):
    folder = _hostile(hf_ckpt, nothing_loaded / "c", lambda m: m["base"]["config"].update({key: value}))
    _refused(folder, nothing_loaded, rf"base\.config\.{key} = .* is not allowed: .*{why}")


def test_nested_transformers_configs_are_checked_too(hf_ckpt, nothing_loaded):
    nested = {"model_type": "vit", "auto_map": {"AutoConfig": "evil.Config"}}
    folder = _hostile(hf_ckpt, nothing_loaded / "c", lambda m: m["base"]["config"].update(backbone_config=nested))
    _refused(folder, nothing_loaded, r"base\.config\.backbone_config\.auto_map = ")
    folder = _hostile(hf_ckpt, nothing_loaded / "d", lambda m: m["base"]["config"].update(model_type="evil"))
    _refused(folder, nothing_loaded, r"base\.config\.model_type = 'evil' is not allowed")


@pytest.mark.parametrize(
    "config",
    [
        transformers.ViTConfig(**SMALL_HF),
        transformers.Dinov2Config(**SMALL_HF),
        transformers.BeitConfig(**SMALL_HF),
        transformers.CLIPConfig(),
        transformers.SiglipConfig(),
        transformers.DetrConfig(use_timm_backbone=False, backbone=None),
    ],
    ids=lambda config: type(config).__name__,
)
def test_stock_configs_pass_the_guard(config):
    config._name_or_path = "/home/me/models/local"  # a local folder it was loaded from is blanked on save
    check_transformers_config(local_name_or_path_removed(config.to_dict()), "test")


def test_a_model_loaded_from_a_local_folder_saves_without_its_path(tmp_path):
    transformers.ViTModel(transformers.ViTConfig(**SMALL_HF)).save_pretrained(tmp_path / "vit")
    model = load_base_model(str(tmp_path / "vit"), pretrained=True).eval()
    assert model.config._name_or_path == str(tmp_path / "vit")
    patch_model(model, VCAConfig(contrast_tokens=4))
    vca_patch.save_pretrained(model, tmp_path / "c")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["base"]["config"]["_name_or_path"] == ""
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(vca_patch.from_pretrained(tmp_path / "c")(x).last_hidden_state, model(x).last_hidden_state)


def test_source_config_architecture_must_be_a_model_class(tmp_path):
    transformers.ViTModel(transformers.ViTConfig(**SMALL_HF)).save_pretrained(tmp_path / "vit")
    config = json.loads((tmp_path / "vit" / "config.json").read_text())
    (tmp_path / "vit" / "config.json").write_text(json.dumps({**config, "architectures": ["pipeline"]}))
    with pytest.raises(vca_patch.checkpoint.UnknownModelError, match=r"architectures\[0\] = 'pipeline' is not allowed"):
        load_base_model(str(tmp_path / "vit"), pretrained=False)


# -- delta base weights ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_delta(tmp_path_factory) -> tuple[Path, Path, torch.Tensor]:
    """A delta checkpoint made against a local base file (which exists and is the right base), and its output."""
    root = tmp_path_factory.mktemp("delta")
    model, args = tiny()
    save_file({k: v.clone() for k, v in model.state_dict().items()}, str(root / "base.safetensors"))
    patch_model(model, VCAConfig(contrast_tokens=4))
    vca_patch.save_pretrained(model, root / "d", model_args=args, form="delta", base_weights=root / "base.safetensors")
    with torch.no_grad():
        return root / "d", root / "base.safetensors", model(torch.ones(1, 3, 64, 64))


def test_a_delta_follows_its_recorded_local_path_only_when_the_caller_passes_it(local_delta, tmp_path):
    folder, base, expected = local_delta
    recorded = json.loads((folder / "config.json").read_text())["delta"]["base_weights"]
    assert recorded == {"path": str(base.resolve())}
    with pytest.raises(DeltaError, match=r"not followed\. Pass the base weights yourself: .*base_weights=PATH"):
        vca_patch.from_pretrained(folder)
    with torch.no_grad():
        assert torch.equal(vca_patch.from_pretrained(folder, base_weights=base)(torch.ones(1, 3, 64, 64)), expected)
        assert torch.equal(
            vca_patch.from_pretrained(str(folder), base_weights=str(base))(torch.ones(1, 3, 64, 64)), expected
        )
    merged = _hostile(folder, tmp_path / "m", lambda m: m.update(checkpoint_form="merged"))
    (merged / "model.safetensors").write_bytes((merged / "delta.safetensors").read_bytes())
    with pytest.raises(ValueError, match="base_weights / base_state_dict are for delta checkpoints"):
        vca_patch.from_pretrained(merged, base_weights=base)


def test_a_delta_downloaded_from_the_hub_does_not_follow_an_absolute_path(local_delta, monkeypatch, tmp_path):
    folder, base, _ = local_delta  # base exists here: following it would load silently
    hub = FakeHub().start()
    try:
        point_at(monkeypatch, hub.url, tmp_path / "hf-cache")
        hub.seed("acme/hostile-delta", {p.name: p.read_bytes() for p in folder.iterdir()})
        monkeypatch.setattr(delta_module, "read_state_dict", lambda *a: pytest.fail("the written path was read"))
        with pytest.raises(DeltaError, match=rf"local file {re.escape(str(base.resolve()))}; a path written in"):
            vca_patch.from_pretrained("acme/hostile-delta")
    finally:
        hub.stop()


def test_a_hostile_hub_config_is_refused_before_its_weights_are_fetched(timm_ckpt, monkeypatch, tmp_path):
    folder = _hostile(timm_ckpt, tmp_path / "c", lambda m: m["base"]["model_args"].update(checkpoint_path="/etc/x"))
    hub = FakeHub().start()
    try:
        point_at(monkeypatch, hub.url, tmp_path / "hf-cache")
        hub.seed("acme/hostile", {p.name: p.read_bytes() for p in folder.iterdir()})
        with pytest.raises(UnsafeConfigError, match=r"config\.json of acme/hostile: base\.model_args\.checkpoint_path"):
            vca_patch.from_pretrained("acme/hostile")
        with pytest.raises(UnsafeConfigError, match=r"base\.model_args\.checkpoint_path"):
            timm.create_model("hf-hub:acme/hostile", pretrained=True)
        fetched = {p.rsplit("/", 1)[1] for m, p in hub.log if m == "GET" and "/resolve/" in p}
        assert fetched == {"config.json"}
    finally:
        hub.stop()


BAD_HUB_REFS = [
    ({"hf_hub_id": "../../etc", "revision": "main", "filename": "model.safetensors"}, r"\.hf_hub_id = '\.\./\.\./etc'"),
    ({"hf_hub_id": "/abs/dir", "revision": "main", "filename": "model.safetensors"}, r"\.hf_hub_id = '/abs/dir'"),
    ({"hf_hub_id": "org/name", "revision": "../x", "filename": "model.safetensors"}, r"\.revision = '\.\./x'"),
    ({"hf_hub_id": "org/name", "revision": "main", "filename": "../passwd"}, r"\.filename = '\.\./passwd'"),
    ({"hf_hub_id": "org/name", "revision": "main", "filename": "m.safetensors", "path": "/x"}, r" = \{'hf_hub_id'"),
    ({"path": 3}, r" = \{'path': 3\}"),
]


@pytest.mark.parametrize(
    ("ref", "match"), BAD_HUB_REFS, ids=["dotdot-id", "abs-id", "revision", "filename", "extra-key", "path-type"]
)
def test_a_delta_base_must_be_a_hub_id_at_a_revision(local_delta, nothing_loaded, ref, match):
    folder, _, _ = local_delta
    hostile = _hostile(folder, nothing_loaded / "c", lambda m: m["delta"].update(base_weights=ref))
    _refused(hostile, nothing_loaded, r"config\.json: delta\.base_weights" + match)


# -- pickles ----------------------------------------------------------------------------------------------


class _RunsCode:
    """Unpickling this calls Path.touch(marker): what a hostile .pt file would do with os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_torch_files_load_weights_only_and_never_run_code(tmp_path):
    model, args = tiny()
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({**model.state_dict(), "payload": _RunsCode(marker)}, evil)
    with pytest.raises(vca_patch.checkpoint.WeightsMismatchError, match=r"not a weights-only torch checkpoint.*GLOBAL"):
        load_base_model("deit_tiny_patch16_224", weights=evil, model_args=args)
    patch_model(model, VCAConfig(contrast_tokens=4))
    with pytest.raises(vca_patch.checkpoint.WeightsMismatchError, match="not a weights-only torch checkpoint"):
        vca_patch.save_pretrained(model, tmp_path / "d", model_args=args, form="delta", base_weights=evil)
    assert not marker.exists() and not (tmp_path / "d").exists()
