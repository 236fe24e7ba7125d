"""Split-KV partials and their merge, shared by the tiled extend kernel (runs of keys per
query tile, triton_extend.py) and the GQA-packed kernel (splits over the history,
triton_verify.py).

Each split leaves, per (token, query head), its normalised output and log-sum-exp (base 2) in
a scratch [T, Hq, NUM_SPLITS(, D_PAD)]; the merge weights the splits by 2^lse. A split that
saw no key stores lse -inf and weighs nothing; a row no split saw merges to zeros, as one
split leaves it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.dispatch import next_pow2

# Split partials (normalised outputs) of 16-bit queries in the query's dtype: half the scratch
# traffic of float32 at one more rounding (float32 queries keep float32 partials).
PARTIALS_16BIT = True


@triton.jit
def store_partials(mid_o, mid_lse, row, o, l_i, m_i, d, D_PAD: tl.constexpr, io_mask, row_mask):
    """Stores one split's tile: ``row`` [BLOCK_M] indexes the scratch's (token, head, split)
    rows, ``o`` [BLOCK_M, D_PAD] the normalised output, ``l_i``/``m_i`` the softmax sum and
    max (base 2); a row with l 0 (no key in this split) stores lse -inf."""
    tl.store(mid_o + row[:, None] * D_PAD + d[None, :], o.to(mid_o.dtype.element_ty),
             mask=io_mask)  # fmt: skip
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(mid_lse + row, lse, mask=row_mask)


@triton.jit
def _merge_kernel(
    mid_o, mid_lse, out, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[t, h] = sum_k 2^lse_k o_k / sum_k 2^lse_k over the splits k; zeros where every
    split is empty (lse -inf)."""
    if PDL:
        tl.extra.cuda.gdc_wait()  # the split kernel has finished and its stores are visible
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    row = (token * tl.num_programs(1) + head) * NUM_SPLITS
    lse = tl.load(mid_lse + row + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.max(lse, 0)))
    mask = (sp < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :]
    o = tl.load(mid_o + (row + sp)[:, None] * D_PAD + d[None, :], mask=mask, other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o.to(tl.float32) * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    dst = out + token * stride_ot + head * stride_oh + d
    tl.store(dst, res.to(out.dtype.element_ty), mask=d < HEAD_DIM)


def split_partials(
    query: torch.Tensor, num_splits: int, d_pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for ``num_splits`` splits of query [T, Hq, D]: outputs [T, Hq, splits, d_pad]
    (the query's dtype for 16-bit queries if ``PARTIALS_16BIT``, else float32) and float32
    log-sum-exps [T, Hq, splits]."""
    total_q, num_q_heads, _ = query.shape
    dtype = query.dtype if PARTIALS_16BIT else torch.float32
    mid_o = torch.empty(total_q, num_q_heads, num_splits, d_pad, dtype=dtype, device=query.device)
    mid_lse = torch.empty(
        total_q, num_q_heads, num_splits, dtype=torch.float32, device=query.device
    )
    return mid_o, mid_lse


def merge_splits(
    mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, head_dim: int, pdl: bool
) -> None:
    """Writes out [T, Hq, D] from ``split_partials``' scratch; ``pdl`` launches the merge as
    a programmatic dependent of the split kernel (which must have been launched with it)."""
    total_q, num_q_heads, num_splits, d_pad = mid_o.shape
    _merge_kernel[(total_q, num_q_heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits,
        SPLITS_PAD=next_pow2(num_splits), PDL=pdl,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
