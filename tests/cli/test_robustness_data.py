"""Data errors name the file, images are adapted to the model, SIGTERM unwinds like Ctrl-C, and an output folder
is claimed by one run at a time (issue #43: deliverables 4 and 6)."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import vca_patch
from tests.support.cli import digest, one_error_line, run_unchanged, runner
from tests.support.models import tiny
from tests.support.paths import RECIPES
from vca_patch import patch_model
from vca_patch.cli import app

RECIPE = RECIPES / "fashion_mnist.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """A converted RGB checkpoint, a 1-channel one, and ImageFolders with and without a truncated JPEG."""
    root = tmp_path_factory.mktemp("data")
    model, args = tiny()
    patch_model(model)
    out = {"ckpt": vca_patch.save_pretrained(model, root / "ckpt", model_args=args)}
    grey, grey_args = tiny(in_chans=1, img_size=32)
    patch_model(grey)
    out["grey"] = vca_patch.save_pretrained(grey, root / "grey", model_args=grey_args)
    for name, corrupt in (("good", False), ("bad", True)):
        for split in ("train", "test"):
            for cls in ("cat", "dog"):
                folder = root / name / split / cls
                folder.mkdir(parents=True)
                for i in range(3):
                    Image.new("RGB", (40, 40), (40 * i, 90, 200)).save(folder / f"{i}.jpg")
        if corrupt:
            for split in ("train", "test"):
                jpeg = root / name / split / "cat" / "1.jpg"
                jpeg.write_bytes(jpeg.read_bytes()[:200])  # a truncated JPEG
    out["good"], out["bad"] = root / "good", root / "bad"
    out["bad_jpeg"] = root / "bad" / "test" / "cat" / "1.jpg"
    recipe = json.loads(json.dumps(__import__("yaml").safe_load(RECIPE.read_text())))
    recipe["data"] = {"kind": "imagefolder", "path": str(root / "bad"), "train_split": "train", "eval_split": "test"}
    recipe.setdefault("train", {})["batch_size"] = 2
    (root / "bad_recipe.yaml").write_text(__import__("yaml").safe_dump(recipe))
    out["bad_recipe"] = root / "bad_recipe.yaml"
    recipe["data"]["num_workers"] = 2
    (root / "bad_recipe_workers.yaml").write_text(__import__("yaml").safe_dump(recipe))
    out["bad_recipe_workers"] = root / "bad_recipe_workers.yaml"
    return out


CPU = ["--device", "cpu"]
CASES = [  # (id, args, inputs, exit code, needles)
    ("fidelity-corrupt-jpeg", ["fidelity", "{ckpt}", "--data", "{bad}", *CPU], ["ckpt", "bad"], 2,
     ["cannot read image", "1.jpg", "--skip-bad-images"]),
    ("convert-corrupt-jpeg", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "32",
     "--contrast-tokens", "4", "--calibration-data", "{bad}", "--calibration-images", "6", "-o", "{out}"], ["bad"], 2,
     ["cannot read image", "1.jpg", "--skip-bad-images"]),
    ("finetune-corrupt-jpeg", ["finetune", "{ckpt}", "--recipe", "{bad_recipe}", "-o", "{out}", *CPU],
     ["ckpt", "bad", "bad_recipe"], 2, ["cannot read image", "1.jpg", "--skip-bad-images"]),
    ("finetune-corrupt-jpeg-num-workers", ["finetune", "{ckpt}", "--recipe", "{bad_recipe_workers}", "-o", "{out}",
     *CPU], ["ckpt", "bad", "bad_recipe_workers"], 2, ["error: cannot read image", "1.jpg", "--skip-bad-images"]),
]  # fmt: skip


@pytest.mark.parametrize(("args", "inputs", "code", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_corrupt_image_is_named_in_one_line(data, tmp_path, args, inputs, code, needles):
    names = {k: str(v) for k, v in data.items()} | {"out": str(tmp_path / "out")}
    result = run_unchanged([a.format(**names) for a in args], [data[n] for n in inputs])
    one_error_line(result, code, *needles)
    assert not [p for p in tmp_path.iterdir() if ".staging-" in p.name or p.name.endswith(".lock")]


def test_skip_bad_images_skips_and_counts(data):
    before = digest(data["bad"])
    result = runner.invoke(app, ["fidelity", str(data["ckpt"]), "--data", str(data["bad"]), "--skip-bad-images", *CPU])
    assert result.exit_code == 0, result.output
    assert "skipped 1 unreadable image(s)" in result.output and "1.jpg" in result.output
    assert digest(data["bad"]) == before


def test_a_one_channel_checkpoint_is_measured_on_rgb_images(data):
    """The images are adapted to the model (grey), as recipes do: no conv2d channel error."""
    result = runner.invoke(app, ["fidelity", str(data["grey"]), "--data", str(data["good"]), *CPU])
    assert result.exit_code == 0, result.output
    from vca_patch.data import build_dataset
    from vca_patch.train.recipe import DataSpec

    spec = DataSpec(kind="imagefolder", path=str(data["good"]), eval_split="test")
    cfg = {"input_size": (1, 32, 32), "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
    image, _ = build_dataset(spec, "test", training=False, img_size=32, model_cfg=cfg)[0]
    assert tuple(image.shape) == (1, 32, 32)


@pytest.mark.parametrize(
    ("batches", "needle"),
    [
        ([], "no batches"),
        ([torch.zeros(0, 3, 64, 64)], "is empty"),
        ([torch.full((2, 3, 64, 64), float("nan"))], "NaN"),
    ],
    ids=["empty", "empty-batch", "nan"],
)
def test_calibrate_refuses_empty_or_nan_data_before_torch(batches, needle):
    from vca_patch.data import DatasetError
    from vca_patch.recovery import calibrate

    model, _ = tiny()
    patch_model(model)
    with pytest.raises(DatasetError, match=needle):
        calibrate(model, batches)


def test_the_second_claim_on_an_output_is_refused_and_a_stale_one_recovered(tmp_path):
    from vca_patch.core.lock import OutputLockedError, lock_path, output_lock

    out = tmp_path / "out"
    other = {"pid": os.getppid(), "host": socket.gethostname(), "command": "vca-patch convert"}
    lock_path(out).write_text(json.dumps(other))  # a live process (our parent) holds it
    refused = rf"being written by vca-patch convert \(pid {os.getppid()}"
    with pytest.raises(OutputLockedError, match=refused), output_lock(out, "vca-patch convert"):
        pass
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock_path(out).write_text(json.dumps({**other, "pid": int(dead.stdout)}))  # a killed run's lock
    with output_lock(out, "vca-patch convert") as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        with output_lock(out, "nested"):  # this process holds it: a nested claim passes
            pass
        assert lock.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_concurrent_convert_into_a_claimed_folder_fails_in_one_line(tmp_path):
    from vca_patch.core.lock import lock_path

    out = tmp_path / "out"
    lock_path(out).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "command": "convert"}))
    result = runner.invoke(app, ["convert", "deit_tiny_patch16_224", "--no-pretrained", "-o", str(out)])
    one_error_line(result, 2, "is being written by convert", f"pid {os.getppid()}")
    assert not out.exists()


STAGE_SCRIPT = """
import time
from pathlib import Path
from vca_patch.cli.errors import guarded
from vca_patch.core.atomic import staged_directory

