"""Triton kernel of a gated MLP's activation, ``silu(gate) * up`` (``gated_act.py`` holds the
launcher and the reference): one program per (row, block of columns)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanoserve.kernels.triton_common import pdl_enter


@triton.jit
def _silu_mul_kernel(
    gate, up, out, stride_g, stride_u, N,
    BLOCK: tl.constexpr, ACCURATE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    kind = out.dtype.element_ty
    g = tl.load(gate + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    if ACCURATE:  # noqa: SIM108 (a constexpr branch)
        # expf and an IEEE division, as PyTorch's CUDA silu computes x / (1 + exp(-x))
        act = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    else:  # (the interpreter: numpy's float32 exp and division)
        act = g / (1.0 + tl.exp(-g))
    # eager rounds silu's result to the tensors' dtype, then the product
    y = act.to(kind).to(tl.float32) * u
    tl.store(out + row * N + cols, y.to(kind), mask=ok)
