"""Triton prefix pass of shared-prefix (cascade) decode attention (``shared_prefix.py``).

One program takes the rows of one prefix tile (a sub-tile of them where the query heads of one
KV head make more than 64 matrix rows), one KV head and one split of the shared prefix's
tokens: the rows' query heads of that KV head are the rows of one matrix, so each shared key
and value is read once for all of them, and the scores are one product per tile of keys. It
writes each (row, query head)'s normalized partial output and its base-2 log-sum-exp; the
decode kernel folds them into the row's own tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.dispatch import floor_pow2, head_dim_pad, next_pow2, sm_count
from nanoserve.kernels.quant import FP8_DTYPE, INT8_DTYPE, INT8_K_GROUP, int8_groups
from nanoserve.kernels.shared_prefix import TILE_ROWS
from nanoserve.kernels.triton_common import (
    int8_key_scores,
    mma,
    pdl_enter,
    query_for_fp8_tiles,
    scores_to_log2,
)

# Matrix rows (tile rows x query heads of one KV head) a program holds at most; INT8 pools'
# grouped key products hold more registers a row, and at 64 rows the pass runs out of them.
PREFIX_MATRIX_ROWS = 64
INT8_PREFIX_MATRIX_ROWS = 32
# Fewest prefix tokens a split keeps, and the most splits.
PREFIX_SPLIT_TOKENS = 256
MAX_PREFIX_SPLITS = 16


@triton.jit
def _prefix_kernel(
    query, key_cache, value_cache, block_tables, prefix_lens, tiles, prefix_o, prefix_lse,
    scale, softcap, k_scale, v_scale, num_kv_heads,
    stride_qs, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr, SUB_TILES: tl.constexpr, SPLITS: tl.constexpr,
    TILE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP32: tl.constexpr, FP8: tl.constexpr,
    INT8: tl.constexpr, K_GROUPS: tl.constexpr, K_GW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    tile = tl.program_id(0) // SUB_TILES
    sub = tl.program_id(0) % SUB_TILES
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    m = tl.arange(0, BLOCK_M)
    member = m // GROUP
    slot = sub * ROWS_PER_PROGRAM + member
    in_tile = (member < ROWS_PER_PROGRAM) & (slot < TILE)
    row = tl.load(tiles + tile * TILE + slot, mask=in_tile, other=-1)
    active = row >= 0
    row = tl.maximum(row, 0)
    lead = tl.load(tiles + tile * TILE)  # every member shares the first member's blocks
    prefix = tl.where(lead >= 0, tl.load(prefix_lens + tl.maximum(lead, 0)), 0)
    per_split = tl.cdiv(tl.cdiv(prefix, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, prefix)

    head = kv_head * GROUP + m % GROUP
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q_mask = active[:, None] & d_mask[None, :]
    q_rows = query + row[:, None] * stride_qs + head[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0)
    if FP8:  # K's scale folds into the score scale; V's is the decode kernel's, at its end
        scale = scale * tl.load(k_scale + kv_head)
        if not FP32:
            q, scale = query_for_fp8_tiles(q, scale, True)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables + tl.maximum(lead, 0).to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        at = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        kv_mask = valid[:, None] & d_mask[None, :]
        v = tl.load(value_cache + at[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if INT8:  # as the decode kernel; a value's one scale folds into its softmax weight
            s = int8_key_scores(q, q_rows, active, key_cache, at, valid, k_scale,
                                BLOCK_M, BLOCK_N, HEAD_DIM, K_GROUPS, K_GW, FP32)  # fmt: skip
            v_token = tl.load(v_scale + at // HEAD_DIM, mask=valid, other=0.0).to(tl.float32)
        else:
            k = tl.load(key_cache + at[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = mma(q, tl.trans(k.to(q.dtype)), FP32)
        s = scores_to_log2(s, scale, softcap, HAS_SOFTCAP)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if INT8:
            p = p * v_token[None, :]
        acc = acc * alpha[:, None] + mma(p, v.to(q.dtype), FP32)
        m_i = m_new

    # Scratch: prefix_o [S, Hq, SPLITS, D_PAD], prefix_lse [S, Hq, SPLITS]; an empty split
    # leaves lse -1e30 and zeros, which weigh nothing beside a split that saw keys.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    at = (row * (GROUP * num_kv_heads) + head).to(tl.int64) * SPLITS + split
    tl.store(prefix_o + at[:, None] * D_PAD + d[None, :], acc / l_safe[:, None],
             mask=active[:, None])  # fmt: skip
    tl.store(prefix_lse + at, m_i + tl.log2(l_safe), mask=active)


def prefix_tile_shape(group: int, int8: bool = False) -> tuple[int, int, int]:
    """(rows a program takes, programs a tile, matrix rows) for ``group`` query heads a KV
    head: as many of a tile's rows as keep the matrix within PREFIX_MATRIX_ROWS rows
    (INT8_PREFIX_MATRIX_ROWS over ``int8`` pools; at least one row, at least 16 matrix rows
    for ``tl.dot``)."""
    most = INT8_PREFIX_MATRIX_ROWS if int8 else PREFIX_MATRIX_ROWS
    rows = max(1, min(TILE_ROWS, most // next_pow2(group)))
    return rows, -(-TILE_ROWS // rows), max(16, next_pow2(rows * group))


def prefix_key_tile(fp32: bool, d_pad: int, block_size: int, block_m: int) -> tuple[int, int]:
    """(keys a loop step, warps) of the prefix pass for a float32 query or not, head-dim
    tile ``d_pad`` and ``block_m`` matrix rows: 64 keys (32 for float32 or past head_dim
    128), at least a block; 8 warps past 64 x 128 matrix entries."""
    block_n = max(32 if fp32 or d_pad > 128 else 64, next_pow2(block_size))
    return block_n, 8 if block_m * d_pad > 64 * 128 else 4


def prefix_splits(num_tiles: int, num_kv_heads: int, group: int, capacity: int,
                  device: torch.device, int8: bool = False) -> int:  # fmt: skip
    """Splits of the shared prefix from shapes only (a CUDA graph fixes them): about two
    programs an SM over the tiles' programs, each split keeping PREFIX_SPLIT_TOKENS of the
    most the tables can hold (``capacity`` tokens), a power of two up to MAX_PREFIX_SPLITS."""
    programs = num_tiles * prefix_tile_shape(group, int8)[1] * num_kv_heads
    want = -(-2 * sm_count(device) // max(programs, 1))
    most = max(1, capacity // PREFIX_SPLIT_TOKENS)
    return floor_pow2(max(1, min(want, most, MAX_PREFIX_SPLITS)))


def shared_prefix_partials(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    tiles: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    pdl: dict,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Run the prefix pass: (prefix_o float32 [S, Hq, splits, D_PAD], prefix_lse float32
    [S, Hq, splits], splits). Only the rows of ``tiles`` are written; query [S, Hq, D] with a
    unit last stride; 16-bit, float32, FP8 or INT8 pools, with the decode launch's
    ``k_scale``/``v_scale`` (FP8: float32 [Hkv], the outputs left in units of the unscaled
    values, which the decode kernel scales at its end; INT8: the pools' per-slot scales), no
    sliding window."""
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    d_pad = head_dim_pad(head_dim)
    fp32 = query.dtype == torch.float32
    fp8 = key_cache.dtype == FP8_DTYPE
    int8 = key_cache.dtype == INT8_DTYPE
    rows, sub_tiles, block_m = prefix_tile_shape(group, int8)
    capacity = block_tables.shape[1] * block_size
    splits = prefix_splits(tiles.shape[0], num_kv_heads, group, capacity, query.device, int8)
    shape = (num_seqs, num_q_heads, splits)
    prefix_o = torch.empty((*shape, d_pad), dtype=torch.float32, device=query.device)
    prefix_lse = torch.empty(shape, dtype=torch.float32, device=query.device)
    block_n, warps = prefix_key_tile(fp32, d_pad, block_size, block_m)
    grid = (tiles.shape[0] * sub_tiles, num_kv_heads, splits)
    _prefix_kernel[grid](
        query, key_cache, value_cache, block_tables, prefix_lens, tiles, prefix_o, prefix_lse,
        float(scale), float(softcap or 1.0), k_scale, v_scale, num_kv_heads,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, ROWS_PER_PROGRAM=rows, SUB_TILES=sub_tiles,
        SPLITS=splits, TILE=TILE_ROWS, HAS_SOFTCAP=softcap is not None, FP32=fp32,
        FP8=fp8, INT8=int8, K_GROUPS=int8_groups(head_dim, INT8_K_GROUP), K_GW=INT8_K_GROUP,
        PDL=bool(pdl), num_warps=warps, num_stages=2, **pdl,
    )  # fmt: skip
    return prefix_o, prefix_lse, splits
