"""Triton kernel for the projections of a decode step: y = x @ W.T for a few rows of x.

At one to 64 rows a linear layer only reads its weight, and a decode step of a small
model reads many small ones (cuBLAS reaches a fraction of the bandwidth on a 2 MiB matrix).
One launch here covers up to three weights that read the same input (a layer's q, k and v
projections) or a gate and an up projection with the activation and product applied as they
are written (``silu(x @ Wg.T) * (x @ Wu.T)``, rounded where eager PyTorch rounds).

Each program computes a ``BLOCK_N``-column tile of one weight's output over a ``1 / SPLIT``
share of K with float32 accumulation; with ``SPLIT > 1`` the shares go to a float32
workspace that a second kernel sums in a fixed order (no atomics: the result does not change
from run to run). With ``ROTARY`` (q, k and v, unsplit) a tile of q or k holds matching
columns of the two halves of one head, so that the rotary embedding of the rounded outputs
is written to two more outputs as Llama applies it, and with ``STORE_KV`` k rotated and v
to their slots of the layer's K/V pools as well (a decode step's slot scatter).
``small_batch_linear.py`` holds the launcher and the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanoserve.kernels.triton_common import mma_acc, pdl_enter


@triton.jit
def _pick(index, a, b, c):
    """a, b or c by a runtime index 0, 1 or 2 (the three weights' pointers or sizes)."""
    return tl.where(index == 0, a, tl.where(index == 1, b, c))


@triton.jit
def _w_tile(w, cols, n, k, k_hi, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """[BLOCK_K, BLOCK_N]: columns ``cols`` of W.T over k..k+BLOCK_K (zero past n, k_hi)."""
    kk = k + tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(w + cols[None, :] * K + kk[:, None], mask=cols[None, :] < n, other=0.0)
    ok = (cols[None, :] < n) & (kk[:, None] < k_hi)
    return tl.load(w + cols[None, :] * K + kk[:, None], mask=ok, other=0.0)


@triton.jit
def _x_tile(x, stride_x, rows, M, k, k_hi, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K]: rows of x over k..k+BLOCK_K (zero past M, k_hi)."""
    kk = k + tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(x + rows[:, None] * stride_x + kk[None, :], mask=rows[:, None] < M,
                       other=0.0)  # fmt: skip
    ok = (rows[:, None] < M) & (kk[None, :] < k_hi)
    return tl.load(x + rows[:, None] * stride_x + kk[None, :], mask=ok, other=0.0)


@triton.jit
def _tile_product(
    x, stride_x, rows, M, w, cols, n, k_lo, k_hi, K, w_first,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FP32: tl.constexpr,
):  # fmt: skip
    """float32 [BLOCK_M, BLOCK_N]: rows of x times columns ``cols`` of W.T over k_lo..k_hi;
    ``w_first`` is W's first tile (``_w_tile`` at k_lo), loaded by the caller."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = mma_acc(_x_tile(x, stride_x, rows, M, k_lo, k_hi, BLOCK_K, EVEN_K), w_first, acc, FP32)
    for k in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        xt = _x_tile(x, stride_x, rows, M, k, k_hi, BLOCK_K, EVEN_K)
        wt = _w_tile(w, cols, n, k, k_hi, K, BLOCK_K, EVEN_K)
        acc = mma_acc(xt, wt, acc, FP32)
    return acc


@triton.jit
def _finish(acc, bias, cols, n, HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The layer's output dtype from a float32 tile: bias added first, rounded once."""
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    return acc.to(OUT_DTYPE)


@triton.jit
def _rotary_cols(tile, n, HALF, BLOCK_N: tl.constexpr):
    """[BLOCK_N] columns of one head: ``BLOCK_N // 2`` of its first half, then the same
    positions of its second half (``HALF``: half the head dimension); n where past the half."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    per_head = tl.cdiv(HALF, HALF_N)
    c = tl.arange(0, BLOCK_N)
    j = (tile % per_head) * HALF_N + c % HALF_N
    col = (tile // per_head) * 2 * HALF + (c // HALF_N) * HALF + j
    return tl.where(j < HALF, col, n)


@triton.jit
def _pool_store(pool, slots, n, cols, vals, ok, store):
    """Stores ``vals`` [BLOCK_M, C] (columns ``cols`` [C] of rows of n values) where ``ok``
    to the rows' slots of ``pool`` (contiguous [blocks, block_size, heads, D] with heads * D
    = n) if the scalar ``store``; ``slots`` int64 [BLOCK_M], -1: not stored."""
    # (the scalar joins the mask as a tile: the interpreter refuses a scalar in a tile's mask)
    keep = (slots >= 0) & ((tl.zeros_like(slots) + store.to(tl.int64)) > 0)
    tl.store(pool + slots[:, None] * n + cols[None, :], vals, mask=ok & keep[:, None])


@triton.jit
def _rotary_store(y, cols, n, rows, M, rot, stride_rot, cos, stride_cos, sin, stride_sin,
                  HALF, pool, slots, store, STORE_KV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Writes to ``rot`` [M, n] ``q * cos + rotate_half(q) * sin`` of a rounded tile ``y``
    [BLOCK_M, BLOCK_N] whose columns ``cols`` come from ``_rotary_cols``, with eager's
    roundings (each product, then the sum); cos and sin [M, 2 * HALF]: each row's angles.
    With ``STORE_KV`` and ``store`` the rotated rows go to their ``slots`` of ``pool`` too."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    x1, x2 = tl.split(tl.permute(tl.reshape(y.to(tl.float32), [BLOCK_M, 2, HALF_N]), [0, 2, 1]))
    lo_cols, hi_cols = tl.split(tl.permute(tl.reshape(cols, [2, HALF_N]), [1, 0]))
    ok = (rows[:, None] < M) & (lo_cols[None, :] < n)
    j = (lo_cols % (2 * HALF))[None, :]
    c1 = tl.load(cos + rows[:, None] * stride_cos + j, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos + rows[:, None] * stride_cos + j + HALF, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin + rows[:, None] * stride_sin + j, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin + rows[:, None] * stride_sin + j + HALF, mask=ok, other=0.0).to(tl.float32)
    kind = rot.dtype.element_ty
    lo = (x1 * c1).to(kind).to(tl.float32) + (-x2 * s1).to(kind).to(tl.float32)
    hi = (x2 * c2).to(kind).to(tl.float32) + (x1 * s2).to(kind).to(tl.float32)
    at = rot + rows[:, None] * stride_rot
    tl.store(at + lo_cols[None, :], lo.to(kind), mask=ok)
    tl.store(at + hi_cols[None, :], hi.to(kind), mask=ok)
    if STORE_KV:
        _pool_store(pool, slots, n, lo_cols, lo.to(kind), ok, store)
        _pool_store(pool, slots, n, hi_cols, hi.to(kind), ok, store)


@triton.jit
def _gate(g, u, OUT_DTYPE: tl.constexpr):
    """silu(g) * u from rounded g and u, rounding silu's result as eager PyTorch does."""
    g = g.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(OUT_DTYPE).to(tl.float32)
    return (act * u.to(tl.float32)).to(OUT_DTYPE)


@triton.jit
def _linear_kernel(
    x, stride_x, M, K,
    w0, w1, w2, b0, b1, b2, n0, n1, n2, tiles0, tiles1,
    out, stride_out, partial, k_share,
    rot_q, rot_k, stride_rq, stride_rk, cos, stride_cos, sin, stride_sin, HALF,
    key_pool, value_pool, slot_mapping,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr, WEIGHTS_FIRST: tl.constexpr,
    ROTARY: tl.constexpr, STORE_KV: tl.constexpr,
):  # fmt: skip
    # WEIGHTS_FIRST: the weights' first tiles are loaded before the wait for the kernel ahead
    # (under PDL this program may start while that one runs): only x depends on it.
    # STORE_KV (with ROTARY): k rotated and v also go to their slots of the layer's pools.
    out_dtype = out.dtype.element_ty
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    k_lo = split * k_share
    k_hi = tl.minimum(k_lo + k_share, K)
    if GATED:
        # one tile of the gate's columns and the same tile of the up projection's
        tile = pid
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if not WEIGHTS_FIRST:
            pdl_enter(PDL)
        g_first = _w_tile(w0, cols, n0, k_lo, k_hi, K, BLOCK_K, EVEN_K)
        u_first = _w_tile(w1, cols, n0, k_lo, k_hi, K, BLOCK_K, EVEN_K)
        if WEIGHTS_FIRST:
            pdl_enter(PDL)
        g = _tile_product(x, stride_x, rows, M, w0, cols, n0, k_lo, k_hi, K, g_first,
                          BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP32)  # fmt: skip
        u = _tile_product(x, stride_x, rows, M, w1, cols, n0, k_lo, k_hi, K, u_first,
                          BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP32)  # fmt: skip
        ok = (rows[:, None] < M) & (cols[None, :] < n0)
        if SPLIT == 1:
            y = _gate(_finish(g, b0, cols, n0, HAS_BIAS, out_dtype),
                      _finish(u, b1, cols, n0, HAS_BIAS, out_dtype), out_dtype)  # fmt: skip
            tl.store(out + rows[:, None] * stride_out + cols[None, :], y, mask=ok)
        else:
            base = partial + split * BLOCK_M * 2 * n0 + rows[:, None] * 2 * n0 + cols[None, :]
            tl.store(base, g, mask=ok)
            tl.store(base + n0, u, mask=ok)
    else:
        index = (pid >= tiles0).to(tl.int32) + (pid >= tiles0 + tiles1).to(tl.int32)
        tile = pid - _pick(index, 0, tiles0, tiles0 + tiles1)
        w = _pick(index, w0, w1, w2)
        bias = _pick(index, b0, b1, b2)
        n = _pick(index, n0, n1, n2)
        first_col = _pick(index, 0, n0, n0 + n1)
        if ROTARY:  # (q's and k's tiles: halves of a head; v's as without)
            cols = tl.where(index < 2, _rotary_cols(tile, n, HALF, BLOCK_N),
                            tile * BLOCK_N + tl.arange(0, BLOCK_N))  # fmt: skip
        else:
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if not WEIGHTS_FIRST:
            pdl_enter(PDL)
        w_first = _w_tile(w, cols, n, k_lo, k_hi, K, BLOCK_K, EVEN_K)
        if WEIGHTS_FIRST:
            pdl_enter(PDL)
        acc = _tile_product(x, stride_x, rows, M, w, cols, n, k_lo, k_hi, K, w_first,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP32)  # fmt: skip
        ok = (rows[:, None] < M) & (cols[None, :] < n)
        if SPLIT == 1:
            y = _finish(acc, bias, cols, n, HAS_BIAS, out_dtype)
            tl.store(out + rows[:, None] * stride_out + first_col + cols[None, :], y, mask=ok)
            slots = tl.zeros([BLOCK_M], tl.int64)
            if STORE_KV:
                slots = tl.load(slot_mapping + rows, mask=rows < M, other=-1).to(tl.int64)
                _pool_store(value_pool, slots, n, cols, y, ok, index == 2)
            if ROTARY:  # noqa: SIM102 (a constexpr branch around a runtime one)
                if index < 2:
                    _rotary_store(y, cols, n, rows, M, _pick(index, rot_q, rot_k, rot_k),
                                  _pick(index, stride_rq, stride_rk, stride_rk), cos,
                                  stride_cos, sin, stride_sin, HALF, key_pool, slots,
                                  index == 1, STORE_KV, BLOCK_M, BLOCK_N)  # fmt: skip
        else:
            width = n0 + n1 + n2
            base = partial + split * BLOCK_M * width + rows[:, None] * width
            tl.store(base + first_col + cols[None, :], acc, mask=ok)


@triton.jit
def _sum_shares_kernel(
    partial, out, stride_out, M, b0, b1, b2, n0, n1,
    width: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Adds the K shares in order and writes what ``_linear_kernel`` writes unsplit."""
    pdl_enter(PDL)
    out_dtype = out.dtype.element_ty
    tile = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATED:
        ok = (rows[:, None] < M) & (cols[None, :] < n0)
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(SPLIT):
            base = partial + s * BLOCK_M * 2 * n0 + rows[:, None] * 2 * n0 + cols[None, :]
            g += tl.load(base, mask=ok, other=0.0)
            u += tl.load(base + n0, mask=ok, other=0.0)
        y = _gate(_finish(g, b0, cols, n0, HAS_BIAS, out_dtype),
                  _finish(u, b1, cols, n0, HAS_BIAS, out_dtype), out_dtype)  # fmt: skip
    else:
        ok = (rows[:, None] < M) & (cols[None, :] < width)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(SPLIT):
            acc += tl.load(partial + s * BLOCK_M * width + rows[:, None] * width + cols[None, :],
                           mask=ok, other=0.0)  # fmt: skip
        if HAS_BIAS:
            # the concatenated columns' bias, each weight's from its own tensor
            in0 = cols < n0
            in1 = (cols >= n0) & (cols < n0 + n1)
            in2 = (cols >= n0 + n1) & (cols < width)
            bias = tl.load(b0 + cols, mask=in0, other=0.0).to(tl.float32)
            bias += tl.load(b1 + cols - n0, mask=in1, other=0.0).to(tl.float32)
            bias += tl.load(b2 + cols - n0 - n1, mask=in2, other=0.0).to(tl.float32)
            acc += bias[None, :]
        y = acc.to(out_dtype)
    tl.store(out + rows[:, None] * stride_out + cols[None, :], y, mask=ok)
