"""Triton kernel of RMSNorm as Llama's modules compute it (``rms_norm.py`` holds the launchers
and the references): one program per row, the row held in registers. With ``RESIDUAL`` the
row is first the sum of x and a residual row, rounded to their dtype as PyTorch's add rounds
it, and that sum is written out too (a pre-norm decoder layer's residual add and the norm
after it in one launch)."""

from __future__ import annotations

import triton
import triton.language as tl

from nanoserve.kernels.triton_common import pdl_enter


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, total, stride_x, stride_r, D, eps,
    BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    kind = out.dtype.element_ty
    v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0)
    if RESIDUAL:
        r = tl.load(residual + row * stride_r + cols, mask=ok, other=0.0)
        v = (v.to(tl.float32) + r.to(tl.float32)).to(kind)
        tl.store(total + row * D + cols, v, mask=ok)
    v = v.to(tl.float32)
    variance = tl.sum(v * v, axis=0) / D
    normed = (v * tl.math.rsqrt(variance + eps)).to(kind)
    w = tl.load(weight + cols, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out + row * D + cols, y.to(kind), mask=ok)
