"""Recipe schema: recovery recipes are data (YAML), validated into dataclasses.

Unknown keys and wrong types are errors that name the key and list the valid ones.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from vca_patch.core.errors import ConfigError
from vca_patch.core.sizes import MAX_IMG_SIZE
from vca_patch.train import target_keys
from vca_patch.train.diffusion_spec import MAX_SEED, DiffusionSpec, check_diffusion_spec


class RecipeError(ValueError):
    """A recipe file or value is invalid."""


def _flat(data: dict[str, Any]) -> dict[str, Any]:
    """A section's dict with its `options` (the targets' keys) written beside its own keys."""
    data = dict(data)
    return data | data.pop("options")


@dataclass
class DataSpec:
    """Where the images come from.

    kind: "fashion_mnist" (idx files under `path`), "imagefolder" (`path`/train, `path`/val trees)
    or "hf" (a Hugging Face `datasets` name in `path`). `*_limit` keep the first examples.
    """

    kind: Literal["fashion_mnist", "imagefolder", "hf"] = "fashion_mnist"
    path: str | None = None
    train_split: str = "train"
    eval_split: str = "test"
    train_limit: int | None = None
    eval_limit: int | None = 2000
    img_size: int | None = None
    augment: Literal["none", "timm"] = "none"
    mixup: float = 0.0
    cutmix: float = 0.0
    num_workers: int = 0
    image_key: str = "image"
    label_key: str = "label"
    skip_bad_images: bool = False  # an unreadable image file: skipped and counted (default: an error naming it)


@dataclass
class TrainSpec:
    """Loop settings shared by every stage.

    options: the keys registered targets add to this section (`TargetConfig.recipe_options`; written beside the
    others in a recipe, e.g. VCA's `lambda_guard: clamp` and `lambda_max: 0.95`, the λ guard after each update).
    """

    batch_size: int = 64
    grad_accum: int = 1
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    seed: int = 0
    ema_decay: float = 0.0
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    eval_every: int = 100
    eval_images: int = 1000
    log_every: int = 10
    grad_clip: float = 5.0
    options: dict[str, Any] = field(default_factory=dict, metadata={"target_keys": "train"})

    def __post_init__(self) -> None:
        self.options = target_keys.with_defaults("train", self.options)


@dataclass
class StageSpec:
    """One recovery stage.

    kind: "calibrate" (closed-form, no gradient steps), "attention_transfer" (each VCA layer
    reproduces the frozen original attention output on the original's input; normalised MSE) or
    "distill" (end to end from the original model: KL on logits, or feature cosine without a
    head; plus cross-entropy on labels when label_weight > 0) or "distill_diffusion" (a diffusion transformer:
    attention-output, teacher-prediction and own-objective losses per the recipe's `diffusion` section).
    lr: the target's new parameters; carried_lr: q/k/v/proj (0 = frozen);
    rest_lr: everything outside attention (distill only; 0 = frozen).
    train_only: which parameters of each group with a learning rate train: "all", or "norms_and_biases" (BitFit,
    Zaken et al. 2022: norm weights and biases, and every bias; e.g. 61 k of DINOv2-S's 22 M), a change small
    enough that a short run on few photos cannot derail features that are already close (a merge plan's).
    feature_space: what a head-less "distill" stage's feature cosine compares: "raw" final tokens, or
    "standardized": each channel centred and scaled by the teacher's running mean and std (token 0 and the
    other tokens apart), so every channel counts as a linear probe on standardised features sees it, not
    mostly the few large ones shared by all images.
    cls_weight: token 0's share of a head-less "distill" stage's feature loss, the other tokens sharing the rest
    alike (null: every token alike, so token 0 weighs 1/T of it: CLS fidelity then barely drives training).
    target_state: settings of the patch target switched at this stage's start and kept by later stages until one
    changes them (JSON-safe; the target's `apply_stage_state` validates them, e.g. DIDB's
    {"weights": false, "activations": true}); empty: leave the target as it is.
    options: the keys registered targets add to a stage (`TargetConfig.recipe_options`; written beside the others
    in a recipe), e.g. VCA's `lambda_lr`, the learning rate of its "lambda" parameter group (the λ vectors).
    """

    name: str
    kind: Literal["calibrate", "attention_transfer", "distill", "distill_diffusion"]
    steps: int = 0
    lr: float = 3e-3
    carried_lr: float = 0.0
    rest_lr: float = 0.0
    train_only: Literal["all", "norms_and_biases"] = "all"
    weight_decay: float = 0.0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.01
    kd_temperature: float = 1.0
    label_weight: float = 0.0
    feature_space: Literal["raw", "standardized"] = "raw"
    cls_weight: float | None = None
    calibration_images: int = 256
    target_state: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict, metadata={"target_keys": "stage"})

    def __post_init__(self) -> None:
        self.options = target_keys.with_defaults("stage", self.options)


@dataclass
class Recipe:
    """A named, staged recovery recipe with the budget it was designed for."""

    name: str
    stages: list[StageSpec]
    description: str = ""
    budget: str = ""
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    diffusion: DiffusionSpec | None = None  # the latents and losses of distill_diffusion stages

    def to_dict(self) -> dict[str, Any]:
        """The recipe as its file would write it: each section's target keys beside its own."""
        data = dataclasses.asdict(self)
        data["train"] = _flat(data["train"])
        data["stages"] = [_flat(stage) for stage in data["stages"]]
        return data

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages if s.kind != "calibrate")


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


# YAML 1.2 reads `3e-3` and `1e4` as numbers; PyYAML (YAML 1.1) needs a dot (`3.0e-3`) and returns a string.
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _number(value: Any) -> float | None:
    """A finite number from a YAML value (a number, or a string in exponent notation); None for anything else."""
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        options = [a for a in get_args(tp) if a is not type(None)]
        if len(options) == 1 and dataclasses.is_dataclass(options[0]):  # a section or null: the section's own error
            return _convert(value, options[0], where)
        errors = []
        for option in get_args(tp):
            if option is type(None):
                continue
            try:
                return _convert(value, option, where)
            except RecipeError as exc:
                errors.append(str(exc))
        raise RecipeError(f"{where}: expected {' or '.join(_type_name(a) for a in get_args(tp))}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise RecipeError(f"{where}: expected {_type_name(tp)}, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise RecipeError(f"{where}: expected a mapping with string keys, got {value!r}")
        for key, item in value.items():
            _check_json_safe(item, f"{where}.{key}")
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{where}: expected a list, got {value!r}")
        (item,) = get_args(tp)
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is float:
        number = _number(value)
        if number is None:
            raise RecipeError(f"{where}: expected a number, got {value!r}")
        return number
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _number(value) if isinstance(value, str) else None  # `1e4`; never 2.0 or true
        if number is None or number != int(number):
            raise RecipeError(f"{where}: expected an integer, got {value!r}")
        return int(number)
    if tp is bool or tp is str:
        if not isinstance(value, tp):
            raise RecipeError(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def _check_json_safe(value: Any, where: str) -> None:
    """Refuse what JSON/YAML cannot hold as plain data (a recipe is written to metrics.json and checkpoints)."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise RecipeError(f"{where}: expected a finite number, got {value!r}")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_safe(item, f"{where}[{i}]")
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for key, item in value.items():
            _check_json_safe(item, f"{where}.{key}")
        return
    raise RecipeError(
        f"{where}: expected JSON-safe data (null, booleans, numbers, strings, lists, mappings), got {value!r}"
    )


def _build(cls: type, data: Any, where: str) -> Any:
    own = {f.name: f for f in dataclasses.fields(cls) if "target_keys" not in f.metadata}
    section = next((f.metadata["target_keys"] for f in dataclasses.fields(cls) if "target_keys" in f.metadata), None)
    extra = target_keys.declared(section) if section is not None else {}
    valid = sorted({*own, *extra})
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping with keys {[*own, *extra]}")
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise RecipeError(f"{where}: unknown key {unknown[0]!r}; valid keys: {valid}")
    missing = [
        n
        for n, f in own.items()
        if n not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise RecipeError(f"{where}: missing required key {missing[0]!r}; valid keys: {valid}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}") for k, v in data.items() if k in own}
    if section is not None:
        kwargs["options"] = _target_keys(section, {k: v for k, v in data.items() if k in extra}, extra, where)
    return cls(**kwargs)


def _target_keys(section: str, given: dict[str, Any], keys: dict[str, Any], where: str) -> dict[str, Any]:
    """The registered targets' keys given in a section, typed by and validated with their declaring dataclass (the
    section's `__post_init__` adds the others at their defaults, so a recipe records every value it ran with)."""
    values = {k: _convert(v, keys[k].hint, f"{where}.{k}") for k, v in given.items()}
    try:
        target_keys.validate(section, values)
    except ConfigError as exc:  # its message starts with the key
        raise RecipeError(f"{where}.{exc}") from None
    return values


# Largest values a recipe may give: far above any real run, far below what overflows a counter, an ETA or memory.
MAX_STEPS = 10_000_000  # updates of one stage, and step intervals (ImageNet for 300 epochs at batch 256: ~1.5 M)
MAX_BATCH = 65_536  # images per micro-batch
MAX_GRAD_ACCUM = 4096  # micro-batches per update
MAX_IMAGES = 100_000_000  # evaluation and calibration images, examples
MAX_WORKERS = 256  # data loader processes
MAX_KEEP = 1000  # training checkpoints kept
MAX_TEMPERATURE = 100.0  # knowledge-distillation temperature

# (low, high) of each integer key, inclusive
_TRAIN_RANGES = {
    "batch_size": (1, MAX_BATCH), "grad_accum": (1, MAX_GRAD_ACCUM), "seed": (0, MAX_SEED),
    "checkpoint_every": (1, MAX_STEPS), "eval_every": (1, MAX_STEPS), "log_every": (1, MAX_STEPS),
    "keep_checkpoints": (1, MAX_KEEP), "eval_images": (1, MAX_IMAGES),
}  # fmt: skip
_STAGE_RANGES = {"warmup_steps": (0, MAX_STEPS), "calibration_images": (1, MAX_IMAGES)}
_STAGE_NON_NEGATIVE = ("lr", "carried_lr", "rest_lr", "weight_decay", "label_weight")


def _in_range(where: str, value: float, low: float, high: float, note: str = "") -> None:
    """`low <= value <= high`, else a RecipeError naming the key, the range and the value."""
    if not low <= value <= high:
        raise RecipeError(f"{where} must be >= {low} and <= {high}{note}, got {value}")


def _check(recipe: Recipe) -> None:
    """Every section's values within their ranges, and the sections consistent with each other."""
    _check_train(recipe.train)
    if not recipe.stages:
        raise RecipeError("stages: a recipe needs at least one stage")
    names = [s.name for s in recipe.stages]
    if len(set(names)) != len(names):
        raise RecipeError(f"stages: names must be unique, got {names}")
    for i, stage in enumerate(recipe.stages):
        _check_stage(stage, f"stages[{i}]")
    _check_diffusion(recipe)
    _check_data(recipe.data)


def _check_train(t: TrainSpec) -> None:
    """The loop's counts, intervals and seed in range; EMA decay in [0, 1); gradient clipping >= 0 (0: off)."""
    for key, (low, high) in _TRAIN_RANGES.items():
        _in_range(f"train.{key}", getattr(t, key), low, high)
    if not 0.0 <= t.ema_decay < 1.0:
        raise RecipeError(f"train.ema_decay must be in [0, 1), got {t.ema_decay}")
    if t.grad_clip < 0:
        raise RecipeError(f"train.grad_clip must be >= 0 (0: no clipping), got {t.grad_clip}")


def _check_stage(s: StageSpec, where: str) -> None:
    """A stage's step counts, rates, ratios and temperature in range (steps >= 1 unless it only calibrates)."""
    _in_range(f"{where}.steps", s.steps, 0 if s.kind == "calibrate" else 1, MAX_STEPS, f" for a {s.kind} stage")
    for key, (low, high) in _STAGE_RANGES.items():
        _in_range(f"{where}.{key}", getattr(s, key), low, high)
    for key in _STAGE_NON_NEGATIVE:
        if getattr(s, key) < 0:
            raise RecipeError(f"{where}.{key} must be >= 0, got {getattr(s, key)}")
    _in_range(f"{where}.min_lr_ratio", s.min_lr_ratio, 0.0, 1.0, " (the final learning rate over the peak)")
    if not 0.0 < s.kd_temperature <= MAX_TEMPERATURE:
        raise RecipeError(f"{where}.kd_temperature must be > 0 and <= {MAX_TEMPERATURE}, got {s.kd_temperature}")
    if s.cls_weight is not None and not 0.0 <= s.cls_weight <= 1.0:
        raise RecipeError(f"{where}.cls_weight must be in [0, 1] (or null), got {s.cls_weight}")


def _check_diffusion(recipe: Recipe) -> None:
    """distill_diffusion stages and a `diffusion` section come together, and the section is valid."""
    diffusion_stages = [s.name for s in recipe.stages if s.kind == "distill_diffusion"]
    if diffusion_stages and recipe.diffusion is None:
        raise RecipeError(f"stage {diffusion_stages[0]!r} is distill_diffusion: the recipe needs a `diffusion` section")
    if recipe.diffusion is not None:
        other = [s.name for s in recipe.stages if s.kind != "distill_diffusion"]
        problems = check_diffusion_spec(recipe.diffusion)
        if other:
            problems.append(f"stage {other[0]!r}: a recipe with a `diffusion` section takes distill_diffusion stages")
        if problems:
            raise RecipeError(problems[0])


def _check_data(d: DataSpec) -> None:
    """Counts and sizes that make no sense are refused before anything is loaded: example counts of at least 1
    (null: all), an image side of 1 to 16384 px, 0 to MAX_WORKERS workers, mixup and cutmix alphas >= 0."""
    if d.mixup < 0 or d.cutmix < 0:
        raise RecipeError("data.mixup and data.cutmix must be >= 0")
    for key in ("train_limit", "eval_limit"):
        if getattr(d, key) is not None and getattr(d, key) < 1:
            raise RecipeError(f"data.{key} must be >= 1 (or null: every example), got {getattr(d, key)}")
    if d.img_size is not None and not 1 <= d.img_size <= MAX_IMG_SIZE:
        raise RecipeError(f"data.img_size must be from 1 to {MAX_IMG_SIZE} px (or null: the model's), got {d.img_size}")
    _in_range("data.num_workers", d.num_workers, 0, MAX_WORKERS, " (0: load in the main process)")


def recipe_from_dict(data: Any, source: str = "recipe") -> Recipe:
    """Validate a parsed recipe mapping; every error names `source` (the file) and the key."""
    recipe = _build(Recipe, data, source)
    try:
        _check(recipe)
    except RecipeError as exc:
        raise RecipeError(f"{source}: {exc}") from None
    return recipe


MAX_RECIPE_BYTES = 1 << 20  # a recipe file (the shipped ones are under 4 KiB)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a YAML recipe file: a regular file of at most MAX_RECIPE_BYTES, loaded with safe tags and
    bounded aliases and nesting (`core.bounded_yaml`), so no file can hang or exhaust the loader."""
    import yaml

    from vca_patch.core.bounded import read_bounded
    from vca_patch.core.bounded_yaml import YAMLLimitError, bounded_safe_load

    path = Path(path)
    data = read_bounded(path, MAX_RECIPE_BYTES, "recipe file", RecipeError)
    try:
        parsed = bounded_safe_load(data.decode("utf-8"))
    except YAMLLimitError as exc:
        raise RecipeError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path} is not valid YAML: {exc}") from exc
    except UnicodeDecodeError as exc:  # a binary file
        raise RecipeError(f"{path} is not a readable YAML text file ({type(exc).__name__}: {exc})") from exc
    return recipe_from_dict(parsed, path.name)
