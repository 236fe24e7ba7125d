"""Rotary position embedding as Llama, Mistral, Qwen and Gemma apply it: launcher and
reference.

``q * cos + rotate_half(q) * sin`` (and the same for k), with ``rotate_half(x) = cat(-x2,
x1)`` over the two halves of the head dimension: transformers' ``apply_rotary_pos_emb`` with
``unsqueeze_dim=1``. Each product and the sum are rounded to the tensors' dtype, as eager
PyTorch rounds them (and no product is fused into the sum), so outputs are bit-equal to
eager's.

``rotary_cos_sin`` makes the cos and sin a step's layers share, as the rotary embedding
module of those models computes them (``cos(position * inv_freq) * scaling`` over the two
halves of the head dimension, rounded once to the model's dtype): one launch for what eager
runs as about ten.
"""

from __future__ import annotations

import math

import torch

from nanoserve.kernels.dispatch import (
    float_input_problem,
    meta_problem,
    next_pow2,
    pdl_launch,
    use_triton,
)

# elements of one half-head tile a program holds, per tensor (x1, x2 and the products)
_TILE = 2048


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference, eager's operations in the tensors' dtype: q [B, Hq, S, D], k [B, Hk, S,
    D], cos and sin [B, S, D]; returns (q, k) rotated, new tensors of q's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def input_problem(q, k, cos, sin) -> str | None:
    """Why ``apply_rotary`` refuses these arguments (the ValueError's message), or None."""
    if q.dim() != 4 or q.shape[-1] % 2 or q.shape[-1] == 0:
        return f"q: expected [B, Hq, S, D] with D even, got {tuple(q.shape)}"
    if (problem := float_input_problem("q", q)) is not None:
        return problem
    batch, _, seq, dim = q.shape
    if k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq, dim):
        return f"k: expected [{batch}, Hk, {seq}, {dim}] like q, got {tuple(k.shape)}"
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (batch, seq, dim):
            return f"{name}: expected [{batch}, {seq}, {dim}], got {tuple(t.shape)}"
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype != q.dtype or t.device != q.device:
            return f"{name}: expected q's dtype and device, got {t.dtype} on {t.device}"
    return meta_problem("q", q)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend="auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_ref(q, k, cos, sin)`` by one Triton launch for q and k together.

    q [B, Hq, S, D] and k [B, Hk, S, D] of any strides (a transposed view of a projection's
    output is read in place; the head dimension is copied to unit stride first if it is
    not), cos and sin [B, S, D], all of one dtype (float16, bfloat16 or float32). Returns new
    contiguous tensors shaped as q and k, bit-equal to eager's.
    """
    problem = input_problem(q, k, cos, sin)
    if problem is not None:
        raise ValueError(problem)
    if not use_triton(backend, q):
        return rotary_ref(q, k, cos, sin)
    from nanoserve.kernels.triton_rotary import _rotary_kernel

    q, k, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, cos, sin))
    batch, q_heads, seq, dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q_out.numel() + k_out.numel() == 0:
        return q_out, k_out
    half = dim // 2
    block = next_pow2(half)
    heads = min(next_pow2(max(q_heads, k_heads)), max(1, _TILE // block))
    q_blocks, k_blocks = -(-q_heads // heads), -(-k_heads // heads)
    launch = pdl_launch(q.device)
    _rotary_kernel[(batch * seq, q_blocks + k_blocks)](
        q, k, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        seq, q_heads, k_heads, half, q_blocks,
        HEADS=heads, BLOCK=block, PDL=bool(launch), num_warps=4,
        enable_fp_fusion=False,  # a product fused into the sum would skip eager's rounding
        **launch,
    )  # fmt: skip
    return q_out, k_out


def rotary_cos_sin_ref(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference, transformers' rotary embedding forward: positions integer [B, S], inv_freq
    float [D / 2] (taken as float32, as the module does); returns (cos, sin), new [B, S, D]
    tensors of ``dtype``."""
    freqs = positions[..., None].float() * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def cos_sin_problem(positions, inv_freq, scaling, dtype) -> str | None:
    """Why ``rotary_cos_sin`` refuses these arguments (the ValueError's message), or None."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return f"positions: expected a [B, S] tensor, got {getattr(positions, 'shape', positions)}"
    if (
        positions.dtype.is_floating_point
        or positions.dtype.is_complex
        or positions.dtype == torch.bool
    ):
        return f"positions: expected an integer tensor, got {positions.dtype}"
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1 or inv_freq.numel() == 0:
        return f"inv_freq: expected a [D / 2] tensor, got {getattr(inv_freq, 'shape', inv_freq)}"
    if not inv_freq.dtype.is_floating_point or inv_freq.device != positions.device:
        return (
            f"inv_freq: expected a float tensor on positions' device, got {inv_freq.dtype} on "
            f"{inv_freq.device}"
        )
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        return f"scaling: expected a float, got {scaling!r}"
    # (an int past float64's range makes float() raise)
    if abs(scaling) > torch.finfo(torch.float32).max or not math.isfinite(scaling):
        return f"scaling: expected a finite float32, got {scaling!r}"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype: expected float16, bfloat16 or float32, got {dtype}"
    return meta_problem("positions", positions) or meta_problem("inv_freq", inv_freq)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype,
    *, backend="auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``rotary_cos_sin_ref(positions, inv_freq, scaling, dtype)`` in one Triton launch.

    positions integer [B, S] (any strides), inv_freq float [D / 2] (rounded to float32 first,
    as the module rounds it), on one device. Returns (cos, sin), new contiguous [B, S, D]
    tensors of ``dtype``; on the GPU bit-equal to eager's (CUDA's cosf and sinf, one rounded
    product for each angle).
    """
    problem = cos_sin_problem(positions, inv_freq, scaling, dtype)
    if problem is not None:
        raise ValueError(problem)
    if not use_triton(backend, inv_freq):
        return rotary_cos_sin_ref(positions, inv_freq, scaling, dtype)
    from nanoserve.kernels.triton_rotary import _cos_sin_kernel

    batch, seq = positions.shape
    half = inv_freq.numel()
    shape = (batch, seq, 2 * half)
    cos = torch.empty(shape, dtype=dtype, device=positions.device)
    sin = torch.empty(shape, dtype=dtype, device=positions.device)
    if batch * seq == 0:
        return cos, sin
    launch = pdl_launch(positions.device)
    _cos_sin_kernel[(batch * seq,)](
        positions, inv_freq.contiguous(), cos, sin, positions.stride(0), positions.stride(1),
        seq, half, float(scaling),
        BLOCK=next_pow2(half), ACCURATE=positions.is_cuda, PDL=bool(launch), num_warps=1,
        **launch,
    )  # fmt: skip
    return cos, sin
