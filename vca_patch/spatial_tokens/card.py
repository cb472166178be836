"""The README.md written beside a saved LLaVA-SP model: what was added, what it costs, how to load it."""

from __future__ import annotations

from typing import Any

PAPER = "https://arxiv.org/abs/2507.00505"


def render_card(meta: dict[str, Any]) -> str:
    """Markdown model card from the spatial_tokens.json contents."""
    config = meta["config"]
    grid, n = meta["grid"], config["num_tokens"]
    views = "adaptive average pools" if config["variant"] == "pooling" else "nested centre crops"
    detail = " plus a detail conv read by single-head cross-attention" if config["variant"] == "cropping" else ""
    return f"""---
library_name: transformers
pipeline_tag: image-text-to-text
tags:
- llava
- llava-sp
- vca-patch
---

# LLaVA-SP spatial tokens ({config["variant"]})

This LLaVA model has **{n} visual spatial tokens** ([LLaVA-SP]({PAPER})) in front of its projected patch tokens,
added with `vca_patch.add_spatial_tokens`. Each image now takes **{meta["image_tokens"]}** `<image>` tokens
(was {meta["base_image_tokens"]}). The tokens come from the {grid}×{grid} patch map by {views} with kernel-sized
convolutions (view sides {meta["view_sizes"]}){detail}: **+{meta["parameters"]:,} parameters**.

- `model.safetensors` / `config.json`: the LLaVA model *without* the spatial tokens (its projector as trained
  together with them): plain transformers loads it as an ordinary LLaVA, which is not the trained system.
- `spatial_tokens.safetensors` / `spatial_tokens.json`: the new modules and their settings.

Load the full model with

```python
from vca_patch import load_spatial_tokens
model = load_spatial_tokens("path/to/this/folder")
```

and build prompts with the saved processor (its `num_additional_image_tokens` already counts the {n} tokens),
or `vca_patch.image_token_count(model, processor)`.

Metadata: `{meta.get("metadata") or {}}`
"""
