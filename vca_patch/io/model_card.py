"""The README.md model card written beside a converted checkpoint."""

from __future__ import annotations

from typing import Any

from huggingface_hub import ModelCardData

PAPER = "https://arxiv.org/abs/2511.00833"


def _front_matter(meta: dict[str, Any]) -> str:
    base = meta["base"]
    tags = [
        "vca-patch",
        "vca",
        "visual-contrast-attention",
        "linear-attention",
        "image-classification",
        base["library"],
    ]
    data: dict[str, Any] = {"library_name": "vca-patch", "tags": tags, "pipeline_tag": "image-classification"}
    if base.get("license"):
        data["license"] = base["license"]
    if base.get("hf_hub_id") and meta.get("metadata", {}).get("base_weights") == "pretrained":
        data["base_model"] = base["hf_hub_id"]
        data["base_model_relation"] = "finetune"
    return ModelCardData(**data).to_yaml()


def _fidelity_section(metrics: dict[str, Any] | None) -> str:
    if not metrics:
        return "No fidelity measurement was recorded."
    rows = "\n".join(
        f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |"
        for key, value in metrics.items()
    )
    return f"| metric | value |\n|---|---|\n{rows}"


def _method(config: dict[str, Any]) -> tuple[str, str, str]:
    """(attention name, one-paragraph description, conversion-table rows) of the config's target."""
    if config.get("target") == "mano":
        levels = config["levels"] if config.get("levels") is not None else "auto"
        intro = (
            "[Multipole Attention](https://arxiv.org/abs/2507.02748) (MANO) with\n"
            f"[vca-patch](https://pypi.org/project/vca-patch/). MANO attends within {config['window']}×"
            f"{config['window']} windows on a hierarchy of grids\ncoarsened by {config['rate']} "
            "and combined in a V-cycle, so attention costs O(N·C·(C + k²)) instead of O(N²·C)."
        )
        rows = (
            f"| window k / rate r / levels | {config['window']} / {config['rate']} / {levels} |\n"
            f"| down / up | {config['down']} / {config['up']} |\n"
            f"| prefix tokens | {config['prefix']} |\n"
            f"| initialisation | {config['init']} |"
        )
        return "Multipole Attention", intro, rows
    intro = (
        f"[Visual-Contrast Attention]({PAPER}) (VCA, NeurIPS 2025) with\n"
        f"[vca-patch](https://pypi.org/project/vca-patch/). VCA attends through {config['contrast_tokens']} pooled\n"
        "contrast tokens, so attention costs O(N·n·C) instead of O(N²·C) in the number of tokens N."
    )
    rows = (
        f"| contrast tokens n | {config['contrast_tokens']} |\n"
        f"| Stage-II softmax | {config['softmax']} |\n"
        f"| initialisation | {config['init']} |"
    )
    return "Visual-Contrast Attention", intro, rows


def render_model_card(meta: dict[str, Any]) -> str:
    base, config, layers = meta["base"], meta["config"], meta["layers"]
    extra = meta.get("metadata", {})
    arch = base["architecture"] + (f".{base['pretrained_tag']}" if base.get("pretrained_tag") else "")
    blocks = ", ".join(str(v["layer_index"]) for v in layers.values())
    before, after = meta["params"]["before"], meta["params"]["after"]
    base_line = (
        f"[{base['hf_hub_id']}](https://huggingface.co/{base['hf_hub_id']})"
        if base.get("hf_hub_id") and extra.get("base_weights") == "pretrained"
        else f"`{arch}` ({extra.get('base_weights', 'weights of unknown origin')})"
    )
    method_name, method_intro, method_rows = _method(config)
    return f"""---
{_front_matter(meta)}
---

# {arch} with {method_name}

This is `{arch}` ({base["library"]}) whose softmax self-attention was replaced by
{method_intro}

Base model: {base_line}

## Conversion

| | |
|---|---|
| blocks converted | {len(layers)} ({blocks}) |
{method_rows}
| parameters | {before:,} → {after:,} (+{after - before:,}) |
| vca-patch | {meta["vca_patch_version"]} |

## Fidelity to the original before fine-tuning

{_fidelity_section(extra.get("probe"))}

Conversion alone does not preserve accuracy: fine-tune before relying on this model.

## Usage

```python
# pip install vca-patch
import vca_patch

model = vca_patch.from_pretrained("path/or/repo-id")  # rebuilds {arch}, re-applies VCA, loads weights
```

## Citation

```bibtex
@inproceedings{{pu2025lineardiff,
  title     = {{Linear Differential Vision Transformer: Learning Visual Contrasts via Pairwise Differentials}},
  author    = {{Pu, Yifan and others}},
  booktitle = {{Advances in Neural Information Processing Systems}},
  year      = {{2025}}
}}
```
"""
