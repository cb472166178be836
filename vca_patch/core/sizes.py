"""Sizes checked from shapes alone, before any work: image sizes against a model's patch and position table,
contrast tokens against its patch grid, config sizes against sane bounds, and an estimate of the activation
memory a forward pass needs against the memory this machine has free.

The memory estimate is deliberately simple (an order of magnitude, stated in the error with the limit):

    bytes = dtype_bytes × batch × (TENSORS_PER_BLOCK × tokens × width × depth + heads × tokens²)

the first term is what the blocks' activations hold (input, q/k/v and the MLP's share, per block), the second
one block's softmax attention matrix (0 heads for attention that never forms it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vca_patch.core.errors import ConfigError

MAX_IMG_SIZE = 16384  # pixels a side: --img-size, bench resolutions, config.json and recipe image sizes
MAX_DEPTH = 256  # blocks
MAX_WIDTH = 16384  # embedding width (embed_dim / hidden_size)
MAX_HEADS = 1024
TENSORS_PER_BLOCK = 4  # activations of width `width` each token keeps per block (estimate)


class SizeError(ConfigError):
    """A size (image, tokens, depth, width, memory) the model or this machine cannot take; nothing was done."""


def activation_bytes(
    tokens: int, width: int, depth: int, batch: int = 1, *, heads: int = 0, dtype_bytes: int = 4
) -> int:
    """Estimated activation memory of a forward pass (see the module's docstring for the formula)."""
    values = TENSORS_PER_BLOCK * tokens * width * depth + heads * tokens * tokens
    return int(dtype_bytes) * int(batch) * int(values)


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(count) < 1024 or unit == "PiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError  # unreachable


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(device: str = "cpu") -> tuple[int | None, str]:
    """(bytes free for activations, what they are): free CUDA memory on a CUDA device, else the machine's
    available memory (psutil when installed, else /proc/meminfo); None when it cannot be told."""
    if str(device).startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"free memory on {device}"
    try:
        import psutil
    except ImportError:
        return _meminfo_available(), "available memory"
    return int(psutil.virtual_memory().available), "available memory"


def check_memory(
    estimate: int,
    what: str,
    *,
    device: str = "cpu",
    available: int | None = None,
    hint: str = "",
    of: str = "activations",
) -> None:
    """Refuse `what` when its estimated memory (`of` activations, or weights) passes the memory free on `device`."""
    label = "available memory"
    if available is None:
        available, label = available_memory(device)
    if available is None or estimate <= available:
        return
    raise SizeError(
        f"{what} needs about {format_bytes(estimate)} of {of}, more than the {format_bytes(available)} of "
        f"{label} here{'; ' + hint if hint else ''}"
    )


def check_bound(value: int, name: str, low: int, high: int) -> None:
    """`low <= value <= high`, or a SizeError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SizeError(f"{name} must be an integer from {low} to {high}, got {value!r}")


def check_image_size(
    size: int, option: str, *, patch: int | None = None, max_size: int | None = None, dynamic: bool = False
) -> None:
    """An image side: at least one patch, a whole number of patches, at most the position table's `max_size`
    (unless the model interpolates it: `dynamic`) and at most MAX_IMG_SIZE."""
    check_bound(size, option, 1, MAX_IMG_SIZE)
    if patch is None:
        return
    if size < patch:
        raise SizeError(f"{option} {size}: an image must hold at least one {patch}×{patch} patch; use {patch} or more")
    if size % patch:
        near = max(patch, round(size / patch) * patch)
        raise SizeError(f"{option} {size} px is not a multiple of the patch size {patch}; use e.g. {near}")
    if max_size is not None and not dynamic and size > max_size:
        raise SizeError(
            f"{option} {size} px is more than the model's position table covers ({max_size} px); build it at that "
            f"size (--img-size) or use {max_size} or less"
        )


def check_contrast_tokens(n: int, grid: tuple[int, int], option: str = "contrast_tokens (--contrast-tokens)") -> None:
    """Contrast tokens pool the patch grid: more tokens than it has patches would repeat patches instead of
    summarising them (and cost more than they save), so they are refused, naming the largest square that fits."""
    height, width = grid
    patches = height * width
    if n > patches:
        side = min(height, width)
        raise SizeError(
            f"{option} {n} is more than the {height}×{width} patch grid's {patches} patches; use "
            f"{side * side} ({side}×{side}) or fewer, or a larger image size (--img-size)"
        )


# config.json sizes (timm model_args and transformers config keys) and their largest sane value
CONFIG_SIZE_BOUNDS = {
    "depth": MAX_DEPTH, "depths": MAX_DEPTH, "num_hidden_layers": MAX_DEPTH,
    "embed_dim": MAX_WIDTH, "embed_dims": MAX_WIDTH, "hidden_size": MAX_WIDTH, "hidden_sizes": MAX_WIDTH,
    "intermediate_size": 16 * MAX_WIDTH,
    "img_size": MAX_IMG_SIZE, "image_size": MAX_IMG_SIZE, "patch_size": MAX_IMG_SIZE,
    "num_heads": MAX_HEADS, "num_attention_heads": MAX_HEADS,
}  # fmt: skip


def config_size_problem(key: str, value: object) -> str | None:
    """Why a config.json size option is out of bounds (see CONFIG_SIZE_BOUNDS), or None when it is not one or
    is fine: each value (or each item of a list) an integer from 1 to the key's bound."""
    high = CONFIG_SIZE_BOUNDS.get(key)
    if high is None or value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    if all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= high for v in items):
        return None
    return f"expected {'integers' if isinstance(value, (list, tuple)) else 'an integer'} from 1 to {high}"


