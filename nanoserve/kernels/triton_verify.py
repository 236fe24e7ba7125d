"""Triton GQA-packed extend attention, split over the history: the few-query-token case
(speculative verify, short chunks) and turns of a few dozen tokens over a long history, which
are memory-bound like decode.

One program takes one KV head of one sequence and packs every query head of that KV head for
``BLOCK_M // GROUP`` consecutive new tokens into the rows of one tile (row r: token r // GROUP,
head r % GROUP), so each K/V row is read once per KV head, not once per query head. The grid is
(query tiles, KV heads, splits), sized from shapes alone: tiles map to sequences by the same
binary search over ``cu_seqlens_q`` as the extend kernel. Split k of a tile takes the k-th run
of whole key tiles of [first key in the window, last visible key]; with more than one split the
partial results (normalised outputs, log-sum-exp base 2) go to a scratch and the merge kernel
of triton_split_merge.py combines them (launched with programmatic dependent launch on
Hopper, as in the decode kernel).
The causal / window masks, and the unmasked run of key tiles below the diagonal, are those of
the extend kernel (``_attend_tiles``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nanoserve.kernels.dispatch import (
    floor_pow2,
    head_dim_pad,
    keys_in_reach,
    next_pow2,
    sm_count,
    supports_pdl,
    unit_stride,
)
from nanoserve.kernels.triton_extend import _attend_tiles, fast_tanh
from nanoserve.kernels.triton_split_merge import merge_splits, split_partials, store_partials

MAX_SPLITS = 32
# A program's cost beyond its key tiles (the query tile, the sequence search, the pipeline's
# fill, the partials' store), in key tiles: the split count's model (``packed_splits``).
SPLIT_OVERHEAD_TILES = 2
# Turns (``triton_extend.TURN_MAX_QUERY_LEN``) split while each split keeps at least this many
# keys of the history the block tables can hold: fewer keys a split cost more in partials and
# merge than they win in parallel reads (the turn classes of benchmarks/RESULTS.md).
TURN_SPLIT_KEYS = 512
# A turn's tile where the default 128-row tile would leave SMs idle or hold one program an SM
# (head dims past 64): more programs, each over fewer query rows (``turn_plan``).
TURN_NARROW_TILE = (64, 64, 4, 3)


@triton.jit(do_not_specialize=["window", "num_seqs", "num_q_heads"])
def _packed_kernel(
    query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out, mid_o, mid_lse,
    scale, softcap, window, num_seqs, num_q_heads,
    stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP32: tl.constexpr,
    FAST_TANH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        # lets the merge kernel's launch start now; it still waits for this grid to finish
        tl.extra.cuda.gdc_launch_dependents()
    TOKENS: tl.constexpr = BLOCK_M // GROUP  # new tokens per tile
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Largest i with cu[i] // TOKENS + i <= tile (see _extend_kernel).
    lo = 0
    hi = num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q + mid) // TOKENS + mid
        go_right = first_tile <= tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo
    q_begin = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_begin
    t0 = (tile - (q_begin // TOKENS + seq)) * TOKENS
    if t0 >= q_len:
        return
    ctx = tl.load(seq_lens + seq) - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    tok = t0 + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < TOKENS * GROUP) & (tok < q_len)
    io_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    tokens = (q_begin + tok).to(tl.int64)
    q_ptrs = query + tokens[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    q_pos = ctx + tok
    qk_scale = scale * 1.4426950408889634

    q_end = tl.minimum(t0 + TOKENS, q_len)
    kv_hi = ctx + q_end
    diag = ((ctx + t0) // BLOCK_N) * BLOCK_N
    kv_lo = 0
    full_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(ctx + t0 - window + 1, 0)
        full_lo = tl.cdiv(tl.maximum(ctx + q_end - window, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(full_lo, diag)
    # this split's keys [a, b): a run of whole key tiles of [first window tile, kv_hi)
    start = (kv_lo // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(kv_hi - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    a = start + split * per_split
    b = tl.minimum(a + per_split, kv_hi)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    if HAS_WINDOW:
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, key_cache, value_cache, table, head_off, stride_cb,
            stride_ct, a, tl.minimum(b, full_lo), kv_lo, kv_hi, qk_scale, scale,
            softcap, window, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, True,
            HAS_WINDOW, HAS_SOFTCAP, FP32, FAST_TANH, False,
        )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, key_cache, value_cache, table, head_off, stride_cb, stride_ct,
        tl.maximum(a, full_lo), tl.minimum(b, diag), kv_lo, kv_hi, qk_scale, scale, softcap,
        window, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, False,
        HAS_WINDOW, HAS_SOFTCAP, FP32, FAST_TANH, False,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, key_cache, value_cache, table, head_off, stride_cb, stride_ct,
        tl.maximum(a, diag), b, kv_lo, kv_hi, qk_scale, scale, softcap, window,
        HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, True, HAS_WINDOW, HAS_SOFTCAP, FP32, FAST_TANH,
        False,
    )  # fmt: skip

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        dst = out + tokens[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=io_mask)
    else:
        # partials [T, Hq, NUM_SPLITS, D_PAD] (triton_split_merge.py)
        row = (tokens * num_q_heads + head) * NUM_SPLITS + split
        store_partials(mid_o, mid_lse, row, o, l_i, m_i, d, D_PAD, io_mask, row_ok)


def packed_config(
    head_dim: int, group: int, max_query_len: int | None, dtype: torch.dtype, on_gpu: bool
) -> tuple[int, int, int, int]:
    """Default (BLOCK_M, BLOCK_N, num_warps, num_stages): BLOCK_M rows hold every query
    head of a KV head for as many tokens as ``max_query_len`` needs, up to 128 rows (64 for
    head dims over 128); with no bound (None: maybe a long prefill) the largest tile."""
    tokens = max_query_len or 128
    block_m = min(max(16, next_pow2(group * tokens)), 64 if head_dim > 128 else 128)
    block_m = max(block_m, next_pow2(group))
    if not on_gpu:
        return (block_m, 32, 4, 1)
    warps = 8 if block_m >= 128 else 4
    if next_pow2(head_dim) > 128 or dtype == torch.float32:
        return (block_m, 32, warps, 2)
    return (block_m, 64, warps, 3)


def resident_programs(block_m: int, head_dim: int) -> int:
    """Packed-kernel programs of a ``block_m``-row tile an SM runs at once on Hopper (their
    registers and shared memory, read off the compiled default tiles): three for tiles of at
    most 2,048 query-row x head-dim elements, one for 128-row tiles past head dim 64, else two."""
    d_pad = head_dim_pad(head_dim)
    if block_m * d_pad <= 2048:
        return 3
    return 1 if block_m >= 128 and d_pad > 64 else 2


def packed_splits(programs: int, key_tiles: int, resident: int, device: torch.device) -> int:
    """Splits over the history for ``programs`` (busy tiles x KV heads) whose tables hold
    ``key_tiles`` key tiles, ``resident`` programs an SM: the count up to ``MAX_SPLITS`` with
    the least time in waves, ceil(programs x splits / slots) x (key tiles a split +
    ``SPLIT_OVERHEAD_TILES``), and of equal ones the fewest (each split adds partials and a
    program's fixed cost). A split count that leaves a last wave part-filled loses: programs
    of equal work finish together, so a wave costs the same however few programs it holds."""
    return _least_wave_splits(max(programs, 1), key_tiles, resident * sm_count(device))


@functools.cache
def _least_wave_splits(programs: int, key_tiles: int, slots: int) -> int:
    """``packed_splits``'s count (ints only: cached, an eager step of a few tokens pays the
    search once a shape)."""

    def cost(splits: int) -> tuple[int, int]:
        waves = -(-programs * splits // slots)
        return waves * (-(-key_tiles // splits) + SPLIT_OVERHEAD_TILES), splits

    return min(range(1, MAX_SPLITS + 1), key=cost)


def turn_plan(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    sliding_window: int | None,
) -> tuple[tuple[int, int, int, int], int]:
    """(config, splits) of the packed kernel for a turn (query packed [T, Hq, D], pools
    [N, bs, Hkv, D], tables int32 [S, width], ``max_query_len`` host-known), from shapes only.

    Splits: as many as keep ``TURN_SPLIT_KEYS`` keys each of what the tables can hold (the
    window and the turn, with one), and no more than the tile's programs resident at once fill
    the device (``resident_programs``); a
    power of two, 1 meaning a turn too short or too wide to split. Tile: ``packed_config``'s,
    or ``TURN_NARROW_TILE`` past head dim 64 and where the default tile's programs, split by
    the keys, would not give every SM one."""
    total_q, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    on_gpu = query.device.type == "cuda"
    history = keys_in_reach(block_tables, block_size, sliding_window, max_query_len)
    key_splits = min(-(-history // TURN_SPLIT_KEYS), MAX_SPLITS)
    sms = sm_count(query.device)

    def programs(block_m: int) -> int:
        return max(1, -(-total_q // (block_m // group)) * num_kv_heads)

    config = packed_config(head_dim, group, max_query_len, query.dtype, on_gpu)
    narrow_rows = TURN_NARROW_TILE[0]
    if config[0] > narrow_rows >= group and (
        next_pow2(head_dim) > 64 or programs(config[0]) * key_splits < sms
    ):
        config = TURN_NARROW_TILE if on_gpu else (narrow_rows, *config[1:])
    resident = resident_programs(config[0], head_dim)
    splits = min(key_splits, resident * sms // programs(config[0]))
    return config, floor_pow2(splits)


def paged_extend_attention_packed(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    max_query_len: int | None = None,
    config: tuple[int, int, int, int] | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """GQA-packed split-KV extend attention (arguments already validated): query packed
    [T, Hq, D] float16/bfloat16/float32 with cu_seqlens_q int32 [S + 1]; returns [T, Hq, D].

    Correct for any number of new tokens per sequence; ``max_query_len`` (a host-known bound,
    or None) only sizes the default tile. ``config`` (BLOCK_M, BLOCK_N, num_warps,
    num_stages) and ``num_splits`` override the defaults (sweeps, tests). No host sync.
    """
    total_q, num_q_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if total_q == 0 or num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    block_tables, seq_lens = unit_stride(block_tables), unit_stride(seq_lens)
    cu_seqlens_q = unit_stride(cu_seqlens_q)
    on_gpu = query.device.type == "cuda"
    if config is None:
        config = packed_config(head_dim, group, max_query_len, query.dtype, on_gpu)
    block_m, block_n, num_warps, num_stages = config
    if block_m < group or block_m < 16:
        raise ValueError(f"config: BLOCK_M {block_m} must be >= 16 and >= the GQA group {group}")
    tokens_per_tile = block_m // group
    tiles = total_q // tokens_per_tile + num_seqs
    if num_splits is None:
        busy = tiles  # tiles that hold tokens (the grid's others exit at once)
        if max_query_len is not None:
            busy = min(tiles, num_seqs * -(-max_query_len // tokens_per_tile))
        history = keys_in_reach(block_tables, block_size, sliding_window, max_query_len or total_q)
        resident = resident_programs(block_m, head_dim)
        num_splits = packed_splits(
            busy * num_kv_heads, -(-history // block_n), resident, query.device
        )
    d_pad = head_dim_pad(head_dim)
    if num_splits > 1:
        mid_o, mid_lse = split_partials(query, num_splits, d_pad)
    else:
        mid_o = mid_lse = out  # not touched
    pdl = num_splits > 1 and supports_pdl(query.device)
    _packed_kernel[(tiles, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out, mid_o, mid_lse,
        float(scale), float(softcap or 1.0), int(sliding_window or 0), num_seqs, num_q_heads,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, SEARCH_STEPS=max(1, num_seqs.bit_length()),
        NUM_SPLITS=num_splits, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None, FP32=query.dtype == torch.float32,
        FAST_TANH=fast_tanh(query), PDL=pdl, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(mid_o, mid_lse, out, head_dim, pdl)
    return out
