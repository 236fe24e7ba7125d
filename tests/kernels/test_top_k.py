"""The top-k filter of sampling: Triton (interpreter) against HF's ops (torch.topk, compare,
masked_fill), bit for bit, with ties, NaN, infinities and signed zeros; bad input."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import needs_interpreter

from nanoserve.kernels.top_k import MAX_K, TopKConfig, choose_config, top_k_filter, top_k_filter_ref

SMALL = TopKConfig(chunk=1024, num_warps=4)  # several chunks a row at a CPU test's vocabulary


def same(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal bit for bit where it matters: the same NaNs, the same values (signed zeros too)."""
    return torch.equal(out.isnan(), ref.isnan()) and torch.equal(
        out.nan_to_num().view(torch.int32), ref.nan_to_num().view(torch.int32)
    )


def scores_with_hazards(rows: int, vocab: int, k: int, seed: int) -> torch.Tensor:
    """Random scores whose rows hold, in turn: a few NaN (fewer than k), a run of values tied
    at the k-th largest, a block of -inf and one of +inf, -0.0 and +0.0 at the threshold."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 4
    for row in range(rows):
        cols = torch.randperm(vocab, generator=gen)
        kind = row % 4
        if kind == 0:
            x[row, cols[: max(1, k // 3)]] = float("nan")
        elif kind == 1:
            tied = x[row].sort(descending=True).values[k - 1]
            x[row, cols[: k + 5]] = tied
        elif kind == 2:
            x[row, cols[: vocab // 3]] = -float("inf")
            x[row, cols[vocab // 3 : vocab // 3 + 2]] = float("inf")
        else:
            x[row] = x[row].abs() * -1
            x[row, cols[: k // 2 + 1]] = 0.0
            x[row, cols[k // 2 + 1 : k + 3]] = -0.0
    return x


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize(
    ("rows", "vocab", "k", "config"),
    [
        (4, 1500, 50, SMALL),  # every hazard, two chunks a row, the second ragged
        (2, 1100, MAX_K, SMALL),  # the largest k: 256 kept of each chunk
        (2, 1024, 1, SMALL),  # k = 1: the row's maximum, one exact chunk
        (1, 17, 20, SMALL),  # k past the vocabulary: clamped, nothing removed
    ],
)
def test_matches_reference_bit_for_bit(rows, vocab, k, config):
    """Planted: the key map without the flip of negatives' magnitude bits, the k-th taken as
    the (k+1)-th, and the chunk keeping only half of its best: each failed."""
    scores = scores_with_hazards(rows, vocab, min(k, vocab), seed=rows * vocab + k)
    out = top_k_filter(scores, k, -float("inf"), backend="triton", config=config)
    ref = top_k_filter_ref(scores, k, -float("inf"))
    assert same(out, ref)
    kept = (out != -float("inf")).sum(dim=1)
    assert (kept >= min(k, vocab)).all()  # (ties and NaN keep more)


@needs_interpreter
def test_many_nan_keep_the_row_and_strided_rows():
    """A row with k or more NaN has NaN as its k-th largest: nothing is removed (stock then
    raises at the draw). Rows of a wider tensor (stride past the vocabulary) are read in
    place; the filter value is the caller's."""
    wide = torch.randn(2, 1300)
    scores = wide[:, :1100]
    scores[1, :40] = float("nan")
    out = top_k_filter(scores, 32, -7.5, backend="triton", config=SMALL)
    ref = top_k_filter_ref(scores, 32, -7.5)
    assert same(out, ref)
    assert same(out[1], scores[1])  # nothing removed
    assert (out[0] == -7.5).sum() == 1100 - 32


def test_bad_input_names_the_argument():
    scores = torch.randn(2, 64)
    cases = [
        (scores.double(), 4, "scores"),
        (scores[0], 4, "scores"),
        (scores.t(), 4, "scores"),
        (scores, 0, "k"),
        (scores, MAX_K + 1, "k"),
        (scores, True, "k"),
        (torch.randn(1, 1_100_000), MAX_K, "scores"),  # candidates past one sort
    ]
    for bad, k, name in cases:
        with pytest.raises(ValueError, match=name):
            top_k_filter(bad, k, backend="torch")


def test_reference_is_hf_top_k_warper():
    """The reference is HF's TopKLogitsWarper on the same scores (-inf filter)."""
    from transformers.generation.logits_process import TopKLogitsWarper

    scores = scores_with_hazards(4, 300, 20, seed=5)
    warper = TopKLogitsWarper(top_k=20)
    assert same(top_k_filter_ref(scores, 20, -float("inf")), warper(None, scores))


def test_config_keeps_candidates_in_one_sort():
    for vocab in (32000, 128256, 151936, 256000):
        for k in (1, 50, MAX_K):
            cfg = choose_config(vocab, k)
            assert -(-vocab // cfg.chunk) * max(16, 1 << (k - 1).bit_length()) <= 16384
