"""Token merging's choice of tokens exports to ONNX: traced, the stable descending sort (which ONNX lacks) is
replaced by ranks counted with comparisons, which must pick exactly the same tokens, ties included."""

from __future__ import annotations

import pytest
import torch

from vca_patch.targets.merge.matching import _ranked_split, _sorted_split


@pytest.mark.parametrize("r", [1, 3, 7, 8])
def test_ranks_pick_what_the_stable_sort_picks_ties_included(r):
    gen = torch.Generator().manual_seed(r)
    for levels in (3, 1000):  # 3 values: ties everywhere (flat image regions give equal similarities)
        best = torch.randint(0, levels, (5, 8), generator=gen).float() / levels
        src, kept = _ranked_split(best, r)
        want_src, want_kept = _sorted_split(best, r)
        assert torch.equal(src, want_src) and torch.equal(kept, want_kept)


def test_ties_go_to_the_lower_offset_first():
    best = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1]])
    src, kept = _ranked_split(best, 3)
    assert src.tolist() == [[1, 3, 0]] and kept.tolist() == [[2, 4]]


def test_the_traced_matching_uses_the_ranks_and_exports_without_a_sort():
    from vca_patch.targets.merge.matching import bipartite_soft_matching

    class Match(torch.nn.Module):
        def forward(self, metric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            merge = bipartite_soft_matching(metric, 2, 1)
            return merge.src, merge.dst, merge.kept

    metric = torch.randn(2, 11, 4, generator=torch.Generator().manual_seed(0))
    half = torch.export.Dim("half", min=4, max=32)  # odd token counts: the strided A/B split guards the parity
    program = torch.export.export(Match(), (metric,), dynamic_shapes=({1: 2 * half - 1},))
    assert not [n for n in program.graph.nodes if "sort" in str(n.target)]
    run = program.module()
    for n in (11, 13, 21):
        x = torch.randn(2, n, 4, generator=torch.Generator().manual_seed(n))
        want = bipartite_soft_matching(x, 2, 1)
        assert all(torch.equal(a, b) for a, b in zip(run(x), (want.src, want.dst, want.kept), strict=True))