# A model config's keys for its width, depth, image side, patch side and heads (transformers' names, then timm's).
_WIDTH_KEYS = ("hidden_size", "embed_dim")
_DEPTH_KEYS = ("num_hidden_layers", "depth")
_IMAGE_KEYS = ("image_size", "img_size")
_HEAD_KEYS = ("num_attention_heads", "num_heads")
_LABEL_MAPS = ("id2label", "label2id")  # free-form label names, not sizes
WEIGHT_BYTES = 4  # float32, as a model is built


def config_sections(config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(field prefix, mapping) of `config` and of every config nested in it (`vision_config.`, ...), found
    iteratively so that no nesting exhausts the stack."""
    found, stack = [], [("", config)]
    while stack:
        prefix, section = stack.pop()
        found.append((prefix, section))
        for key, value in section.items():
            if isinstance(value, dict) and key not in _LABEL_MAPS:
                stack.append((f"{prefix}{key}.", value))
    return found


def _first_int(section: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, int] | None:
    """(key, value) of the first of `keys` that `section` sets to an integer; None when none does."""
    for key in keys:
        value = section.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return None


def _sides(value: Any) -> tuple[int, int] | None:
    """(height, width) of a size given as N or [H, W]; None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def _check_section(section: dict[str, Any], where: str, prefix: str) -> None:
    """One (sub)config: each size within CONFIG_SIZE_BOUNDS, the patch no larger than the image, and the heads
    dividing the width (each head takes an equal share of it)."""
    for key, value in section.items():
        problem = config_size_problem(key, value)
        if problem:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise SizeError(f"{where}: {prefix}{key} = {shown} is out of bounds: {problem}")
    image_key = next((k for k in _IMAGE_KEYS if k in section), None)
    image, patch = _sides(section.get(image_key)), _sides(section.get("patch_size"))
    if image and patch and (patch[0] > image[0] or patch[1] > image[1]):
        raise SizeError(
            f"{where}: {prefix}patch_size = {section['patch_size']!r} is larger than {prefix}{image_key} = "
            f"{section[image_key]!r}: an image must hold at least one patch"
        )
    width, heads = _first_int(section, _WIDTH_KEYS), _first_int(section, _HEAD_KEYS)
    if width and heads and width[1] % heads[1]:
        raise SizeError(
            f"{where}: {prefix}{heads[0]} = {heads[1]} does not divide {prefix}{width[0]} = {width[1]}: each "
            "attention head takes an equal share of the width"
        )


def weight_bytes(section: dict[str, Any]) -> int:
    """A lower estimate of the float32 weights one (sub)config builds: its position table (one row of `width` per
    patch of the image) and `depth` blocks of 12·width² (attention 4·width², MLP 8·width²); 0 for what it does
    not say."""
    width, depth = _first_int(section, _WIDTH_KEYS), _first_int(section, _DEPTH_KEYS)
    image_key = next((k for k in _IMAGE_KEYS if k in section), None)
    image, patch = _sides(section.get(image_key)), _sides(section.get("patch_size"))
    if width is None:
        return 0
    values = 12 * width[1] ** 2 * depth[1] if depth else 0
    if image and patch and patch[0] and patch[1]:
        values += (image[0] // patch[0]) * (image[1] // patch[1]) * width[1]
    return WEIGHT_BYTES * values


def check_model_config(config: dict[str, Any], where: str, *, field: str = "", available: int | None = None) -> None:
    """Refuse (a SizeError naming `where` and the field) a model config that no model is built from: a size out
    of CONFIG_SIZE_BOUNDS, a patch larger than the image, heads that do not divide the width (in the config and
    each nested one), or weights (`weight_bytes`) larger than the memory available here. Checked before the model
    is built, so a config.json asking for a 65536 px position table is one line, not an out-of-memory kill.
    `field` prefixes the fields named (e.g. "base.model_args." for a checkpoint's)."""
    sections = config_sections(config)
    for prefix, section in sections:
        _check_section(section, where, field + prefix)
    estimate = sum(weight_bytes(section) for _, section in sections)
    check_memory(estimate, f"the model of {where}", available=available, of="weights",
                 hint="its config asks for a larger model than this machine holds")  # fmt: skip
