"""Quantized K/V pools: the two storage formats and their torch quantize / dequantize.

FP8: a pool holds ``torch.float8_e4m3fn`` values with one float32 scale per KV head
(``k_scale`` / ``v_scale`` [Hkv]): the real value is ``fp8.to(float32) * scale``. Writing
divides by the scale in float32, saturates to +-448 (the largest finite e4m3 value; inf
becomes +-448, NaN stays NaN) and rounds to nearest even.

INT8: a pool holds ``torch.int8`` values and every slot its own float16 scales in a tensor
beside the pool: keys one scale per (KV head, group of ``INT8_K_GROUP`` channels of the head
dim), values one per KV head (``k_scale`` [num_blocks, block_size, Hkv, groups], ``v_scale``
[num_blocks, block_size, Hkv, 1]). The real value is ``int8 * scale``. Writing takes the
group's amax / 127, rounded to float16 (and kept in [2^-14, 65504]), as the scale, then
rounds x / scale to the nearest integer (half to even) and saturates to +-127. A group
holding inf or NaN gets a NaN scale, so it reads back as NaN. No calibration: a token's
stored values depend on that token alone. Keys need the finer groups: a few channels carry
most of q.k, and one scale per head would round the rest coarsely (benchmarks/RESULTS.md
has the accuracy of each choice); a value's scale per head folds into the softmax weights.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_DTYPE = torch.int8
INT8_MAX = 127.0
# Channels of the head dim that share one INT8 key scale (values: the whole head).
INT8_K_GROUP = 16
INT8_SCALE_DTYPE = torch.float16
# The smallest and largest INT8 scales: float16's least normal and its largest finite value.
INT8_SCALE_MIN = 2.0**-14
INT8_SCALE_MAX = 65504.0
# The pool dtypes that store scaled values and need scales beside them.
QUANTIZED_DTYPES = (FP8_DTYPE, INT8_DTYPE)
# The pool dtypes a caller may ask for by name (patch_model's kv_dtype).
KV_DTYPE_NAMES = {
    "fp8_e4m3": FP8_DTYPE,
    "float8_e4m3fn": FP8_DTYPE,
    "int8": INT8_DTYPE,
}


def int8_groups(head_dim: int, group: int | None) -> int:
    """Scales per (slot, KV head) of INT8 pools of ``head_dim`` with ``group`` channels a
    scale (None: the whole head, one scale)."""
    return 1 if group is None else -(-head_dim // group)


def int8_scale_shape(pool_shape, group: int | None) -> tuple[int, ...]:
    """Shape of the scales of an INT8 pool [num_blocks, block_size, Hkv, D]: ``group`` as
    in ``int8_groups`` (``INT8_K_GROUP`` for keys, None for values)."""
    *lead, head_dim = pool_shape
    return (*lead, int8_groups(head_dim, group))


def _grouped(x: torch.Tensor, width: int) -> torch.Tensor:
    """[..., D] -> [..., ceil(D / width), width], the last group padded with zeros."""
    pad = -x.shape[-1] % width
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    # (the group count spelled out: -1 cannot be inferred when x holds no row)
    return x.reshape(*x.shape[:-1], x.shape[-1] // width, width)


def quantize_int8(
    x: torch.Tensor, group: int | None = INT8_K_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (int8 [..., D], float16 scales [..., groups]) with
    ``group`` channels a scale (None: one scale per row)."""
    head_dim = x.shape[-1]
    groups = _grouped(x.to(torch.float32), head_dim if group is None else group)
    amax = groups.abs().amax(dim=-1)
    # amax / 127 correctly rounded to float32, as the scatter kernel's division: torch on CUDA
    # divides by a Python number through its reciprocal, whose extra rounding can land on a
    # float16 tie and round the scale the other way (float64 cannot)
    quotient = (amax.double() / INT8_MAX).to(torch.float32)
    scale = quotient.clamp(INT8_SCALE_MIN, INT8_SCALE_MAX).to(INT8_SCALE_DTYPE)
    finite = torch.isfinite(groups).all(dim=-1)
    scale = torch.where(finite, scale, torch.nan)
    q = groups / scale.to(torch.float32)[..., None]
    q = torch.where(finite[..., None], q.round().clamp(-INT8_MAX, INT8_MAX), 0.0)
    q = q.flatten(-2)[..., :head_dim]
    return q.to(INT8_DTYPE).contiguous(), scale


def dequantize_int8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x int8 [..., D] * scale float16 [..., groups] (one group: the whole row; more: groups
    of ``INT8_K_GROUP`` channels) -> ``dtype`` (computed in float32, or float64 when
    ``dtype`` is float64; exact in either)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    head_dim, groups = x.shape[-1], scale.shape[-1]
    if groups not in (1, int8_groups(head_dim, INT8_K_GROUP)):
        raise ValueError(f"scale: {groups} groups fit no INT8 layout of head dim {head_dim}")
    values = _grouped(x.to(compute), head_dim if groups == 1 else INT8_K_GROUP)
    values = values * scale.to(compute)[..., None]
    return values.flatten(-2)[..., :head_dim].to(dtype).contiguous()


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] (any float dtype) / scale [Hkv] -> float8_e4m3fn, saturating."""
    scaled = x.to(torch.float32) / scale.to(torch.float32)[:, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x float8_e4m3fn [..., Hkv, D] * scale [Hkv] -> ``dtype`` (computed in float32, or
    float64 when ``dtype`` is float64)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (x.to(compute) * scale.to(compute)[:, None]).to(dtype)
