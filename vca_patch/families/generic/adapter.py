"""Architectures no family adapter knows: structural detection, kept only when verification passes.

A candidate has a fused `qkv` Linear (or q/k/v Linears), an output Linear and a head count. The token
layout comes from the model's patch convolution (grid) and one probe forward (prefix-token count). A
candidate is converted only if a reference softmax attention built from its weights reproduces it.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from vca_patch.families.base import AttentionSite, ModelAdapter, SkippedSite
from vca_patch.families.call_shims import TokensOnly, TupleOutput
from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.fused_qkv import FusedQKVView, SplitQKV
from vca_patch.layers.layout import TokenLayout

_QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"), ("to_q", "to_k", "to_v"))
_OUTPUT_NAMES = ("proj", "o_proj", "out_proj", "to_out", "dense", "output")
_HEAD_NAMES = ("num_heads", "num_attention_heads", "heads", "n_heads", "n_head")
_INDEX = re.compile(r"\.(\d+)\.")


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def _qkv(module: nn.Module) -> nn.Module | FusedQKVView | None:
    fused = _linear(module, "qkv")
    if fused is not None and fused.out_features % 3 == 0:
        return fused
    for names in _QKV_NAMES:
        parts = [_linear(module, n) for n in names]
        if all(parts) and len({(p.in_features, p.out_features) for p in parts}) == 1:
            return SplitQKV(module, names)  # read under the module's own names
    return None


def _output_name(module: nn.Module) -> str | None:
    return next((name for name in _OUTPUT_NAMES if _linear(module, name) is not None), None)


def _output(module: nn.Module) -> nn.Linear | None:
    name = _output_name(module)
    return None if name is None else _linear(module, name)


def _heads(module: nn.Module) -> int | None:
    return next((getattr(module, n) for n in _HEAD_NAMES if isinstance(getattr(module, n, None), int)), None)


def _candidate(module: nn.Module) -> tuple[nn.Module, nn.Linear, int] | None:
    qkv, out, heads = _qkv(module), _output(module), _heads(module)
    if qkv is None or out is None or not heads or (qkv.out_features // 3) % heads:
        return None
    return qkv, out, heads


def _patch_conv(model: nn.Module) -> nn.Conv2d | None:
    return next(
        (m for m in model.modules() if isinstance(m, nn.Conv2d) and m.stride == m.kernel_size and m.stride[0] > 1),
        None,
    )


def _input_size(model: nn.Module, conv: nn.Conv2d) -> tuple[int, int]:
    for owner in (model, getattr(model, "config", None)):
        size = getattr(owner, "img_size", None) or getattr(owner, "image_size", None)
        if size:
            return (size, size) if isinstance(size, int) else tuple(size)[-2:]
    return (conv.stride[0] * 14, conv.stride[1] * 14)


class GenericAdapter(ModelAdapter):
    """Self-attention found by structure in any model with a patch convolution; verified before it is used."""

    name = "generic"

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return _patch_conv(model) is not None and any(_candidate(m) for m in model.modules())

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        candidates = [(path, m) for path, m in model.named_modules() if _candidate(m)]
        tokens, tuple_output = self._probe(model, [m for _, m in candidates])
        grid = self._probe_grid
        sites, skipped = [], []
        for order, (path, module) in enumerate(candidates):
            qkv, _, heads = _candidate(module)
            seen = tokens.get(path)
            if seen is None or seen < grid[0] * grid[1]:
                reason = "not called on the patch tokens in a probe forward (cross- or pooling attention?)"
                skipped.append(SkippedSite(path, type(module).__name__, reason))
                continue
            match = _INDEX.search(f".{path}.")
            site = AttentionSite(path, module, int(match.group(1)) if match else order, qkv.in_features, heads)
            self._tuple_output[path] = tuple_output[path]
            sites.append(site)
        prefixes = {tokens[s.path] - grid[0] * grid[1] for s in sites}
        if len(prefixes) > 1:
            raise ValueError(f"attention modules see different token counts {sorted(prefixes)}; cannot tell the layout")
        self.num_prefix_tokens = prefixes.pop() if prefixes else 0
        return sites, skipped

    @torch.no_grad()
    def _probe(self, model: nn.Module, modules: list[nn.Module]) -> tuple[dict[str, int], dict[str, bool]]:
        """One forward on a zero image: tokens each candidate sees, whether it returns a tuple, the grid."""
        conv = _patch_conv(model)
        names = {id(m): p for p, m in model.named_modules()}
        tokens: dict[str, int] = {}
        tuple_output: dict[str, bool] = {}
        self._tuple_output: dict[str, bool] = {}

        def record(module, args, kwargs, output):
            x = args[0] if args else next(iter(kwargs.values()))
            tokens[names[id(module)]] = int(x.shape[1])
            tuple_output[names[id(module)]] = isinstance(output, tuple)

        def record_grid(module, args, output):
            self._probe_grid = (int(output.shape[-2]), int(output.shape[-1]))

        handles = [m.register_forward_hook(record, with_kwargs=True) for m in modules]
        handles.append(conv.register_forward_hook(record_grid))
        was_training = model.training
        try:
            model.eval()
            weight = conv.weight
            model(torch.zeros(1, conv.in_channels, *_input_size(model, conv), dtype=weight.dtype, device=weight.device))
        finally:
            model.train(was_training)
            for handle in handles:
                handle.remove()
        return tokens, tuple_output

    def embedding_module(self, model: nn.Module) -> nn.Module:
        return _patch_conv(model)

    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout:
        return TokenLayout(self.num_prefix_tokens, (output.shape[-2], output.shape[-1]))

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        return TokenLayout(self.num_prefix_tokens, self._probe_grid)

    def carry(self, site: AttentionSite) -> CarriedAttention:
        qkv, out, heads = _candidate(site.module)
        return CarriedAttention(
            qkv=qkv, proj=out, num_heads=heads, head_dim=qkv.out_features // 3 // heads,
            proj_name=_output_name(site.module),
        )  # fmt: skip

    def call_original(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = module(x)
        return out[0] if isinstance(out, tuple) else out

    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        replacement.register_forward_pre_hook(TokensOnly(), with_kwargs=True)
        if self._tuple_output.get(site.path):
            replacement.register_forward_hook(TupleOutput())

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        raise ValueError(
            f"{type(model).__name__} was patched by generic detection and cannot be rebuilt from a name; "
            "save its state_dict and re-apply patch_model after building it yourself"
        )

    @classmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        raise ValueError("generic-detection checkpoints cannot be rebuilt")
