"""top_k_filter: Triton (interpreter; on the GPU with ``-m gpu``) against HF's top-k warper's
ops: ties across the threshold and over more entries than the candidate list holds, NaN of
both signs, -inf rows, signed zeros, k at 1 and at the row length, chunk edges; the warper's
own output; bad input."""

from __future__ import annotations

import math
import os

import pytest
import torch
from kernel_inputs import ON_GPU, needs_interpreter
from transformers.generation.logits_process import TopKLogitsWarper

from nanoserve.kernels.top_k import (
    CAPACITY,
    CHUNK,
    GROUP,
    MAX_K,
    NEGATIVE_NAN_LAST_FROM_K,
    bound_group,
    narrow_slots,
    top_k_filter,
    top_k_filter_ref,
)


def hard_scores(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [rows, vocab]: random scores, coarsely rounded in row 0 (many ties, some at
    the threshold), NaN of both signs, -inf and signed zeros in row 1, all -inf in row 2, a
    masked half in row 3 (-inf), large magnitudes of both signs in row 4, one value in row 5
    (a tie over the whole row), positive NaN only in row 6."""
    scores = torch.randn(rows, vocab, generator=gen) * 3
    scores[0] = (scores[0] * 2).round() / 2
    if rows > 1:
        picks = torch.randint(0, vocab, (4, 3), generator=gen)
        scores[1, picks[0]] = float("nan")
        scores[1, picks[0, 0]] = -torch.tensor(float("nan"))  # a NaN with its sign bit set
        scores[1, picks[1]] = float("-inf")
        scores[1, picks[2]] = -0.0
        scores[1, picks[3]] = 0.0
    if rows > 2:
        scores[2] = float("-inf")
    if rows > 3:
        scores[3][torch.rand(vocab, generator=gen) < 0.5] = float("-inf")
    if rows > 4:
        scores[4] *= 1e30
    if rows > 5:
        scores[5] = 1.5
    if rows > 6:
        scores[6, torch.randint(0, vocab, (2,), generator=gen)] = float("nan")
    return scores


def as_on_cuda(scores: torch.Tensor, k: int, fill: float = -math.inf) -> torch.Tensor:
    """``top_k_filter_ref`` as CUDA's ``torch.topk`` gives it (the GPU tests check that
    against CUDA itself): where a row holds a NaN with its sign bit set and fewer than k NaN
    in all, and k is at least ``NEGATIVE_NAN_LAST_FROM_K``, CUDA's k-th value is NaN and the
    row is left whole. On the CPU the same row's k-th value is the k-th largest, NaN counted
    as the largest."""
    expected = top_k_filter_ref(scores, k, fill)
    nan = scores.isnan()
    negative_nan = (nan & torch.signbit(scores)).any(dim=1) & (nan.sum(dim=1) < k)
    negative_nan &= k >= NEGATIVE_NAN_LAST_FROM_K
    return torch.where(negative_nan[:, None], scores, expected)


def assert_same(got: torch.Tensor, expected: torch.Tensor):
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert torch.equal(torch.signbit(got), torch.signbit(expected))


@needs_interpreter
@pytest.mark.parametrize(
    ("vocab", "k"),
    [(1, 1), (7, 3), (7, 7), (GROUP * 3, 5), (CHUNK - 1, 50), (CHUNK, 1), (CHUNK + 1, 50),
     (2 * CHUNK + 9, 300), (3 * CHUNK, 40), (CHUNK, 32), (CHUNK, 33),
     (CAPACITY + 2 * GROUP, MAX_K)],
)  # fmt: skip
def test_filter_matches_the_warpers_ops(vocab, k):
    """Against ``scores.masked_fill(scores < topk(...)[..., -1:], fill)`` bit for bit (as on
    CUDA, ``as_on_cuda``), and HF's warper itself on rows without a negative NaN. Rows 2 and
    5 (-inf, one value) overflow the candidate list past ``CAPACITY`` entries. Planted: the
    bound from the (k-1)-th largest group maximum (a candidate short), every gather writing
    from slot 0, negative floats' keys not flipped, the negative NaN's rule left out, the
    fallback's count strict: each failed."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    scores = hard_scores(7, vocab, gen)
    for fill in (-math.inf, -1e4):
        assert_same(top_k_filter(scores, k, fill, backend="triton"), as_on_cuda(scores, k, fill))
    warper = TopKLogitsWarper(top_k=k)
    expected = warper(torch.zeros(7, 1, dtype=torch.long), scores.clone())
    got = top_k_filter(scores, k, backend="triton")
    plain = torch.ones(7, dtype=torch.bool)
    plain[1] = k < NEGATIVE_NAN_LAST_FROM_K  # (a negative NaN: CUDA's topk may sort it last)
    assert_same(got[plain], expected[plain])


