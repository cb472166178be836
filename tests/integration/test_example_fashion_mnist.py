"""The end-to-end Fashion-MNIST example, shortened (data subsets, a few steps)."""

from __future__ import annotations

import importlib.util
import json

import vca_patch
from tests.support.paths import EXAMPLES
from tests.support.recovery import needs_fashion_mnist

EXAMPLE = EXAMPLES / "fashion_mnist.py"


@needs_fashion_mnist
def test_quick_example_writes_the_metrics_table(tmp_path):
    spec = importlib.util.spec_from_file_location("fashion_mnist_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    metrics = example.main(["--output", str(tmp_path), "--quick", "--threads", "1"])
    written = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("teacher_top1", "before_top1", "after_top1", "agreement_after"):
        assert 0.0 <= written[key] <= 1.0 and written[key] == metrics[key]
    assert written["teacher_top1"] > 0.25  # it learned something from 1500 images (chance: 0.1)
    recovered = vca_patch.from_pretrained(tmp_path / "recovered")
    assert recovered.vca_patch_state.config.prefix_readout == "exact"
