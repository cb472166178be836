"""Which image sizes a dynamic exported program holds for: its shape guards, evaluated at probe sizes.

A branch on the token grid's size inside a traced forward (a layer choosing its cheaper path, a level count)
becomes a guard of the exported program: the reloaded .pt2 refuses the sizes outside it ("Guard failed"), while
ONNX keeps no guards, so onnxruntime runs the traced branch at every size, right or wrong. Probing the guards
tells the export which sizes to check in onnxruntime, and the user where a .pt2 stops."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

PROBE_SIDES = (2, 3, 5, 8, 13, 21, 34)  # patches per side: non-multiples of the usual windows and blocks


@dataclass(frozen=True)
class Refusal:
    """A size (height, width in pixels) the program's guards refuse, and the first failing guard."""

    height: int
    width: int
    guard: str

    @property
    def size(self) -> tuple[int, int]:
        return (self.height, self.width)


def readable(guard: str) -> str:
    """A guard message with the image's batch, height and width named B, H and W."""
    text = re.sub(r"^Guard failed:\s*", "", guard.strip())
    for index, name in ((0, "B"), (2, "H"), (3, "W")):
        text = re.sub(rf"(?:L\['\w+'\]|\w+)\.size\(\)\[{index}\]", name, text)
    return text


class Guards:
    """The shape guards of an exported program, evaluated on meta tensors (no compute). A program without a guard
    function (an older torch) accepts every size."""

    def __init__(self, program: torch.export.ExportedProgram) -> None:
        self._check = getattr(program.module(), "_guards_fn", None)

    def refusal(self, images: torch.Tensor) -> Refusal | None:
        """The first guard that the shape of `images` [B, C, H, W] fails, or None."""
        if self._check is None:
            return None
        try:
            self._check(torch.empty(images.shape, device="meta"))
        except AssertionError as exc:
            return Refusal(int(images.shape[2]), int(images.shape[3]), readable(str(exc)))
        return None

    def probe(self, example: torch.Tensor, patch: tuple[int, int]) -> list[Refusal]:
        """The sizes of PROBE_SIDES patches per side (every pair) that the guards refuse, fewest pixels first."""
        batch, chans = example.shape[:2]
        found = []
        for rows in PROBE_SIDES:
            for cols in PROBE_SIDES:
                refused = self.refusal(torch.empty(batch, chans, rows * patch[0], cols * patch[1], device="meta"))
                if refused is not None:
                    found.append(refused)
        return sorted(found, key=lambda r: (r.height * r.width, r.height))
