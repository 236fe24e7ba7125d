"""INT8 paged inputs for kernel tests: quantized pools and per-slot scales beside their
float64 dequantization."""

from __future__ import annotations

import torch
from kernel_inputs import make_paged_kv

from nanoserve.kernels.quant import INT8_K_GROUP, dequantize_int8, quantize_int8

# amax / 127 lies just past a float16 midpoint; amax * (1 / 127) in float32 lands on it and
# rounds to even, the other way (found on the GPU, where torch divides a tensor by a number so)
NEAR_TIE_AMAXES = [4073.922119140625, 127.80615997314453, 255.61231994628906, 521462.03125]
NEAR_TIE_AMAXES += [0.12481070309877396]


def near_tie_group(amax: float) -> torch.Tensor:
    """16 float32 channels whose amax is ``amax``."""
    group = torch.linspace(-0.9, 0.9, 16) * amax
    group[3] = -amax
    return group


def make_int8_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, device="cpu", **kwargs):
    """(key_cache, value_cache, k_scale, v_scale, key64, value64, block_tables, seq_lens).

    The pools hold random K/V quantized per (slot, KV head) and, for keys, group of 16
    channels; ``key64``
    and ``value64`` are their exact dequantization in float64 (pools of the same layout), the
    reference's input. Channel magnitudes span three decades, so every group has its own
    scale and a scale read for the wrong group or row shows. Slots holding no token have NaN
    scales (their values were NaN): read by mistake, they make the output NaN.
    """
    key32, value32, tables, lens = make_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, torch.float32, device=device, **kwargs
    )
    spread = torch.logspace(-1.5, 1.5, head_dim, device=key32.device)[torch.randperm(head_dim)]
    pools, scales = [], []
    for pool, group in ((key32 * spread, INT8_K_GROUP), (value32 * spread.flip(0), None)):
        values, scale = quantize_int8(pool, group)
        pools.append(values)
        scales.append(scale)
    key64 = dequantize_int8(pools[0], scales[0], torch.float64)
    value64 = dequantize_int8(pools[1], scales[1], torch.float64)
    return pools[0], pools[1], scales[0], scales[1], key64, value64, tables, lens