def save(dest: str):
    with staged_directory(Path(dest)) as stage:
        (stage / "model.safetensors").write_bytes(b"0" * 1000)
        print("staged", flush=True)
        time.sleep(60)

import typer
app = typer.Typer()
app.command()(guarded(save))
app()
"""


def test_sigterm_while_saving_leaves_no_staging_folder(tmp_path):
    """SIGTERM is handled like Ctrl-C by the CLI's boundary: the staging folder is removed, one line, exit 143."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", STAGE_SCRIPT, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "staged"
    assert [p for p in tmp_path.iterdir() if ".staging-" in p.name]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["error: terminated (SIGTERM)"], err
    assert list(tmp_path.iterdir()) == []


def test_convert_skips_bad_calibration_images_when_asked(data, tmp_path):
    out = tmp_path / "out"
    args = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "32", "--contrast-tokens", "4",
            "--calibration-data", str(data["bad"]), "--calibration-images", "6", "--skip-bad-images",
            "-o", str(out)]  # fmt: skip
    result = run_unchanged(args, [data["bad"]])
    assert result.exit_code == 0, result.output
    assert "skipped 1 unreadable image(s)" in result.output and (out / "model.safetensors").is_file()
    assert "Reading 6 calibration images: 1/1 batches" in result.output  # piped: plain lines with the total
    assert not [p for p in tmp_path.iterdir() if p.name != "out"]  # no lock or staging folder left


def test_an_interrupt_before_any_metrics_does_not_claim_they_were_marked(tmp_path):
    from vca_patch.train.finetune import mark_interrupted

    step = tmp_path / "checkpoints" / "step_0000003"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    message = mark_interrupted(tmp_path)
    assert "marked" not in message and "step 3" in message and not (tmp_path / "metrics.json").exists()


def test_piped_training_progress_has_a_total_and_an_eta(capsys):
    from vca_patch.train.engine import _Progress

    progress = _Progress(True, total=100, completed=0)
    assert progress.bar is None  # captured: not a terminal
    progress.start -= 10  # 10 s for the first 10 steps
    progress.update("distill", 10, "loss 1.0", log=True)
    line = capsys.readouterr().err.strip()
    assert line.startswith("[distill] step 10/100, ETA 0:01:") and line.endswith("loss 1.0"), line


def test_an_image_error_raised_in_a_dataloader_worker_is_one_line(data, capsys):
    """torch re-raises a worker's DatasetError wrapped ("Caught DatasetError in DataLoader worker process 0 ...
    Original Traceback ..."): the CLI's error boundary shows the original message alone."""
    from torch.utils.data import DataLoader

    from vca_patch.cli.errors import report
    from vca_patch.data.errors import DatasetError
    from vca_patch.data.imagefolder import load_imagefolder

    dataset = load_imagefolder(data["bad"], "test", training=False, transform=lambda image: 0)
    with pytest.raises(DatasetError) as caught:
        list(DataLoader(dataset, batch_size=6, num_workers=2))
    assert str(caught.value).startswith("Caught DatasetError in DataLoader worker process")  # what torch gives
    assert report(caught.value) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "1.jpg" in line and "--skip-bad-images" in line and "Caught" not in line
