"""Reading weight files into a model, with errors that name the keys that do not fit."""

from __future__ import annotations

import pickle
import re
import struct
from pathlib import Path

import torch
from torch import nn

from vca_patch.core.bounded import not_regular
from vca_patch.core.sizes import format_bytes


class WeightsMismatchError(ValueError):
    """A state dict does not fit the model."""


class WeightsFileError(WeightsMismatchError):
    """A weights file that cannot be read at all: truncated, corrupt, or not a weights file."""


def _unreadable(path: Path, kind: str, cause: BaseException) -> WeightsFileError:
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0].split(". ")[0][:160]
    return WeightsFileError(
        f"{path} is not a readable {kind} ({type(cause).__name__}: {reason}): the file is truncated, corrupt or "
        "not a weights file; download or export it again"
    )


MAX_HEADER_BYTES = 100 << 20  # the largest safetensors header safetensors itself reads


def _check_safetensors_header(path: Path) -> None:
    """The 8-byte header length of a safetensors file fits in the file and under MAX_HEADER_BYTES, else a
    WeightsFileError with both numbers (a corrupt length would otherwise be a bare "invalid header length")."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
    if len(head) < 8:
        raise WeightsFileError(
            f"{path} is not a readable safetensors file: it is {size} bytes, shorter than the 8-byte header "
            "length; the file is truncated or not a weights file; download or export it again"
        )
    (claimed,) = struct.unpack("<Q", head)
    if claimed > min(size - 8, MAX_HEADER_BYTES):
        raise WeightsFileError(
            f"{path} is not a readable safetensors file: its header claims {claimed} bytes, but the file holds "
            f"{size - 8} after the length (and a header may hold {format_bytes(MAX_HEADER_BYTES)}); the file is "
            "truncated, corrupt or not a weights file; download or export it again"
        )


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors from a .safetensors file, or a .pt/.pth/.bin torch checkpoint (loaded weights-only).
    A truncated, corrupt or foreign file raises WeightsFileError naming the file."""
    path = Path(path)
    kind = not_regular(path)
    if kind is not None:  # a FIFO would block, a folder is not a file
        raise WeightsFileError(f"weights file {path} is {kind}, not a regular file")
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        _check_safetensors_header(path)
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise _unreadable(path, "safetensors file", exc) from None
    with path.open("rb") as f:
        magic = f.read(2)
    if magic[:2] != b"PK" and magic[:1] != b"\x80":  # neither torch.save's zip nor a (legacy) pickle
        raise _unreadable(path, "torch checkpoint", ValueError(f"it starts with {magic!r}, not a zip or a pickle"))
    try:  # weights-only: a pickle that names any other Python object is refused, never run
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported (?:global|operand)[^.\n]*", str(exc))
        if found is None and "weights_only" not in str(exc).lower():
            raise _unreadable(path, "torch checkpoint", exc) from None
        raise WeightsMismatchError(
            f"{path} is not a weights-only torch checkpoint: it pickles Python objects, which are never loaded "
            f"({found.group(0).strip() if found else 'refused by torch.load(weights_only=True)'}); "
            "save a state dict of tensors, or convert it to .safetensors"
        ) from None
    except (RuntimeError, EOFError, KeyError, ValueError, OSError, IndexError, TypeError) as exc:
        raise _unreadable(path, "torch checkpoint", exc) from None
    for key in ("state_dict", "model", "model_ema"):
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
            break
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise WeightsMismatchError(f"{path} does not hold a state dict of tensors")
    return data


def _listing(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def load_state_dict_checked(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Load strictly; on mismatch raise one error listing missing, unexpected and mis-shaped keys."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    shapes = [
        f"{k} {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or shapes:
        parts = [f"weights from {source} do not fit {type(model).__name__}:"]
        if missing:
            parts.append(f"missing keys: {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_listing(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches: {_listing(shapes)}")
        raise WeightsMismatchError("\n  ".join(parts))
    check_weight_values(model, state_dict, source)
    model.load_state_dict(state_dict, strict=True)


def check_weight_values(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Refuse, naming the tensor, what `load_state_dict` would take silently and the model then computes wrong with:
    a non-floating tensor (int8, bool, complex) where the model holds floats (it would be cast without a word),
    NaN in any floating tensor, and an infinite value in a parameter (buffers such as masks may hold -inf)."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for key, expected in model.state_dict().items():
        given = state_dict[key]
        if expected.is_floating_point() and not given.is_floating_point():
            raise WeightsMismatchError(
                f"weights from {source}: tensor {key} is {str(given.dtype).removeprefix('torch.')}, not floating "
                f"point like the model's {str(expected.dtype).removeprefix('torch.')} (quantized or not weights): "
                "it would be cast without a word; save floating-point weights"
            )
        if given.is_floating_point() and given.numel():
            _check_finite(key, given, key in parameters, source)


def _check_finite(key: str, tensor: torch.Tensor, parameter: bool, source: str) -> None:
    """No NaN in `tensor`, and for a parameter no infinite value either; else a WeightsMismatchError naming it."""
    if bool(torch.isfinite(tensor).all() if parameter else ~torch.isnan(tensor).any()):
        return
    nan = int(torch.isnan(tensor).sum())
    inf = int(torch.isinf(tensor).sum()) if parameter else 0
    if nan or inf:
        found = ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "infinite")) if n)
        raise WeightsMismatchError(
            f"weights from {source}: tensor {key} holds {found} value(s) of {tensor.numel()}: the weights are "
            "corrupt or came from a diverged run; use other weights"
        )
