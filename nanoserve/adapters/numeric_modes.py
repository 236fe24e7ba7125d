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


def numeric_modes() -> tuple:
    """A comparable, printable tuple of the settings above as they stand now."""
    autocast = tuple(
        (kind, torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None
        for kind in _AUTOCAST_DEVICES
    )
    matmul = torch.backends.cuda.matmul
    return (
        autocast,
        torch.get_float32_matmul_precision(),
        getattr(matmul, "fp32_precision", None),
        getattr(torch.backends.cudnn, "fp32_precision", None),
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    )
