"""What `--to llava-sp` would add to a LLaVA model (a dry run, nothing built on real memory), and the projector
section `vca-patch inspect` prints beside the attention sites."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.targets.llava_sp.config import VARIANTS, SpatialTokensConfig
from vca_patch.targets.llava_sp.io import CONFIG_FILE, read_spatial_tokens_config
from vca_patch.targets.llava_sp.model import (
    ANYRES_TYPES,
    SpatialTokensError,
    SpatialTokensReport,
    _build,
    _check_projector,
    _feature_prefix,
    _grid,
    get_spatial_projector,
    image_token_count,
    llava_core,
)


def plan_spatial_tokens(model: nn.Module, config: SpatialTokensConfig | None = None) -> SpatialTokensReport:
    """The report add_spatial_tokens(model, config) would give, without changing the model (the new modules are
    built on the meta device, so CLIP-L's 0.77-0.90 B parameters cost no memory). Raises SpatialTokensError as
    add_spatial_tokens would."""
    config = config or SpatialTokensConfig()
    core = llava_core(model)
    projector = core.multi_modal_projector
    _check_projector(projector)
    grid, prefix = _grid(core), _feature_prefix(core)
    with torch.device("meta"):
        spatial = _build(config, projector.linear_1.in_features, projector.linear_2.out_features, grid)
    before = image_token_count(model)
    return SpatialTokensReport(
        variant=config.variant,
        num_tokens=config.num_tokens,
        grid=grid,
        added_parameters=sum(p.numel() for p in spatial.parameters()),
        image_tokens_before=before,
        image_tokens_after=prefix + grid * grid + config.num_tokens,
    )


def _is_llava_like(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in (*ANYRES_TYPES, "llava") or hasattr(config, "image_grid_pinpoints")


def projector_rows(model: nn.Module, source: str | Path | None = None) -> list[dict[str, Any]] | None:
    """Rows of the projector section for `model` (loaded from `source`): the spatial tokens a saved LLaVA-SP
    folder has, else what each variant would add, else why the model cannot take them; None for a model that is
    not a LLaVA."""
    try:
        core = llava_core(model)
    except SpatialTokensError as exc:
        return [{"module": "multi_modal_projector", "action": f"refuse: {exc}"}] if _is_llava_like(model) else None
    path = "model.multi_modal_projector" if core is not model else "multi_modal_projector"
    folder = Path(source).expanduser() if source is not None else None
    if folder is not None and (folder / CONFIG_FILE).is_file():
        meta = read_spatial_tokens_config(folder)
        config = meta["config"]
        extra = "".join(
            f"; vision tower: {r['config'].get('target', 'vca').upper()} on {len(r['layers'])} layers (saved)"
            for r in meta.get("vision_patch") or []
        )
        return [
            {
                "module": path,
                "variant": config["variant"],
                "tokens": config["num_tokens"],
                "params": meta["parameters"],
                "image_tokens": f"{meta['base_image_tokens']} → {meta['image_tokens']}",
                "action": f"added ({CONFIG_FILE}){extra}",
            }
        ]
    projector = get_spatial_projector(model)
    if projector is not None:
        return [
            {
                "module": path,
                "variant": projector.spatial_config.variant,
                "tokens": projector.num_tokens,
                "params": sum(p.numel() for p in projector.spatial_tokens.parameters()),
                "image_tokens": f"{image_token_count(model) - projector.num_tokens} → {image_token_count(model)}",
                "action": "added",
            }
        ]
    rows = []
    for variant in VARIANTS:
        try:
            report = plan_spatial_tokens(model, SpatialTokensConfig(variant=variant))
        except (SpatialTokensError, ValueError) as exc:
            return [{"module": path, "action": f"refuse: {exc}"}]
        rows.append(
            {
                "module": path,
                "variant": variant,
                "tokens": report.num_tokens,
                "params": report.added_parameters,
                "image_tokens": f"{report.image_tokens_before} → {report.image_tokens_after}",
                "action": f"`--to llava-sp --spatial-variant {variant}` would add (grid {report.grid}×{report.grid})",
            }
        )
    return rows


def projector_table(model: nn.Module, source: str | Path | None = None) -> Any:
    """A rich Table of projector_rows, or None for a model that is not a LLaVA."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    rows = projector_rows(model, source)
    if rows is None:
        return None
    table = Table(
        title="Projector surgery (LLaVA-SP spatial tokens)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    for column, justify in [("module", "left"), ("variant", "left"), ("tokens", "right"), ("+params", "right"),
                            ("image tokens", "right"), ("action", "left")]:  # fmt: skip
        table.add_column(column, justify=justify, overflow="fold")
    for row in rows:
        params = f"{row['params']:,}" if "params" in row else ""
        table.add_row(
            escape(row["module"]), row.get("variant", ""), str(row.get("tokens", "")), params,
            row.get("image_tokens", ""), escape(row["action"]),
        )  # fmt: skip
    return table
