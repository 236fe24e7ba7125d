"""GPU tests (``pytest -m gpu``): the top-k filter at real vocabularies and batch sizes, bit
for bit against HF's ops (torch.topk, compare, masked_fill). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from test_top_k import same, scores_with_hazards

from nanoserve.kernels.top_k import MAX_K, top_k_filter, top_k_filter_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("vocab", [32000, 49152, 128256, 151936, 256000])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("k", [1, 50, 64, 65, MAX_K])
def test_equals_hf_ops(vocab, rows, k):
    scores = scores_with_hazards(rows, vocab, k, seed=vocab + rows * k).cuda()
    out = top_k_filter(scores, k, -float("inf"))
    assert same(out, top_k_filter_ref(scores, k, -float("inf")))


def test_under_graph_replay():
    """Captured once, replayed on new scores written into the same buffer."""
    scores = torch.randn(16, 128256, device="cuda")
    top_k_filter(scores, 50)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = top_k_filter(scores, 50)
    for seed in range(3):
        scores.copy_(scores_with_hazards(16, 128256, 50, seed=seed).cuda())
        graph.replay()
        assert same(out, top_k_filter_ref(scores, 50, -float("inf")))
