"""torch's settings that change what a forward computes without changing the model.

Autocast (per device type: on or off, and its dtype) makes a float32 model's projections run
in bfloat16 or float16; the float32 matmul precision (TF32, bf16 passes) and the reduced
precision reductions change every matmul's rounding. K/V stored under one setting are not
what a call under another would compute (the prefix cache must not serve them), and a CUDA
graph replays the kernels it was captured with (the decode graphs must not replay across a
change). Read at each call's start and each graph step: a few attribute reads.
"""

from __future__ import annotations

import torch

_AUTOCAST_DEVICES = ("cpu", "cuda")
# torch's per-backend float32 precision settings (its newer API, which a torch may lack)
_PRECISION_OWNERS = (
    ("backends",),
    ("backends", "mkldnn"),
    ("backends", "mkldnn", "matmul"),
    ("backends", "mkldnn", "conv"),
    ("backends", "mkldnn", "rnn"),
    ("backends", "cuda", "matmul"),
    ("backends", "cudnn"),
    ("backends", "cudnn", "conv"),
    ("backends", "cudnn", "rnn"),
)


def numeric_modes() -> tuple:
    """A comparable, printable tuple of the settings above as they stand now."""
    autocast = tuple(
        (kind, torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None
        for kind in _AUTOCAST_DEVICES
    )
    matmul = torch.backends.cuda.matmul
    return (
        autocast,
        _legacy_matmul_precision(),
        tuple(_fp32_precision(owner) for owner in _PRECISION_OWNERS),
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    )


def _legacy_matmul_precision() -> str:
    """``torch.get_float32_matmul_precision()``; torch refuses to answer it once the newer
    per-backend settings were used beside it (those then say the precision)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return "per backend"


def _fp32_precision(owner: tuple[str, ...]) -> str | None:
    """The ``fp32_precision`` setting of ``torch.<owner>``, or None where this torch has none."""
    found = torch
    for name in owner:
        found = getattr(found, name, None)
    try:
        return getattr(found, "fp32_precision", None)
    except RuntimeError:
        return "unreadable"
