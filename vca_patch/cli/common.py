"""Shared CLI helpers: consoles, error exits, argument parsing (layers, device, dtype, image size)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape

from vca_patch.cli.narrow import env_console_width, fit_tables, floor_typer_width
from vca_patch.core.sizes import (
    MAX_IMG_SIZE,
    SizeError,
    activation_bytes,
    check_bound,
    check_memory,
)


class StdoutConsole(Console):
    """A console whose width is read at each print: COLUMNS if a positive number, else the terminal's width; piped
    or captured without COLUMNS, 160 columns (no terminal to fit, so tables are not squeezed into rich's default
    80); never below 20. A table too wide for it prints as a listing, one row a line (`cli/narrow.py`)."""

    @property
    def size(self) -> ConsoleDimensions:
        return ConsoleDimensions(env_console_width(self.is_terminal), super().size.height)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        fitted, listed = fit_tables(self, objects)
        super().print(*fitted, **({**kwargs, "soft_wrap": True} if listed else kwargs))


def stdout_console() -> Console:
    """The console commands print to (see `StdoutConsole`)."""
    return StdoutConsole()


console = stdout_console()
err_console = StdoutConsole(stderr=True)  # COLUMNS=0 or 1 must not swallow an error line
floor_typer_width()  # typer's usage errors and --help too

if TYPE_CHECKING:
    import torch
    from torch import nn


DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICE_HELP = "auto (cuda if available, else cpu), cpu, cuda or cuda:N"
DTYPE_HELP = "Parameter dtype: float32, bfloat16 or float16"


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # [hf] is text
    raise typer.Exit(code)


def prepare_cpu_kernel() -> None:
    """Load the targets' fused CPU kernels under a spinner (compiled on the first run), not silently in a first
    forward."""
    from vca_patch.bench.kernels import cpu_kernels

    for name, kernel in cpu_kernels().items():
        if kernel.status() == "fused (not built yet)":
            with console.status(f"Loading {name}'s fused CPU kernel (compiled on the first run, 10–30 s)..."):
                kernel.available()


def parse_layers(spec: str | None) -> list[int] | None:
    """'0-5,8' -> [0, 1, 2, 3, 4, 5, 8]; None or 'all' -> None."""
    if spec is None or spec.strip().lower() == "all":
        return None
    layers: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                start, end = (int(v) for v in part.split("-", 1))
                if start > end:
                    raise ValueError
                layers.update(range(start, end + 1))
            else:
                layers.add(int(part))
        except ValueError:
            raise typer.BadParameter(
                f"{part!r} is not a block index or range; use e.g. '0-5,8'", param_hint="--layers"
            ) from None
    if any(i < 0 for i in layers):
        raise typer.BadParameter("block indices are non-negative", param_hint="--layers")
    return sorted(layers)


def resolve_device(spec: str) -> torch.device:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> a torch.device that exists here; anything else exits with one line."""
    import torch

    spec = spec.strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        fail(f"--device must be {DEVICE_HELP}; got {spec!r}", 2)
    if device.type not in ("cpu", "cuda"):
        fail(f"--device must be {DEVICE_HELP}; got {spec!r}", 2)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            fail(f"--device {spec}: no CUDA GPU is available on this machine (torch {torch.__version__}, {build})", 2)
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            fail(f"--device {spec}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}", 2)
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' -> the torch dtype; anything else exits with one line."""
    import torch

    if name not in DTYPE_NAMES:
        fail(f"--dtype must be one of {', '.join(DTYPE_NAMES)}; got {name!r}", 2)
    return getattr(torch, name)


def img_size_args(img_size: int | None) -> dict[str, Any]:
    """timm `model_args` for --img-size (empty without it); refuses a non-positive size."""
    if img_size is None:
        return {}
    if img_size < 1:
        fail(f"--img-size must be a positive number of pixels, got {img_size}", 2)
    return {"img_size": img_size}


# transformers model types whose position table is interpolated to any input size on every forward
RESIZABLE_TRANSFORMERS = ("dinov2", "dinov2_with_registers")


def check_img_size(net: nn.Module, name: str, img_size: int | None) -> None:
    """A transformers model takes its image size from its config: refuse an --img-size that differs from it, except
    for models that interpolate their position table on every forward (DINOv2), whose config then records it."""
    from vca_patch.checkpoint.base_model import is_transformers_source
    from vca_patch.core.model_io import model_input_size

    if img_size is None or not is_transformers_source(name):
        return
    config = getattr(net, "config", None)
    if getattr(config, "model_type", None) in RESIZABLE_TRANSFORMERS:
        net.vca_patch_input_size = (3, img_size, img_size)  # probed, calibrated, measured at (the config unchanged)
        return
    _, height, width = model_input_size(net)
    if (height, width) != (img_size, img_size):
        fail(
            f"--img-size {img_size}: {name} is a transformers model, whose image size comes from its config "
            f"(image_size={height if height == width else (height, width)}); drop --img-size or pass "
            f"--img-size {height}",
            2,
        )


def _without_given_hint(message: str, *, pretrained: bool, weights: Path | None) -> str:
    """A Hub error's hint, less the options the user already gave (--no-pretrained still needs a Hub config)."""
    hints = ("Use --weights FILE for a local checkpoint, or --no-pretrained for random weights.",
             "use --weights FILE or --no-pretrained")  # fmt: skip
    if pretrained and weights is None:
        return message
    for hint in hints:
        message = message.replace(
            hint,
            "Its architecture itself comes from the Hub, also with --no-pretrained or --weights: pass a local "
            "model folder (with config.json), or a timm model name, instead.",
        )
    return message


