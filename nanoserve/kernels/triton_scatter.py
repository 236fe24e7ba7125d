"""Triton slot scatter: one launch writes every new token's K and V row into the pools.

Each program copies BLOCK_T tokens x BLOCK_H heads: a [BLOCK_T * BLOCK_H, BLOCK_D] tile whose
rows are (token, head) pairs and whose columns run along head_dim, so loads and stores are
wide and contiguous; a token's destination row is its slot's NUM_KV_HEADS x HEAD_DIM run.
Tokens with slot -1 are masked out.

FP8 pools are written through uint8 views: each value is divided by its KV head's scale,
saturated to +-448 and encoded to e4m3 bits in integer arithmetic (round to nearest even;
NaN stays NaN). The encoding is spelled out rather than left to ``.to(tl.float8e4nv)``
because the Triton interpreter rounds that cast wrongly, and one code path on GPU and CPU
keeps the CPU tests meaningful; the scatter is memory-bound, so the integer work is free.

INT8 pools get each (token, head)'s values and float16 scales (keys per group of
``INT8_K_GROUP`` channels, values per head), as ``quant.quantize_int8`` computes them (the
tile's columns reshaped into groups).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.dispatch import next_pow2, pdl_launch, unit_stride
from nanoserve.kernels.quant import INT8_DTYPE, INT8_K_GROUP, int8_groups
from nanoserve.kernels.triton_common import pdl_enter


@triton.jit
def encode_e4m3(x):
    """float32 tile -> uint8 tile of float8_e4m3fn bits: saturating, round to nearest even."""
    x = tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    mag = bits & 0x7FFFFFFF
    # normal e4m3 (|x| >= 2**-6): keep 3 mantissa bits, carry may reach the exponent
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal e4m3: round |x| * 2**9 to an integer (steps of 2**-9)
    exp = (mag >> 23).to(tl.int32)
    man = ((mag & 0x7FFFFF) | tl.where(exp > 0, 0x800000, 0)).to(tl.uint32)
    shift = tl.minimum(141 - tl.maximum(exp, 1), 31).to(tl.uint32)
    q = man >> shift
    rest = man - (q << shift)
    half = (1 << (shift - 1)).to(tl.uint32)
    sub = q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(tl.uint32)
    code = tl.where(mag >= 0x3C800000, normal, sub)
    code = tl.where(x != x, 0x7F, code)
    return code.to(tl.uint8) | sign


@triton.jit
def round_half_even(y):
    """float32 tile -> its nearest integers (ties to even), as float32; |y| < 2**22.
    (``libdevice.rint`` has no interpreter version.)"""
    f = tl.floor(y)
    frac = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))


@triton.jit
def quantize_int8_tile(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, GW: tl.constexpr):
    """float32 [ROWS, BLOCK_D] (padding columns zero) -> (int8 [ROWS, BLOCK_D], float16
    scales [ROWS, BLOCK_D // GW]), as ``quant.quantize_int8``: amax / 127 rounded to float16
    within [2^-14, 65504], x / scale rounded half to even and saturated to +-127; a group with
    inf or NaN gets a NaN scale and zeros."""
    groups = tl.reshape(x, [ROWS, BLOCK_D // GW, GW])
    bad = tl.max(((groups != groups) | (tl.abs(groups) == float("inf"))).to(tl.int32), 2) > 0
    amax = tl.max(tl.where(groups == groups, tl.abs(groups), 0.0), 2)
    scale = tl.clamp(tl.math.div_rn(amax, 127.0), 2.0**-14, 65504.0).to(tl.float16)
    scale = tl.where(bad, float("nan"), scale)
    y = tl.math.div_rn(groups, scale.to(tl.float32)[:, :, None])
    q = round_half_even(tl.clamp(y, -127.0, 127.0))
    q = tl.where(bad[:, :, None], 0.0, q)
    return tl.reshape(q, [ROWS, BLOCK_D]).to(tl.int8), scale


@triton.jit(do_not_specialize=["num_tokens"])
def _slot_scatter_kernel(
    key, value, key_cache, value_cache, slot_mapping, num_tokens, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr, INT8: tl.constexpr = False, K_GROUPS: tl.constexpr = 1,
    K_GW: tl.constexpr = 16,
):  # fmt: skip
    pdl_enter(PDL)
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    tokens = tl.program_id(0) * BLOCK_T + r // BLOCK_H
    heads = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    slot = tl.load(slot_mapping + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    keep = (slot >= 0) & (heads < NUM_KV_HEADS)
    dims = tl.arange(0, BLOCK_D)
    mask = keep[:, None] & (dims < HEAD_DIM)[None, :]
    t = tokens.to(tl.int64)
    k = tl.load(key + (t * stride_kt + heads * stride_kh)[:, None] + dims[None, :], mask=mask)
    v = tl.load(value + (t * stride_vt + heads * stride_vh)[:, None] + dims[None, :], mask=mask)
    dst = (slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM)[:, None] + dims[None, :]
    if FP8:  # the pools are uint8 views
        in_range = heads < NUM_KV_HEADS
        ks = tl.load(k_scale + heads, mask=in_range, other=1.0)
        vs = tl.load(v_scale + heads, mask=in_range, other=1.0)
        k = encode_e4m3(tl.math.div_rn(k.to(tl.float32), ks[:, None]))
        v = encode_e4m3(tl.math.div_rn(v.to(tl.float32), vs[:, None]))
    if INT8:  # per-slot scales beside the pools: K [slots, Hkv, K_GROUPS], V [slots, Hkv]
        ROWS: tl.constexpr = BLOCK_T * BLOCK_H
        k, k_scales = quantize_int8_tile(tl.where(mask, k.to(tl.float32), 0.0), ROWS, BLOCK_D, K_GW)
        v, v_scales = quantize_int8_tile(
            tl.where(mask, v.to(tl.float32), 0.0), ROWS, BLOCK_D, BLOCK_D
        )
        g = tl.arange(0, BLOCK_D // K_GW)
        slot_head = slot * NUM_KV_HEADS + heads
        k_at = slot_head[:, None] * K_GROUPS + g[None, :]
        tl.store(k_scale + k_at, k_scales, mask=keep[:, None] & (g < K_GROUPS)[None, :])
        tl.store(v_scale + slot_head[:, None] + tl.arange(0, 1)[None, :], v_scales,
                 mask=keep[:, None])  # fmt: skip
    tl.store(key_cache + dst, k, mask=mask)
    tl.store(value_cache + dst, v, mask=mask)


# Elements of K (and as many of V) per program, and warps: measured on the H200 (see
# benchmarks/RESULTS.md). Off GPU the same shapes run under the interpreter.
ELEMENTS_PER_PROGRAM = 4096
NUM_WARPS = 4


def scatter_config(num_kv_heads: int, head_dim: int, elements: int = ELEMENTS_PER_PROGRAM):
    """(BLOCK_T tokens, BLOCK_H heads, BLOCK_D) per program: whole tokens when they fit."""
    block_d = next_pow2(head_dim)
    block_h = max(1, min(next_pow2(num_kv_heads), elements // block_d))
    block_t = max(1, elements // (block_h * block_d))
    return block_t, block_h, block_d


def slot_scatter_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    config: tuple[int, int] | None = None,
) -> None:
    """Launch the scatter; arguments as ``slot_scatter_ref`` (already validated).

    key/value [T, Hkv, D] may be strided views as long as the last dim is contiguous.
    ``config`` (elements per program, num_warps) overrides the default (benchmark sweeps).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    slot_mapping = unit_stride(slot_mapping)
    elements, num_warps = config or (ELEMENTS_PER_PROGRAM, NUM_WARPS)
    block_t, block_h, block_d = scatter_config(num_kv_heads, head_dim, elements)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_kv_heads, block_h))
    int8 = key_cache.dtype == INT8_DTYPE
    fp8 = k_scale is not None and not int8
    if fp8:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    elif not int8:
        k_scale = v_scale = slot_mapping  # unused
    launch = pdl_launch(key.device)
    _slot_scatter_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, num_tokens, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, FP8=fp8, PDL=bool(launch),
        INT8=int8, K_GROUPS=int8_groups(head_dim, INT8_K_GROUP), K_GW=min(INT8_K_GROUP, block_d),
        num_warps=num_warps, **launch,
    )  # fmt: skip
