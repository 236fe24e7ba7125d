"""FP8 paged inputs for kernel tests: quantized pools beside their float64 dequantization."""

from __future__ import annotations

import torch
from kernel_inputs import make_paged_kv

from nanoserve.kernels.quant import FP8_MAX, dequantize, quantize


def fitting_scales(pool: torch.Tensor) -> torch.Tensor:
    """float32 [Hkv] scales that fit each head's finite amax in e4m3 with a random headroom
    of 1x to 4x."""
    amax = pool.nan_to_num(0.0).abs().amax(dim=(0, 1, 3)).clamp_min(1e-3)
    return (amax / FP8_MAX * (1 + 3 * torch.rand(pool.shape[2], device=pool.device))).float()


def make_fp8_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, **kwargs):
    """(key_cache, value_cache, k_scale, v_scale, key64, value64, block_tables, seq_lens).

    The pools hold random K/V (unit normal) quantized with per-head scales; ``key64`` and
    ``value64`` are their exact dequantization in float64 (pools of the same layout), the
    reference's input. Slots holding no token store 448, the largest e4m3 value (the
    interpreter reads fp8 NaN as 480, so NaN cannot poison them): read by mistake, such a
    key dominates its row and such a value swamps the output.
    """
    key32, value32, tables, lens = make_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, torch.float32, **kwargs
    )
    # magnitudes (hence scales) 10x apart between heads: a scale read for the wrong head shows
    spread = torch.logspace(-0.5, 0.5, num_kv_heads)[torch.randperm(num_kv_heads), None]
    spread = spread.to(key32.device)
    key32, value32 = key32 * spread, value32 * spread
    k_scale, v_scale = fitting_scales(key32), fitting_scales(value32)
    pools = []
    for pool, scale in ((key32, k_scale), (value32, v_scale)):
        pools.append(quantize(torch.where(torch.isnan(pool), float("inf"), pool), scale))
    key64 = dequantize(pools[0], k_scale, torch.float64)
    value64 = dequantize(pools[1], v_scale, torch.float64)
    return pools[0], pools[1], k_scale, v_scale, key64, value64, tables, lens
