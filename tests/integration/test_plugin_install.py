"""Issue #51: the example plug-in (examples/plugin/) installed as a user installs it, then used by the stock CLI and
`from_pretrained` in fresh processes that never import it: its target and family come from its entry points.

The venv sees this environment's packages (`--system-site-packages`: torch, vca-patch) and gets only the plug-in,
installed offline (`--no-deps --no-build-isolation`) from a copy, so no build files land in the source tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.e2e  # a venv, a pip install and six fresh processes: ~40 s on one core

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin"
DIST = "vca-patch-toy-plugin"


@pytest.fixture(scope="module")
def plugin_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh venv holding the installed example plug-in (and nothing else of its own)."""
    root = tmp_path_factory.mktemp("plugin-venv")
    source = shutil.copytree(EXAMPLE, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    venv.create(root / "venv", system_site_packages=True, with_pip=False)
    python = root / "venv" / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-build-isolation",
               "--no-index", "--quiet", str(source)]  # fmt: skip
    done = subprocess.run(install, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    return python


def _run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    env.pop("PYTHONPATH", None)  # the venv alone decides what is importable
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def _image_folder(root: Path, count: int = 10) -> Path:
    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(count // 2):
            Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(root / label / f"{i}.png")
    return root


def test_installed_plugin_works_with_the_stock_cli_and_from_pretrained(plugin_python, tmp_path):
    python, out = plugin_python, tmp_path / "converted"

    # The entry points are what the installed distribution declares, and nothing is imported yet.
    probe = ("import sys, importlib.metadata as m; import vca_patch.targets as t, vca_patch.families as f; "
             "print(sorted(e.name for e in m.entry_points(group='vca_patch.targets') if e.dist.name == sys.argv[1]), "
             "'toy_plugin' in sys.modules, 'temp-softmax' in t.CONFIG_TYPES, 'toy-vit' in f.ADAPTERS, "
             "t.CONFIG_TYPES.distribution('temp-softmax'))")  # fmt: skip
    done = _run(python, "-c", probe, DIST, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['temp-softmax']", "False", "True", "True", DIST]

    # `--help` of the stock command lists the plug-in's option, from its config field.
    done = _run(python, "-m", "vca_patch", "convert", "--help", cwd=tmp_path)
    assert done.returncode == 0 and "--temperature" in done.stdout and "temp-softmax" in done.stdout, done.stdout

    done = _run(python, "-m", "vca_patch", "inspect", "toy-vit-tiny", "--to", "temp-softmax", "--temperature", "2",
                cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "blocks.1.attn" in done.stdout and "temperature=2" in done.stdout.replace(" ", "")

    done = _run(python, "-m", "vca_patch", "convert", "toy-vit-tiny", "--no-pretrained", "--to", "temp-softmax",
                "--device", "cpu", "-o", str(out), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    meta = json.loads((out / "config.json").read_text())
    assert meta["adapter"] == "toy-vit" and meta["config"]["target"] == "temp-softmax"
    assert meta["base"] == {"library": "toy", "architecture": "ToyViT", "options": {
        "img_size": 32, "patch_size": 8, "dim": 32, "depth": 2, "num_heads": 4, "num_classes": 10}}  # fmt: skip
    card = (out / "README.md").read_text()
    assert f"pip install {DIST}" in card  # the usage snippet names the plug-in's distribution

    # At temperature 1 the converted model computes what the original did: fidelity measures it so.
    report = tmp_path / "fidelity.json"
    images = _image_folder(tmp_path / "images")
    done = _run(python, "-m", "vca_patch", "fidelity", str(out), "--data", str(images), "--data-kind", "imagefolder",
                "--limit", "4", "--device", "cpu", "--json", str(report), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    measured = json.loads(report.read_text())
    assert measured["num_images"] >= 1 and measured["top1_agreement"] == 1.0, measured
    assert min(measured["cls_cosine"], measured["patch_cosine"]) > 0.9999 and max(measured["layer_error"]) < 1e-5

    # from_pretrained in a fresh process that imports no plug-in; then a save / reload round trip.
    script = f"""
import sys, torch, vca_patch
model = vca_patch.from_pretrained({str(out)!r}).eval()
assert "toy_plugin" in sys.modules  # imported by entry-point discovery, not by this script
x = torch.randn(2, 3, 32, 32)
with torch.no_grad():
    model.blocks[0].attn.temperature.fill_(0.5)  # trained: the reload must carry it
    expected = model(x)
again = vca_patch.from_pretrained(vca_patch.save_pretrained(model, {str(tmp_path / "again")!r}))
with torch.no_grad():
    print(type(model).__name__, type(again.blocks[0].attn).__name__, torch.equal(again(x), expected))
"""
    done = _run(python, "-c", script, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["ToyViT", "TempSoftmaxAttention", "True"]
