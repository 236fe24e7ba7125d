"""Triton kernels of Llama's rotary embedding (``rotary.py`` holds the launchers and the
references): the rotation, one program per (token, block of heads), q's heads and k's in one
launch; and a step's cos and sin tables, one program per token."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanoserve.kernels.triton_common import pdl_enter


@triton.jit
def _rotate_heads(src, dst, stride_b, stride_h, stride_s, b, s, S, H, head0, c1, c2, s1, s2,
                  HALF, HEADS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    heads = head0 + tl.arange(0, HEADS)
    dims = tl.arange(0, BLOCK)
    ok = (heads < H)[:, None] & (dims < HALF)[None, :]
    at = src + b * stride_b + s * stride_s + heads[:, None].to(tl.int64) * stride_h + dims[None, :]
    x1 = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
    kind = dst.dtype.element_ty
    # eager's roundings: each product, then the sum, rounded to the tensors' dtype
    lo = (x1 * c1).to(kind).to(tl.float32) + (-x2 * s1).to(kind).to(tl.float32)
    hi = (x2 * c2).to(kind).to(tl.float32) + (x1 * s2).to(kind).to(tl.float32)
    out = dst + ((b * H + heads[:, None].to(tl.int64)) * S + s) * (2 * HALF) + dims[None, :]
    tl.store(out, lo.to(kind), mask=ok)
    tl.store(out + HALF, hi.to(kind), mask=ok)


@triton.jit
def _rotary_kernel(q, k, cos, sin, q_out, k_out,
                   stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                   stride_cb, stride_cs, stride_sb, stride_ss,
                   S, HQ, HK, HALF, Q_BLOCKS,
                   HEADS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    b = token // S
    s = token % S
    dims = tl.arange(0, BLOCK)
    ok = dims < HALF
    c_at = cos + b * stride_cb + s * stride_cs + dims
    s_at = sin + b * stride_sb + s * stride_ss + dims
    c1 = tl.load(c_at, mask=ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_at + HALF, mask=ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_at, mask=ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_at + HALF, mask=ok, other=0.0).to(tl.float32)[None, :]
    if block < Q_BLOCKS:
        _rotate_heads(q, q_out, stride_qb, stride_qh, stride_qs, b, s, S, HQ, block * HEADS,
                      c1, c2, s1, s2, HALF, HEADS, BLOCK)  # fmt: skip
    else:
        _rotate_heads(k, k_out, stride_kb, stride_kh, stride_ks, b, s, S, HK,
                      (block - Q_BLOCKS) * HEADS, c1, c2, s1, s2, HALF, HEADS, BLOCK)  # fmt: skip


@triton.jit
def _cos_sin_kernel(positions, inv_freq, cos, sin, stride_pb, stride_ps, S, HALF, scaling,
                    BLOCK: tl.constexpr, ACCURATE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    b = token // S
    s = token % S
    dims = tl.arange(0, BLOCK)
    ok = dims < HALF
    # the position rounded to float32, times each frequency: one rounded product, as eager's
    position = tl.load(positions + b * stride_pb + s * stride_ps).to(tl.float32)
    freqs = position * tl.load(inv_freq + dims, mask=ok, other=0.0).to(tl.float32)
    if ACCURATE:
        # CUDA's cosf and sinf, which PyTorch's CUDA cos and sin call
        c = libdevice.cos(freqs)
        n = libdevice.sin(freqs)
    else:  # (the interpreter: numpy's float32 cos and sin)
        c = tl.cos(freqs)
        n = tl.sin(freqs)
    kind = cos.dtype.element_ty
    c = (c * scaling).to(kind)
    n = (n * scaling).to(kind)
    out = token * (2 * HALF) + dims
    tl.store(cos + out, c, mask=ok)
    tl.store(cos + out + HALF, c, mask=ok)
    tl.store(sin + out, n, mask=ok)
    tl.store(sin + out + HALF, n, mask=ok)
