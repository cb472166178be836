"""LLaVA-SP's checkpoint format: a transformers LLaVA folder plus spatial_tokens.json and the spatial tokens' weights
(and, when its vision tower is patched, the patch), saved, loaded and converted to; registered with `core.formats`."""

from vca_patch.formats.llava_sp.convert import convert_to_llava_sp
from vca_patch.formats.llava_sp.folder import load_spatial_tokens, save_spatial_tokens
from vca_patch.formats.llava_sp.format import LLAVA_SP_FORMAT, has_spatial_tokens

__all__ = ["LLAVA_SP_FORMAT", "convert_to_llava_sp", "has_spatial_tokens", "load_spatial_tokens", "save_spatial_tokens"]
