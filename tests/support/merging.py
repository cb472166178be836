"""Token merging's float64 reference (from the ToMe paper, token by token) and the tiny models it runs on."""

from __future__ import annotations

import math

import timm
import torch
from torch import nn
from transformers import Dinov2Config, Dinov2Model


def timm_vit(depth: int = 4) -> nn.Module:
    model = timm.create_model(
        "vit_small_patch14_dinov2",
        pretrained=False,
        img_size=56,
        depth=depth,
        embed_dim=64,
        num_heads=4,
        init_values=0.5,
        num_classes=0,
    )
    with torch.no_grad():  # LayerScale gammas that matter (dropping ls1/ls2 would show)
        for block in model.blocks:
            block.ls1.gamma.uniform_(0.2, 1.5)
            block.ls2.gamma.uniform_(0.2, 1.5)
    return model.eval().double()


def hf_dinov2(depth: int = 3) -> nn.Module:
    config = Dinov2Config(
        hidden_size=48,
        num_hidden_layers=depth,
        num_attention_heads=4,
        intermediate_size=96,
        image_size=56,
        patch_size=14,
        layerscale_value=0.7,
    )
    return Dinov2Model(config).eval().double()


def timm_parts(block: nn.Module) -> dict:
    attn = block.attn
    return {
        "norm1": block.norm1,
        "qkv": attn.qkv,
        "proj": attn.proj,
        "heads": attn.num_heads,
        "ls1": block.ls1,
        "norm2": block.norm2,
        "mlp": block.mlp,
        "ls2": block.ls2,
    }


def hf_parts(layer: nn.Module) -> dict:
    attn = layer.attention

    def qkv(x):
        return torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)

    return {
        "norm1": layer.norm1,
        "qkv": qkv,
        "proj": attn.o_proj,
        "heads": attn.num_attention_heads,
        "ls1": layer.layer_scale1,
        "norm2": layer.norm2,
        "mlp": layer.mlp,
        "ls2": layer.layer_scale2,
    }


def reference_image(
    tokens: torch.Tensor, parts: list[dict], schedule: list[int], prefix: int, unmerge: str = "copy"
) -> torch.Tensor:
    """One image (N, C) through the blocks with ToMe, token by token in Python, float64; returns (N, C) unmerged:
    "copy" gives each original token its group's final value, "residual" adds what every merge took from it (its
    value before the merge minus the merged value)."""
    x = [tokens[i] for i in range(tokens.shape[0])]
    size = [1.0] * len(x)
    groups = [[i] for i in range(len(x))]  # original tokens held by each current token
    taken = [torch.zeros_like(tokens[0]) for _ in range(tokens.shape[0])]  # per original token
    for p, r in zip(parts, schedule, strict=True):
        n, heads = len(x), p["heads"]
        h = p["norm1"](torch.stack(x))
        q, k, v = p["qkv"](h).chunk(3, dim=-1)
        d = q.shape[-1] // heads
        out = []
        for head in range(heads):
            s = slice(head * d, (head + 1) * d)
            logits = q[:, s] @ k[:, s].T / math.sqrt(d) + torch.tensor([math.log(z) for z in size], dtype=q.dtype)
            out.append(torch.softmax(logits, dim=-1) @ v[:, s])
        x = list(torch.stack(x) + p["ls1"](p["proj"](torch.cat(out, dim=-1))))
        keys = torch.stack([k[i].reshape(heads, d).mean(0) for i in range(n)]).detach()  # matching only
        if r:
            a = list(range(prefix, n, 2))
            b = list(range(prefix + 1, n, 2))
            best = []
            for i in a:
                sims = [float(keys[i] @ keys[j] / (keys[i].norm() * keys[j].norm())) for j in b]
                top = max(range(len(b)), key=lambda t, sims=sims: sims[t])
                best.append((sims[top], i, b[top]))
            ranked = sorted(range(len(a)), key=lambda t: -best[t][0])  # stable: ties keep A's order
            merged = {best[t][1]: best[t][2] for t in ranked[: min(r, len(a))]}
            total = {j: x[j] * size[j] for j in b}
            weight = {j: size[j] for j in b}
            held = {j: list(groups[j]) for j in b}
            for i, j in merged.items():
                total[j] = total[j] + x[i] * size[i]
                weight[j] += size[i]
                held[j] += groups[i]
            for i, j in [(j, j) for j in b] + list(merged.items()):  # token i went into B token j
                for member in groups[i]:
                    taken[member] = taken[member] + x[i] - total[j] / weight[j]
            order = list(range(prefix)) + [i for i in a if i not in merged]
            x = [x[i] for i in order] + [total[j] / weight[j] for j in b]
            size = [size[i] for i in order] + [weight[j] for j in b]
            groups = [groups[i] for i in order] + [held[j] for j in b]
        x = list(torch.stack(x) + p["ls2"](p["mlp"](p["norm2"](torch.stack(x)))))
    full = [None] * tokens.shape[0]
    for token, members in zip(x, groups, strict=True):
        for i in members:
            full[i] = token + taken[i] if unmerge == "residual" else token
    return torch.stack(full)


def timm_reference(
    model: nn.Module, images: torch.Tensor, schedule: list[int], vca_blocks: int = 0, unmerge: str = "copy"
) -> torch.Tensor:
    with torch.no_grad():
        x = model.norm_pre(model._pos_embed(model.patch_embed(images)))
        for block in model.blocks[:vca_blocks]:  # VCA blocks run as patched (VCA itself is tested elsewhere)
            x = block(x)
        parts = [timm_parts(b) for b in model.blocks[vca_blocks:]]
        out = [reference_image(t, parts, schedule[vca_blocks:], model.num_prefix_tokens, unmerge) for t in x]
        return model.norm(torch.stack(out))
