"""Top-k filtering of a step's scores: kernel launcher and reference.

``top_k_filter(scores, k)`` is ``scores.masked_fill(scores < kth, fill)`` with ``kth`` each
row's k-th largest entry, as ``torch.topk(scores, k)[0][..., -1:]`` gives it on CUDA (ties
counted, NaN the largest; but for k of at least ``NEGATIVE_NAN_LAST_FROM_K`` CUDA's topk sorts
its k values with a NaN whose sign bit is set last, so a row holding one, fewer than k NaN in
all, gets NaN there): HF's top-k warper. ``torch.topk`` runs it
as about twenty launches of a radix select and a sort; here five small Triton launches find
the k-th largest among the few entries at or above a bound (the k-th largest of the maxima
of groups of 32 entries, or of coarser groups: ``bound_group``), then filter. Exact: the
threshold is an entry of the row, found by comparing order-keeping integer keys, never by
arithmetic.
"""

from __future__ import annotations

import math

import torch

from nanoserve.kernels.dispatch import check_backend, next_pow2, pdl_launch, use_triton

CHUNK = 4096  # entries a program of the group, gather and fallback passes reads
GROUP = 32  # entries a group maximum covers (one 128-byte line of float32)
CAPACITY = 4096  # candidates a row keeps; past them the threshold reads the whole row
FILTER_BLOCK = 4096
BOUND_GROUPS_PER_K = 2  # coarse maxima a row needs per k to bound by them
NARROW_PER_K = 4  # candidate slots the narrow threshold search covers per k
MAX_K = 1024  # the kernel path's largest k ("auto"; past it torch.topk)
MAX_GROUPS = 16384  # group maxima one program searches (vocabularies up to 524,288)
# from this k torch's CUDA topk sorts its values by a radix sort, which puts a negative NaN
# last; below it, a comparison sort that takes every NaN as the largest
NEGATIVE_NAN_LAST_FROM_K = 33


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
    # (torch's masked_fill refuses these; the kernel would write them rounded to +-inf)
    if isinstance(fill, int) and not -(2**63) <= fill < 2**63:
        return f"fill: {fill!r} is outside int64's range"
    if math.isfinite(fill) and abs(fill) > torch.finfo(torch.float32).max:
        return f"fill: {fill!r} is outside float32's range"
    return None


def kernel_takes(scores: torch.Tensor, k: int) -> bool:
    """Whether the Triton path holds this problem: k at most ``MAX_K`` and a row's group
    maxima within one program's ``MAX_GROUPS``."""
    return k <= MAX_K and -(-scores.shape[1] // GROUP) <= MAX_GROUPS


def bound_group(vocab: int, k: int) -> int:
    """Entries under each maximum that the lower bound is the k-th largest of: the coarsest
    power-of-two multiple of ``GROUP`` up to ``CHUNK`` of which a row has at least
    ``BOUND_GROUPS_PER_K * k`` (``GROUP`` when none has). Coarser maxima make a smaller
    search; k of them per ``BOUND_GROUPS_PER_K * k`` keep the candidates near k."""
    size = GROUP
    while size < CHUNK and -(-vocab // (2 * size)) >= BOUND_GROUPS_PER_K * k:
        size *= 2
    return size


def narrow_slots(k: int) -> int:
    """Candidate slots the threshold's first search covers (more candidates take the
    ``CAPACITY``-wide search): a power of two of at least ``NARROW_PER_K * k``."""
    return min(CAPACITY, next_pow2(max(128, NARROW_PER_K * k)))


def search_warps(width: int) -> int:
    """Warps of a program searching ``width`` keys: one for up to 128 (no cross-warp
    reduction), up to 8."""
    return min(8, max(1, width // 128))


def top_k_filter(
    scores: torch.Tensor, k: int, fill: float = -math.inf, *, backend: str = "auto"
) -> torch.Tensor:
    """``top_k_filter_ref(scores, k, fill)`` as on CUDA, in five Triton launches (CUDA with
    Triton, k up to ``MAX_K``); the reference elsewhere or with ``backend="torch"``;
    ``backend="triton"`` on CPU needs TRITON_INTERPRET=1 (a problem past the kernel's bounds
    then raises). No host sync. Returns a new contiguous float32 [B, V] tensor."""
    check_backend(backend)
    problem = input_problem(scores, k, fill)
    if problem is not None:
        raise ValueError(problem)
    if not use_triton(backend, scores) or (backend == "auto" and not kernel_takes(scores, k)):
        return top_k_filter_ref(scores, k, fill)
    if not kernel_takes(scores, k):
        raise ValueError(
            f"k: the Triton path takes k up to {MAX_K} and rows up to {MAX_GROUPS * GROUP}"
        )
    from nanoserve.kernels import triton_top_k as kernels

    rows, vocab = scores.shape
    out = torch.empty(rows, vocab, dtype=scores.dtype, device=scores.device)
    if rows == 0:
        return out
    chunks = -(-vocab // CHUNK)
    groups = chunks * (CHUNK // GROUP)
    coarse_size = bound_group(vocab, k)
    int32 = dict(dtype=torch.int32, device=scores.device)
    maxima = torch.empty(rows, groups, **int32)
    coarse = maxima
    if coarse_size > GROUP:
        coarse = torch.empty(rows, chunks * (CHUNK // coarse_size), **int32)
    bound, count = torch.empty(rows, **int32), torch.empty(rows, **int32)
    candidates = torch.empty(rows, CAPACITY, **int32)
    threshold = torch.empty(rows, dtype=torch.float32, device=scores.device)
    launch = pdl_launch(scores.device)
    pdl = bool(launch)
    kernels._group_max_kernel[(rows, chunks)](
        scores, maxima, coarse, vocab, scores.stride(0), maxima.stride(0), coarse.stride(0),
        CHUNK=CHUNK, GROUP=GROUP, COARSE=coarse_size, PDL=pdl, num_warps=4, **launch,
    )  # fmt: skip
    searched = next_pow2(coarse.shape[1])
    kernels._lower_bound_kernel[(rows,)](
        coarse, bound, count, -(-vocab // coarse_size), k, coarse.stride(0),
        GROUPS_PAD=searched, PDL=pdl, num_warps=search_warps(searched), **launch,
    )  # fmt: skip
    kernels._gather_kernel[(rows, chunks)](
        scores, maxima, bound, count, candidates, vocab, CAPACITY,
        scores.stride(0), maxima.stride(0), candidates.stride(0),
        CHUNK=CHUNK, GROUP=GROUP, PDL=pdl, num_warps=4, **launch,
    )  # fmt: skip
    kernels._threshold_kernel[(rows,)](
        scores, candidates, count, threshold, vocab, k, scores.stride(0), candidates.stride(0),
        NARROW=narrow_slots(k), CAPACITY=CAPACITY, CHUNK=CHUNK,
        NEGATIVE_NAN_LAST=k >= NEGATIVE_NAN_LAST_FROM_K, PDL=pdl, num_warps=4, **launch,
    )  # fmt: skip
    kernels._filter_kernel[(rows, -(-vocab // FILTER_BLOCK))](
        scores, threshold, out, vocab, float(fill), scores.stride(0), out.stride(0),
        BLOCK=FILTER_BLOCK, PDL=pdl, num_warps=8, **launch,
    )  # fmt: skip
    return out
