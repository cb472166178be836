"""Device and precision: the engine follows the Accelerator's device, bf16 autocast trains on the CPU, and bad
--device / --mixed-precision values fail early with a clear message."""

from __future__ import annotations

import pytest
import timm
import torch
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import vca_patch
from tests.support.recovery import TINY_ARGS
from vca_patch.cli.app import app
from vca_patch.train import make_accelerator, recipe_from_dict, run_recipe, teacher_from
from vca_patch.train.engine import mixed_precision_mode

RECIPE = {
    "name": "bf16",
    "train": {"batch_size": 8, "eval_every": 4, "checkpoint_every": 4, "eval_images": 16},
    "stages": [
        {"name": "transfer", "kind": "attention_transfer", "steps": 2, "lr": 3e-3},
        {"name": "distill", "kind": "distill", "steps": 2, "lr": 1e-3, "carried_lr": 1e-4, "label_weight": 0.1},
    ],
}


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide state (device, mixed precision); give this test its own."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def test_bf16_mixed_precision_trains_on_the_cpu(tmp_path, fresh_accelerate_state):
    torch.manual_seed(0)
    student = timm.create_model("vit_tiny_patch16_224", pretrained=False, **TINY_ARGS)
    vca_patch.patch_model(student.eval(), vca_patch.VCAConfig(contrast_tokens=4))
    teacher = teacher_from(student)
    carried = student.blocks[0].attn.qkv.weight
    start = carried.detach().clone()
    seen: dict[str, set] = {"fc1": set(), "qkv": set()}
    hooks = [
        student.blocks[0].mlp.fc1.register_forward_hook(lambda m, a, o: seen["fc1"].add((m.training, o.dtype))),
        student.blocks[0].attn.qkv.register_forward_hook(lambda m, a, o: seen["qkv"].add((m.training, o.dtype))),
    ]
    accelerator = make_accelerator("bf16", device="cpu")
    result = run_recipe(
        student, teacher, recipe_from_dict(RECIPE), tmp_path, train_set=_data(32, 1), eval_set=_data(16, 2),
        accelerator=accelerator,
    )  # fmt: skip
    for h in hooks:
        h.remove()
    assert result.metrics["mixed_precision"] == "bf16" and result.metrics["device"] == "cpu"
    assert (True, torch.bfloat16) in seen["fc1"] and (True, torch.bfloat16) in seen["qkv"]  # training ran in bf16
    assert all(p.dtype == torch.float32 for p in student.parameters())  # float32 master weights
    losses = [e["loss"] for e in result.metrics["evaluations"]]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(start, carried)  # the carried q/k/v weights were trained (distill carried_lr > 0)


def test_mixed_precision_names():
    assert [mixed_precision_mode(v) for v in ("no", "BF16", "bfloat16", "float16", "float32", "auto")] == [
        "no", "bf16", "bf16", "fp16", "no", "auto",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="must be auto, no, bf16 or fp16"):
        mixed_precision_mode("int8")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "tpu"}, "device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        ({"device": "cpu", "mixed_precision": "fp16"}, "fp16 mixed precision needs a CUDA GPU; on the CPU use bf16"),
        pytest.param(
            {"device": "cuda:0"},
            "no CUDA GPU is visible",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA"),
        ),
    ],
)
def test_bad_device_or_precision_is_refused_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_accelerator(**kwargs)


def test_cli_finetune_checks_device_and_precision_first(tmp_path):
    (tmp_path / "r.yaml").write_text("name: r\nstages:\n  - {name: a, kind: distill, steps: 1}\n")
    runner = CliRunner()
    args = ["finetune", str(tmp_path / "missing"), "--recipe", str(tmp_path / "r.yaml"), "-o", str(tmp_path / "o")]
    bad_device = runner.invoke(app, [*args, "--device", "npu"])
    assert bad_device.exit_code == 2 and "device must be auto, cpu, cuda or cuda:N" in bad_device.output
    bad_dtype = runner.invoke(app, [*args, "--device", "cpu", "--dtype", "fp16"])
    assert bad_dtype.exit_code == 2 and "fp16 mixed precision needs a CUDA GPU" in bad_dtype.output
    assert not (tmp_path / "o").exists()
