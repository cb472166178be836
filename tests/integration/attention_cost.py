"""A tiny model whose softmax attention costs what a large model's does, for tests that time plans."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from timm.models.vision_transformer import Attention


@contextmanager
def quadratic_softmax(monkeypatch: pytest.MonkeyPatch, seconds_at_65_tokens: float = 0.008) -> Iterator[None]:
    """timm's softmax attention made to cost time quadratic in its tokens (8 ms at 65), on one torch thread: a tiny
    model's own time is noise on a busy machine (where two threads also stall on each other), so converted and
    merged blocks time faster every run. The attention's outputs are unchanged."""
    forward = Attention.forward

    def quadratic(self: Attention, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        time.sleep(seconds_at_65_tokens * (x.shape[1] / 65) ** 2)
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(Attention, "forward", quadratic)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
