"""Bipartite soft matching (ToMe, Bolya et al., ICLR 2023), written from the paper: which tokens merge into which.

The patch tokens are split alternately into sets A (even offsets) and B (odd offsets); each A token's most similar
B token (cosine of the metric, the attention keys summed over heads: the cosine of their mean) is its candidate edge;
the r A tokens with the most similar partners merge into them. Prefix tokens (CLS, registers) take no part: they stay
in front, unchanged. The merged sequence is [prefix, the A tokens kept (in order), B (with what merged into it)].

Tokens move as whole rows (`take_rows`, `add_rows_`: index_select / index_add_ on the (B * N, C) view), several
times faster on CPU than a gather or scatter with the index expanded over the channels.
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
    def r(self) -> int:
        return int(self.src.shape[1])

    def merge(self, x: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Size-weighted mean of each merged group: (x (B, N, C), size (B, N, 1)) -> (x', size'), N - r tokens."""
        out, new_size, _, _ = self._merge(x, size, residual=False)
        return out, new_size

    def merge_residual(
        self, x: torch.Tensor, size: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`merge`, and what it took from the tokens that merged: (x', size', rows (B, 2r), taken (B, 2r, C)).

        rows: the A tokens that merged away, then the B token each went into (in x); taken: what each row lost, its
        value minus its group's mean. A B token that took k A tokens appears k times, each row carrying minus what
        one A token added to it, so adding every row back gives each token exactly what it lost."""
        return self._merge(x, size, residual=True)

    def _merge(self, x: torch.Tensor, size: torch.Tensor, residual: bool) -> tuple[torch.Tensor, ...]:
        # Only the r merged rows are computed: a B token that takes A tokens i moves to
        # x_b + sum_i size_i (x_i - x_b) / size_b', the weighted mean, without weighting and dividing all N tokens.
        p, num_kept = self.prefix, self.kept.shape[1]
        x_b = x[:, p + 1 :: 2]  # (B, Nb, C), a view
        size_a, size_b = size[:, p::2], size[:, p + 1 :: 2]
        src, dst = self.src.unsqueeze(-1), self.dst.unsqueeze(-1)
        size_src = size_a.gather(1, src)  # (B, r, 1)
        new_size_b = size_b.scatter_add(1, dst, size_src)  # (B, Nb, 1)
        weight = (size_src / new_size_b.gather(1, dst)).to(x.dtype)
        a_rows, b_rows = p + 2 * self.src, p + 1 + 2 * self.dst  # (B, r): the merging tokens' indices in x
        x_src, x_dst = take_rows(x, a_rows), take_rows(x, b_rows)  # (B, r, C)
        out = torch.cat([x[:, :p], take_rows(x, p + 2 * self.kept), x_b], dim=1)
        delta = (x_src - x_dst) * weight  # (B, r, C): what each A token adds to its B token
        add_rows_(out, p + num_kept + self.dst, delta)  # `out` is new: in place is autograd-safe
        new_size = torch.cat([size[:, :p], size_a.gather(1, self.kept.unsqueeze(-1)), new_size_b], dim=1)
        if not residual:
            return out, new_size, None, None
        # an A token lost (itself - its group's mean); a B token lost -(the sum of the deltas it took), one per row
        taken = torch.cat([x_src - take_rows(out, p + num_kept + self.dst), -delta], dim=1)
        return out, new_size, torch.cat([a_rows, b_rows], dim=1), taken

    def positions(self) -> torch.Tensor:
        """(B, N): the index, in the merged sequence, of the token each input token went into."""
        batch, num_kept = self.kept.shape
        p, device = self.prefix, self.kept.device
        num_a = (self.num_tokens - p + 1) // 2
        new = torch.empty(batch, self.num_tokens, dtype=torch.long, device=device)
        new[:, :p] = torch.arange(p, device=device)
        pos_a = torch.empty(batch, num_a, dtype=torch.long, device=device)
        pos_a.scatter_(1, self.kept, (p + torch.arange(num_kept, device=device)).expand(batch, -1))
        pos_a.scatter_(1, self.src, p + num_kept + self.dst)
        new[:, p::2] = pos_a
        new[:, p + 1 :: 2] = torch.arange(p + num_kept, self.num_tokens - self.r, device=device)
        return new


def _flat_rows(index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(B, M) token indices -> (B * M,) row indices into the (B * N, C) view of a batch."""
    if index.shape[0] == 1:
        return index.reshape(-1)
    offsets = torch.arange(index.shape[0], device=index.device).unsqueeze(1) * num_tokens
    return (index + offsets).reshape(-1)


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[b, index[b, i]]: (B, N, C), (B, M) -> (B, M, C). Whole rows at once (index_select), several times faster on
    CPU than a gather with the index expanded over C."""
    batch, tokens, channels = x.shape
    return x.reshape(batch * tokens, channels).index_select(0, _flat_rows(index, tokens)).view(batch, -1, channels)


def add_rows_(x: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """x[b, index[b, i]] += values[b, i] in place (repeated indices accumulate): (B, N, C), (B, M), (B, M, C)."""
    batch, tokens, channels = x.shape
    x.view(batch * tokens, channels).index_add_(0, _flat_rows(index, tokens), values.reshape(-1, channels))
    return x


def bipartite_soft_matching(metric: torch.Tensor, r: int, prefix: int) -> TokenMerge:
    """The merge of `r` tokens (clipped to |A|) chosen on `metric` (B, N, d); the first `prefix` tokens never merge."""
    batch, num_tokens, _ = metric.shape
    if not 0 <= prefix <= num_tokens:
        raise ValueError(f"prefix {prefix} does not fit {num_tokens} tokens")
    device = metric.device
    num_a, num_b = (num_tokens - prefix + 1) // 2, (num_tokens - prefix) // 2  # A: even offsets, B: odd
    if isinstance(num_b, torch.SymInt) and 0 < int(r) <= num_b:  # traced with symbolic sizes (export, compile)
        # the sample merges all r tokens: keep r a constant and require as many B tokens (a runtime check of the
        # input size) rather than pin the token count to the sample's by a branch on it
        r = int(r)
        torch._check(num_b >= r)
    else:
        r = max(0, min(int(r), num_a if num_b else 0))  # every A token may merge, but only into a B token
    if r == 0:
        empty = torch.empty(batch, 0, dtype=torch.long, device=device)
        kept = torch.arange(num_a, device=device).expand(batch, -1)
        return TokenMerge(prefix, num_tokens, kept.contiguous(), empty, empty)
    unit = F.normalize(metric.to(torch.promote_types(metric.dtype, torch.float32)), dim=-1)
    scores = unit[:, prefix::2] @ unit[:, prefix + 1 :: 2].transpose(1, 2)  # (B, Na, Nb)
    best, best_b = scores.max(dim=-1)
    src, kept = (_ranked_split if torch.compiler.is_compiling() else _sorted_split)(best, r)
    return TokenMerge(prefix, num_tokens, kept, src, best_b.gather(1, src))


def _sorted_split(best: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, kept) from (B, Na) scores: the offsets of the r best in descending order (ties: the lower offset
    first), and the other offsets ascending."""
    order = torch.sort(best, dim=-1, descending=True, stable=True).indices
    return order[:, :r], order[:, r:].sort(dim=-1).values


def _ranked_split(best: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_sorted_split` without a sort, for traced graphs (ONNX has no stable sort; a TopK breaks ties its own way):
    each offset's place in the stable descending order counted by comparisons (O(Na²) booleans), then one scatter
    puts the kept offsets (ascending) before the merged ones (in rank order)."""
    batch, num = best.shape
    index = torch.arange(num, device=best.device)
    earlier = index.unsqueeze(1) < index.unsqueeze(0)  # [j, i]: offset j comes before offset i
    above, here = best.unsqueeze(2), best.unsqueeze(1)  # best_j along dim 1, best_i along dim 2
    rank = ((above > here) | ((above == here) & earlier)).sum(dim=1)  # (B, Na): the place of i in the order
    merged = rank < r
    slot = torch.where(merged, rank + (num - r), torch.cumsum(~merged, dim=1) - 1)
    order = torch.empty_like(rank).scatter_(1, slot, index.expand(batch, -1))
    return order[:, num - r :], order[:, : num - r]
