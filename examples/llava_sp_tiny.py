"""LLaVA-SP on a tiny random LLaVA (CPU, offline): parameters, tokens, latency, and both training stages.

python examples/llava_sp_tiny.py [--runs 20] [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from vca_patch.targets.llava_sp import (
    SpatialTokensConfig,
    add_spatial_tokens,
    apply_stage2_lora,
    caption_batch,
    image_token_count,
    stage1_parameters,
    stage2_param_groups,
)
from vca_patch.targets.llava_sp.tiny import IMAGE_TOKEN_ID, tiny_llava


def median_ms(models: dict[str, torch.nn.Module], pixels: torch.Tensor, runs: int) -> dict[str, float]:
    """Median forward CPU time (one thread) of each model for one image + a 32-token question; runs interleaved
    and CPU time, not wall time, so that load from other processes distorts the comparison less."""
    inputs = {}
    for name, model in models.items():
        image = torch.full((1, image_token_count(model)), IMAGE_TOKEN_ID)
        inputs[name] = torch.cat([torch.ones(1, 1, dtype=torch.long), image, torch.arange(3, 35).unsqueeze(0)], 1)
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for i in range(runs + 1):
            for name in list(models)[i % len(models) :] + list(models)[: i % len(models)]:
                start = time.process_time()
                models[name](input_ids=inputs[name], pixel_values=pixels)
                if i:  # the first round is a warm-up
                    times[name].append(time.process_time() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def train(model, groups, pixels, captions, steps: int, lr: float) -> list[float]:
    inputs = caption_batch(model, captions, bos_token_id=1)
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(**inputs, pixel_values=pixels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)

    model = tiny_llava()
    pixels = torch.randn(1, 3, 48, 48)
    models, reports = {"base": model}, {}
    for variant in ("pooling", "cropping"):
        models[variant] = copy.deepcopy(model)
        reports[variant] = add_spatial_tokens(models[variant], SpatialTokensConfig(variant=variant))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ms = median_ms(models, pixels, args.runs)
    torch.set_num_threads(threads)
    base_params = sum(p.numel() for p in model.parameters())
    print(f"tiny LLaVA: {base_params:,} parameters, {image_token_count(model)} image tokens, {ms['base']:.2f} ms")
    for variant, report in reports.items():
        print(f"  + {report}; {ms[variant]:.2f} ms ({ms[variant] / ms['base'] - 1:+.1%})")
    print(f"  (CPU ms, 1 thread, forward of 1 image + 32 text tokens, median of {args.runs} interleaved runs)")

    g = torch.Generator().manual_seed(7)
    pixels, captions = torch.randn(4, 3, 48, 48, generator=g), torch.randint(3, IMAGE_TOKEN_ID, (4, 6), generator=g)
    add_spatial_tokens(model, SpatialTokensConfig(variant="pooling"))
    losses = train(model, stage1_parameters(model), pixels, captions, args.steps, 1e-2)
    print(f"stage 1 (projector + spatial tokens): loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps")
    peft_model = apply_stage2_lora(model, r=4, alpha=8, dropout=0.0)
    losses = train(peft_model, stage2_param_groups(peft_model, 1e-2, 1e-3), pixels, captions, args.steps, 1e-2)
    print(f"stage 2 (LoRA on the LM + projector): loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps")


if __name__ == "__main__":
    main()
