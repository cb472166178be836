"""A plain supervised classifier loop (used to make the stand-in pretrained teachers in examples and tests)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass
class ClassifierTraining:
    """The settings of `train_classifier`."""

    epochs: float = 1.0
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_steps: int = 50
    label_smoothing: float = 0.0
    time_limit_s: float | None = None
    seed: int = 0
    log_every: int = 0


def train_classifier(
    model: nn.Module, dataset: Dataset, settings: ClassifierTraining | None = None, **fields: Any
) -> dict[str, float]:
    """AdamW + warmup-cosine cross-entropy training; stops early at `time_limit_s`. Returns a summary.

    `settings` (or its fields as keywords: epochs=..., lr=..., ...; see `ClassifierTraining`)."""
    o = settings or ClassifierTraining(**fields)
    epochs, batch_size, lr, warmup_steps = o.epochs, o.batch_size, o.lr, o.warmup_steps
    label_smoothing, time_limit_s, log_every = o.label_smoothing, o.time_limit_s, o.log_every
    generator = torch.Generator().manual_seed(o.seed)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)
    total = max(1, int(epochs * len(loader)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=o.weight_decay)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    start, step, loss_value = time.monotonic(), 0, float("nan")
    while step < total:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y, label_smoothing=label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            loss_value = float(loss.detach())
            if log_every and step % log_every == 0:
                print(f"step {step}/{total} loss {loss_value:.4f} {time.monotonic() - start:.0f}s", flush=True)
            if step >= total or (time_limit_s is not None and time.monotonic() - start > time_limit_s):
                total = step
                break
    model.eval()
    return {"steps": step, "final_loss": loss_value, "seconds": time.monotonic() - start}


@torch.no_grad()
def evaluate_top1(model: nn.Module, dataset: Dataset, batch_size: int = 256) -> float:
    """Top-1 accuracy of a classifier on a labelled dataset."""
    model.eval()
    correct = total = 0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        correct += int((model(x).argmax(-1) == y).sum())
        total += len(y)
    return correct / max(1, total)
