"""Triton kernels of ``top_k.py``: the k-th largest entry of each row by radix select on
order-keeping integer keys, then the filter.

A float's key is its bits with the sign bit flipped (non-negative values) or every bit
flipped (negative ones), so keys order as the floats do; NaN takes the largest key and -0.0
sits just below +0.0, as in ``torch.topk``. ``_chunk_candidates_kernel`` finds, per (row,
chunk), the chunk's k-th largest key and writes its k largest keys (the keys above it, then
copies of it); the row's k-th largest key is the k-th largest of those, which
``_row_threshold_kernel`` finds the same way; ``_filter_kernel`` replaces the entries below
it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanoserve.kernels.triton_common import pdl_enter


@triton.jit
def _keys(x):
    """uint32 keys of float32 ``x`` that order as the floats (NaN largest)."""
    bits = x.to(tl.uint32, bitcast=True)
    flip = tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return tl.where(x != x, 0xFFFFFFFF, bits ^ flip).to(tl.uint32)


@triton.jit
def _float_of_key(key):
    """The float32 whose key is ``key`` (NaN for the largest key)."""
    bits = tl.where((key >> 31) != 0, key ^ 0x80000000, ~key).to(tl.uint32)
    return tl.where(key == 0xFFFFFFFF, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _kth_largest_key(keys, k):
    """The ``k``-th largest of the uint32 ``keys`` (a 1-D tensor; padding keys 0 count), by
    four passes over 8-bit digits from the top: each keeps the keys that share the digits
    chosen so far and picks the digit holding the k-th largest of the rest."""
    bins = tl.arange(0, 512)
    prefix = tl.zeros([], tl.uint32)
    remaining = k
    for p in tl.static_range(4):
        shift: tl.constexpr = 24 - 8 * p
        chosen_bits: tl.constexpr = (0xFFFFFFFF << (32 - 8 * p)) & 0xFFFFFFFF  # 0 at first
        match = (keys & chosen_bits) == (prefix & chosen_bits)
        digit = ((keys >> shift) & 0xFF).to(tl.int32)
        counts = tl.histogram(tl.where(match, digit, 256), 512)
        counts = tl.where(bins < 256, counts, 0)
        # keys of the kept ones whose digit is >= d: all kept minus those below d
        at_least = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
        chosen = tl.max(tl.where((at_least >= remaining) & (bins < 256), bins, -1), 0)
        above = tl.sum(tl.where(bins > chosen, counts, 0), 0)
        remaining = remaining - above
        prefix = prefix | (chosen.to(tl.uint32) << shift)
    return prefix


@triton.jit
def _chunk_candidates_kernel(
    scores, candidates, vocab, num_chunks, k, stride_s,
    CHUNK: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < vocab
    x = tl.load(scores + row.to(tl.int64) * stride_s + cols, mask=inside, other=0.0)
    keys = tl.where(inside, _keys(x), 0)  # key 0 is below every float's (-inf's included)
    kth = _kth_largest_key(keys, k)
    above = keys > kth
    slot = tl.cumsum(above.to(tl.int32), 0) - 1
    base = candidates + (row.to(tl.int64) * num_chunks + chunk) * K_PAD
    # (int32 storage: the keys' bits)
    tl.store(base + slot, keys.to(tl.int32, bitcast=True), mask=above)
    fill = tl.arange(0, K_PAD)
    copies = (tl.zeros([K_PAD], tl.uint32) + kth).to(tl.int32, bitcast=True)
    tl.store(base + fill, copies, mask=(fill >= tl.sum(above.to(tl.int32), 0)) & (fill < k))


@triton.jit
def _row_threshold_kernel(
    candidates, threshold, num_chunks, k,
    K_PAD: tl.constexpr, CANDIDATES_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    i = tl.arange(0, CANDIDATES_PAD)
    real = ((i // K_PAD) < num_chunks) & ((i % K_PAD) < k)
    keys = tl.load(candidates + row.to(tl.int64) * num_chunks * K_PAD + i, mask=real, other=0)
    keys = keys.to(tl.uint32, bitcast=True)
    tl.store(threshold + row, _float_of_key(_kth_largest_key(keys, k)))


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
