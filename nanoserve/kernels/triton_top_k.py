"""Triton kernels of ``top_k.py``: each row's k-th largest entry, found among few candidates,
then the filter.

A float's key is its bits with the sign bit flipped (non-negative values) or every bit
flipped (negative ones), so keys order as the floats do and -0.0 sits just below +0.0; NaN
takes a key above every number's (0xFFFFFFFF, or 0xFFFFFFFE for one with its sign bit set),
as in ``torch.topk``. Key 0 belongs to no float and pads.

1. ``_group_max_kernel``: the largest key of each group of ``GROUP`` entries, and of each
   coarse group of ``COARSE`` entries (when coarser).
2. ``_lower_bound_kernel``: the k-th largest of a row's coarse group maxima. The k largest
   maxima are k entries of the row, so the row's k-th largest key is at least this bound, and
   the entries at or above it (the candidates) are few: about k for scores without long ties
   when the row has a few coarse groups per k.
3. ``_gather_kernel``: the candidates, read only from groups whose maximum reaches the bound,
   appended to the row's list (up to ``capacity``; the count goes on past it).
4. ``_threshold_kernel``: the k-th largest candidate (a search over ``NARROW`` slots when
   the candidates fit, else over ``CAPACITY``), or, when the list overflowed (ties over
   many entries, a row of -inf), the k-th largest key of the whole row by passes over it;
   as a float, NaN where ``torch.topk`` on CUDA returns NaN as the k-th value (k NaN, or a
   negative NaN when its sort of the k values puts that last).
5. ``_filter_kernel``: the entries below the threshold replaced by the fill value.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanoserve.kernels.triton_common import pdl_enter


@triton.jit
def _keys(x):
    """uint32 keys of float32 ``x`` that order as the floats; NaN above every number."""
    bits = x.to(tl.uint32, bitcast=True)
    negative = (bits >> 31) != 0
    flip = tl.where(negative, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    nan_key = tl.where(negative, 0xFFFFFFFE, 0xFFFFFFFF).to(tl.uint32)
    return tl.where(x != x, nan_key, bits ^ flip).to(tl.uint32)


@triton.jit
def _float_of_key(key):
    """The float32 whose key is ``key`` (NaN for the NaN keys)."""
    bits = tl.where((key >> 31) != 0, key ^ 0x80000000, ~key).to(tl.uint32)
    return tl.where(key >= 0xFFFFFFFE, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _kth_largest_key(keys, k):
    """The ``k``-th largest of the uint32 ``keys`` (a 1-D tensor; 0 when fewer than k are
    nonzero), bit by bit from the top: the largest t with at least k keys >= t."""
    found = tl.zeros([], tl.uint32)
    for bit in tl.static_range(31, -1, -1):
        trial = found | (tl.full([], 1, tl.uint32) << bit)
        enough = tl.sum((keys >= trial).to(tl.int32), 0) >= k
        found = tl.where(enough, trial, found)
    return found


@triton.jit
def _group_max_kernel(
    scores, maxima, coarse, vocab, stride_s, stride_m, stride_c,
    CHUNK: tl.constexpr, GROUP: tl.constexpr, COARSE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < vocab
    x = tl.load(scores + row.to(tl.int64) * stride_s + cols, mask=inside, other=0.0)
    keys = tl.where(inside, _keys(x), 0).to(tl.uint32)
    top = tl.max(tl.reshape(keys, (CHUNK // GROUP, GROUP)), axis=1)
    groups = chunk * (CHUNK // GROUP) + tl.arange(0, CHUNK // GROUP)
    # (int32 storage: the keys' bits)
    tl.store(maxima + row.to(tl.int64) * stride_m + groups, top.to(tl.int32, bitcast=True))
    if COARSE > GROUP:
        wide = tl.max(tl.reshape(top, (CHUNK // COARSE, COARSE // GROUP)), axis=1)
        at = chunk * (CHUNK // COARSE) + tl.arange(0, CHUNK // COARSE)
        tl.store(coarse + row.to(tl.int64) * stride_c + at, wide.to(tl.int32, bitcast=True))


@triton.jit
def _lower_bound_kernel(
    maxima, bound, count, num_groups, k, stride_m,
    GROUPS_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    g = tl.arange(0, GROUPS_PAD)
    top = tl.load(maxima + row.to(tl.int64) * stride_m + g, mask=g < num_groups, other=0)
    least = _kth_largest_key(top.to(tl.uint32, bitcast=True), k)
    tl.store(bound + row, least.to(tl.int32, bitcast=True))
    tl.store(count + row, 0)


@triton.jit
def _gather_kernel(
    scores, maxima, bound, count, candidates, vocab, capacity, stride_s, stride_m, stride_c,
    CHUNK: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    least = tl.load(bound + row).to(tl.uint32, bitcast=True)
    groups = chunk * (CHUNK // GROUP) + tl.arange(0, CHUNK // GROUP)
    top = tl.load(maxima + row.to(tl.int64) * stride_m + groups).to(tl.uint32, bitcast=True)
    hot = tl.broadcast_to((top >= least)[:, None], (CHUNK // GROUP, GROUP))
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    # groups below the bound are not read (their lanes are masked off)
    read = tl.reshape(hot, (CHUNK,)) & (cols < vocab)
    x = tl.load(scores + row.to(tl.int64) * stride_s + cols, mask=read, other=0.0)
    keys = tl.where(read, _keys(x), 0).to(tl.uint32)
    take = read & (keys >= least)
    taken = tl.sum(take.to(tl.int32), 0)
    start = tl.atomic_add(count + row, taken)
    slot = start + tl.cumsum(take.to(tl.int32), 0) - 1
    target = candidates + row.to(tl.int64) * stride_c + slot
    tl.store(target, keys.to(tl.int32, bitcast=True), mask=take & (slot < capacity))


@triton.jit
def _search_candidates(candidates, row, taken, k, stride_c, WIDTH: tl.constexpr):
    """(k-th largest key, whether a negative NaN is among them) of the ``taken`` candidate
    keys of ``row``, searched over WIDTH slots. Every NaN of the row is a candidate unless k
    of them are, and then the k-th is NaN's."""
    i = tl.arange(0, WIDTH)
    keys = tl.load(candidates + row.to(tl.int64) * stride_c + i, mask=i < taken, other=0)
    keys = keys.to(tl.uint32, bitcast=True)
    return _kth_largest_key(keys, k), tl.max((keys == 0xFFFFFFFE).to(tl.int32), 0)


