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
    """tanh in fp32. Near 0 an odd polynomial: there 1 - 2 / (e^2x + 1) cancels to a few
    correct bits, which a large softcap multiplies back into the logits. Beyond, through
    exp2: saturates cleanly to +-1 (exp2 overflows to inf, never NaN)."""
    x2 = x * x
    # x (1 - x^2/3 + 2x^4/15 - 17x^6/315 + 62x^8/2835): below 0.125 within float rounding
    near = -0.05396825396825397 + x2 * 0.021869488536155203
    near = 0.13333333333333333 + x2 * near
    near = x * (1.0 + x2 * (-0.3333333333333333 + x2 * near))
    far = 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)
    return tl.where(tl.abs(x) < 0.125, near, far)


@triton.jit
def scores_to_log2(s, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k in fp32 -> logits in base 2 (scaled, optionally soft-capped)."""
    if HAS_SOFTCAP:
        s = softcap * tanh(s * (scale / softcap))
        return s * 1.4426950408889634
    else:
        return s * (scale * 1.4426950408889634)


@triton.jit
def query_for_fp8_tiles(q, scale, PER_ROW: tl.constexpr):
    """(q [M, D] as float16, the score scale to use with it) for products with e4m3 tiles,
    which convert to float16 in one instruction and to bfloat16 only through more: the tiles
    meet in float16. The query is divided by the power of two that puts its largest entry in
    [2^13, 2^14): no overflow, and every entry down to 2^-27 of the largest keeps all of
    bfloat16's bits; the scale takes the power back. ``PER_ROW``: a power for each row (the
    scale [M, 1]), for a matrix whose rows are different sequences' (the prefix pass), so that
    one row's huge or infinite entries leave the others' bits; else one for the whole matrix
    (the heads of one sequence: a scalar scale, fewer instructions in the decode loop)."""
    if PER_ROW:
        q_max = tl.max(tl.abs(q.to(tl.float32)), 1)[:, None]
    else:
        q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
    exponent = (q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF
    q_pow = (tl.maximum(exponent - 13, 1) << 23).to(tl.float32, bitcast=True)
    return (q.to(tl.float32) / q_pow).to(tl.float16), scale * q_pow


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


@triton.jit
def int8_rows_scales(scales, rows, valid, HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr,
                     G_PAD: tl.constexpr):  # fmt: skip
    """float16 scales [BLOCK_N, G_PAD] of INT8 pool rows starting at element offsets ``rows``
    (contiguous pools: a row's scales start at rows // HEAD_DIM * GROUPS); 0 where masked."""
    g = tl.arange(0, G_PAD)
    at = (rows // HEAD_DIM * GROUPS)[:, None] + g[None, :]
    return tl.load(scales + at, mask=valid[:, None] & (g < GROUPS)[None, :], other=0.0)


@triton.jit
def int8_key_scores(q, q_rows, q_valid, key_cache, rows, valid, k_scale, M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, K_GROUPS: tl.constexpr,
                    K_GW: tl.constexpr, FP32: tl.constexpr):  # fmt: skip
    """float32 raw scores [M, BLOCK_N] of the query rows at pointers ``q_rows`` [M, 1] (those
    with ``q_valid`` [M]; ``q`` [M, D_PAD] gives the products' dtype) against INT8 keys at
    element offsets ``rows`` [BLOCK_N] (``valid`` ones): a key's scales are per group of K_GW
    channels, so the scores sum one product per group, each times its keys' float16 scales
    (contiguous pools: a key's scales start at rows // HEAD_DIM * K_GROUPS)."""
    s = tl.zeros([M, BLOCK_N], tl.float32)
    slot_head = rows // HEAD_DIM
    for gi in tl.static_range(K_GROUPS):
        c = gi * K_GW + tl.arange(0, K_GW)
        c_mask = c < HEAD_DIM
        k_g = tl.load(key_cache + rows[:, None] + c[None, :],
                      mask=valid[:, None] & c_mask[None, :], other=0)  # fmt: skip
        q_g = tl.load(q_rows + c[None, :], mask=q_valid[:, None] & c_mask[None, :], other=0.0)
        k_mul = tl.load(k_scale + slot_head * K_GROUPS + gi, mask=valid, other=0.0)
        s += mma(q_g, tl.trans(k_g.to(q.dtype)), FP32) * k_mul.to(tl.float32)[None, :]
    return s


@triton.jit
def dequantize_int8_tile(x, scales, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
                         G_PAD: tl.constexpr):  # fmt: skip
    """int8 [BLOCK_N, D_PAD] times its float16 scales [BLOCK_N, G_PAD] (one per group of
    D_PAD // G_PAD channels) -> float32 [BLOCK_N, D_PAD], exact."""
    groups = tl.reshape(x.to(tl.float32), [BLOCK_N, G_PAD, D_PAD // G_PAD])
    return tl.reshape(groups * scales.to(tl.float32)[:, :, None], [BLOCK_N, D_PAD])
