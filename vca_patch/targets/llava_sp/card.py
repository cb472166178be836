"""The README.md written beside a saved LLaVA-SP model: what was added, what it costs, how to load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

PAPER = "https://arxiv.org/abs/2507.00505"


def base_model_id(meta: dict[str, Any]) -> str | None:
    """The Hub id of the LLaVA the tokens were added to, when it is one (not a local folder) with its weights."""
    extra = meta.get("metadata") or {}
    name = extra.get("model_name")
    if not isinstance(name, str) or extra.get("base_weights") != "pretrained":
        return None
    name = name.removeprefix("hf-hub:")
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or name.startswith((".", "~")) or Path(name).expanduser().exists():
        return None
    return name


def _front_matter(meta: dict[str, Any]) -> str:
    data: dict[str, Any] = {
        "library_name": "transformers",
        "pipeline_tag": "image-text-to-text",
        "tags": ["llava", "llava-sp", f"llava-sp-{meta['config']['variant']}", "vca-patch"],
    }
    if meta.get("vision_patch"):
        data["tags"].append("vca" if meta["vision_patch"][0]["config"].get("target") == "vca" else "mano")
    base = base_model_id(meta)
    if base:
        data["base_model"] = base
        data["base_model_relation"] = "finetune"
    return yaml.safe_dump(data, sort_keys=False).strip()


def _vision_patch_lines(meta: dict[str, Any]) -> str:
    lines = []
    for record in meta.get("vision_patch") or []:
        target = record["config"].get("target", "vca").upper()
        where = record["path"] or "the model"
        lines.append(
            f"- The vision tower's softmax attention is also converted to {target} ({len(record['layers'])} layers "
            f"under `{where}`): their new tensors are in `vision_patch.safetensors`; vca-patch re-applies the "
            "patch on load (plain transformers loads softmax attention and reports those tensors as unexpected)."
        )
    return "\n".join(lines)


def render_card(meta: dict[str, Any], repo_id: str | None = None) -> str:
    """Markdown model card from the spatial_tokens.json contents; `repo_id` fills in the usage snippet."""
    config = meta["config"]
    grid, n = meta["grid"], config["num_tokens"]
    views = "adaptive average pools" if config["variant"] == "pooling" else "nested centre crops"
    detail = " plus a detail conv read by single-head cross-attention" if config["variant"] == "cropping" else ""
    base = base_model_id(meta)
    extra = meta.get("metadata") or {}
    if base:
        base_line = f"Base model: [{base}](https://huggingface.co/{base})."
    else:
        origin = extra.get("base_weights", "weights of unknown origin")
        base_line = f"Base model: `{extra.get('model_name', 'a LLaVA model')}` ({origin} weights)."
    target = repo_id or "path/or/repo-id"
    vision = _vision_patch_lines(meta)
    return f"""---
{_front_matter(meta)}
---

# LLaVA-SP spatial tokens ({config["variant"]})

This LLaVA model has **{n} visual spatial tokens** ([LLaVA-SP]({PAPER})) in front of its projected patch tokens,
added with `vca_patch.add_spatial_tokens`. Each image now takes **{meta["image_tokens"]}** `<image>` tokens
(was {meta["base_image_tokens"]}). The tokens come from the {grid}×{grid} patch map by {views} with kernel-sized
convolutions (view sides {meta["view_sizes"]}){detail}: **+{meta["parameters"]:,} parameters**.

{base_line}

| | |
|---|---|
| variant | {config["variant"]} |
| spatial tokens | {n} |
| new parameters | {meta["parameters"]:,} |
| image tokens per image | {meta["base_image_tokens"]} → {meta["image_tokens"]} |

- `model.safetensors` / `config.json`: the LLaVA model *without* the spatial tokens (its projector as trained
  together with them): plain transformers loads it as an ordinary LLaVA, which is not the trained system.
- `spatial_tokens.safetensors` / `spatial_tokens.json`: the new modules and their settings.
{vision}

Load the full model with

```python
# needs vca-patch (from its clone: pip install -e '.[llava-sp]')
import vca_patch
from transformers import AutoProcessor

model = vca_patch.from_pretrained("{target}")  # the LLaVA, then its spatial tokens with their weights
processor = AutoProcessor.from_pretrained("{target}")
```

and build prompts with the saved processor (its `num_additional_image_tokens` already counts the {n} tokens),
or `vca_patch.image_token_count(model, processor)`.

Metadata: `{extra}`
"""
