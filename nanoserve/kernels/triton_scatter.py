"""Triton slot scatter: one launch writes every new token's K and V row into the pools."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.dispatch import next_pow2


@triton.jit
def _slot_scatter_kernel(
    key, value, key_cache, value_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    t = token.to(tl.int64)
    k = tl.load(key + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(key_cache + dst, k, mask=mask)
    tl.store(value_cache + dst, v, mask=mask)


def slot_scatter_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch the scatter; arguments as ``slot_scatter_ref`` (already validated).

    key/value [T, Hkv, D] may be strided views as long as the last dim is contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    block_d = next_pow2(head_dim)
    # About 2k elements per program: all heads of a token for small models, a slice otherwise.
    block_h = max(1, min(next_pow2(num_kv_heads), 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _slot_scatter_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip
