"""Reading weight files into a model, with errors that name the keys that do not fit."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch
from torch import nn


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


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors from a .safetensors file, or a .pt/.pth/.bin torch checkpoint (loaded weights-only).
    A truncated, corrupt or foreign file raises WeightsFileError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

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
    model.load_state_dict(state_dict, strict=True)
