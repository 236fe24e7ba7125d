"""Triton kernel of RMSNorm as Llama's modules compute it (``rms_norm.py`` holds the launcher
and the reference): one program per row, the row held in registers."""

from __future__ import annotations

import triton
import triton.language as tl

from nanoserve.kernels.triton_common import pdl_enter


@triton.jit
def _rms_norm_kernel(x, weight, out, stride_x, D, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    variance = tl.sum(v * v, axis=0) / D
    normed = (v * tl.math.rsqrt(variance + eps)).to(out.dtype.element_ty)
    w = tl.load(weight + cols, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out + row * D + cols, y.to(out.dtype.element_ty), mask=ok)
