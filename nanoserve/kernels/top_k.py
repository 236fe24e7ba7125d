"""The top-k filter of sampling (HF's ``TopKLogitsWarper``): kernel launcher and reference.

``top_k_filter(scores, k, filter_value)`` is ``scores.masked_fill(scores < torch.topk(scores,
k)[0][..., -1, None], filter_value)``: every entry below its row's k-th largest (duplicates
counted, NaN the largest, as ``torch.topk`` counts them) becomes ``filter_value``. The
threshold is one of the row's own values and the comparison is the same, so the result is
the reference's bit for bit. ``torch.topk`` on a 128k vocabulary runs a multi-pass radix
select that takes longer than the rest of a sampled token's choice; here each chunk of a row
is sorted by its own program and one program a row picks the k-th among the chunks' best.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nanoserve.kernels.dispatch import use_triton

MAX_K = 256  # larger k: the candidates of a row outgrow one program's sort
_MAX_CANDIDATES = 16384
_MAX_CHUNK = 16384


class TopKConfig(NamedTuple):
    """Entries a stage-1 program sorts, and its warps."""

    chunk: int
    num_warps: int


def top_k_filter_ref(scores: torch.Tensor, k: int, filter_value: float) -> torch.Tensor:
    """Reference (HF's ops): scores [B, V] -> a new [B, V] tensor of scores' dtype."""
    k = min(k, scores.shape[-1])
    remove = scores < torch.topk(scores, k)[0][..., -1, None]
    return scores.masked_fill(remove, filter_value)


def candidates_per_chunk(k: int) -> int:
    """Entries each chunk keeps: k rounded up to a power of two, at least 16."""
    return max(16, 1 << (k - 1).bit_length())


def choose_config(vocab: int, k: int) -> TopKConfig:
    """Chunks of 4,096 entries, doubled (fewer chunks, fewer candidates) while a row's
    candidates would not fit one program's sort."""
    chunk = 4096
    while -(-vocab // chunk) * candidates_per_chunk(k) > _MAX_CANDIDATES:
        chunk *= 2
    return TopKConfig(chunk, num_warps=8)


def input_problem(scores: torch.Tensor, k: int) -> str | None:
    """Why ``top_k_filter`` refuses these arguments (the ValueError's message), or None."""
    if scores.dim() != 2 or scores.shape[0] < 1 or scores.shape[1] < 1:
        return f"scores: expected a non-empty [B, V] tensor, got {tuple(scores.shape)}"
    if scores.dtype != torch.float32:
        return f"scores: expected float32, got {scores.dtype}"
    if scores.stride(1) != 1:
        return "scores: the last dimension must have unit stride"
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        return f"k: expected an int in 1..{MAX_K}, got {k!r}"
    kp = candidates_per_chunk(min(k, scores.shape[1]))
    if -(-scores.shape[1] // _MAX_CHUNK) * kp > _MAX_CANDIDATES:
        return f"scores: a vocabulary of {scores.shape[1]} is too wide for k={k}"
    return None


def top_k_filter(
    scores: torch.Tensor,
    k: int,
    filter_value: float = -float("inf"),
    *,
    backend: str = "auto",
    config: TopKConfig | None = None,
) -> torch.Tensor:
    """``top_k_filter_ref``'s result in three Triton launches. scores float32 [B, V] with unit
    stride in V; k in 1..MAX_K (clamped to V, as HF clamps it). ``config`` overrides the
    chunk (benchmarks). Returns a new float32 [B, V] tensor."""
    problem = input_problem(scores, k)
    if problem is not None:
        raise ValueError(problem)
    if not use_triton(backend, scores):
        return top_k_filter_ref(scores, k, filter_value)
    from nanoserve.kernels.triton_top_k import (
        _chunk_top_kernel,
        _filter_kernel,
        _threshold_kernel,
    )

    rows, vocab = scores.shape
    k = min(k, vocab)
    kp = candidates_per_chunk(k)
    cfg = config or choose_config(vocab, k)
    if kp > cfg.chunk:
        raise ValueError(f"config: chunk {cfg.chunk} is smaller than the {kp} kept of it")
    n_chunks = -(-vocab // cfg.chunk)
    n_candidates = n_chunks * kp
    candidates = torch.empty(rows, n_candidates, dtype=torch.int32, device=scores.device)
    thresholds = torch.empty(rows, dtype=torch.float32, device=scores.device)
    out = torch.empty_like(scores, memory_format=torch.contiguous_format)
    _chunk_top_kernel[(rows, n_chunks)](
        scores, scores.stride(0), vocab, candidates, n_chunks,
        CHUNK=cfg.chunk, KP=kp, num_warps=cfg.num_warps,
    )  # fmt: skip
    ncand = 1 << (n_candidates - 1).bit_length()
    _threshold_kernel[(rows,)](
        candidates, n_candidates, k, thresholds, NCAND=ncand, num_warps=8 if ncand > 2048 else 4
    )
    block = 2048
    _filter_kernel[(rows, -(-vocab // block))](
        scores, scores.stride(0), out, out.stride(0), vocab, thresholds, float(filter_value),
        BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out
