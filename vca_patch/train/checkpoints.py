"""Training checkpoints: `Accelerator.save_state` folders (model, optimizer, scheduler, every process's RNG
state) plus the EMA weights and the engine's progress, made visible in one rename; the last few kept.

checkpoints/step_0000100/ holds model.safetensors, optimizer.bin, scheduler.bin, random_states_<rank>.pkl,
ema.safetensors (with EMA) and trainer_state.json. Loading uses safetensors and `torch.load(weights_only=True)`
only, so a checkpoint folder cannot run code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from torch import nn

STATE_NAME = "trainer_state.json"
EMA_NAME = "ema.safetensors"
_NAME = re.compile(r"^step_(\d+)$")


def checkpoint_dir(output: Path) -> Path:
    return Path(output) / "checkpoints"


def save_checkpoint(
    accelerator: Any, output: Path, step: int, state: dict[str, Any], ema: nn.Module | None = None, keep: int = 2
) -> Path:
    """Write checkpoints/step_{step}: every process saves into a hidden folder, the main process renames it into
    place (replacing an older copy of the same step) and prunes checkpoints beyond `keep`."""
    from safetensors.torch import save_model

    folder = checkpoint_dir(output)
    final, tmp = folder / f"step_{step:07d}", folder / f".tmp-step_{step:07d}"
    main = accelerator.is_main_process
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if main:
        if ema is not None:
            save_model(ema, str(tmp / EMA_NAME))
        (tmp / STATE_NAME).write_text(json.dumps(state, indent=1) + "\n")
        old = folder / f".old-step_{step:07d}"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        for stale in list_checkpoints(output)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def trainer_state(path: Path) -> dict[str, Any]:
    """The engine's progress (step counters, evaluations so far) stored in checkpoint `path`."""
    path = Path(path)
    if not (path / STATE_NAME).is_file():
        raise FileNotFoundError(f"{path} is not a complete training checkpoint (no {STATE_NAME})")
    return json.loads((path / STATE_NAME).read_text())


def load_checkpoint(accelerator: Any, path: Path, ema: nn.Module | None = None) -> None:
    """Restore the objects prepared by `accelerator`, every RNG state and the EMA weights from `path`."""
    from safetensors.torch import load_model

    path = Path(path)
    if accelerator.num_processes > 1 and not (path / f"random_states_{accelerator.process_index}.pkl").is_file():
        raise ValueError(
            f"{path} was written by fewer processes than this run's {accelerator.num_processes}: "
            "resume with the same number of processes"
        )
    accelerator.load_state(str(path), load_kwargs={"weights_only": True})
    if ema is not None:
        if not (path / EMA_NAME).is_file():
            raise FileNotFoundError(f"{path} has no EMA weights ({EMA_NAME}) but the recipe uses EMA")
        load_model(ema, str(path / EMA_NAME), device=str(next(ema.parameters()).device))


def list_checkpoints(output: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    folder = checkpoint_dir(output)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and (p / STATE_NAME).exists()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output: Path) -> Path | None:
    found = list_checkpoints(output)
    return found[-1] if found else None
