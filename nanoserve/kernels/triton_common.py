"""Device helpers shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel launched with programmatic dependent launch (``PDL``):
    wait until the kernel before it in the stream has finished and its stores are visible
    (so everything before that has finished too), then let the next kernel's launch begin
    while this one runs. The launch of a kernel in a decode step then overlaps its
    predecessor instead of following it."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def tanh(x):
    """tanh through exp2: saturates cleanly to +-1 (exp2 overflows to inf, never NaN)."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def scores_to_log2(s, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k in fp32 -> logits in base 2 (scaled, optionally soft-capped)."""
    if HAS_SOFTCAP:
        s = softcap * tanh(s * (scale / softcap))
        return s * 1.4426950408889634
    else:
        return s * (scale * 1.4426950408889634)


@triton.jit
def mma(a, b, FP32: tl.constexpr):
    """a @ b with fp32 accumulation; float32 operands stay exact (no TF32 rounding)."""
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def mma_acc(a, b, acc, FP32: tl.constexpr):
    """acc + a @ b accumulated in place (the matrix unit adds into acc)."""
    if FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b, acc)
