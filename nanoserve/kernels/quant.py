"""FP8 (e4m3) K/V pools: the storage format and its torch quantize / dequantize.

A quantized pool holds ``torch.float8_e4m3fn`` values with one float32 scale per KV head
(``k_scale`` / ``v_scale`` [Hkv]): the real value is ``fp8.to(float32) * scale``. Writing
divides by the scale in float32, saturates to +-448 (the largest finite e4m3 value; inf
becomes +-448, NaN stays NaN) and rounds to nearest even.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# The pool dtypes a caller may ask for by name (patch_model's kv_dtype).
KV_DTYPE_NAMES = {"fp8_e4m3": FP8_DTYPE, "float8_e4m3fn": FP8_DTYPE}


def is_quantized(pool: torch.Tensor) -> bool:
    """True when ``pool`` stores FP8 values that need scales."""
    return pool.dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] (any float dtype) / scale [Hkv] -> float8_e4m3fn, saturating."""
    scaled = x.to(torch.float32) / scale.to(torch.float32)[:, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x float8_e4m3fn [..., Hkv, D] * scale [Hkv] -> ``dtype`` (computed in float32, or
    float64 when ``dtype`` is float64)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (x.to(compute) * scale.to(compute)[:, None]).to(dtype)
