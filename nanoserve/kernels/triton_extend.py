"""Triton paged extend attention: several new tokens per sequence over the paged history.

Flash-attention tiles of BLOCK_M query rows x BLOCK_N keys, one query head per program. The
grid is (query tiles, query heads) and sized from shapes alone (no host sync): sequence i owns
the tile ids from ``cu_seqlens_q[i] // BLOCK_M + i`` on, which is strictly increasing in i, so
a program finds its sequence by binary search over ``cu_seqlens_q`` and exits early when its
tile lies past that sequence's new tokens. Tiles run in reverse order (the latest query rows,
which see the most keys, start first) so the short causal tiles fill the last wave; for the
families in ``TILE_MAJOR_FAMILIES`` the grid is one dimension, tile-major, so that this holds
across heads too.

Each program walks its keys in up to three runs: key tiles wholly below the diagonal (and,
with a sliding window, wholly inside every row's window) take no mask at all; the diagonal
tiles (and the window's lower edge) take the causal / window / length mask. With
``NUM_SPLITS`` > 1 (a routed call on a grid that leaves most SMs idle, ``extend_splits``) a
third grid axis cuts those keys into runs of whole key tiles, and the merge kernel of
triton_split_merge.py combines the runs' partial results.

The tile shape, warps, pipeline depth (a register cap, and whether each tile's block ids
load a step ahead) come from ``ROUTES`` (fixed picks per ``route_key``: head-dim family,
whether the grid fills the GPU, whether the sequences are short, window, soft-cap), or else
on CUDA from ``triton.autotune`` over a small grid per family, and off GPU (the
interpreter) from one small fixed tile that keeps the tests quick. Calls with
few new tokens per sequence (a host-known ``max_query_len``), turns of up to
``TURN_MAX_QUERY_LEN`` over a history long enough to split, or calls routed so, take the
GQA-packed split-KV kernel of triton_verify.py instead.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from nanoserve.kernels.dispatch import (
    floor_pow2,
    head_dim_pad,
    keys_in_reach,
    next_pow2,
    sm_count,
    unit_stride,
)
from nanoserve.kernels.quant import FP8_DTYPE, INT8_DTYPE, INT8_K_GROUP, int8_groups
from nanoserve.kernels.triton_common import (
    dequantize_int8_tile,
    int8_rows_scales,
    mma,
    mma_acc,
    scores_to_log2,
)
from nanoserve.kernels.triton_split_merge import merge_splits, split_partials, store_partials


@triton.jit
def tanh_approx(x):
    """tanh in one special-function instruction (CUDA only: the interpreter has no PTX)."""
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def softcap_to_log2(s, scale, softcap, FAST_TANH: tl.constexpr):
    """Raw q.k in fp32 -> soft-capped logits in base 2; FAST_TANH uses ``tanh_approx``."""
    if FAST_TANH:
        return tanh_approx(s * (scale / softcap)) * (softcap * 1.4426950408889634)
    else:
        return scores_to_log2(s, scale, softcap, True)


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, q_pos, key_cache, value_cache, table, head_off, stride_cb, stride_ct,
    lo, hi, kv_lo, kv_hi, qk_scale, scale, softcap, window,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP32: tl.constexpr,
    FAST_TANH: tl.constexpr, WARP_SPEC: tl.constexpr,
    k_scale=None, v_scale=None, INT8: tl.constexpr = False, K_GROUPS: tl.constexpr = 1,
    G_PAD: tl.constexpr = 1, TABLE_AHEAD: tl.constexpr = False,
):  # fmt: skip
    """Online softmax over key tiles [lo, hi) (lo a multiple of BLOCK_N).

    MASKED=False: every key in the run is valid and visible to every row (no mask at all, and
    no mask on the loads unless head_dim is padded). MASKED=True: keys outside [kv_lo, kv_hi)
    are not loaded, and the causal (and window) test applies per row. WARP_SPEC asks Triton
    to warp-specialize the loop (loads and matmuls in separate warps). INT8 pools come with
    their per-slot scales (``k_scale``/``v_scale``): keys are dequantized tile by tile (G_PAD
    groups of channels), a value's scale folds into its softmax weight. TABLE_AHEAD (unmasked
    runs) loads the next tile's block ids a step ahead (see ``TABLE_AHEAD``).
    """
    d = tl.arange(0, D_PAD)
    ahead_ids = tl.zeros([BLOCK_N], tl.int32)  # (Triton wants loop values defined before)
    if TABLE_AHEAD and not MASKED:
        ahead = lo + tl.arange(0, BLOCK_N)
        ahead_ids = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < hi, other=0)
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        pos = start + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = (pos < kv_hi) & (pos >= kv_lo)
            block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        elif TABLE_AHEAD:
            block = ahead_ids
            ahead = pos + BLOCK_N
            ahead_ids = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < hi, other=0)
        else:
            block = tl.load(table + pos // BLOCK_SIZE)
        rows = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        ptrs = rows[:, None] + d[None, :]
        if MASKED:
            kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(key_cache + ptrs, mask=kv_mask, other=0.0)
            v = tl.load(value_cache + ptrs, mask=kv_mask, other=0.0)
        elif HEAD_DIM != D_PAD:
            kv_mask = (pos >= 0)[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(key_cache + ptrs, mask=kv_mask, other=0.0)
            v = tl.load(value_cache + ptrs, mask=kv_mask, other=0.0)
        else:
            k = tl.load(key_cache + ptrs)
            v = tl.load(value_cache + ptrs)
        if INT8:
            in_run = (pos < kv_hi) & (pos >= kv_lo) if MASKED else pos >= 0
            ks = int8_rows_scales(k_scale, rows, in_run, HEAD_DIM, K_GROUPS, G_PAD)
            k = dequantize_int8_tile(k, ks, BLOCK_N, D_PAD, G_PAD)
            v_token = tl.load(v_scale + rows // HEAD_DIM, mask=in_run, other=0.0)
        k, v = k.to(q.dtype), v.to(q.dtype)  # fp8 tiles: exact in 16-bit and fp32
        s = mma(q, tl.trans(k), FP32)
        if MASKED:
            visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
        if HAS_SOFTCAP:
            s = softcap_to_log2(s, scale, softcap, FAST_TANH)
            if MASKED:
                s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:
            # Scale folded into one multiply-add per score (scale > 0 keeps the max the max).
            if MASKED:
                s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if INT8:
            p = p * v_token.to(tl.float32)[None, :]
        acc = mma_acc(p, v, acc * alpha[:, None], FP32)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["window", "num_seqs", "tune_key"])
def _extend_kernel(
    query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out,
    scale, softcap, window, num_seqs, tune_key,
    stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, NUM_Q_HEADS: tl.constexpr, HEADS_INNER: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FP32: tl.constexpr,
    FAST_TANH: tl.constexpr, WARP_SPEC: tl.constexpr,
    k_scale=None, v_scale=None, FP8: tl.constexpr = False,
    INT8: tl.constexpr = False, K_GROUPS: tl.constexpr = 1, G_PAD: tl.constexpr = 1,
    TABLE_AHEAD: tl.constexpr = False,
    mid_o=None, mid_lse=None, NUM_SPLITS: tl.constexpr = 1,
):  # fmt: skip
    # NUM_SPLITS > 1: the last grid axis cuts each tile's keys into runs of whole key tiles;
    # each program leaves its run's normalised output and log-sum-exp (base 2) in mid_o /
    # mid_lse [T, Hq, NUM_SPLITS(, D_PAD)] for triton_split_merge's merge kernel.
    split = tl.program_id(1 if HEADS_INNER else 2)
    if HEADS_INNER:  # one 1-D grid, every head of a tile before the next tile
        tiles = tl.num_programs(0) // NUM_Q_HEADS
        tile = tiles - 1 - tl.program_id(0) // NUM_Q_HEADS  # latest (longest) tiles first
        head = tl.program_id(0) % NUM_Q_HEADS
    else:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        head = tl.program_id(1)
    # Largest i with cu[i] // BLOCK_M + i <= tile, in num_seqs.bit_length() steps: one more
    # than needed at powers of two, and one for a single sequence, which keeps one code path
    # (skipping the search for batch 1 made those prefills slower; see RESULTS.md).
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
    q_mask = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    tokens = (q_begin + rows).to(tl.int64)
    q = tl.load(query + tokens[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask)
    q_pos = ctx + rows
    if FP8:  # fp8 pools: K's scale folds into the score scale, V's into the output
        scale = scale * tl.load(k_scale + head // GROUP)
        v_mul = tl.load(v_scale + head // GROUP)
    qk_scale = scale * 1.4426950408889634

    q_end = tl.minimum(m0 + BLOCK_M, q_len)
    kv_hi = ctx + q_end  # last visible position + 1
    # Key tiles below `diag` lie before the first row's own position: visible to every row.
    diag = ((ctx + m0) // BLOCK_N) * BLOCK_N
    kv_lo = 0
    full_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(ctx + m0 - window + 1, 0)
        # From full_lo on, keys are inside the last row's window, hence inside every row's.
        full_lo = tl.cdiv(tl.maximum(ctx + q_end - window, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(full_lo, diag)
    # this program's keys [a, b): all of [first window tile, kv_hi), or a split's run of it
    a = (kv_lo // BLOCK_N) * BLOCK_N
    b = kv_hi
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_hi - a, NUM_SPLITS), BLOCK_N) * BLOCK_N
        a = a + split * per_split
        b = tl.minimum(a + per_split, kv_hi)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    head_off = (head // GROUP) * stride_ch
    if HAS_WINDOW:
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, key_cache, value_cache, table, head_off, stride_cb,
            stride_ct, a, tl.minimum(b, full_lo), kv_lo, kv_hi, qk_scale, scale,
            softcap, window, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, True,
            HAS_WINDOW, HAS_SOFTCAP, FP32, FAST_TANH, False,
            k_scale, v_scale, INT8, K_GROUPS, G_PAD,
        )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, key_cache, value_cache, table, head_off, stride_cb, stride_ct,
        tl.maximum(a, full_lo), tl.minimum(b, diag), kv_lo, kv_hi, qk_scale, scale, softcap,
        window, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, False, HAS_WINDOW, HAS_SOFTCAP, FP32,
        FAST_TANH, WARP_SPEC, k_scale, v_scale, INT8, K_GROUPS, G_PAD, TABLE_AHEAD,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, key_cache, value_cache, table, head_off, stride_cb, stride_ct,
        tl.maximum(a, diag), b, kv_lo, kv_hi, qk_scale, scale, softcap, window,
        HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, True, HAS_WINDOW, HAS_SOFTCAP, FP32, FAST_TANH,
        False, k_scale, v_scale, INT8, K_GROUPS, G_PAD,
    )  # fmt: skip

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8:
        o = o * v_mul
    if NUM_SPLITS == 1:
        dst = out + tokens[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=q_mask)
    else:
        # partials [T, Hq, NUM_SPLITS, D_PAD] (triton_split_merge.py)
        row = (tokens * NUM_Q_HEADS + head) * NUM_SPLITS + split
        store_partials(mid_o, mid_lse, row, o, l_i, m_i, d, D_PAD, q_mask, rows < q_len)


# (BLOCK_M, BLOCK_N, num_warps, num_stages[, max registers per thread]) per family on CUDA;
# autotune picks among them. A register cap (Triton's ``maxnreg``) lets two 8-warp programs
# share an SM where the compiler's own choice fits one.
# From the sweeps (bench_extend.py --sweep; see RESULTS.md): each is best on some shape;
# (64, 32, 4, 2) is there for the short-sequence bucket. For head_dim 128, (64, 64, 4, 2)
# replaced (64, 64, 4, 3), which was slower yet sometimes won the autotune's timing.
CUDA_CONFIGS: dict[str, list[tuple[int, ...]]] = {
    "16bit-d64": [
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (64, 64, 4, 3),
        (64, 64, 4, 2),
        (64, 32, 4, 2),
        (128, 128, 8, 2, 128),
    ],
    "16bit-d128": [
        (64, 64, 4, 2),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (64, 32, 4, 2),
    ],
    # 4-warp tiles of 64 rows won where the grid is short (a chunk over history), 8-warp
    # tiles of 128 rows (one program per SM) on full grids (benchmarks/RESULTS.md)
    "16bit-d256": [(64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2)],
    "fp32": [(64, 64, 4, 3)],
    "fp32-d256": [(64, 32, 8, 3)],
}
INTERPRETER_CONFIG = (16, 32, 4, 1)
# Calls whose caller passes max_query_len <= this (speculative verify, short chunks) get
# their own route_key bucket, which takes the GQA-packed split-KV kernel of triton_verify.py
# (memory-bound like decode) unless ROUTES says otherwise.
PACKED_MAX_QUERY_LEN = 16
# Turns: a host-known bound of more new tokens than that, up to this many, over a history the
# block tables make long enough to split (``triton_verify.turn_plan``) take the packed
# kernel too, split so: chat turns and continuations over a cached prompt are memory-bound on
# the history, which one program per tile reads alone. Measured at 16-bit head dims 64 and
# 128 (80 and 96 pad to 128 and take it unmeasured).
TURN_MAX_QUERY_LEN = 128
TURN_FAMILIES = frozenset({"16bit-d64", "16bit-d128"})
# Fixed picks per route_key (family, bucket), bypassing autotune: ("tiles", (BLOCK_M,
# BLOCK_N, num_warps, num_stages[, maxnreg])) for the extend kernel here, "tiles-ahead" for
# it with the block ids loaded a step ahead (``TABLE_AHEAD``), ("packed", config or None,
# splits or None) for the GQA-packed split-KV kernel; a key not listed autotunes (or, for
# few new tokens, takes the packed kernel's defaults).
# bench_extend_classes.py prints each class's key beside its candidates.
ROUTES: dict[tuple[str, int], tuple] = {
    # head_dim 256 with a soft-cap: autotune's timing once picked a tile that ran twice as
    # long in the class benchmark, so these are fixed: 128-row tiles where the grid is full
    # and the sequences long, the smallest 4-warp tile elsewhere (benchmarks/RESULTS.md).
    **{("16bit-d256", bucket): ("tiles", (64, 32, 4, 2)) for bucket in (8, 9, 11)},
    ("16bit-d256", 10): ("tiles", (128, 64, 8, 2)),
    # Chunks over history (a short grid of short sequences) and windowed prefill over a full
    # grid: three stages with the ids ahead (a second K/V buffer) beat every autotune config
    # in the class benchmark; elsewhere they lost (benchmarks/RESULTS.md).
    ("16bit-d128", 1): ("tiles-ahead", (64, 64, 4, 3)),
    ("16bit-d128", 6): ("tiles-ahead", (128, 32, 8, 3, 128)),
    ("16bit-d256", 1): ("tiles-ahead", (64, 32, 4, 3)),
}
# Route kinds that launch the extend kernel here at a fixed config.
TILE_ROUTES = ("tiles", "tiles-ahead")
# A routed call whose tiles give fewer than half the SMs a program (a chunk over history of a
# model with few heads) splits each tile's keys into runs that fill them, each of at least
# this many keys of what the block tables hold (``extend_splits``; benchmarks/RESULTS.md).
EXTEND_SPLIT_KEYS = 1024
EXTEND_MAX_SPLITS = 8
# Warp-specialize the extend kernel's unmasked key loop (Triton's automatic warp
# specialization); off until the class benchmark shows it pays.
WARP_SPECIALIZE = False
# Load the unmasked run's block ids a step ahead (a value carried by the loop): Triton's
# pipeliner otherwise spends a stage on the block-table load, so that up to four stages keep
# one K/V tile in flight, issued after the tile before it computed; with the ids ahead, three
# stages fill a K/V buffer while the tile before it computes. "tiles-ahead" routes turn it
# on for their calls; this turns it on for every call (benchmarks, tests).
TABLE_AHEAD = False
# Families whose programs run tile-major (all query heads of the latest tile first, one 1-D
# grid): with few programs resident per SM (head_dim 256), the (tile, head) grid starts the last
# heads' longest tiles in the last wave and waits for them; with head_dim up to 128 the class
# benchmark found tile-major no faster, and slower on chunked prefill (benchmarks/RESULTS.md).
TILE_MAJOR_FAMILIES = frozenset({"16bit-d256"})
# Soft-capping through tanh.approx on CUDA for 16-bit queries (see ``fast_tanh``).
FAST_TANH = True
# Autotune buckets: a grid under this many waves of BLOCK_M=128 tiles counts as small.
SMALL_GRID_WAVES = 2
# ... and sequences of at most this many new tokens on average count as short.
SHORT_NEW_TOKENS = 512


def config_family(head_dim: int, dtype: torch.dtype) -> str:
    """Name of the config list in ``CUDA_CONFIGS`` for a head dim and dtype."""
    d_pad = next_pow2(head_dim)
    if dtype == torch.float32:
        return "fp32" if d_pad <= 128 else "fp32-d256"
    if d_pad <= 64:
        return "16bit-d64"
    return "16bit-d128" if d_pad <= 128 else "16bit-d256"


def fast_tanh(query: torch.Tensor) -> bool:
    """Soft-cap with ``tanh.approx`` (one instruction, about 11 bits): on CUDA, for 16-bit
    queries, while ``FAST_TANH`` is set (float32 and the interpreter take the exact tanh)."""
    on_cuda = query.device.type == "cuda" and torch.version.hip is None
    return (
        FAST_TANH
        and on_cuda
        and query.dtype != torch.float32
        and os.environ.get("TRITON_INTERPRET") != "1"
    )


def route_key(
    query: torch.Tensor,
    num_seqs: int,
    sliding_window: int | None,
    softcap: float | None,
    max_query_len: int | None = None,
) -> tuple[str, int]:
    """(config family, bucket) of a call, from shapes and host values only: the key of
    ``ROUTES`` and of the autotune. Bucket bits: 2 = the grid of BLOCK_M=128 tiles fills at
    least ``SMALL_GRID_WAVES`` waves, 1 = at most ``SHORT_NEW_TOKENS`` new tokens per sequence
    on average, 4 = a sliding window, 8 = a soft-cap, 16 = few new tokens per sequence (a
    host-known ``max_query_len`` <= ``PACKED_MAX_QUERY_LEN``)."""
    total_q, num_q_heads, head_dim = query.shape
    waves = (total_q // 128 + num_seqs) * num_q_heads / sm_count(query.device)
    # does the grid fill the GPU; are the sequences short (many programs with few key tiles
    # each, where a smaller fixed cost per program wins)
    short = total_q <= SHORT_NEW_TOKENS * num_seqs
    bucket = (0 if waves < SMALL_GRID_WAVES else 2) + int(short)
    bucket += 4 * (sliding_window is not None) + 8 * (softcap is not None)
    bucket += 16 * few_tokens(max_query_len)
    return config_family(head_dim, query.dtype), bucket


def few_tokens(max_query_len: int | None) -> bool:
    """True for a host-known bound of at most ``PACKED_MAX_QUERY_LEN`` new tokens per
    sequence (speculative verify, short chunks): memory-bound like decode."""
    return max_query_len is not None and max_query_len <= PACKED_MAX_QUERY_LEN


def is_turn(key: tuple[str, int], max_query_len: int | None) -> bool:
    """Whether a call of ``route_key`` ``key`` may be a turn (see ``TURN_MAX_QUERY_LEN``):
    a 16-bit family of head dim up to 128 and a bound past the few-token one."""
    return (
        key[0] in TURN_FAMILIES
        and max_query_len is not None
        and PACKED_MAX_QUERY_LEN < max_query_len <= TURN_MAX_QUERY_LEN
    )


def extend_route(key: tuple[str, int]) -> tuple:
    """Which kernel a call of ``route_key`` ``key`` takes: ``ROUTES[key]``, else for few new
    tokens per sequence ("packed", None, None) (the packed kernel's own defaults), else
    ("autotune",) over ``CUDA_CONFIGS[family]``."""
    if key in ROUTES:
        return ROUTES[key]
    return ("packed", None, None) if key[1] & 16 else ("autotune",)


def extend_splits(
    query: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    block_m: int,
    sliding_window: int | None,
    max_query_len: int | None,
) -> int:
    """Key runs per tile for a routed call (query packed [T, Hq, D], tables [S, width]), from
    shapes and host values only: as many as give each SM about one program, while a run keeps
    ``EXTEND_SPLIT_KEYS`` keys of what the tables hold (the window and the new tokens, with
    one); a power of two up to ``EXTEND_MAX_SPLITS``, 1 for a grid that fills half the SMs."""
    total_q, num_q_heads, _ = query.shape
    num_seqs = block_tables.shape[0]
    tiles = total_q // block_m + num_seqs
    if max_query_len is not None:
        tiles = min(tiles, num_seqs * -(-max_query_len // block_m))
    history = keys_in_reach(block_tables, block_size, sliding_window, max_query_len or total_q)
    return floor_pow2(
        min(
            sm_count(query.device) // max(tiles * num_q_heads, 1),
            history // EXTEND_SPLIT_KEYS,
            EXTEND_MAX_SPLITS,
        )
    )


def register_cap(config: tuple[int, ...], query: torch.Tensor) -> dict[str, int]:
    """Launch options for a config's register cap (its fifth entry): Triton's ``maxnreg``,
    an NVIDIA-backend option, so none on other devices."""
    nvidia = query.device.type == "cuda" and torch.version.hip is None
    return {"maxnreg": config[4]} if len(config) > 4 and nvidia else {}


# Fixed ROUTES tiles and packed-kernel tiles a device could not launch (Triton's
# OutOfResources: a tile picked on an H200 can need more shared memory than another GPU has),
# by (device, config; a packed one as ("packed", *config)): those calls take the extend
# kernel's route without it (the family's autotune skips the configs that do not fit).
_UNFIT: set[tuple[torch.device, tuple]] = set()
_TUNED: dict[str, object] = {}
# What autotune chose, by (family, head_dim, bucket, dtypes): later calls launch the
# kernel with it directly, skipping the autotuner's per-call Python (a launch-bound cost).
_PICKED: dict[tuple, tuple[int, ...]] = {}


def autotune_picks() -> dict[tuple, tuple[int, ...]]:
    """What autotune chose so far: (family, head_dim, tune_key, query dtype, cache dtype) ->
    (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg])."""
    return dict(_PICKED)


def _graph_bench(kernel_call, quantiles):
    """Autotune's timer: CUDA-graph replay, the kernel alone. With plain launches a small
    prefill times the host's launch cost, not the kernel, and the pick for its key (which
    larger prefills then share) was noise (see RESULTS.md)."""
    # do_bench_cudagraph launches on a new stream that does not wait for the caller's: the
    # inputs (metadata copied non-blocking, K/V just scattered) must have landed first.
    torch.cuda.current_stream().synchronize()
    return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)


def _tuned_kernel(family: str):
    if family not in _TUNED:
        configs = [
            triton.Config(
                {"BLOCK_M": c[0], "BLOCK_N": c[1]},
                num_warps=c[2],
                num_stages=c[3],
                maxnreg=c[4] if len(c) > 4 and torch.version.hip is None else None,
            )
            for c in CUDA_CONFIGS[family]
        ]
        _TUNED[family] = triton.autotune(
            configs, key=["HEAD_DIM", "tune_key"], do_bench=_graph_bench
        )(_extend_kernel)
    return _TUNED[family]


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
    config: tuple[int, ...] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_query_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Launch extend attention (arguments already validated); returns [T, Hq, D] like query.
    FP8 pools come with float32 ``k_scale``/``v_scale`` [Hkv], INT8 pools with their float16
    per-slot scales.

    ``config`` (BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]) bypasses routing and
    autotuning (tests, sweeps); ``num_splits`` cuts each tile's keys into runs merged by a
    second kernel (None: ``extend_splits``' count on a fixed route, else 1). Otherwise
    ``extend_route`` picks the kernel: on CUDA the first call for a
    (head dim, bucket, dtype) not in ``ROUTES`` autotunes: warm up before capturing a CUDA
    graph. ``max_query_len``: a host-known bound on the new tokens of every sequence, or None;
    at most ``PACKED_MAX_QUERY_LEN`` routes the call to the GQA-packed split-KV kernel, and
    so does a turn of up to ``TURN_MAX_QUERY_LEN`` over a long history (a wrong bound costs
    speed, never correctness).
    """
    total_q, num_q_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    key = route_key(query, num_seqs, sliding_window, softcap, max_query_len)
    routed, table_ahead = False, TABLE_AHEAD
    if config is None:
        route = base_route = extend_route(key)
        # The packed kernel reads pools in the query's dtype only (no FP8 or INT8 scales yet).
        if k_scale is None and is_turn(key, max_query_len):
            from nanoserve.kernels.triton_verify import turn_plan

            tile, splits = turn_plan(query, key_cache, block_tables, max_query_len, sliding_window)
            if splits > 1:
                route = ("packed", tile, splits)
        if route[0] == "packed" and k_scale is None:
            from nanoserve.kernels import triton_verify as verify

            group = num_q_heads // key_cache.shape[2]
            on_gpu = query.device.type == "cuda"
            packed = route[1] or verify.packed_config(
                head_dim, group, max_query_len, query.dtype, on_gpu
            )
            unfit = (query.device, ("packed", *packed))
            if unfit not in _UNFIT:
                try:
                    return verify.paged_extend_attention_packed(
                        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                        scale=scale, sliding_window=sliding_window, softcap=softcap,
                        max_query_len=max_query_len, config=packed, num_splits=route[2],
                    )  # fmt: skip
                except OutOfResources:  # raised before anything runs: nothing written yet
                    _UNFIT.add(unfit)
            route = base_route if base_route[0] != "packed" else ("autotune",)
        if route[0] in TILE_ROUTES and (query.device, route[1]) not in _UNFIT:
            config, routed = route[1], True
            table_ahead = table_ahead or route[0] == "tiles-ahead"
            if num_splits is None:
                num_splits = extend_splits(
                    query, block_tables, key_cache.shape[1], config[0], sliding_window,
                    max_query_len,
                )  # fmt: skip
    if config is None and query.device.type != "cuda":
        config = INTERPRETER_CONFIG
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if total_q == 0 or num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    block_tables, seq_lens = unit_stride(block_tables), unit_stride(seq_lens)
    cu_seqlens_q = unit_stride(cu_seqlens_q)
    family, tune_key = key
    args = (
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out,
        float(scale), float(softcap or 1.0), int(sliding_window or 0), num_seqs, tune_key,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
    )  # fmt: skip
    meta = dict(
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=head_dim_pad(head_dim),
        BLOCK_SIZE=block_size, SEARCH_STEPS=max(1, num_seqs.bit_length()),
        NUM_Q_HEADS=num_q_heads, HEADS_INNER=family in TILE_MAJOR_FAMILIES,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
        FP32=query.dtype == torch.float32, FAST_TANH=fast_tanh(query),
        WARP_SPEC=WARP_SPECIALIZE and query.device.type == "cuda", TABLE_AHEAD=table_ahead,
        k_scale=k_scale, v_scale=v_scale, FP8=key_cache.dtype == FP8_DTYPE,
        INT8=key_cache.dtype == INT8_DTYPE, K_GROUPS=int8_groups(head_dim, INT8_K_GROUP),
        G_PAD=head_dim_pad(head_dim) // INT8_K_GROUP,
    )  # fmt: skip
    if num_splits is not None and num_splits > 1 and config is not None:
        mid_o, mid_lse = split_partials(query, num_splits, meta["D_PAD"])
        meta.update(NUM_SPLITS=num_splits, mid_o=mid_o, mid_lse=mid_lse)

    def grid(m: dict) -> tuple[int, ...]:
        tiles = total_q // m["BLOCK_M"] + num_seqs
        splits = m.get("NUM_SPLITS", 1)
        return (tiles * num_q_heads, splits) if m["HEADS_INNER"] else (tiles, num_q_heads, splits)

    def launch(config: tuple[int, ...]) -> None:
        block_m, block_n, num_warps, num_stages = config[:4]
        splits = meta.get("NUM_SPLITS", 1)
        _extend_kernel[grid({"BLOCK_M": block_m, **meta})](
            *args, **meta, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps, num_stages=num_stages, **register_cap(config, query),
        )  # fmt: skip
        if splits > 1:
            merge_splits(meta["mid_o"], meta["mid_lse"], out, head_dim, pdl=False)

    if routed:
        try:
            launch(config)
            return out
        except OutOfResources:  # raised before anything runs: nothing written yet
            _UNFIT.add((query.device, config))
            config = INTERPRETER_CONFIG if query.device.type != "cuda" else None
            meta["TABLE_AHEAD"] = TABLE_AHEAD  # what an unrouted call takes
            for split_key in ("NUM_SPLITS", "mid_o", "mid_lse"):
                meta.pop(split_key, None)
    picked_key = (family, head_dim, tune_key, query.dtype, key_cache.dtype)
    if config is None:
        config = _PICKED.get(picked_key)
    if config is not None:
        launch(config)
        return out
    tuner = _tuned_kernel(family)
    tuner[grid](*args, **meta)
    best = getattr(tuner, "best_config", None)
    if best is not None:
        picked = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
        _PICKED[picked_key] = picked + ((best.maxnreg,) if best.maxnreg else ())
    return out