def load_base(name: str, *, pretrained: bool, weights: Path | None, img_size: int | None) -> nn.Module:
    """The model to convert or inspect, at --img-size; every expected failure raises one of vca-patch's errors
    (which the CLI's error boundary reports in one line)."""
    from vca_patch.checkpoint import HubUnavailableError, load_base_model
    from vca_patch.checkpoint.base_model import is_transformers_source
    from vca_patch.core.errors import ConfigError

    refuse_checkpoint_input(name)
    model_args = img_size_args(img_size)
    if img_size is not None:  # before a position table of that size is built
        check_bound(img_size, "--img-size", 1, MAX_IMG_SIZE)
    if is_transformers_source(name):
        model_args = {}  # its size is the config's: checked below
    try:
        net = load_base_model(name, pretrained=pretrained, weights=weights, model_args=model_args)
    except HubUnavailableError as exc:  # its hint, less the options already given
        raise HubUnavailableError(_without_given_hint(str(exc), pretrained=pretrained, weights=weights)) from None
    except TypeError as exc:
        if img_size is None or "img_size" not in str(exc):
            raise
        raise ConfigError(f"--img-size: {name} does not take an image size ({exc})") from None
    check_img_size(net, name, img_size)
    return net


def refuse_checkpoint_input(model: str) -> None:
    """MODEL is a folder vca-patch wrote (its config.json has `vca_patch_version` and a `base`): say what it is
    and what to do, instead of failing inside the loader (a converted model is not converted again)."""
    from vca_patch.core.bounded import read_json
    from vca_patch.core.errors import ConfigError

    config = Path(model) / "config.json"
    if not config.is_file():
        return
    meta = read_json(config, "config.json", error=ConfigError)  # bounded: a too-deep or too-large file is refused
    if not isinstance(meta, dict) or not isinstance(meta.get("base"), dict) or "vca_patch_version" not in meta:
        return
    target = (meta.get("config") or {}).get("target", "?") if isinstance(meta.get("config"), dict) else "?"
    base_meta = meta["base"]  # timm: its model name; transformers: its Hub id when it has one
    base = (base_meta.get("architecture") if base_meta.get("library") == "timm" else None) or base_meta.get(
        "hf_hub_id") or base_meta.get("architecture") or "?"  # fmt: skip
    raise ConfigError(
        f"{model} is already a vca-patch checkpoint (target {target}, base model {base}); convert the base model "
        f"again (vca-patch convert {base} ...), or train this one further with vca-patch finetune {model} --recipe ..."
    )


def model_patch(net: nn.Module) -> int | None:
    """The patch side of a model's patch embedding (its first Conv2d's stride), or None."""
    from torch import nn

    conv = next((m for m in net.modules() if isinstance(m, nn.Conv2d)), None)
    return None if conv is None else int(conv.stride[0])


def check_model_sizes(net: nn.Module, config: Any, *, batch: int, device: str = "cpu", what: str = "MODEL") -> Any:
    """Before any forward pass or patching, from the built model's shapes alone: its input holds a whole
    number of patches (at least one), the config's settings fit its patch grid, and a forward pass of `batch`
    images fits this machine's memory (see vca_patch.core.sizes). Returns `config` fitted to the grid by its
    target (`TargetConfig.fit_grid`, the rule `patch_model` applies too): a value the user chose past the grid is
    refused, a default that does not fit a small --img-size is fitted and said in one note line."""
    from vca_patch.core.model_io import model_input_size
    from vca_patch.surgery import inspect_model

    try:
        report = inspect_model(net)
        _, height, width = model_input_size(net)
    except ValueError:  # not a model these checks can read: the conversion's own checks say why
        return config
    layout, patch = report.layout, model_patch(net)
    if layout is None:  # hierarchical: one grid per stage
        return config
    if patch is None or not report.patched:
        return _fitted_to_grid(config, layout.grid)
    if min(height, width) < patch:
        raise SizeError(f"{what} takes {height}×{width} px, less than one {patch}×{patch} patch; use --img-size "
                        f"{patch} or more")  # fmt: skip
    if height % patch or width % patch:  # the patch embedding would drop the pixels past the last whole patch
        side = min(height, width) // patch * patch
        raise SizeError(f"{what} takes {height}×{width} px, not a whole number of {patch}×{patch} patches (the "
                        f"pixels past the last patch would be dropped); use --img-size {side} or "
                        f"{side + patch}")  # fmt: skip
    config = _fitted_to_grid(config, layout.grid)
    grid = layout.grid
    tokens = layout.num_prefix_tokens + grid[0] * grid[1]
    site = report.patched[0]
    estimate = activation_bytes(tokens, site.dim, len(report.patched), batch, heads=site.num_heads)
    check_memory(estimate, f"{what} at {height}×{width} px ({tokens} tokens, batch {batch})", device=str(device),
                 hint="use a smaller --img-size or fewer images at once")  # fmt: skip
    return config


def _fitted_to_grid(config: Any, grid: tuple[int, int]) -> Any:
    """A target config through its `fit_grid` at `grid`, each note printed; anything else as it is."""
    from vca_patch.targets import TargetConfig

    if not isinstance(config, TargetConfig):
        return config
    config, notes = config.fit_grid(tuple(grid))
    for note in notes:
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)
    return config
