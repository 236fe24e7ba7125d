"""What a fused decode kernel may take in place of stock's modules (no HF knowledge here)."""

from __future__ import annotations

import torch

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


def _autocast(x: torch.Tensor) -> bool:
    try:
        return torch.is_autocast_enabled(x.device.type)
    except TypeError:  # torch before 2.4 takes no device type
        return torch.is_autocast_enabled()


def version_counter(x: torch.Tensor) -> int | None:
    """x's version counter (bumped by every in-place write autograd sees), or None for an
    inference tensor, which keeps none."""
    return None if x.is_inference() else x._version
