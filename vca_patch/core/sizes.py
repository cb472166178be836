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
    estimate: int, what: str, *, device: str = "cpu", available: int | None = None, hint: str = ""
) -> None:
    """Refuse `what` when its estimated activation memory passes the memory free on `device`."""
    label = "available memory"
    if available is None:
        available, label = available_memory(device)
    if available is None or estimate <= available:
        return
    raise SizeError(
        f"{what} needs about {format_bytes(estimate)} of activations, more than the {format_bytes(available)} of "
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


def check_contrast_tokens(n: int, grid: tuple[int, int], option: str = "--contrast-tokens") -> None:
    """Contrast tokens pool the patch grid: more tokens than it has patches would repeat patches instead of
    summarising them (and cost more than they save), so they are refused, naming the largest square that fits."""
    height, width = grid
    patches = height * width
    if n > patches:
        side = min(height, width)
        raise SizeError(
            f"{option} {n} is more than the {height}×{width} patch grid's {patches} patches; pass {option} "
            f"{side * side} ({side}×{side}) or fewer, or a larger --img-size"
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
