"""Triton paged decode attention: one query token per sequence, split-KV (flash-decoding).

One program holds every query head of one KV head as the rows of one tile (padded to >= 16
rows for tl.dot), so each K/V row is read once. It walks a run of one sequence BLOCK_N tokens at
a time straight through the block table (several pages per step when pages are small), with an
online softmax in float32. Two launches cut the work into runs:

- balanced (the default with few (row, KV head) pairs per SM and a table of more than 4k
  tokens, unless the caller says the rows are of one length): every program reads all of
  seq_lens and computes the same plan, so a row of any length gets about its share of the
  total, in work items of whole tiles (FlashInfer builds such a plan on the host; here it
  needs no host copy of the lengths, no sync and no buffer to refresh between CUDA-graph
  replays). Ragged batches no longer wait on their longest row.
- fixed splits: each row in the same number of equal splits, from shapes only (also the
  launch for rows of one length, where it beat the balanced plan).

A row in one run writes its output directly. Otherwise partial results and their log-sum-exp go
to a float32 scratch and a second kernel merges them. On NVIDIA Hopper and later both kernels
are launched with programmatic dependent launch: each launch overlaps the kernel before it and
waits on the device (griddepcontrol) for that kernel's results, which hides part of the launch
cost of small shapes (see benchmarks/RESULTS.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.kernels.dispatch import (
    floor_pow2,
    head_dim_pad,
    next_pow2,
    pdl_launch,
    sm_count,
    unit_stride,
)
from nanoserve.kernels.quant import FP8_DTYPE, INT8_DTYPE, INT8_K_GROUP, int8_groups
from nanoserve.kernels.shared_prefix import SharedPrefixPlan, takes_shared_prefix
from nanoserve.kernels.triton_cascade import shared_prefix_partials
from nanoserve.kernels.triton_common import (
    int8_key_scores,
    mma,
    pdl_enter,
    query_for_fp8_tiles,
    scores_to_log2,
)

MAX_SPLITS = 64
# ... and up to this many for a few long rows, when each split keeps LONG_SPLIT_TOKENS tokens:
# with four or fewer (row, KV head) pairs, 64 splits leave an SM about two programs.
MAX_SPLITS_LONG = 128
LONG_SPLIT_TOKENS = 64
# Balanced launch below this many (row, KV head) programs per SM (see benchmarks/RESULTS.md).
BALANCE_BELOW = 6
# ... and only for block tables of more than this many tokens: rows that fit in such a table
# differ by too little for the plan and its merge launch to pay (see benchmarks/RESULTS.md).
BALANCE_ABOVE_TOKENS = 4096
# Balanced launch: target programs per SM over all KV heads, for fewer than MANY_ROWS rows
# and for at least that many (see benchmarks/RESULTS.md).
WORK_ITEMS_PER_SM = 4
WORK_ITEMS_PER_SM_MANY_ROWS = 8
MANY_ROWS = 16
# Most partial results the merge kernel reads per step: a row of up to this many items merges
# in one step, since each step waits on its loads.
MERGE_ITEMS_STEP = 64
# ... unless rows average at most this many items (many rows share the target): then one-warp
# programs of this many items a step (see ``merge_items_launch``).
MERGE_FEW_ITEMS = 8
# The merge of fixed splits: most partial values (splits x head-dim lanes) a program reads,
# and the fewest lanes a program takes when its lanes are cut across programs.
REDUCE_TILE_ELEMENTS = 2048
REDUCE_MIN_LANES = 16
# Register cap for FP8 tiles of up to 128 tokens (4 warps, head dim <= 128): the compiler's
# own choice holds both converted 16-bit tiles at once and fits two programs per SM; capped,
# four fit (a few registers spill), which hides more of the conversion's latency.
FP8_TILE_REGISTERS = 128


@triton.jit
def _row_items(seq_lens, num_seqs, window, target_items,
               S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
               prefix_lens, HAS_PREFIX: tl.constexpr):  # fmt: skip
    """The balanced plan, computed alike by every program from seq_lens [S_PAD]: each row's
    length, its number of work items (about its share of total / target_items tokens, at
    least one) and the running total of items up to and including it. Tokens a shared
    prefix pass covers (``prefix_lens``) are not the row's work."""
    rows = tl.arange(0, S_PAD)
    lens = tl.load(seq_lens + rows, mask=rows < num_seqs, other=0)
    base = tl.zeros_like(lens)
    if HAS_WINDOW:
        base = (tl.maximum(lens - window, 0) // BLOCK_N) * BLOCK_N
    if HAS_PREFIX:
        skip = tl.load(prefix_lens + rows, mask=rows < num_seqs, other=0)
        base = (skip // BLOCK_N) * BLOCK_N
    total = tl.sum(lens - base, 0)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(total, target_items), BLOCK_N), 1) * BLOCK_N
    items = tl.where(rows < num_seqs, tl.maximum(tl.cdiv(lens - base, chunk), 1), 0)
    return rows, lens, items, tl.cumsum(items, 0)


