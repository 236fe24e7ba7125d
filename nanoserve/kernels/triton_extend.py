"""Triton paged extend attention: several new tokens per sequence over the paged history.

Flash-attention tiles of BLOCK_M query rows x BLOCK_N keys, one query head per program. The
grid is flat over query tiles and sized from shapes alone (no host sync): sequence i owns the
tile ids from ``cu_seqlens_q[i] // BLOCK_M + i`` on, which is strictly increasing in i, so a
program finds its sequence by binary search over ``cu_seqlens_q`` and exits early when its
tile lies past that sequence's new tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.dispatch import next_pow2
from nanoserve.kernels.triton_common import mma, scores_to_log2


@triton.jit
def _extend_kernel(
    query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out,
    scale, softcap, window, num_seqs,
    stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP32: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    head = tl.program_id(1)
    # Largest i with cu[i] // BLOCK_M + i <= tile.
    lo = 0
    hi = num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q + mid) // BLOCK_M + mid
        go_right = first_tile <= tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo
    q_begin = tl.load(cu_seqlens_q + seq)
    q_len = tl.load(cu_seqlens_q + seq + 1) - q_begin
    m0 = (tile - (q_begin // BLOCK_M + seq)) * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    ctx = seq_len - q_len

    rows = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q_mask = (rows < q_len)[:, None] & d_mask[None, :]
    tokens = (q_begin + rows).to(tl.int64)
    q = tl.load(query + tokens[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask)
    q_pos = ctx + rows

    kv_hi = ctx + tl.minimum(m0 + BLOCK_M, q_len)  # last visible position + 1
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(ctx + m0 - window + 1, 0)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    head_off = (head // GROUP) * stride_ch
    for start in range((kv_lo // BLOCK_N) * BLOCK_N, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos < kv_hi) & (pos >= kv_lo)
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(key_cache + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), FP32)
        s = scores_to_log2(s, scale, softcap, HAS_SOFTCAP)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p, v, FP32)
        m_i = m_new

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    dst = out + tokens[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, o.to(out.dtype.element_ty), mask=q_mask)


def extend_config(head_dim: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps); small tiles off GPU keep interpreter tests quick."""
    if device.type != "cuda":
        return 16, 32, 4
    if next_pow2(head_dim) <= 128:
        return 64, 64, 4
    return 64, 32, 8


def paged_extend_attention_triton(
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
) -> torch.Tensor:
    """Launch extend attention (arguments already validated); returns [T, Hq, D] like query."""
    total_q, num_q_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if total_q == 0 or num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    block_m, block_n, num_warps = extend_config(head_dim, query.device)
    grid = (total_q // block_m + num_seqs, num_q_heads)
    _extend_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out,
        scale, softcap or 1.0, sliding_window or 0, num_seqs,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        SEARCH_STEPS=max(1, num_seqs.bit_length()),
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        FP32=query.dtype == torch.float32,
        num_warps=num_warps,
    )  # fmt: skip
    return out
