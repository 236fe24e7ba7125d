"""RMSNorm as Llama, Mistral and Qwen compute it: kernel launcher and reference.

``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)`` with x read in float32 and the
product rounded to x's dtype, the roundings of ``LlamaRMSNorm.forward``. The mean's summation
order differs from PyTorch's, so a 16-bit output can differ from eager's in the last bit.
"""

from __future__ import annotations

import torch

from nanoserve.kernels.dispatch import (
    float_input_problem,
    like_problem,
    meta_problem,
    next_pow2,
    pdl_launch,
    unit_stride_rows,
    use_triton,
)

MAX_WIDTH = 65536


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: x [..., D] and weight [D] of one dtype; returns [..., D] in that dtype."""
    normed = x.to(torch.float32)
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def input_problem(x: torch.Tensor, weight: torch.Tensor, eps) -> str | None:
    """Why ``rms_norm`` refuses these arguments (the ValueError's message), or None."""
    width = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or not 1 <= width <= MAX_WIDTH:
        return f"x: expected [..., D] with 1 <= D <= {MAX_WIDTH}, got {tuple(x.shape)}"
    if (problem := float_input_problem("x", x)) is not None:
        return problem
    if weight.shape != (width,) or weight.dtype != x.dtype or weight.device != x.device:
        return (
            f"weight: expected [{width}] of x's dtype and device, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        return f"eps: expected a number >= 0, got {eps!r}"
    return meta_problem("x", x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto"):
    """``rms_norm_ref(x, weight, eps)`` by one Triton launch (a program per row).

    x [..., D] with unit stride in D (rows may be strided; other layouts are copied first),
    weight [D] contiguous of x's dtype (float16, bfloat16 or float32), D <= 65536. Returns a
    new contiguous tensor shaped as x.
    """
    problem = input_problem(x, weight, eps)
    if problem is not None:
        raise ValueError(problem)
    if not use_triton(backend, x):
        return rms_norm_ref(x, weight, eps)
    return _launch(x, None, weight, eps)[1]


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (x + residual, its ``rms_norm_ref``); x and residual [..., D] of one shape
    and dtype, weight [D]; both results in that dtype."""
    total = x + residual
    return total, rms_norm_ref(total, weight, eps)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm_ref`` by one Triton launch: a pre-norm decoder layer's residual add and
    the norm after it. x and residual as ``rms_norm``'s x, of one shape, dtype and device.
    Returns two new contiguous tensors shaped as x: the sum (rounded as PyTorch's add rounds
    it) and its norm."""
    problem = add_input_problem(x, residual, weight, eps)
    if problem is not None:
        raise ValueError(problem)
    if not use_triton(backend, x):
        return add_rms_norm_ref(x, residual, weight, eps)
    return _launch(x, residual, weight, eps)


def add_input_problem(x: torch.Tensor, residual, weight: torch.Tensor, eps) -> str | None:
    """Why ``add_rms_norm`` refuses these arguments (the ValueError's message), or None."""
    if (problem := like_problem("residual", residual, "x", x)) is not None:
        return problem
    return input_problem(x, weight, eps)


def _launch(x, residual, weight, eps) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the sum or None, the norm) by one launch; arguments already checked."""
    from nanoserve.kernels.triton_rms_norm import _rms_norm_kernel

    width = x.shape[-1]
    rows = unit_stride_rows(x, width)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = None if residual is None else torch.empty_like(out)
    if rows.shape[0] == 0:
        return total, out
    others = rows if residual is None else unit_stride_rows(residual, width)
    block = next_pow2(width)
    num_warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    launch = pdl_launch(x.device)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, others, weight.contiguous(), out, out if total is None else total,
        rows.stride(0), others.stride(0), width, float(eps),
        BLOCK=block, RESIDUAL=residual is not None, PDL=bool(launch),
        num_warps=num_warps, **launch,
    )  # fmt: skip
    return total, out
