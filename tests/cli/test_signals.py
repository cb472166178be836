"""SIGINT, SIGTERM and SIGHUP stop every command alike: one `error:` line, exit 128 + the signal (130, 143, 129), no
lock file, staging folder or temporary file left, and an interrupted `finetune` leaves a metrics.json that says
where it stopped; also while the command is still starting (importing torch takes seconds)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from PIL import Image

import vca_patch
from tests.support.cli import one_error_line, runner
from tests.support.models import tiny
from tests.support.paths import ROOT
from vca_patch import patch_model
from vca_patch.cli.app import app

finetune_module = importlib.import_module("vca_patch.train.finetune")  # the module (the package re-exports a function)
CONVERT = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "32", "--contrast-tokens", "4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
LINES = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)",
         signal.SIGHUP: "terminated (SIGHUP: the terminal or session closed)"}  # fmt: skip
E2E = pytest.mark.e2e


def _start(*args: str, cwd: Path = ROOT) -> subprocess.Popen:
    """`python -m vca_patch ARGS` running in `cwd`, its stderr piped as text."""
    cmd = [sys.executable, "-m", "vca_patch", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Poll `condition` until it holds (the process must still be running: the signal is to land mid-work)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "timed out waiting for the run to get going"
        time.sleep(0.05)


def _stopped(proc: subprocess.Popen, signum: int) -> list[str]:
    """Send `signum`; the run's error lines (stderr lines that are neither notes nor progress)."""
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith(("error:", "internal error:"))]


@pytest.mark.parametrize(
    "signum",
    [signal.SIGHUP, pytest.param(signal.SIGTERM, marks=E2E), pytest.param(signal.SIGINT, marks=E2E)],
    ids=lambda s: signal.Signals(s).name,
)
def test_a_signal_while_converting_leaves_no_lock_or_staging_folder(signum, tmp_path):
    proc = _start(*CONVERT, "-o", "out", cwd=tmp_path)
    _wait_for(lambda: (tmp_path / ".out.lock").exists(), proc)  # claimed: the model is being built
    assert _stopped(proc, signum) == [f"error: {LINES[signum]}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_starting_is_one_line_not_a_traceback(signum, tmp_path):
    """While torch is still being imported: `-X importtime` names each module as it is imported, so the signal
    lands right after vca-patch's start-up guard and long before the command runs."""
    cmd = [sys.executable, "-X", "importtime", "-m", "vca_patch", *CONVERT, "-o", "out"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.rstrip().endswith("vca_patch._startup"):
            break
    proc.send_signal(signum)
    err = proc.stderr.read()
    proc.wait(timeout=60)
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGHUP"
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 128 + signum and lines == [
        f"error: interrupted ({name}) while starting; nothing was done"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    model, args = tiny(img_size=32)
    patch_model(model)
    return vca_patch.save_pretrained(model, tmp_path / "ckpt", model_args=args)


def _image_folder(root: Path) -> Path:
    """train/ and test/ splits of two classes of 32-px images."""
    for split in ("train", "test"):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (32, 32), (40 * i, 200 if label == "a" else 20, 90)).save(
                    root / split / label / f"{i}.png"
                )
    return root


def _recipe(path: Path, data: Path, steps: int) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "tiny-signals", "data": {"kind": "imagefolder", "path": str(data), "eval_limit": 8},
        "train": {"batch_size": 4, "eval_every": 1, "checkpoint_every": 1, "eval_images": 8, "log_every": 1},
        "stages": [{"name": "transfer", "kind": "attention_transfer", "steps": steps, "lr": 1e-3}],
    }))  # fmt: skip
    return path


@E2E
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_finetuning_marks_metrics_and_leaves_no_lock(signum, checkpoint, tmp_path):
    recipe = _recipe(tmp_path / "r.yaml", _image_folder(tmp_path / "images"), steps=1_000_000)
    run = tmp_path / "runs" / "run"
    run.parent.mkdir()
    proc = _start("finetune", str(checkpoint), "--recipe", str(recipe), "-o", str(run), "--device", "cpu")
    _wait_for(lambda: (run / "checkpoints").is_dir() and any((run / "checkpoints").glob("step_*")), proc)
    errors = _stopped(proc, signum)
    assert len(errors) == 1 and "interrupted" in errors[0] and "--resume" in errors[0], errors
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["resume_step"] >= 1
    assert metrics["interrupted_at"] == f"step {metrics['resume_step']}"
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]  # no lock file, no staging folder
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no temporary metrics file


def test_an_interrupt_while_loading_the_data_still_writes_metrics(checkpoint, tmp_path, monkeypatch):
    """Ctrl-C before training starts (loading the model and images): metrics.json says interrupted at step 0, so
    the folder is recognised as this run's by the next `finetune`."""

    class Loading:
        def load(self, converted, recipe):
            raise KeyboardInterrupt

    monkeypatch.setattr(finetune_module, "task_for", lambda recipe: Loading())
    recipe = _recipe(tmp_path / "r.yaml", _image_folder(tmp_path / "images"), steps=4)
    out = tmp_path / "run"
    result = runner.invoke(app, ["finetune", str(checkpoint), "--recipe", str(recipe), "-o", str(out), "--device",
                                 "cpu"])  # fmt: skip
    one_error_line(result, 130, "interrupted before the first checkpoint", "metrics.json says so", "without --resume")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics == {"recipe": "tiny-signals", "status": "interrupted", "evaluations": [], "resume_step": None,
                       "interrupted_at": "step 0"}  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "images", "r.yaml", "run"]


def test_the_process_signal_handlers_raise_like_ctrl_c(monkeypatch):
    """Outside a command too (between start-up and the command), SIGHUP unwinds like Ctrl-C, with exit 129."""
    import vca_patch.cli.errors as errors

    monkeypatch.setattr(errors, "_terminated_by", None)
    previous = errors.install_signal_handlers()
    try:
        with pytest.raises(errors.Terminated) as caught:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)  # the handler raises long before
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert errors.exit_code(caught.value) == 129 and str(caught.value) == LINES[signal.SIGHUP]