@triton.jit
def _decode_kernel(
    query, key_cache, value_cache, block_tables, seq_lens, out, mid_o, mid_lse,
    scale, softcap, window, num_kv_heads, num_seqs, target_items,
    stride_qs, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt, stride_os, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BALANCED: tl.constexpr, S_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr,
    k_scale=None, v_scale=None, FP8: tl.constexpr = False,
    INT8: tl.constexpr = False, K_GROUPS: tl.constexpr = 1, K_GW: tl.constexpr = 16,
    prefix_lens=None, prefix_o=None, prefix_lse=None, PREFIX_SPLITS: tl.constexpr = 0,
    TABLE_AHEAD: tl.constexpr = False,
):  # fmt: skip
    # (the prefix pass before it has finished; the merge kernel's launch starts while this runs)
    pdl_enter(PDL)
    # one grid axis for (work, KV head): axis 1 of a CUDA grid stops at 65,535
    kv_head = tl.program_id(0) % num_kv_heads
    if BALANCED:
        # Work item -> (row, token range): rows hold consecutive items of `chunk` tokens.
        item = tl.program_id(0) // num_kv_heads
        row_ids, lens, items, ends = _row_items(
            seq_lens, num_seqs, window, target_items, S_PAD, BLOCK_N, HAS_WINDOW,
            prefix_lens, PREFIX_SPLITS > 0,
        )  # fmt: skip
        seq = tl.sum((ends <= item).to(tl.int32), 0)
        in_use = seq < num_seqs  # the grid has room for the most items any lengths need
        seq = tl.minimum(seq, num_seqs - 1)
        row_items = tl.sum(tl.where(row_ids == seq, items, 0), 0)
        first = tl.sum(tl.where(row_ids == seq, ends, 0), 0) - row_items
        seq_len = tl.sum(tl.where(row_ids == seq, lens, 0), 0)
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(seq_len - window, 0)
        if PREFIX_SPLITS > 0:  # (never with a window)
            kv_start = tl.load(prefix_lens + seq)
        first_piece = item == first
        # The row's items split [first tile of the window, seq_len) evenly in whole tiles.
        base = (kv_start // BLOCK_N) * BLOCK_N
        per_item = tl.cdiv(tl.cdiv(seq_len - base, row_items), BLOCK_N) * BLOCK_N
        lo = base + (item - first) * per_item
        hi = tl.where(in_use, tl.minimum(lo + per_item, seq_len), lo)
    else:
        seq = tl.program_id(0) // num_kv_heads
        split = tl.program_id(1)
        seq_len = tl.load(seq_lens + seq)
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(seq_len - window, 0)
        if PREFIX_SPLITS > 0:
            kv_start = tl.load(prefix_lens + seq)
        first_piece = split == 0
        # Splits cut [first tile of the window, seq_len) into equal runs of whole tiles.
        base = (kv_start // BLOCK_N) * BLOCK_N
        per_split = tl.cdiv(tl.cdiv(seq_len - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = base + split * per_split
        hi = tl.minimum(lo + per_split, seq_len)
    if FP8:  # fp8 pools: K's scale folds into the score scale, V's into the output
        scale = scale * tl.load(k_scale + kv_head)
        v_mul = tl.load(v_scale + kv_head)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    d_mask = d < HEAD_DIM
    row_mask = (g < GROUP)[:, None] & d_mask[None, :]
    q_rows = query + seq * stride_qs + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=row_mask)
    if FP8 and not FP32:
        q, scale = query_for_fp8_tiles(q, scale, False)

    # A finite start keeps exp2(m_old - m_new) from ever being NaN on fully masked tiles.
    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    ahead_ids = tl.zeros([BLOCK_N], tl.int32)  # (Triton wants loop values defined before)
    if TABLE_AHEAD:
        ahead = lo + tl.arange(0, BLOCK_N)
        ahead_ids = tl.load(table + ahead // BLOCK_SIZE, mask=(ahead < hi) & (ahead >= kv_start),
                            other=0)  # fmt: skip
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos < hi) & (pos >= kv_start)
        if TABLE_AHEAD:
            # this tile's ids were loaded a step ago; load the next tile's now
            block = ahead_ids.to(tl.int64)
            ahead = pos + BLOCK_N
            ahead_ids = tl.load(table + ahead // BLOCK_SIZE,
                                mask=(ahead < hi) & (ahead >= kv_start), other=0)  # fmt: skip
        else:
            block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        kv_mask = valid[:, None] & d_mask[None, :]
        v = tl.load(value_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if INT8:
            # a value's one scale folds into its softmax weight
            s = int8_key_scores(q, q_rows, g < GROUP, key_cache, rows, valid, k_scale,
                                GROUP_PAD, BLOCK_N, HEAD_DIM, K_GROUPS, K_GW, FP32)  # fmt: skip
            v_token = tl.load(v_scale + rows // HEAD_DIM, mask=valid, other=0.0).to(tl.float32)
            v = v.to(q.dtype)
        else:
            k = tl.load(key_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            k, v = k.to(q.dtype), v.to(q.dtype)  # fp8 tiles: exact in float16 and float32
            s = mma(q, tl.trans(k), FP32)
        s = scores_to_log2(s, scale, softcap, HAS_SOFTCAP)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if INT8:
            acc = acc * alpha[:, None] + mma(p * v_token[None, :], v, FP32)
        else:
            acc = acc * alpha[:, None] + mma(p, v, FP32)
        m_i = m_new

    num_q_heads = GROUP * num_kv_heads
    if PREFIX_SPLITS > 0:
        # The row's first piece folds in the prefix pass's partials (none past its prefix).
        folds = (first_piece & (kv_start > 0)).to(tl.int32)
        fold = (g < GROUP) & ((tl.zeros([GROUP_PAD], tl.int32) + folds) > 0)
        for j in tl.static_range(PREFIX_SPLITS):
            at = (seq * num_q_heads + heads).to(tl.int64) * PREFIX_SPLITS + j
            lse_j = tl.load(prefix_lse + at, mask=fold, other=float("-inf"))
            o_j = tl.load(prefix_o + at[:, None] * D_PAD + d[None, :],
                          mask=fold[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
            m_new = tl.maximum(m_i, lse_j)
            alpha = tl.exp2(m_i - m_new)
            beta = tl.exp2(lse_j - m_new)
            acc = acc * alpha[:, None] + o_j * beta[:, None]
            l_i = l_i * alpha + beta
            m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if FP8:
        o = o * v_mul
    if BALANCED:
        # A row of one item is finished here; a row of several leaves partials to merge.
        row_items = tl.where(in_use, row_items, 0)  # past the last item: store nothing
        head_items = tl.zeros([GROUP_PAD], tl.int32) + row_items
        alone = row_mask & (head_items == 1)[:, None]
        dst = out + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=alone)
        # Scratch: mid_o [items, Hq, D_PAD], mid_lse [items, Hq], contiguous.
        row = item.to(tl.int64) * num_q_heads + heads
        split = (g < GROUP) & (head_items > 1)
        tl.store(
            mid_o + row[:, None] * D_PAD + d[None, :], o, mask=split[:, None] & d_mask[None, :]
        )
        tl.store(mid_lse + row, m_i + tl.log2(l_safe), mask=split)
    elif NUM_SPLITS == 1:
        dst = out + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=row_mask)
    else:
        # Scratch: mid_o [S, Hq, NUM_SPLITS, D_PAD], mid_lse [S, Hq, NUM_SPLITS], contiguous.
        row = (seq * num_q_heads + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(mid_o + row[:, None] * D_PAD + d[None, :], o, mask=row_mask)
        tl.store(mid_lse + row, m_i + tl.log2(l_safe), mask=g < GROUP)


@triton.jit
def _reduce_kernel(
    mid_o, mid_lse, out, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, D_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Merge the fixed splits of (row, query head) ``program_id(0, 1)``, head-dim lanes
    [D_BLOCK * program_id(2), + D_BLOCK): mid_o [S, Hq, NUM_SPLITS, D_PAD] and mid_lse
    [S, Hq, NUM_SPLITS] float32 -> out [S, Hq, HEAD_DIM]."""
    if PDL:
        tl.extra.cuda.gdc_wait()  # the split kernel has finished and its stores are visible
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)
    row = (seq * tl.num_programs(1) + head).to(tl.int64) * NUM_SPLITS
    lse = tl.load(mid_lse + row + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    # Empty splits carry lse = -1e30 and weigh 0 beside a split that saw keys; when every
    # split is empty (seq_len 0) they all weigh 1 and the zeros they hold average to zeros.
    w = tl.exp2(lse - tl.max(lse, 0))
    mask = (sp < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :]
    o = tl.load(mid_o + (row + sp)[:, None] * D_PAD + d[None, :], mask=mask, other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    dst = out + seq * stride_os + head * stride_oh + d
    tl.store(dst, res.to(out.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _merge_items_kernel(
    mid_o, mid_lse, out, seq_lens, num_seqs, window, target_items, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, ITEMS_STEP: tl.constexpr, PDL: tl.constexpr,
    prefix_lens=None, HAS_PREFIX: tl.constexpr = False,
):  # fmt: skip
    """Merge the partial results of each row split into several work items (balanced plan)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    rows, _, items, ends = _row_items(
        seq_lens, num_seqs, window, target_items, S_PAD, BLOCK_N, HAS_WINDOW,
        prefix_lens, HAS_PREFIX,
    )  # fmt: skip
    row_items = tl.sum(tl.where(rows == seq, items, 0), 0)
    first = tl.sum(tl.where(rows == seq, ends, 0), 0) - row_items
    if PDL:
        tl.extra.cuda.gdc_wait()  # the split kernel has finished and its stores are visible
    j = tl.arange(0, ITEMS_STEP)
    d = tl.arange(0, D_PAD)
    m = tl.full([1], float("-inf"), tl.float32)
    total_w = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    # A row of one item was written by the split kernel: nothing to merge (zero iterations).
    to_merge = tl.where(row_items > 1, row_items, 0)
    for j0 in range(0, to_merge, ITEMS_STEP):
        in_row = j0 + j < to_merge
        row = (first + j0 + j).to(tl.int64) * num_q_heads + head
        # Empty items carry lse = -1e30 and weigh 0 beside an item that saw keys.
        lse = tl.load(mid_lse + row, mask=in_row, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        mask = in_row[:, None] & (d < HEAD_DIM)[None, :]
        o = tl.load(mid_o + row[:, None] * D_PAD + d[None, :], mask=mask, other=0.0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        total_w = total_w * alpha + tl.sum(w, 0)
        m = m_new
    dst = out + seq * stride_os + head * stride_oh + d
    merged = (tl.zeros([D_PAD], tl.int32) + to_merge) > 1
    total_w = tl.where(total_w > 0.0, total_w, 1.0)  # nothing merged: nothing stored
    tl.store(dst, (acc / total_w).to(out.dtype.element_ty), mask=(d < HEAD_DIM) & merged)


def decode_config(head_dim: int, block_size: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N tokens per step, num_warps, num_stages) for a head dim, page size and dtype.

    Three stages keep more K/V loads in flight for 16-bit tiles of up to 64 tokens
    (``decode_plan`` drops split launches to two); wide fp32 tiles and 128-token steps stay
    at two. See benchmarks/RESULTS.md.
    """
    small = next_pow2(head_dim) <= 128
    # head_dim <= 64, 16-bit: 128-token steps, which beat 64-token ones there (see RESULTS.md).
    narrow = next_pow2(head_dim) <= 64 and dtype != torch.float32
    block_n = max(128 if narrow else 64 if small else 32, next_pow2(block_size))
    stages = 3 if small and dtype != torch.float32 and block_n <= 64 else 2
    return block_n, 4, stages


def many_long_narrow(programs: int, capacity: int, head_dim: int, query: torch.Tensor) -> bool:
    """Head dim <= 64, 16-bit, at least four programs per SM, tables of >= 8k tokens: there
    64-token steps in two splits beat one 128-token run per program (smaller tiles, more
    programs resident per SM); on smaller batches or shorter tables they do not (see
    benchmarks/RESULTS.md)."""
    return (
        next_pow2(head_dim) <= 64
        and query.dtype != torch.float32
        and capacity >= 8192
        and programs >= 4 * sm_count(query.device)
    )


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, capacity: int, block_n: int, device: torch.device
) -> int:
    """Splits per (sequence, KV head) from shapes only, for the fixed-split launch.

    With fewer programs than SMs, about four programs per SM keep enough loads in flight;
    once one wave is full, two programs per SM are enough and more only adds merge traffic
    (the split sweeps are in benchmarks/RESULTS.md). Rounded down to a power of two so
    power-of-two lengths cut into equal whole tiles. Never more splits than the power of two
    at or above the tiles in capacity: where the target allows a tile a split, a table of 6
    tiles takes 8 splits (two of them empty), not 4 of two tiles each (see
    benchmarks/RESULTS.md); nor more than MAX_SPLITS unless each split keeps
    LONG_SPLIT_TOKENS tokens (up to MAX_SPLITS_LONG: a few rows of 8k tokens or more).
    """
    programs = max(num_seqs * num_kv_heads, 1)
    sms = sm_count(device)
    tiles = triton.cdiv(capacity, block_n)
    splits = triton.cdiv((2 if programs >= sms else 4) * sms, programs)
    most = max(MAX_SPLITS, min(MAX_SPLITS_LONG, capacity // LONG_SPLIT_TOKENS))
    return floor_pow2(min(splits, most, next_pow2(tiles)))


def balances(num_seqs: int, num_kv_heads: int, capacity: int, device: torch.device) -> bool:
    """Whether the balanced launch pays: rows that can differ in length (two or more) by a
    lot (a table of more than BALANCE_ABOVE_TOKENS tokens), and up to BALANCE_BELOW programs
    per SM without splits. With more programs, the SMs' own scheduling already evens out rows
    of different lengths; a single row has nothing to even out; in a short table the longest
    row is short too, and the plan and its merge launch cost more than they even out. There
    the fixed-split launch (no plan, usually no merge) is faster (see benchmarks/RESULTS.md)."""
    return (
        num_seqs > 1
        and capacity > BALANCE_ABOVE_TOKENS
        and num_seqs * num_kv_heads < BALANCE_BELOW * sm_count(device)
    )


def choose_work_items(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Target work items per KV head for the balanced launch: programs per SM over all KV
    heads, more where many rows can differ in length than where a few long rows are split.

    Rounding each row up to whole items can add up to one item per row. With up to MANY_ROWS
    rows that extra is taken off the target first, so the launch keeps to its programs per
    SM: otherwise equal rows cut into, say, 9 items where 8 fill the GPU, and the ninth runs
    as a second wave. With more rows the extra items are short rows' and help balance.
    """
    many = num_seqs > MANY_ROWS
    per_sm = WORK_ITEMS_PER_SM_MANY_ROWS if num_seqs >= MANY_ROWS else WORK_ITEMS_PER_SM
    target = triton.cdiv(per_sm * sm_count(device), num_kv_heads)
    return max(1, target if many else target - num_seqs)


def merge_items_launch(work_items: int, num_seqs: int, row_most: int) -> tuple[int, int]:
    """(items a step, warps) of the balanced plan's merge, from the item target, the rows and
    the most items a row can hold. Each program's merge is a short chain of dependent loads;
    where rows hold few items each (``work_items`` at most MERGE_FEW_ITEMS a row), one-warp
    programs of MERGE_FEW_ITEMS items a step ran it fastest, otherwise one step of up to
    MERGE_ITEMS_STEP items a row (four warps) did (see benchmarks/RESULTS.md)."""
    if work_items <= MERGE_FEW_ITEMS * num_seqs:
        return MERGE_FEW_ITEMS, 1
    return min(MERGE_ITEMS_STEP, max(16, next_pow2(row_most))), 4


def reduce_lanes(num_splits: int, d_pad: int) -> int:
    """Head-dim lanes per merge program: all of them unless a program would then hold more
    than REDUCE_TILE_ELEMENTS partial values; past that (many splits) the lanes are cut
    across programs, so that a row's few heads do not merge on a few SMs each reading its
    splits alone (see benchmarks/RESULTS.md)."""
    fit = max(REDUCE_TILE_ELEMENTS // next_pow2(num_splits), REDUCE_MIN_LANES)
    return min(d_pad, floor_pow2(fit))


class DecodePlan(NamedTuple):
    """How one decode launch runs: tile, warps, stages, and either ``num_splits`` fixed splits
    per row (``work_items`` 0) or the balanced plan (``num_splits`` 0): rows cut into items of
    about total_tokens / ``work_items`` tokens, at least one item per row. ``max_registers``
    caps the split kernel's registers per thread (0: the compiler's choice); ``table_ahead``
    loads each tile's block ids a loop step ahead, so that a third pipeline stage is a second
    K/V buffer filled while the tile before it computes (Triton's pipeliner otherwise spends
    that stage on the block-table load)."""

    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    work_items: int
    max_registers: int = 0
    table_ahead: bool = False


def decode_plan(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    config: tuple[int, int, int] | None = None,
    num_splits: int | None = None,
    work_items: int | None = None,
    equal_lengths: bool = False,
) -> DecodePlan:
    """The launch plan from shapes only (no read of seq_lens: no sync). A given ``num_splits``
    asks for the fixed-split launch, a given ``work_items`` the balanced one; otherwise
    ``balances`` decides, and the split count or item target comes from the SM count. Rows
    the caller knows to be of one length (``equal_lengths``) take the fixed splits, which ran
    such batches faster than the balanced plan (see benchmarks/RESULTS.md); a wrong hint
    costs time, never exactness. A given ``config`` is kept as given."""
    num_seqs, _, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    capacity = block_tables.shape[1] * block_size
    balanced = num_splits is None and (
        work_items is not None
        or (not equal_lengths and balances(num_seqs, num_kv_heads, capacity, query.device))
    )
    many_long = (
        config is None
        and num_splits is None
        and many_long_narrow(num_seqs * num_kv_heads, capacity, head_dim, query)
    )
    if many_long:
        config = (max(64, next_pow2(block_size)), 4, 2)
    fp8_tiles = config is None and key_cache.dtype == FP8_DTYPE and query.dtype != torch.float32
    block_n, num_warps, num_stages = config or decode_config(head_dim, block_size, query.dtype)
    max_registers = 0
    if fp8_tiles:
        # one-byte K/V: twice the tokens per step for the bytes of a 16-bit tile, two stages,
        # and registers capped so that four programs fit per SM (see benchmarks/RESULTS.md)
        block_n = max(min(2 * block_n, 128), next_pow2(block_size))
        num_stages = 2
        if next_pow2(head_dim) <= 128 and block_n <= 128 and num_warps == 4:
            max_registers = FP8_TILE_REGISTERS
    items = 0
    if balanced:
        items = work_items or choose_work_items(num_seqs, num_kv_heads, query.device)
        num_splits = 0
    elif num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, capacity, block_n, query.device)
        if many_long:
            num_splits = max(num_splits, 2)
    # INT8 tiles (more work a byte than 16-bit ones) under 16-bit queries in fixed splits:
    # block ids a step ahead, so that three stages hold a second K/V buffer (see
    # benchmarks/RESULTS.md; FP8 tiles and the balanced launch ran slower so).
    table_ahead = (
        config is None
        and not balanced
        and key_cache.dtype == INT8_DTYPE
        and query.dtype != torch.float32
    )
    if table_ahead:
        num_stages = 3
    elif config is None and not fp8_tiles and (balanced or num_splits > 1):
        # A split launch pipelines two stages deep: a third stage costs this grid's split
        # kernel registers, hence occupancy, and ran slower (see RESULTS.md).
        num_stages = min(num_stages, 2)
    return DecodePlan(block_n, num_warps, num_stages, num_splits, items, max_registers, table_ahead)


def paged_decode_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    num_splits: int | None = None,
    config: tuple[int, int, int] | None = None,
    work_items: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    equal_lengths: bool = False,
    shared_prefix: SharedPrefixPlan | None = None,
) -> torch.Tensor:
    """Launch decode attention (arguments already validated); returns [S, Hq, D] like query.
    FP8 pools come with float32 ``k_scale``/``v_scale`` [Hkv], INT8 pools with their float16
    per-slot scales.

    By default the work is balanced over rows of any lengths (see ``DecodePlan``), or split
    evenly per row where the caller says the rows are of one length (``equal_lengths``).
    ``num_splits`` (fixed splits per row), ``work_items`` (the balanced target) and ``config``
    (BLOCK_N, num_warps, num_stages) override the shape-derived choices (tests and sweeps).
    ``shared_prefix`` (a checked ``SharedPrefixPlan`` on the query's device): its rows' shared
    blocks are read once by the prefix pass where ``takes_shared_prefix`` says so; otherwise
    every row is read whole.
    """
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    block_tables, seq_lens = unit_stride(block_tables), unit_stride(seq_lens)
    group = num_q_heads // num_kv_heads
    d_pad = head_dim_pad(head_dim)
    int8 = key_cache.dtype == INT8_DTYPE
    plan = decode_plan(
        query, key_cache, block_tables, config, num_splits, work_items, equal_lengths
    )
    balanced = plan.work_items > 0
    # The most items any lengths can need: sum of ceil(len / chunk) <= work_items + rows, and
    # no row has more items than tiles in the table.
    tiles = triton.cdiv(block_tables.shape[1] * block_size, plan.block_n)
    most_items = min(plan.work_items + num_seqs, num_seqs * max(tiles, 1))
    slots = most_items if balanced else num_seqs * plan.num_splits
    if balanced or plan.num_splits > 1:
        mid_o = torch.empty((slots, num_q_heads, d_pad), dtype=torch.float32, device=query.device)
        mid_lse = torch.empty((slots, num_q_heads), dtype=torch.float32, device=query.device)
    else:
        mid_o = mid_lse = out  # unused
    launch = pdl_launch(query.device)
    pdl = bool(launch)
    prefix = {}
    if shared_prefix is not None and takes_shared_prefix(
        num_seqs, num_kv_heads, sliding_window, query.device
    ):
        prefix_o, prefix_lse, splits = shared_prefix_partials(
            query, key_cache, value_cache, block_tables,
            shared_prefix.prefix_lens, shared_prefix.tiles,
            scale=scale, softcap=softcap, pdl=launch, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        prefix = dict(
            prefix_lens=shared_prefix.prefix_lens, prefix_o=prefix_o, prefix_lse=prefix_lse,
            PREFIX_SPLITS=splits,
        )  # fmt: skip
    # (a launch option of Triton's NVIDIA backend)
    capped = plan.max_registers and torch.version.hip is None
    registers = {"maxnreg": plan.max_registers} if capped else {}
    window = int(sliding_window or 0)
    s_pad = next_pow2(num_seqs) if balanced else 1
    grid = (slots * num_kv_heads, 1) if balanced else (num_seqs * num_kv_heads, plan.num_splits)
    _decode_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, out, mid_o, mid_lse,
        float(scale), float(softcap or 1.0), window, num_kv_heads, num_seqs, plan.work_items,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=plan.block_n, NUM_SPLITS=max(plan.num_splits, 1),
        BALANCED=balanced, S_PAD=s_pad,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        FP32=query.dtype == torch.float32, PDL=pdl,
        k_scale=k_scale, v_scale=v_scale, FP8=key_cache.dtype == FP8_DTYPE,
        INT8=int8, K_GROUPS=int8_groups(head_dim, INT8_K_GROUP), K_GW=INT8_K_GROUP,
        TABLE_AHEAD=plan.table_ahead,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **launch, **registers, **prefix,
    )  # fmt: skip
    if balanced:
        # a row holds at most work_items + 1 items, and never more than its tiles
        row_most = min(plan.work_items + 1, max(tiles, 1))
        items_step, merge_warps = merge_items_launch(plan.work_items, num_seqs, row_most)
        _merge_items_kernel[(num_seqs, num_q_heads)](
            mid_o, mid_lse, out, seq_lens, num_seqs, window, plan.work_items,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=s_pad, BLOCK_N=plan.block_n,
            HAS_WINDOW=sliding_window is not None,
            ITEMS_STEP=items_step, PDL=pdl, num_warps=merge_warps, **launch,
            prefix_lens=prefix.get("prefix_lens"), HAS_PREFIX=bool(prefix),
        )  # fmt: skip
    elif plan.num_splits > 1:
        d_block = reduce_lanes(plan.num_splits, d_pad)
        _reduce_kernel[(num_seqs, num_q_heads, d_pad // d_block)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, D_BLOCK=d_block,
            NUM_SPLITS=plan.num_splits, SPLITS_PAD=next_pow2(plan.num_splits), PDL=pdl,
            **launch,
        )  # fmt: skip
    return out
