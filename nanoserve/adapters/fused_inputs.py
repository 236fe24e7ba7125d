"""What a fused decode kernel may take in place of stock's modules (no HF knowledge here)."""

from __future__ import annotations

import torch

FUSED_DTYPES = (torch.float16, torch.bfloat16)


def fusable(x: torch.Tensor) -> bool:
    """A float16 / bfloat16 input outside autocast (under it stock's modules compute in the
    autocast dtype)."""
    return x.dtype in FUSED_DTYPES and not _autocast(x)


def _autocast(x: torch.Tensor) -> bool:
    try:
        return torch.is_autocast_enabled(x.device.type)
    except TypeError:  # torch before 2.4 takes no device type
        return torch.is_autocast_enabled()
