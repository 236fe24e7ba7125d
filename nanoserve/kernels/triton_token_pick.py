"""Triton kernels of ``token_pick.py``: each row's first largest ratio, then the step's
bookkeeping.

``_chunk_best_kernel`` gives, per (row, chunk of ``CHUNK`` entries), the largest of
``scores / noise`` (or of ``scores``) and its first index, NaN counting as the largest;
``_pick_kernel`` (one program) takes each row's first chunk holding its largest, and applies
the finished rows' pad, the EOS test and the next positions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanoserve.kernels.triton_common import pdl_enter


@triton.jit
def _chunk_best_kernel(
    scores, noise, noise_rows, best_value, best_index, vocab, num_chunks,
    stride_s, stride_n,
    CHUNK: tl.constexpr, HAS_NOISE: tl.constexpr, HAS_ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < vocab
    x = tl.load(scores + row.to(tl.int64) * stride_s + cols, mask=inside, other=float("-inf"))
    if HAS_NOISE:
        source = row
        if HAS_ROWS:
            source = tl.load(noise_rows + row)
        q = tl.load(noise + source.to(tl.int64) * stride_n + cols, mask=inside, other=1.0)
        x = tl.math.div_rn(x, q)  # IEEE division, as torch.div rounds
    nan = x != x
    has_nan = tl.max(nan.to(tl.int32), 0) > 0
    top = tl.max(tl.where(nan, float("-inf"), x), 0)
    hit = tl.where(has_nan, nan, (x == top) & inside)
    first = tl.min(tl.where(hit, cols, 2147483647), 0)
    # (a guard: every chunk holds a column, and an all -inf one matches its first already)
    first = tl.where(first == 2147483647, chunk * CHUNK, first)
    value = tl.where(has_nan, float("nan"), top)
    slot = row * num_chunks + chunk
    tl.store(best_value + slot, value)
    tl.store(best_index + slot, first)


@triton.jit
def _pick_kernel(
    best_value, best_index, tokens, invalid, unfinished, pad, eos, num_eos, positions,
    rows, num_chunks,
    ROWS: tl.constexpr, CHUNKS_PAD: tl.constexpr, HAS_PAD: tl.constexpr,
    HAS_EOS: tl.constexpr, HAS_POSITIONS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    c = tl.arange(0, CHUNKS_PAD)
    any_nan = tl.zeros([ROWS], tl.int32)
    for first_row in range(0, rows, ROWS):
        r = first_row + tl.arange(0, ROWS)
        live = r < rows
        slot = r[:, None] * num_chunks + c[None, :]
        ok = live[:, None] & (c < num_chunks)[None, :]
        v = tl.load(best_value + slot, mask=ok, other=float("-inf"))
        i = tl.load(best_index + slot, mask=ok, other=0)
        nan = (v != v) & ok
        row_nan = tl.max(nan.to(tl.int32), 1) > 0
        top = tl.max(tl.where(nan, float("-inf"), v), 1)
        hit = tl.where(row_nan[:, None], nan, (v == top[:, None]) & ok)
        # chunks are in column order: the first chunk holding the row's largest holds its
        # first largest entry
        first_chunk = tl.min(tl.where(hit, c[None, :], CHUNKS_PAD), 1)
        token = tl.sum(tl.where(c[None, :] == first_chunk[:, None], i, 0), 1).to(tl.int64)
        any_nan = tl.maximum(any_nan, (row_nan & live).to(tl.int32))
        if HAS_PAD or HAS_EOS:
            still = tl.load(unfinished + r, mask=live, other=0) != 0
            if HAS_PAD:  # finished rows take the pad, and the EOS test sees it
                token = tl.where(still, token, tl.load(pad))
            if HAS_EOS:
                is_eos = tl.zeros([ROWS], tl.int1)
                for e in range(num_eos):
                    is_eos = is_eos | (token == tl.load(eos + e))
                tl.store(unfinished + r, still & ~is_eos, mask=live)
        tl.store(tokens + r, token, mask=live)
        if HAS_POSITIONS:
            tl.store(positions + r, tl.load(positions + r, mask=live) + 1, mask=live)
    tl.store(invalid, tl.max(any_nan, 0) > 0)
