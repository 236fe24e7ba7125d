"""What a fused decode kernel may take in place of stock's modules (no HF knowledge here)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoserve.kernels.dispatch import use_triton
from nanoserve.kernels.small_batch_linear import input_problem as linear_problem

FUSED_DTYPES = (torch.float16, torch.bfloat16)


def fusable(x: torch.Tensor) -> bool:
    """A float16 / bfloat16 input outside autocast (under it stock's modules compute in the
    autocast dtype)."""
    return x.dtype in FUSED_DTYPES and not _autocast(x)


def records_grad(*tensors: torch.Tensor) -> bool:
    """True when autograd would record an op on ``tensors`` (the kernels record none)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def plain_linear(module) -> bool:
    """An nn.Linear itself (not a subclass: LoRA and quantized layers compute more), its
    forward not wrapped by another library."""
    return type(module) is torch.nn.Linear and "forward" not in module.__dict__


def fits(
    x: torch.Tensor, linears: Sequence[torch.nn.Linear], backend: str, gated: bool = False
) -> bool:
    """True when the kernel takes ``x`` [M, K] through ``linears`` (``small_batch_linear``'s
    own conditions: at most 64 rows, weights and biases of x's dtype, device and width, ...)
    in a 16-bit step outside autocast; anything else runs stock's."""
    weights, biases = [m.weight for m in linears], [m.bias for m in linears]
    return (
        fusable(x) and linear_problem(x, weights, biases, gated) is None and use_triton(backend, x)
    )


def _autocast(x: torch.Tensor) -> bool:
    try:
        return torch.is_autocast_enabled(x.device.type)
    except TypeError:  # torch before 2.4 takes no device type
        return torch.is_autocast_enabled()