@needs_interpreter
@pytest.mark.parametrize(
    ("vocab", "k"), [(3 * CHUNK + 5, 1), (3 * CHUNK + 5, 7), (2 * CHUNK + 3, 20)]
)
def test_each_search_path_matches_the_ops(vocab, k):
    """Rows whose candidates fit the narrow search (row 0), the ``CAPACITY``-wide one (row 1:
    300 entries tied at the top) and neither (row 2: 5,000 tied), with the bound taken from
    coarse maxima (``bound_group`` past ``GROUP``), against the warper's ops. Planted: a chunk's
    largest entry standing for each of its coarse groups (counted more than once), the narrow
    search a slot short: each failed. (Any entry of a coarse group would keep the bound
    valid, so coarse minima of group maxima are no bug: only slower.)"""
    assert bound_group(vocab, k) > GROUP and narrow_slots(k) < 300 < CAPACITY < 5000 < vocab
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    scores = torch.randn(3, vocab, generator=gen)
    scores[1, torch.randperm(vocab, generator=gen)[:300]] = 9.0
    scores[2, torch.randperm(vocab, generator=gen)[:5000]] = 9.0
    assert_same(top_k_filter(scores, k, backend="triton"), top_k_filter_ref(scores, k))


@pytest.mark.parametrize("device", ON_GPU)
@pytest.mark.parametrize("rows", [1, 8, 64, 65])
@pytest.mark.parametrize("vocab", [32000, 128256, 151936, 262144])
@pytest.mark.parametrize("k", [1, 20, 32, 33, 50, MAX_K])
def test_filter_on_the_gpu(device, rows, vocab, k):
    """On CUDA against the warper's ops there (CUDA's ``torch.topk``, negative NaN included)
    at real vocabularies (Gemma 3's 262,144 included), and replayed from a CUDA graph on new
    scores."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    scores = hard_scores(rows, vocab, gen).to(device)
    assert_same(top_k_filter(scores, k), top_k_filter_ref(scores, k))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = top_k_filter(scores, k)
    scores.copy_(hard_scores(rows, vocab, gen))
    graph.replay()
    assert_same(out, top_k_filter_ref(scores, k))


def test_reference_off_the_gpu_and_past_the_kernels_k():
    """'auto' on the CPU, and a k past ``MAX_K`` with 'auto', are the reference; forcing the
    kernel there is refused."""
    scores = torch.randn(3, MAX_K + 10)
    assert_same(top_k_filter(scores, 5), top_k_filter_ref(scores, 5))
    assert_same(top_k_filter(scores, MAX_K + 1), top_k_filter_ref(scores, MAX_K + 1))
    with pytest.raises(ValueError, match="k: the Triton path takes k up to"):
        top_k_filter(scores, MAX_K + 1, backend="triton")


@pytest.mark.parametrize(
    ("scores", "k", "fill", "message"),
    [
        (torch.zeros(5), 1, -1.0, "scores: expected a \\[B, V\\]"),
        (torch.zeros(2, 5, dtype=torch.float16), 1, -1.0, "scores: expected float32"),
        (torch.zeros(5, 2).T, 1, -1.0, "scores: expected float32"),
        (torch.zeros(2, 5), 0, -1.0, "k: expected an int in 1..5"),
        (torch.zeros(2, 5), 6, -1.0, "k: expected"),
        (torch.zeros(2, 5), 2.0, -1.0, "k: expected"),
        (torch.zeros(2, 5), 2, "x", "fill: expected a float"),
        (torch.zeros(2, 5), 2, torch.tensor(-1.0), "fill: expected a float"),
        (torch.zeros(2, 5), 2, 1e39, "fill: 1e\\+39 is outside float32's range"),
        (torch.zeros(2, 5), 2, -(2**70), "fill: -1180591620717411303424 is outside int64's"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(scores, k, fill, message):
    with pytest.raises(ValueError, match=message):
        top_k_filter(scores, k, fill)
