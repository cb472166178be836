"""The `--to llava-sp` conversion as a function, for the CLI to call: load a LLaVA, add tokens, save."""

from __future__ import annotations

from pathlib import Path

from vca_patch.checkpoint import load_base_model
from vca_patch.core.atomic import check_output_dir
from vca_patch.formats.llava_sp.folder import save_spatial_tokens
from vca_patch.targets.llava_sp.config import SpatialTokensConfig
from vca_patch.targets.llava_sp.model import SpatialTokensReport, add_spatial_tokens


def convert_to_llava_sp(
    model_name: str,
    output: str | Path,
    config: SpatialTokensConfig,
    *,
    pretrained: bool = True,
    overwrite: bool = False,
) -> SpatialTokensReport:
    """Build `model_name` (a transformers LLaVA folder or Hub id), add spatial tokens, save it to `output`.

    The processor is saved alongside (with its image-token count updated) when the source has one.
    """
    check_output_dir(Path(output), overwrite=overwrite)  # before any loading
    model = load_base_model(model_name, pretrained=pretrained).eval()
    report = add_spatial_tokens(model, config)
    processor = None
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_name)
    except (OSError, ValueError, ImportError):
        processor = None  # no processor files: the model alone
    metadata = {"model_name": model_name, "base_weights": "pretrained" if pretrained else "random"}
    save_spatial_tokens(model, output, processor=processor, overwrite=overwrite, metadata=metadata)
    return report
