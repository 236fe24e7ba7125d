"""Triton paged decode attention: one query token per sequence, split-KV (flash-decoding).

Grid (num_seqs * num_kv_heads, num_splits), KV head fastest. One program holds every query
head of one KV head as the rows of one tile (padded to >= 16 rows for tl.dot), so each K/V
row is read once. It walks its share of the sequence BLOCK_N tokens at a time straight
through the block table (several pages per step when pages are small), with an online
softmax in float32. With more than one split, partial results and their log-sum-exp go to a
float32 scratch and a second kernel merges them. On NVIDIA Hopper and later the merge kernel
is launched with programmatic dependent launch: its launch overlaps the split kernel's run
and it waits on the device (griddepcontrol) for that kernel's results, which hides part of the
launch cost of small shapes (see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.dispatch import next_pow2, sm_count, supports_pdl, unit_stride
from nanoserve.kernels.triton_common import mma, scores_to_log2

MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    query, key_cache, value_cache, block_tables, seq_lens, out, mid_o, mid_lse,
    scale, softcap, window, num_kv_heads,
    stride_qs, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt, stride_os, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        # lets the merge kernel's launch start now; it still waits for this grid to finish
        tl.extra.cuda.gdc_launch_dependents()
    # one grid axis for (sequence, KV head): axis 1 of a CUDA grid stops at 65,535
    kv_head = tl.program_id(0) % num_kv_heads
    seq = tl.program_id(0) // num_kv_heads
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens + seq)
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    # Splits cut [first tile of the window, seq_len) into equal runs of whole tiles.
    base = (kv_start // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len - base, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = base + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    d_mask = d < HEAD_DIM
    row_mask = (g < GROUP)[:, None] & d_mask[None, :]
    q = tl.load(query + seq * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=row_mask)

    # A finite start keeps exp2(m_old - m_new) from ever being NaN on fully masked tiles.
    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos < hi) & (pos >= kv_start)
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(key_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), FP32)
        s = scores_to_log2(s, scale, softcap, HAS_SOFTCAP)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p, v, FP32)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        dst = out + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=row_mask)
    else:
        # Scratch: mid_o [S, Hq, NUM_SPLITS, D_PAD], mid_lse [S, Hq, NUM_SPLITS], contiguous.
        row = (seq * (GROUP * num_kv_heads) + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(mid_o + row[:, None] * D_PAD + d[None, :], o, mask=row_mask)
        tl.store(mid_lse + row, m_i + tl.log2(l_safe), mask=g < GROUP)


@triton.jit
def _reduce_kernel(
    mid_o, mid_lse, out, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()  # the split kernel has finished and its stores are visible
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
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
    """Splits per (sequence, KV head) from shapes only (no read of seq_lens: no sync).

    With fewer programs than SMs, about four programs per SM keep enough loads in flight;
    once one wave is full, two programs per SM are enough and more only adds merge traffic
    (the split sweeps are in benchmarks/RESULTS.md). Rounded down to a power of two so
    power-of-two lengths cut into equal whole tiles. Never more splits than tiles in capacity.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    sms = sm_count(device)
    splits = triton.cdiv((2 if programs >= sms else 4) * sms, programs)
    splits = min(splits, MAX_SPLITS, triton.cdiv(capacity, block_n))
    return 1 << (max(splits, 1).bit_length() - 1)


def decode_plan(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    config: tuple[int, int, int] | None = None,
    num_splits: int | None = None,
) -> tuple[int, int, int, int]:
    """(BLOCK_N, num_warps, num_stages, num_splits) of a launch, from shapes only; a given
    ``config`` or ``num_splits`` is kept as given."""
    num_seqs, _, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    capacity = block_tables.shape[1] * block_size
    many_long = (
        config is None
        and num_splits is None
        and many_long_narrow(num_seqs * num_kv_heads, capacity, head_dim, query)
    )
    if many_long:
        config = (max(64, next_pow2(block_size)), 4, 2)
    block_n, num_warps, num_stages = config or decode_config(head_dim, block_size, query.dtype)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, capacity, block_n, query.device)
        if many_long:
            num_splits = max(num_splits, 2)
    if config is None and num_splits > 1:
        # A split launch pipelines two stages deep: a third stage costs this grid's split
        # kernel registers, hence occupancy, and ran slower (see RESULTS.md).
        num_stages = min(num_stages, 2)
    return block_n, num_warps, num_stages, num_splits


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
) -> torch.Tensor:
    """Launch decode attention (arguments already validated); returns [S, Hq, D] like query.

    ``num_splits`` and ``config`` (BLOCK_N, num_warps, num_stages) override the shape-derived
    choices (tests and benchmark sweeps).
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
    d_pad = next_pow2(head_dim)
    block_n, num_warps, num_stages, num_splits = decode_plan(
        query, key_cache, block_tables, config, num_splits
    )
    if num_splits > 1:
        mid_o = torch.empty(
            (num_seqs, num_q_heads, num_splits, d_pad), dtype=torch.float32, device=query.device
        )
        mid_lse = torch.empty(
            (num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:
        mid_o = mid_lse = out  # unused
    pdl = num_splits > 1 and supports_pdl(query.device)
    _decode_kernel[(num_seqs * num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, out, mid_o, mid_lse,
        float(scale), float(softcap or 1.0), int(sliding_window or 0), num_kv_heads,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        FP32=query.dtype == torch.float32, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_q_heads)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=next_pow2(num_splits), PDL=pdl,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
    return out
