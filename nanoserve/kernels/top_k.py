"""Top-k filtering of a step's scores: kernel launcher and reference.

``top_k_filter(scores, k)`` is ``scores.masked_fill(scores < kth, fill)`` with ``kth`` each
row's k-th largest entry, as ``torch.topk(scores, k)[0][..., -1:]`` gives it (ties counted,
NaN the largest): HF's top-k warper. ``torch.topk`` runs it as about twenty launches of a
radix select; here three Triton launches: each chunk of a row keeps its k largest entries,
one program a row picks the k-th largest of those, and the filter writes the result. Exact:
the threshold is an entry of the row, found by comparing keys, never by arithmetic.
"""

from __future__ import annotations

import math

import torch

from nanoserve.kernels.dispatch import check_backend, next_pow2, pdl_launch, use_triton

CHUNK = 4096
# the kernel path's largest k, and most candidates one program holds (chunks x padded k)
MAX_K = 256
MAX_CANDIDATES = 16384
FILTER_BLOCK = 4096


def top_k_filter_ref(scores: torch.Tensor, k: int, fill: float = -math.inf) -> torch.Tensor:
    """Reference: scores float32 [B, V], 1 <= k <= V; a new [B, V] tensor whose entries below
    each row's k-th largest are ``fill``."""
    kth = torch.topk(scores, k)[0][..., -1, None]
    return scores.masked_fill(scores < kth, fill)


def input_problem(scores, k, fill) -> str | None:
    """Why ``top_k_filter`` refuses these arguments (the ValueError's message), or None."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        return f"scores: expected a [B, V] tensor, got {getattr(scores, 'shape', type(scores))}"
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        return "scores: expected float32 [B, V] with unit stride in V"
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= scores.shape[1]:
        return f"k: expected an int in 1..{scores.shape[1]} (the row length), got {k!r}"
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        return f"fill: expected a float, got {fill!r}"
    return None


def kernel_takes(scores: torch.Tensor, k: int) -> bool:
    """Whether the Triton path holds this k: at most ``MAX_K``, and the chunks' candidates of
    a row fit one program."""
    chunks = -(-scores.shape[1] // CHUNK)
    return k <= MAX_K and next_pow2(chunks * next_pow2(k)) <= MAX_CANDIDATES


def top_k_filter(
    scores: torch.Tensor, k: int, fill: float = -math.inf, *, backend: str = "auto"
) -> torch.Tensor:
    """``top_k_filter_ref(scores, k, fill)`` in three Triton launches (CUDA with Triton, k up
    to ``MAX_K``); the reference elsewhere or with ``backend="torch"``; ``backend="triton"``
    on CPU needs TRITON_INTERPRET=1 (a k past the kernel's bounds then raises). No host
    sync. Returns a new contiguous float32 [B, V] tensor."""
    check_backend(backend)
    problem = input_problem(scores, k, fill)
    if problem is not None:
        raise ValueError(problem)
    if not use_triton(backend, scores) or (backend == "auto" and not kernel_takes(scores, k)):
        return top_k_filter_ref(scores, k, fill)
    if not kernel_takes(scores, k):
        raise ValueError(f"k: the Triton path takes k up to {MAX_K} for this row length")
    from nanoserve.kernels.triton_top_k import (
        _chunk_candidates_kernel,
        _filter_kernel,
        _row_threshold_kernel,
    )

    rows, vocab = scores.shape
    out = torch.empty(rows, vocab, dtype=scores.dtype, device=scores.device)
    if rows == 0:
        return out
    chunks = -(-vocab // CHUNK)
    k_pad = next_pow2(k)
    candidates = torch.empty(rows, chunks, k_pad, dtype=torch.int32, device=scores.device)
    threshold = torch.empty(rows, dtype=torch.float32, device=scores.device)
    launch = pdl_launch(scores.device)
    pdl = bool(launch)
    _chunk_candidates_kernel[(rows, chunks)](
        scores, candidates, vocab, chunks, k, scores.stride(0),
        CHUNK=CHUNK, K_PAD=k_pad, PDL=pdl, num_warps=8, **launch,
    )  # fmt: skip
    _row_threshold_kernel[(rows,)](
        candidates, threshold, chunks, k,
        K_PAD=k_pad, CANDIDATES_PAD=next_pow2(chunks * k_pad), PDL=pdl, num_warps=8, **launch,
    )  # fmt: skip
    _filter_kernel[(rows, -(-vocab // FILTER_BLOCK))](
        scores, threshold, out, vocab, float(fill), scores.stride(0), out.stride(0),
        BLOCK=FILTER_BLOCK, PDL=pdl, num_warps=8, **launch,
    )  # fmt: skip
    return out
