"""Triton kernel for a gated MLP of a few rows in one launch: ``down(silu(x Wg^T) * (x Wu^T))``.

At a decode step's few rows the MLP's products only read their weights, and two launches
(gate and up with the activation, then down) each pay a launch's ramp and tail, plus the
step between them. Here one launch of a few programs an SM, all resident at once (a
cooperative launch), streams all three weights: each program computes column tiles of the
activation ``h``, the programs meet at a grid barrier (``h`` whole and visible), then each
computes (column tile, K share) items of the output from ``h``, its first ``down`` tile
loaded while it waited; a tile's last share to finish adds the shares' partials in order.
Each output is rounded where eager PyTorch rounds it (gate's and up's products, the SiLU,
the product, down's product), from float32 accumulation.

``PHASES`` 1 or 2 runs one phase alone: two launches, where a barrier cannot be (Triton's
CPU interpreter runs programs one after another, so a barrier would wait forever).
``fused_mlp.py`` holds the launcher and the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanoserve.kernels.triton_common import mma_acc, pdl_enter
from nanoserve.kernels.triton_linear import _gate, _tile_product, _w_tile


@triton.jit
def _grid_barrier(state, programs):
    """Returns once every one of ``programs`` programs has called it; each program's stores
    before the call are visible to every program after it. ``state``'s first two int32
    words: the arrivals and a flag, kept between launches (the last arrival sets the count
    back to 0 and flips the flag that the others wait on), so a launch needs no reset."""
    sense = tl.atomic_add(state + 1, 0, sem="relaxed", scope="gpu")
    tl.debug_barrier()  # the whole program's stores come before its arrival's release
    arrived = tl.atomic_add(state, 1, sem="acq_rel", scope="gpu")
    if arrived == programs - 1:
        tl.atomic_xchg(state, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state + 1, 1 - sense, sem="release", scope="gpu")
    else:
        flag = tl.atomic_add(state + 1, 0, sem="acquire", scope="gpu")
        while flag == sense:
            flag = tl.atomic_add(state + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _activation_tile(
    x, stride_x, rows, M, K, wg, wu, h, N, tile, g_first, u_first,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FP32: tl.constexpr,
):  # fmt: skip
    """h[:, tile's columns] = silu(x Wg^T) * (x Wu^T), rounded as eager rounds each step;
    ``g_first`` / ``u_first``: the weights' first K tiles, loaded by the caller."""
    dtype = h.dtype.element_ty
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    g = _tile_product(x, stride_x, rows, M, wg, cols, N, 0, K, K, g_first,
                      BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP32)  # fmt: skip
    u = _tile_product(x, stride_x, rows, M, wu, cols, N, 0, K, K, u_first,
                      BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP32)  # fmt: skip
    y = _gate(g.to(dtype), u.to(dtype), dtype)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(h + rows[:, None] * N + cols[None, :], y, mask=ok)


@triton.jit
def _h_tile(h, rows, M, N, k, k_hi, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K]: rows of h over k..k+BLOCK_K (zero past M and k_hi <= N), read from
    the L2 (``.cg``): other programs wrote it in this launch."""
    kk = k + tl.arange(0, BLOCK_K)
    ok = (rows[:, None] < M) & (kk[None, :] < k_hi)
    return tl.load(h + rows[:, None] * N + kk[None, :], mask=ok, other=0.0, cache_modifier=".cg")


@triton.jit
def _down_item(
    h, rows, M, N, wd, out, stride_out, H, state, partial, item, down_tiles, k_share, shares,
    w_first,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FP32: tl.constexpr,
):  # fmt: skip
    """Work item ``item`` of the down product: one column tile over one K share of
    ``shares``; ``w_first``: Wd's first K tile of the item, loaded by the caller. With one
    share the tile is rounded and stored; else its float32 partial goes to ``partial``
    [shares, BLOCK_M, H] and the tile's last share to finish (a counter per tile in
    ``state[2:]``, set back to 0 by it) adds the partials in share order, so the result does
    not depend on which finished last."""
    tile = item % down_tiles
    share = item // down_tiles
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = share * k_share
    k_hi = tl.minimum(k_lo + k_share, N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = mma_acc(_h_tile(h, rows, M, N, k_lo, k_hi, BLOCK_K), w_first, acc, FP32)
    for k in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        xt = _h_tile(h, rows, M, N, k, k_hi, BLOCK_K)
        wt = _w_tile(wd, cols, H, k, k_hi, N, BLOCK_K, EVEN_K)
        acc = mma_acc(xt, wt, acc, FP32)
    ok = (rows[:, None] < M) & (cols[None, :] < H)
    dst = out + rows[:, None] * stride_out + cols[None, :]
    if shares == 1:
        tl.store(dst, acc.to(out.dtype.element_ty), mask=ok)
    else:
        at = partial + (share * BLOCK_M + rows[:, None]) * H + cols[None, :]
        tl.store(at, acc, mask=ok)
        tl.debug_barrier()  # the whole tile stored before this share's arrival is released
        done = tl.atomic_add(state + 2 + tile, 1, sem="acq_rel", scope="gpu")
        if done == shares - 1:
            tl.atomic_xchg(state + 2 + tile, 0, sem="relaxed", scope="gpu")
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, shares):
                at = partial + (s * BLOCK_M + rows[:, None]) * H + cols[None, :]
                total += tl.load(at, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(dst, total.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _fused_mlp_kernel(
    x, stride_x, M, K, wg, wu, h, N, wd, out, stride_out, H, state, partial,
    up_tiles, down_tiles, k_share, shares,
    BLOCK_M: tl.constexpr, UP_N: tl.constexpr, UP_K: tl.constexpr, DOWN_N: tl.constexpr,
    DOWN_K: tl.constexpr, PHASES: tl.constexpr, EVEN_UP_K: tl.constexpr,
    EVEN_DOWN_K: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr,
    WEIGHTS_FIRST: tl.constexpr,
):  # fmt: skip
    """x [M, K] -> h [M, N] (PHASES 1 or 3) -> out [M, H] (PHASES 2 or 3); weights Wg, Wu
    [N, K] and Wd [H, N] contiguous. Program p takes work items p, p + programs, ... of each
    phase: the activation's column tiles, then the down product's (column tile, K share)
    items. ``state`` int32 [2 + down_tiles]: the grid barrier's two words, then a counter per
    down tile (all kept at 0 between launches). WEIGHTS_FIRST: the first weight tiles are
    loaded before the wait for the kernel ahead (under PDL this program may start while that
    one runs)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    if PHASES != 2:
        cols = pid * UP_N + tl.arange(0, UP_N)
        if not WEIGHTS_FIRST:
            pdl_enter(PDL)
        g_first = _w_tile(wg, cols, N, 0, K, K, UP_K, EVEN_UP_K)
        u_first = _w_tile(wu, cols, N, 0, K, K, UP_K, EVEN_UP_K)
        if WEIGHTS_FIRST:
            pdl_enter(PDL)
        if pid < up_tiles:
            _activation_tile(x, stride_x, rows, M, K, wg, wu, h, N, pid, g_first, u_first,
                             BLOCK_M, UP_N, UP_K, EVEN_UP_K, FP32)  # fmt: skip
        for tile in range(pid + programs, up_tiles, programs):
            cols = tile * UP_N + tl.arange(0, UP_N)
            g_first = _w_tile(wg, cols, N, 0, K, K, UP_K, EVEN_UP_K)
            u_first = _w_tile(wu, cols, N, 0, K, K, UP_K, EVEN_UP_K)
            _activation_tile(x, stride_x, rows, M, K, wg, wu, h, N, tile, g_first, u_first,
                             BLOCK_M, UP_N, UP_K, EVEN_UP_K, FP32)  # fmt: skip
    if PHASES != 1:
        items = down_tiles * shares
        # (a program past the last item loads nothing: its columns lie past H)
        cols = tl.where(pid < items, pid % down_tiles, down_tiles) * DOWN_N
        cols += tl.arange(0, DOWN_N)
        k_lo = (pid // down_tiles) * k_share
        k_hi = tl.minimum(k_lo + k_share, N)
        if PHASES == 2 and not WEIGHTS_FIRST:
            pdl_enter(PDL)
        w_first = _w_tile(wd, cols, H, k_lo, k_hi, N, DOWN_K, EVEN_DOWN_K)
        if PHASES == 2 and WEIGHTS_FIRST:
            pdl_enter(PDL)
        if PHASES == 3:
            _grid_barrier(state, programs)
        if pid < items:
            _down_item(h, rows, M, N, wd, out, stride_out, H, state, partial, pid, down_tiles,
                       k_share, shares, w_first,
                       BLOCK_M, DOWN_N, DOWN_K, EVEN_DOWN_K, FP32)  # fmt: skip
        for item in range(pid + programs, items, programs):
            cols = (item % down_tiles) * DOWN_N + tl.arange(0, DOWN_N)
            k_lo = (item // down_tiles) * k_share
            k_hi = tl.minimum(k_lo + k_share, N)
            w_first = _w_tile(wd, cols, H, k_lo, k_hi, N, DOWN_K, EVEN_DOWN_K)
            _down_item(h, rows, M, N, wd, out, stride_out, H, state, partial, item, down_tiles,
                       k_share, shares, w_first,
                       BLOCK_M, DOWN_N, DOWN_K, EVEN_DOWN_K, FP32)  # fmt: skip
