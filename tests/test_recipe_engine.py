"""The recipe engine: stage-1 transfer, resume, NaN stop, two processes, published checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vca_patch
from tests.recovery_helpers import TINY_ARGS, needs_fashion_mnist, probe_images, trained_tiny_vit
from vca_patch.fidelity import fidelity
from vca_patch.io.checkpoint import read_checkpoint_config
from vca_patch.recovery import calibrate
from vca_patch.train import TrainingDiverged, finetune, recipe_from_dict, run_recipe, teacher_from
from vca_patch.train import engine as engine_module
from vca_patch.train.checkpoints import list_checkpoints

pytestmark = needs_fashion_mnist
ROOT = Path(__file__).resolve().parents[1]


def _recipe(transfer: int = 4, distill: int = 4, **train) -> dict:
    return {
        "name": "tiny",
        "budget": "CPU, seconds",
        "data": {"kind": "fashion_mnist", "train_limit": 256, "eval_limit": 64},
        "train": {"batch_size": 16, "eval_every": 4, "checkpoint_every": 2, "eval_images": 64, **train},
        "stages": [
            {"name": "transfer", "kind": "attention_transfer", "steps": transfer, "lr": 3e-3, "warmup_steps": 1},
            {
                "name": "distill",
                "kind": "distill",
                "steps": distill,
                "lr": 1e-3,
                "carried_lr": 1e-4,
                "label_weight": 0.1,
            },
        ],
    }


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A calibrated conversion of the tiny trained teacher, saved as a checkpoint folder."""
    model = trained_tiny_vit()
    vca_patch.patch_model(model, vca_patch.VCAConfig(contrast_tokens=4, prefix_readout="exact"))
    calibrate(model, [probe_images(64, "train")])
    path = tmp_path_factory.mktemp("converted") / "ck"
    vca_patch.save_pretrained(model, path, model_args=TINY_ARGS, metadata={"base_weights": "local file"})
    return path


def _datasets():
    from vca_patch.data import load_fashion_mnist

    return load_fashion_mnist("train", limit=256), load_fashion_mnist("test", limit=64)


def test_short_attention_transfer_lowers_per_layer_error(tmp_path):
    model = trained_tiny_vit()
    vca_patch.patch_model(model, vca_patch.VCAConfig(contrast_tokens=4))
    calibrate(model, [probe_images(64, "train")], temperature=False, dwc=False)
    teacher = teacher_from(model)
    probe = [probe_images(64)]
    before = fidelity(teacher, model, probe).layer_error
    train, _ = _datasets()
    spec = recipe_from_dict({**_recipe(transfer=25), "stages": _recipe(transfer=25)["stages"][:1]})
    run_recipe(model, teacher, spec, tmp_path, train_set=train)
    after = fidelity(teacher, model, probe).layer_error
    assert all(a < b for a, b in zip(after, before, strict=True)), (before, after)


def _run(out: Path, converted: Path, **kw):
    return finetune(converted, recipe_from_dict(_recipe()), out, **kw)


def test_finetune_writes_loadable_checkpoint_and_metrics(tmp_path, converted):
    result = _run(tmp_path / "out", converted)
    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["world_size"] == 1
    assert [e["step"] for e in metrics["evaluations"]] == [4, 8]
    for key in ("loss", "lr", "lambda", "top1_agreement", "cls_cosine", "layer_error", "images_per_s"):
        assert key in metrics["evaluations"][-1]
    assert all(0 <= lam < 1 for pair in metrics["evaluations"][-1]["lambda"] for lam in pair)
    meta = read_checkpoint_config(out)["metadata"]
    assert meta["recipe"]["name"] == "tiny" and meta["datasets"] == ["fashion_mnist"]
    assert {"teacher_top1", "before_top1", "after_top1", "agreement_after"} <= set(meta["metrics"])
    loaded = vca_patch.from_pretrained(out)
    x = probe_images(4)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), result.model.eval()(x))


def test_resume_after_interruption_gives_the_same_results(tmp_path, converted):
    full = _run(tmp_path / "full", converted)
    first = _run(tmp_path / "cut", converted, stop_after_steps=6)
    assert (
        not first.completed and json.loads((tmp_path / "cut" / "metrics.json").read_text())["status"] == "interrupted"
    )
    resumed = _run(tmp_path / "cut", converted, resume=True)
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    strip = lambda evals: [{k: v for k, v in e.items() if k != "images_per_s"} for e in evals]  # noqa: E731
    assert strip(full.metrics["evaluations"]) == strip(resumed.metrics["evaluations"])


def test_nan_loss_stops_at_the_step_and_keeps_the_last_good_checkpoint(tmp_path, converted, monkeypatch):
    calls = {"n": 0}
    real = engine_module._transfer_loss

    def flaky(*args):
        calls["n"] += 1
        loss = real(*args)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(engine_module, "_transfer_loss", flaky)
    with pytest.raises(TrainingDiverged, match=r"at step 3 .*step_0000002\.pt"):
        _run(tmp_path / "nan", converted)
    metrics = json.loads((tmp_path / "nan" / "metrics.json").read_text())
    assert metrics["status"] == "diverged" and metrics["diverged_at_step"] == 3
    assert [p.name for p in list_checkpoints(tmp_path / "nan")] == ["step_0000002.pt"]


def test_two_cpu_processes_write_the_same_metrics_format(tmp_path, converted):
    recipe = tmp_path / "tiny.yaml"
    import yaml

    recipe.write_text(yaml.safe_dump(_recipe()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    single = tmp_path / "single"
    args = ["finetune", str(converted), "--recipe", str(recipe)]
    subprocess.run(
        [sys.executable, "-m", "vca_patch", *args, "--output", str(single)],
        check=True, env=env, cwd=ROOT, capture_output=True, timeout=300,
    )  # fmt: skip
    double = tmp_path / "double"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517"]
    cmd += ["-m", "vca_patch", *args, "--output", str(double), "--cpu"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads((single / "metrics.json").read_text())
    two = json.loads((double / "metrics.json").read_text())
    assert two["world_size"] == 2 and one["world_size"] == 1 and two["global_batch"] == 2 * one["global_batch"]
    assert set(one) == set(two)
    assert [set(e) for e in one["evaluations"]] == [set(e) for e in two["evaluations"]]
    vca_patch.from_pretrained(double)