@triton.jit
def _threshold_kernel(
    scores, candidates, count, threshold, vocab, k, stride_s, stride_c,
    NARROW: tl.constexpr, CAPACITY: tl.constexpr, CHUNK: tl.constexpr,
    NEGATIVE_NAN_LAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    taken = tl.load(count + row)
    if taken <= NARROW:  # (the usual case: a search over few slots)
        kth, negative_nan = _search_candidates(candidates, row, taken, k, stride_c, NARROW)
    elif taken <= CAPACITY:
        kth, negative_nan = _search_candidates(candidates, row, taken, k, stride_c, CAPACITY)
    else:
        kth = tl.zeros([], tl.uint32)
        negative_nan = tl.zeros([], tl.int32)
        for bit in tl.static_range(31, -1, -1):
            trial = kth | (tl.full([], 1, tl.uint32) << bit)
            at_least = tl.zeros([], tl.int32)
            for start in range(0, vocab, CHUNK):
                cols = start + tl.arange(0, CHUNK)
                inside = cols < vocab
                x = tl.load(scores + row.to(tl.int64) * stride_s + cols, mask=inside)
                keys = tl.where(inside, _keys(x), 0).to(tl.uint32)
                at_least += tl.sum((keys >= trial).to(tl.int32), 0)
                if bit == 31:
                    seen = tl.max((keys == 0xFFFFFFFE).to(tl.int32), 0)
                    negative_nan = tl.maximum(negative_nan, seen)
            kth = tl.where(at_least >= k, trial, kth)
    value = _float_of_key(kth)
    if NEGATIVE_NAN_LAST:  # CUDA's topk sorts such k values with a negative NaN last
        value = tl.where(negative_nan > 0, float("nan"), value)
    tl.store(threshold + row, value)


@triton.jit
def _filter_kernel(
    scores, threshold, out, vocab, fill, stride_s, stride_o,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    x = tl.load(scores + row.to(tl.int64) * stride_s + cols, mask=inside)
    below = x < tl.load(threshold + row)
    tl.store(out + row.to(tl.int64) * stride_o + cols, tl.where(below, fill, x), mask=inside)
