"""Benchmarks of original vs patched models: analytic MACs, interleaved latency, peak memory."""

from vca_patch.bench.crossover import crossover
from vca_patch.bench.errors import BenchError
from vca_patch.bench.flops import (
    ATTENTION_MACS,
    AttentionShape,
    ModelShape,
    attention_macs,
    model_macs,
    model_shape,
    register_attention_macs,
    softmax_attention_macs,
)
from vca_patch.bench.memory import peak_mib
from vca_patch.bench.sweep import BenchSettings, check_resolutions, run_sweep
from vca_patch.bench.timing import time_interleaved
from vca_patch.bench.variants import ORIGINAL, UNFUSED, Variant, build_variants

__all__ = [
    "ATTENTION_MACS",
    "ORIGINAL",
    "UNFUSED",
    "AttentionShape",
    "BenchError",
    "BenchSettings",
    "ModelShape",
    "Variant",
    "attention_macs",
    "build_variants",
    "check_resolutions",
    "crossover",
    "model_macs",
    "model_shape",
    "peak_mib",
    "register_attention_macs",
    "run_sweep",
    "softmax_attention_macs",
    "time_interleaved",
]
