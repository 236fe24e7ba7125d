"""pick_tokens: Triton (interpreter) against the eager ops, on the GPU too (``-m gpu``): ties,
NaN and all -inf rows, chunk edges, a compacted batch's noise rows, the pad / EOS / positions
updates, bad input."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_inputs import ON_GPU, needs_interpreter

from nanoserve.kernels.token_pick import CHUNK, pick_tokens, pick_tokens_ref


def scores_with_edges(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [rows, vocab]: random scores with a tie for the largest in row 0 (its first
    copy must win), a NaN pair in row 1 (the first NaN wins), -inf everywhere in row 2, +inf
    in row 3, and masked (-inf) halves in the rest."""
    scores = torch.randn(rows, vocab, generator=gen) * 4
    scores[4:][torch.rand(max(rows - 4, 0), vocab, generator=gen) < 0.5] = float("-inf")
    if vocab >= 3:
        top = scores[0].max() + 1
        scores[0, vocab - 1] = top
        scores[0, vocab // 2] = top
    if rows > 1 and vocab >= 2:
        scores[1, vocab - 1] = float("nan")
        scores[1, (vocab - 1) // 3] = float("nan")
    if rows > 2:
        scores[2] = float("-inf")
    if rows > 3:
        scores[3, vocab // 4] = float("inf")
    return scores


def run_both(scores, noise=None, noise_rows=None, with_flags=True, device="cpu"):
    """(kernel's (tokens, invalid, unfinished, positions), the reference's), each on its own
    copies of the in-place arguments."""
    rows = scores.shape[0]
    gen = torch.Generator().manual_seed(rows)
    unfinished = (torch.rand(rows, generator=gen) > 0.3).to(device)
    positions = torch.randint(0, 1000, (rows, 1), generator=gen).to(device)
    pad = torch.tensor(0, device=device)
    eos = torch.tensor([1, 2, scores.shape[1] - 1], device=device)
    results = []
    for fn, backend in ((pick_tokens, {"backend": "triton"}), (pick_tokens_ref, {})):
        flags = (unfinished.clone(), pad, eos, positions.clone()) if with_flags else ()
        tokens, invalid = fn(scores, noise, noise_rows, *flags, **backend)
        results.append((tokens, invalid, *(flags[0:1] + flags[3:4])))
    return results


def assert_same(kernel, reference):
    assert kernel[0].dtype == torch.int64
    assert torch.equal(kernel[0], reference[0])
    assert bool(kernel[1]) == bool(reference[1])
    for got, expected in zip(kernel[2:], reference[2:], strict=True):
        assert torch.equal(got, expected)


VOCABS = [1, 3, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("vocab", VOCABS)
def test_greedy_pick_is_the_first_argmax(rows, vocab):
    """The argmax (greedy) with pad / EOS / positions, and without them. Planted: the last
    largest entry instead of the first (the tie row), a NaN not counted as the largest, and
    the EOS test's result not stored: each failed."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    scores = scores_with_edges(rows, vocab, gen)
    assert_same(*run_both(scores))
    assert_same(*run_both(scores, with_flags=False))
    assert torch.equal(pick_tokens(scores, backend="triton")[0], torch.argmax(scores, dim=-1))


@needs_interpreter
@pytest.mark.parametrize("vocab", [128256, 49152, 151936, 32000, 4096 + 32, 50257, 1000])
def test_greedy_pick_equals_argmax_on_random_rows_ties_and_nan(vocab):
    """At real vocabularies: ties across and within chunks, all -inf, NaN, all equal, the
    last entry (the loop's greedy choice was ``greedy_tokens``'s two-step argmax before)."""
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
    assert torch.equal(pick_tokens(scores, backend="triton")[0], expected)
    assert expected.tolist()[1:7] == [a, a, 0, b, 0, vocab - 1]


@needs_interpreter
def test_strided_rows():
    """Rows apart in memory (unit stride within a row), as a view of a wider tensor."""
    scores = torch.randn(3, 2 * 8192)[:, :8192]
    assert torch.equal(pick_tokens(scores, backend="triton")[0], torch.argmax(scores, dim=-1))


@needs_interpreter
@pytest.mark.parametrize("vocab", [2, CHUNK + 1, 2 * CHUNK + 7])
@pytest.mark.parametrize("compacted", [False, True])
def test_sampled_pick_draws_as_multinomial(vocab, compacted):
    """probs / noise with each row's noise row (a compacted batch reads rows of a larger draw)
    equals ``torch.multinomial``'s draw over the whole batch and the reference; a NaN
    distribution sets ``invalid``. Planted: the noise read from the batch row instead of
    ``noise_rows``: failed. (The interpreter divides exactly whatever division the kernel
    asks for, so a plant of Triton's approximate one cannot fail here.)"""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    rows, total = 6, 9
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[torch.rand(rows, vocab, generator=gen) < 0.4] = float("-inf")
    logits[:, 0] = 0.0
    probs = torch.softmax(logits, dim=-1)
    index = torch.randperm(total, generator=gen)[:rows] if compacted else None
    torch.manual_seed(seed)
    noise = torch.empty(total if compacted else rows, vocab).exponential_(1)
    kernel, reference = run_both(probs, noise, index)
    assert_same(kernel, reference)
    assert not bool(kernel[1])
    full = probs
    if compacted:  # the rows that left hold other valid distributions
        full = torch.softmax(torch.randn(total, vocab, generator=gen), dim=-1)
        full[index] = probs
    torch.manual_seed(seed)
    expected = torch.multinomial(full, num_samples=1).squeeze(1)
    expected = expected[index] if compacted else expected
    assert torch.equal(pick_tokens(probs, noise, index, backend="triton")[0], expected)
    probs[rows // 2, vocab // 2] = float("nan")
    kernel, reference = run_both(probs, noise, index)
    assert_same(kernel, reference)
    assert bool(kernel[1])


@pytest.mark.parametrize("device", ON_GPU)
@pytest.mark.parametrize("rows", [1, 3, 64, 130])
@pytest.mark.parametrize("vocab", [CHUNK + 1, 32000, 128256, 151936])
def test_pick_on_the_gpu_matches_eager(device, rows, vocab):
    """On CUDA, greedy and sampled picks against the eager ops (rows past the second pass's
    row block, real vocabularies), and replayed from a CUDA graph on new inputs."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    scores = scores_with_edges(rows, vocab, gen).to(device)
    assert_same(*run_both(scores, device=device))
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, dim=-1).to(device)
    noise = torch.empty(rows + 2, vocab, device=device).exponential_(1)
    index = torch.randperm(rows + 2, generator=gen)[:rows].to(device)
    assert_same(*run_both(probs, noise, index, device=device))
    pick_tokens(probs, noise, index)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, _ = pick_tokens(probs, noise, index)
    probs.copy_(torch.softmax(torch.randn(rows, vocab, generator=gen), dim=-1).to(device))
    noise.exponential_(1)
    graph.replay()
    assert torch.equal(tokens, pick_tokens_ref(probs, noise, index)[0])


def test_reference_off_the_gpu_and_empty_batches():
    """backend 'auto' on the CPU is the reference; no rows give no tokens."""
    scores = torch.randn(4, 10)
    assert torch.equal(pick_tokens(scores)[0], scores.argmax(dim=-1))
    tokens, invalid = pick_tokens(torch.empty(0, 10), backend="torch")
    assert tokens.shape == (0,) and not bool(invalid)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(scores=torch.zeros(3)), "scores: expected a \\[B, V\\]"),
        (dict(scores=torch.zeros(2, 5, dtype=torch.float16)), "scores: expected float32"),
        (dict(noise=torch.zeros(2, 4)), "noise: expected float32 \\[T, 5\\]"),
        (dict(noise=torch.zeros(3, 5)), "noise: 3 rows for 2"),
        (dict(noise_rows=torch.zeros(2, dtype=torch.int64)), "noise_rows: expected"),
        (dict(pad=torch.tensor(0)), "unfinished: expected"),
        (dict(unfinished=torch.ones(2, dtype=torch.bool), pad=torch.tensor([0, 1])), "pad:"),
        (dict(unfinished=torch.ones(2, dtype=torch.bool), eos=torch.tensor([1.0])), "eos:"),
        (dict(positions=torch.zeros(2, dtype=torch.int64)), "positions: expected"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(kwargs, message):
    """Each bad argument raises a ValueError naming it, before any write."""
    args = dict(scores=torch.zeros(2, 5)) | kwargs
    with pytest.raises(ValueError, match=message):
        pick_tokens(**args, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        pick_tokens(torch.zeros(2, 5), backend="cuda")
