"""The README.md model card written beside a converted checkpoint, generated from its config.json.

The card is built from config.json: `base` (lineage, license), `config`/`layers`/`params` (what was
converted), `checkpoint_form`/`delta`, and the free-form `metadata` block, whose known keys are:

    metadata = {
      "base_weights": "pretrained" | "local file" | "random",  # where the base weights came from
      "model_name": "deit_tiny_patch16_224",                    # the name the model was built from
      "probe": {"cosine": 0.98, "relative_error": 0.2,          # fidelity right after conversion
                "top1_agreement": 0.75, "max_abs_diff": 1.3},   # (vca_patch.eval.fidelity.compare_outputs)
      "recipe": {"name": "distill-3stage", "images": 1281167,   # the fine-tuning recipe that ran;
                 "stages": [{"name": "attention-transfer", ...}, ...], ...},  # JSON, "name" required
      "metrics": {"dataset": "imagenet-1k", "split": "validation",  # a recipe's metrics.json:
                  "teacher_top1": 0.722, "before_top1": 0.10,       # accuracies as fractions in [0, 1]
                  "after_top1": 0.70, "agreement_after": 0.93},     # (values above 1 read as percent)
      "datasets": ["imagenet-1k"],                              # Hub dataset ids trained on
    }

`recipe_metadata()` builds the recipe part from a recipe dict and a metrics.json; pass the result (merged
with the rest) as `save_pretrained(..., metadata=...)`. `check_metadata()` validates these keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCardData

from vca_patch.families import ADAPTERS
from vca_patch.targets import CONFIG_TYPES, DEFAULT_TARGET
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.handler import handler_for

TASK = "image-classification"
ACCURACY_KEYS = ("teacher_top1", "before_top1", "after_top1", "agreement_after")
_METRIC_LABELS = {
    "teacher_top1": "top-1, original model (teacher)",
    "before_top1": "top-1, converted, before fine-tuning",
    "after_top1": "top-1, after fine-tuning",
    "agreement_after": "top-1 agreement with the original, after fine-tuning",
}
_METRIC_TEXT_KEYS = ("dataset", "split", "dataset_name")
VCA_PATCH_DIST = "vca-patch"  # this package's distribution: its targets and families need no plug-in line
_EXTRAS = {"transformers": "hf", "diffusers": "diffusers"}  # base library -> the vca-patch extra that loads it


def recipe_metadata(
    recipe: dict[str, Any], metrics: dict[str, Any] | str | Path | None = None, datasets: list[str] | None = None
) -> dict[str, Any]:
    """The `recipe`/`metrics`/`datasets` metadata keys, from a recipe dict and a metrics dict or metrics.json."""
    if isinstance(metrics, (str, Path)):
        metrics = json.loads(Path(metrics).read_text())
    out: dict[str, Any] = {"recipe": dict(recipe)}
    if metrics:
        out["metrics"] = dict(metrics)
    datasets = datasets or ([metrics["dataset"]] if metrics and metrics.get("dataset") else None)
    if datasets:
        out["datasets"] = list(datasets)
    check_metadata(out)
    return out


def check_metadata(metadata: dict[str, Any]) -> None:
    """Raise ValueError when a known metadata key has the wrong shape, or the block is not JSON."""
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be JSON-serialisable: {exc}") from exc
    recipe = metadata.get("recipe")
    if recipe is not None and not (isinstance(recipe, dict) and isinstance(recipe.get("name"), str)):
        raise ValueError("metadata['recipe'] must be a dict with a 'name' string")
    for key in ("probe", "metrics"):
        block = metadata.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ValueError(f"metadata[{key!r}] must be a dict of metric name -> number")
        bad = [
            k
            for k, v in block.items()
            if k not in _METRIC_TEXT_KEYS and (isinstance(v, bool) or not isinstance(v, (int, float)))
        ]
        if bad:
            raise ValueError(f"metadata[{key!r}] values must be numbers; not: {', '.join(bad)}")
    datasets = metadata.get("datasets")
    if datasets is not None and not (isinstance(datasets, list) and all(isinstance(d, str) for d in datasets)):
        raise ValueError("metadata['datasets'] must be a list of dataset ids")


def _percent(value: float) -> float:
    return value * 100 if value <= 1 else value


def _arch(base: dict[str, Any]) -> str:
    return base["architecture"] + (f".{base['pretrained_tag']}" if base.get("pretrained_tag") else "")


def _base_model(meta: dict[str, Any]) -> str | None:
    """The Hub id of the base weights, when they are known Hub weights."""
    ref = meta.get("delta", {}).get("base_weights", {})
    if ref.get("hf_hub_id"):
        return ref["hf_hub_id"]
    base = meta["base"]
    if base.get("hf_hub_id") and meta.get("metadata", {}).get("base_weights") == "pretrained":
        return base["hf_hub_id"]
    return None


def _dataset_names(extra: dict[str, Any]) -> list[str]:
    metrics = extra.get("metrics") or {}
    return list(extra.get("datasets") or ([metrics["dataset"]] if metrics.get("dataset") else []))


def _eval_results(extra: dict[str, Any]) -> list[EvalResult]:
    metrics = extra.get("metrics") or {}
    own = "after_top1" if "after_top1" in metrics else "before_top1"
    dataset = metrics.get("dataset") or next(iter(_dataset_names(extra)), None)
    if own not in metrics or not dataset:
        return []
    common = {
        "task_type": TASK,
        "dataset_type": dataset,
        "dataset_name": metrics.get("dataset_name", dataset),
        "dataset_split": metrics.get("split"),
    }
    results = [EvalResult(metric_type="accuracy", metric_value=_percent(metrics[own]), metric_name="top-1", **common)]
    if "agreement_after" in metrics and own == "after_top1":
        results.append(
            EvalResult(
                metric_type="agreement",
                metric_value=_percent(metrics["agreement_after"]),
                metric_name="top-1 agreement with the original",
                **common,
            )
        )
    return results


def _task(base: dict[str, Any]) -> str | None:
    """The card's pipeline tag: the base library's (`ModelLibrary.card_task`, e.g. a diffusion transformer's
    generation task), else image classification."""
    from vca_patch.families import libraries

    library = libraries().get(base["library"])
    return TASK if library is None else library.card_task(base, TASK)


def _front_matter(meta: dict[str, Any], repo_id: str | None) -> str:
    base, extra = meta["base"], meta.get("metadata", {})
    target = meta["config"].get("target", DEFAULT_TARGET)  # config.json without a target: the default one
    method = list(_config_type(target).tags) or [target]
    task = _task(base)
    tags = ["vca-patch", *method, *([task] if task else []), base["library"]]
    data: dict[str, Any] = {"library_name": "vca-patch", "tags": tags}
    if task:
        data["pipeline_tag"] = task
    if base.get("license"):
        data["license"] = base["license"]
    base_model = _base_model(meta)
    if base_model:
        data["base_model"] = base_model
        data["base_model_relation"] = "adapter" if meta.get("checkpoint_form") == "delta" else "finetune"
    if _dataset_names(extra):
        data["datasets"] = _dataset_names(extra)
    results = _eval_results(extra)
    if results:
        data["model_name"] = repo_id or f"{_arch(base)}-{target}"
        data["eval_results"] = results
    return ModelCardData(**data).to_yaml()


def _table(metrics: dict[str, Any], labels: dict[str, str] | None = None) -> str:
    rows = []
    for key, value in metrics.items():
        label = (labels or {}).get(key, key)
        if key in ACCURACY_KEYS and isinstance(value, (int, float)):
            rows.append(f"| {label} | {_percent(value):.2f}% |")
        elif isinstance(value, float):
            rows.append(f"| {label} | {value:.4g} |")
        else:
            rows.append(f"| {label} | {value} |")
    return "| metric | value |\n|---|---|\n" + "\n".join(rows)


def _fidelity_section(probe: dict[str, Any] | None) -> str:
    if not probe:
        return "No fidelity measurement was recorded."
    return (
        "Outputs of the converted model against the original on a fixed probe batch (random images), "
        f"right after conversion:\n\n{_table(probe)}"
    )


def _recipe_section(extra: dict[str, Any]) -> str:
    recipe, metrics = extra.get("recipe"), extra.get("metrics")
    if not recipe and not metrics:
        return (
            "No fine-tuning recipe has been run on this checkpoint. Conversion alone does not preserve "
            "accuracy: fine-tune before relying on this model."
        )
    parts = []
    if recipe:
        parts.append(f"Recipe `{recipe['name']}`:\n\n```json\n{json.dumps(recipe, indent=2)}\n```")
    if metrics:
        where = " / ".join(str(metrics[k]) for k in ("dataset", "split") if metrics.get(k))
        shown = {k: v for k, v in metrics.items() if k not in _METRIC_TEXT_KEYS}
        parts.append(f"Metrics{f' ({where})' if where else ''}:\n\n{_table(shown, _METRIC_LABELS)}")
    return "\n\n".join(parts)


def _form_section(meta: dict[str, Any]) -> str:
    if meta.get("checkpoint_form") != "delta":
        return "This repository holds the merged checkpoint: all weights, in `model.safetensors`."
    delta = meta["delta"]
    ref = delta["base_weights"]
    where = f"`{ref['hf_hub_id']}` at revision `{ref['revision']}`" if "hf_hub_id" in ref else f"`{ref['path']}`"
    return (
        f"This repository holds a delta checkpoint: `delta.safetensors` has only the {delta['added']} new and "
        f"{delta['changed']} changed tensors; the other {delta['reused']} come from the base weights, {where}, "
        "which `from_pretrained` fetches and checks by fingerprint."
    )


def _config_type(target: str) -> type[TargetConfig]:
    """The registered config class of `target`; the base class (generic card text) for an unknown one."""
    return CONFIG_TYPES.get(target, TargetConfig)


def _method(config: dict[str, Any]) -> tuple[str, str, str, str]:
    """(attention name, one-paragraph description, conversion-table rows, BibTeX) of the config's target, from its
    registered config class (its handler's `card_section`, its `citation`); generic text for a target without
    them."""
    cls = _config_type(str(config.get("target", DEFAULT_TARGET)))
    name, intro, rows = handler_for(cls).card_section(cls, config)
    return name, intro, rows, cls.citation or "% no citation recorded for this target"


def _install_line(meta: dict[str, Any]) -> str:
    """The comment that says how to get a vca-patch that loads this checkpoint (vca-patch is not on PyPI: from
    its source tree, with the extra its base library needs, at least the version that wrote it)."""
    extra = _EXTRAS.get(meta["base"].get("library", ""))
    spec = "." + (f"[{extra}]" if extra else "")
    line = f"# needs vca-patch >= {meta['vca_patch_version']}: in its source tree, pip install '{spec}'"
    return "\n".join([line, *_plugin_lines(meta)])


def _plugin_lines(meta: dict[str, Any]) -> list[str]:
    """One comment per plug-in the checkpoint needs (a target or family from another distribution than vca-patch):
    installed, it is found through its entry point, so `from_pretrained` needs no import of it."""
    target = str(meta.get("config", {}).get("target", DEFAULT_TARGET))
    needs = [("target", target, CONFIG_TYPES), ("family", str(meta.get("adapter", "")), ADAPTERS)]
    lines = []
    for kind, name, registry in needs:
        dist = registry.distribution(name) if name in registry else None
        if dist is not None and dist.replace("_", "-").lower() != VCA_PATCH_DIST:
            lines.append(f"# and the plug-in that provides its {kind} {name!r}: pip install {dist}")
    return lines


def _weights_note(meta: dict[str, Any], arch: str) -> str:
    """A warning for a checkpoint converted from random base weights (a demonstration, not a trained model)."""
    if meta.get("metadata", {}).get("base_weights") != "random":
        return ""
    return (
        f"\n> **Random weights.** `{arch}` was built with random weights (`--no-pretrained`) before conversion:\n"
        "> this checkpoint shows the conversion works; it has learned nothing and classifies at chance.\n"
    )


def render_model_card(meta: dict[str, Any], repo_id: str | None = None) -> str:
    """README.md for a checkpoint from its config.json content; `repo_id` fills in the usage snippet."""
    base, config, layers = meta["base"], meta["config"], meta["layers"]
    extra = meta.get("metadata", {})
    random_weights = extra.get("base_weights") == "random"
    arch = base["architecture"] if random_weights else _arch(base)  # a pretrained tag names weights it has not
    blocks = ", ".join(str(v["layer_index"]) for v in layers.values())
    before, after = meta["params"]["before"], meta["params"]["after"]
    base_model = _base_model(meta)
    base_line = (
        f"[{base_model}](https://huggingface.co/{base_model})"
        if base_model
        else f"`{arch}` ({extra.get('base_weights', 'weights of unknown origin')})"
    )
    target = repo_id or "path/or/repo-id"
    timm_usage = (
        f"""
With timm (after `import vca_patch`, which registers the `vca_patch` architecture):

```python
import timm
import vca_patch  # noqa: F401

model = timm.create_model("hf-hub:{target}", pretrained=True)
```
"""
        if base["library"] == "timm" and repo_id
        else ""
    )
    method_name, method_intro, method_rows, citation = _method(config)
    return f"""---
{_front_matter(meta, repo_id)}
---

# {arch}{" (random weights)" if random_weights else ""} with {method_name}
{_weights_note(meta, arch)}
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

{_form_section(meta)}

## Fidelity to the original before fine-tuning

{_fidelity_section(extra.get("probe"))}

## Fine-tuning

{_recipe_section(extra)}

## Usage

```python
{_install_line(meta)}
import vca_patch

model = vca_patch.from_pretrained("{target}")  # rebuilds {arch}, re-applies {method_name}, loads weights
```
{timm_usage}
## Citation

```bibtex
{citation}
```
"""
