"""The decode loop's greedy choice: ``torch.argmax``'s answer, ties and NaN included."""

from __future__ import annotations

import pytest
import torch

from nanoserve.adapters.device_sampling import greedy_tokens


@pytest.mark.parametrize("vocab", [128256, 49152, 151936, 32000, 4096 + 32, 50257, 1000])
def test_equals_argmax_on_random_rows_ties_and_nan(vocab):
    gen = torch.Generator().manual_seed(vocab)
    scores = torch.randn(7, vocab, generator=gen)
    top = scores.max().item() + 1.0
    # row 1: the max twice, in different chunks; row 2: twice in one chunk
    a, b = vocab // 3, vocab // 2
    scores[1, [vocab - 5, a, b]] = top
    scores[2, [a, a + 1]] = top
    scores[3] = float("-inf")  # every entry masked: index 0
    scores[4, [b, vocab - 1]] = float("nan")  # NaN counts as the largest: the first
    scores[5, :] = 0.0  # all equal: index 0
    scores[6, -1] = top  # the last entry
    expected = torch.argmax(scores, dim=-1)
    assert torch.equal(greedy_tokens(scores), expected)
    assert expected.tolist()[1:7] == [a, a, 0, b, 0, vocab - 1]


def test_strided_scores():
    scores = torch.randn(3, 2 * 8192)[:, ::2]
    assert torch.equal(greedy_tokens(scores), torch.argmax(scores, dim=-1))
