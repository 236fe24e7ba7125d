"""Triton kernels for the top-k filter of sampling: scores below each row's k-th largest set
to a filter value, in three launches.

1. ``_chunk_top_kernel``: each program sorts one chunk of one row and keeps its ``KP``
   largest entries (KP >= k), so the row's k largest are among its chunks' candidates.
2. ``_threshold_kernel``: one program a row sorts the row's candidates and takes the k-th.
3. ``_filter_kernel``: every entry below its row's threshold becomes the filter value.

Entries are compared as int32 keys whose order is the floats' (-0.0 below +0.0, NaN above
+inf, as ``torch.topk`` orders them), so the threshold is the value ``torch.topk`` returns
k-th, NaN included; ``top_k.py`` holds the launcher and the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

_LOWEST_KEY = tl.constexpr(-2147483648)  # below every float's key: chunk padding


@triton.jit
def _keys(v, valid):
    """int32 keys ordered as the float32 values ``v`` (NaN highest); ``valid`` False: lowest."""
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(v != v, 0x7FFFFFFF, key)
    return tl.where(valid, key, _LOWEST_KEY)


@triton.jit
def _chunk_top_kernel(
    x, stride_x, V, candidates, n_chunks,
    CHUNK: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < V
    v = tl.load(x + row.to(tl.int64) * stride_x + cols, mask=valid, other=0.0)
    ordered = tl.sort(_keys(v, valid), descending=True)
    # the first KP of the sorted chunk: row 0 of its [CHUNK // KP, KP] view
    grid = tl.reshape(ordered, [CHUNK // KP, KP])
    first = tl.arange(0, CHUNK // KP)[:, None] == 0
    top = tl.max(tl.where(first, grid, _LOWEST_KEY), axis=0)
    tl.store(candidates + (row * n_chunks + chunk) * KP + tl.arange(0, KP), top)


@triton.jit
def _threshold_kernel(candidates, n_candidates, k, thresholds, NCAND: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, NCAND)
    keys = tl.load(candidates + row * n_candidates + offs, mask=offs < n_candidates,
                   other=_LOWEST_KEY)  # fmt: skip
    ordered = tl.sort(keys, descending=True)
    key = tl.max(tl.where(offs == k - 1, ordered, _LOWEST_KEY), axis=0)
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)  # (the key map is its own inverse)
    tl.store(thresholds + row, bits.to(tl.float32, bitcast=True))


@triton.jit
def _filter_kernel(x, stride_x, out, stride_out, V, thresholds, filter_value, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < V
    v = tl.load(x + row.to(tl.int64) * stride_x + cols, mask=valid, other=0.0)
    threshold = tl.load(thresholds + row)
    y = tl.where(v < threshold, filter_value, v)
    tl.store(out + row.to(tl.int64) * stride_out + cols, y, mask=valid)
