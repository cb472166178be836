"""`MergingAttention`: the carried softmax attention with proportional attention, giving its keys for matching."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vca_patch.layers.carried import CarriedAttentionLayer


class MergingAttention(CarriedAttentionLayer):
    """Softmax self-attention on the original q/k/v/proj; after a merge, log(token size) joins the logits.

    `attend(x, size)` returns the output and the keys, from which a merging block takes its matching metric; the
    block calls the layer as a module (so hooks see it), with sizes and keys passed through its `MergeState`.
    """

    def attend(self, x: torch.Tensor, size: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(output (B, N, C), keys (B, heads, N, head_dim)); `size` (B, N, 1) or None (all ones)."""
        batch, tokens, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        bias = None if size is None else size.log().to(q.dtype).reshape(batch, 1, 1, tokens)  # proportional attention
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        out = self.norm(out.transpose(1, 2).reshape(batch, tokens, self.attn_dim))
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out)), k

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, layout: Any = None, **kwargs
    ) -> torch.Tensor:
        """The attention output; inside a merging block's forward with its token sizes (and the keys for matching
        left on the block's `MergeState`), else plain softmax attention (e.g. a lone call on all N tokens)."""
        if attn_mask is not None:
            raise ValueError("MergingAttention takes no attention mask (token merging changes the token count)")
        state = self.__dict__.get("merge_state")
        size = state.size if state is not None else None
        if size is not None and size.shape[1] != x.shape[1]:
            size = None
        out, keys = self.attend(x, size)
        if state is not None:
            state.keys = keys
        return out
