"""Bipartite soft matching (ToMe, Bolya et al., ICLR 2023), written from the paper: which tokens merge into which.

The patch tokens are split alternately into sets A (even offsets) and B (odd offsets); each A token's most similar
B token (cosine of the metric, the attention keys averaged over heads) is its candidate edge; the r A tokens with the
most similar partners merge into them. Prefix tokens (CLS, registers) take no part: they stay in front, unchanged.
The merged sequence is [prefix, the A tokens kept (in order), B (with what merged into it)].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TokenMerge:
    """One merge step of a batch: A's kept and merged tokens (offsets into A) and the B token each merges into."""

    prefix: int
    num_tokens: int  # N before the merge
    kept: torch.Tensor  # (B, Na - r) offsets into A, ascending
    src: torch.Tensor  # (B, r) offsets into A that merge away
    dst: torch.Tensor  # (B, r) offsets into B they merge into

    @property
    def a_index(self) -> torch.Tensor:
        return torch.arange(self.prefix, self.num_tokens, 2, device=self.kept.device)

    @property
    def b_index(self) -> torch.Tensor:
        return torch.arange(self.prefix + 1, self.num_tokens, 2, device=self.kept.device)

    @property
    def r(self) -> int:
        return int(self.src.shape[1])

    def merge(self, x: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Size-weighted mean of each merged group: (x (B, N, C), size (B, N, 1)) -> (x', size'), N - r tokens."""
        channels = x.shape[-1]
        weighted = x * size.to(x.dtype)
        a, b = weighted[:, self.a_index], weighted[:, self.b_index]
        size_a, size_b = size[:, self.a_index], size[:, self.b_index]
        src, dst = self.src.unsqueeze(-1), self.dst.unsqueeze(-1)
        b = b.scatter_add(1, dst.expand(-1, -1, channels), a.gather(1, src.expand(-1, -1, channels)))
        size_b = size_b.scatter_add(1, dst, size_a.gather(1, src))
        kept = self.kept.unsqueeze(-1)
        out = torch.cat([weighted[:, : self.prefix], a.gather(1, kept.expand(-1, -1, channels)), b], dim=1)
        new_size = torch.cat([size[:, : self.prefix], size_a.gather(1, kept), size_b], dim=1)
        return out / new_size.to(x.dtype), new_size

    def merged_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (B, 2r), once (B, 2r) bool): the input indices of the tokens that merged, the A tokens that merged
        away then the B token each went into (a B token appears once per A token it took), and which rows count:
        every A row, and each B token at its first appearance."""
        batch, r = self.src.shape
        order = torch.arange(r, device=self.src.device).expand(batch, -1)
        first = torch.full((batch, self.b_index.numel()), r, dtype=order.dtype, device=order.device)
        first = first.scatter_reduce(1, self.dst, order, reduce="amin")  # the first A each B token took
        once = torch.cat([torch.ones_like(self.src, dtype=torch.bool), first.gather(1, self.dst) == order], dim=1)
        return torch.cat([self.a_index[self.src], self.b_index[self.dst]], dim=1), once

    def positions(self) -> torch.Tensor:
        """(B, N): the index, in the merged sequence, of the token each input token went into."""
        batch = self.kept.shape[0]
        device = self.kept.device
        num_kept = self.kept.shape[1]
        num_b = self.b_index.numel()
        new = torch.empty(batch, self.num_tokens, dtype=torch.long, device=device)
        new[:, : self.prefix] = torch.arange(self.prefix, device=device)
        pos_a = torch.empty(batch, self.a_index.numel(), dtype=torch.long, device=device)
        pos_a.scatter_(1, self.kept, (self.prefix + torch.arange(num_kept, device=device)).expand(batch, -1))
        pos_a.scatter_(1, self.src, self.prefix + num_kept + self.dst)
        new[:, self.a_index] = pos_a
        new[:, self.b_index] = (self.prefix + num_kept + torch.arange(num_b, device=device)).expand(batch, -1)
        return new


def bipartite_soft_matching(metric: torch.Tensor, r: int, prefix: int) -> TokenMerge:
    """The merge of `r` tokens (clipped to |A|) chosen on `metric` (B, N, d); the first `prefix` tokens never merge."""
    batch, num_tokens, _ = metric.shape
    if not 0 <= prefix <= num_tokens:
        raise ValueError(f"prefix {prefix} does not fit {num_tokens} tokens")
    device = metric.device
    a_index = torch.arange(prefix, num_tokens, 2, device=device)
    b_index = torch.arange(prefix + 1, num_tokens, 2, device=device)
    limit = a_index.numel() if b_index.numel() else 0  # every A token may merge, but only into a B token
    r = max(0, min(int(r), limit))
    if r == 0:
        empty = torch.empty(batch, 0, dtype=torch.long, device=device)
        kept = torch.arange(a_index.numel(), device=device).expand(batch, -1)
        return TokenMerge(prefix, num_tokens, kept.contiguous(), empty, empty)
    unit = F.normalize(metric.to(torch.promote_types(metric.dtype, torch.float32)), dim=-1)
    scores = unit[:, a_index] @ unit[:, b_index].transpose(1, 2)  # (B, Na, Nb)
    best, best_b = scores.max(dim=-1)
    order = torch.sort(best, dim=-1, descending=True, stable=True).indices
    src = order[:, :r]
    kept = order[:, r:].sort(dim=-1).values
    return TokenMerge(prefix, num_tokens, kept, src, best_b.gather(1, src))
