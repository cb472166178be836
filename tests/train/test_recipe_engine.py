"""The recipe engine: stage-1 transfer, resume, NaN stop, two processes, published checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vca_patch
from tests.support.paths import ROOT
from tests.support.recovery import TINY_ARGS, head_less_pair, needs_fashion_mnist, probe_images, trained_tiny_vit
from vca_patch.checkpoint.folder import read_checkpoint_config
from vca_patch.eval.fidelity import fidelity
from vca_patch.recovery import calibrate
from vca_patch.targets.vca.training import LAMBDA_ROUNDOFF
from vca_patch.train import TrainingDiverged, finetune, recipe_from_dict, run_recipe, teacher_from
from vca_patch.train import objective as objective_module
from vca_patch.train.checkpoints import list_checkpoints

pytestmark = needs_fashion_mnist
ROOT = ROOT
TWO_PROCESS_RTOL = 5e-7  # losses and evaluations, float32 sums in another order: measured 1e-7
TWO_PROCESS_ATOL = 3e-5  # weights after 8 AdamW steps (which amplify tiny gradients): measured 9.4e-6


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
    # in [0, 1) up to the guard's float32 round-off: a clamped λ read just below 0 in one full-suite run here
    assert all(-LAMBDA_ROUNDOFF <= lam < 1 for pair in metrics["evaluations"][-1]["lambda"] for lam in pair)
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
    real = objective_module.transfer_loss

    def flaky(*args):
        calls["n"] += 1
        loss = real(*args)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(objective_module, "transfer_loss", flaky)
    with pytest.raises(TrainingDiverged, match=r"at step 3 .*step_0000002"):
        _run(tmp_path / "nan", converted)
    metrics = json.loads((tmp_path / "nan" / "metrics.json").read_text())
    assert metrics["status"] == "diverged" and metrics["diverged_at_step"] == 3
    assert [p.name for p in list_checkpoints(tmp_path / "nan")] == ["step_0000002"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.e2e
def test_two_cpu_processes_match_one_process_with_the_same_global_batch(tmp_path, converted):
    """2 processes x 8 images (gloo, DDP) and 1 process x 16 images see the same global batches: the same losses,
    evaluations and weights up to float32 reduction order."""
    import yaml

    spec = _recipe(eval_images=63)  # odd: the second process's shard is padded, gather_for_metrics drops that
    one = finetune(converted, recipe_from_dict(spec), tmp_path / "single")
    half = {**spec, "train": {**spec["train"], "batch_size": 8}}
    (tmp_path / "half.yaml").write_text(yaml.safe_dump(half))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    cmd += ["-m", "vca_patch", "finetune", str(converted), "--recipe", str(tmp_path / "half.yaml")]
    cmd += ["--output", str(tmp_path / "double"), "--device", "cpu"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "double" / "metrics.json").read_text())
    assert two["world_size"] == 2 and one.metrics["world_size"] == 1
    assert two["global_batch"] == one.metrics["global_batch"] == 16
    assert set(one.metrics) == set(two)
    pairs = list(zip(one.metrics["evaluations"], two["evaluations"], strict=True))
    for a, b in pairs:
        assert (a["step"], a["stage"], a["lr"]) == (b["step"], b["stage"], b["lr"])
        for key in ("loss", "cls_cosine", "patch_cosine", "top1_agreement", "top1_patched", "mean_layer_error"):
            assert b[key] == pytest.approx(a[key], rel=TWO_PROCESS_RTOL, abs=1e-9), key
        torch.testing.assert_close(torch.tensor(b["lambda"]), torch.tensor(a["lambda"]), rtol=0, atol=TWO_PROCESS_ATOL)
    for key in ("top1_original", "top1_patched"):
        assert two["final"][key] == pytest.approx(one.metrics["final"][key], abs=1e-9)
    start = vca_patch.from_pretrained(converted).state_dict()
    single = vca_patch.from_pretrained(tmp_path / "single").state_dict()
    double = vca_patch.from_pretrained(tmp_path / "double").state_dict()
    assert single.keys() == double.keys() == start.keys()
    worst = max(float((double[k].float() - single[k].float()).abs().max()) for k in single)
    moved = max(float((single[k].float() - start[k].float()).abs().max()) for k in single)
    assert worst <= TWO_PROCESS_ATOL < moved / 100, (worst, moved)  # same updates, and real ones


def test_head_less_distill_with_mixup_and_cutmix_trains(tmp_path):
    """A backbone without a classifier (features distilled, labels unused) takes the recipe's mixup/cutmix too."""
    teacher, model, train = head_less_pair()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    spec = recipe_from_dict({
        "name": "headless", "data": {"kind": "imagefolder", "path": "unused", "mixup": 1.0, "cutmix": 1.0},
        "train": {"batch_size": 8, "eval_every": 100, "checkpoint_every": 100, "eval_images": 8},
        "stages": [{"name": "distill", "kind": "distill", "steps": 3, "lr": 1e-3}],
    })  # fmt: skip
    result = run_recipe(model, teacher, spec, tmp_path, train_set=train)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["status"] == "completed"
    moved = [n for n, p in result.model.named_parameters() if not torch.equal(p.detach().cpu(), before[n])]
    assert moved and all(".attn." in n for n in moved)  # the new VCA parameters trained, nothing outside attention
