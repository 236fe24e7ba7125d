"""A gated MLP's activation ``silu(gate) * up``: kernel launcher and reference.

Eagerly, Llama's MLP runs ``act_fn(gate_proj(x)) * up_proj(x)`` as two launches (the SiLU,
rounded to the input dtype, then the product); ``silu_mul`` is one, with the same
roundings: on CUDA its float16 and bfloat16 results are bit-equal to eager's (PyTorch's
silu computes ``x / (1 + exp(-x))`` in float32 with an accurate exp and division, and so
does the kernel).
"""

from __future__ import annotations

import torch

from nanoserve.kernels.dispatch import (
    float_input_problem,
    like_problem,
    meta_problem,
    pdl_launch,
    unit_stride_rows,
    use_triton,
)

# columns a program takes
BLOCK = 1024


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference: gate and up [..., N] of one dtype; ``F.silu(gate) * up`` in that dtype."""
    return torch.nn.functional.silu(gate) * up


def input_problem(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    """Why ``silu_mul`` refuses these arguments (the ValueError's message), or None."""
    if not isinstance(gate, torch.Tensor) or gate.dim() == 0:
        return f"gate: expected a tensor [..., N], got {getattr(gate, 'shape', type(gate))}"
    if (problem := float_input_problem("gate", gate)) is not None:
        return problem
    if (problem := like_problem("up", up, "gate", gate)) is not None:
        return problem
    return meta_problem("gate", gate)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu_mul_ref(gate, up)`` by one Triton launch.

    gate and up [..., N] of one shape, dtype (float16, bfloat16 or float32) and device, each
    with unit stride in N (rows may be strided; other layouts are copied first). Returns a
    new contiguous tensor shaped as gate.
    """
    problem = input_problem(gate, up)
    if problem is not None:
        raise ValueError(problem)
    if not use_triton(backend, gate):
        return silu_mul_ref(gate, up)
    from nanoserve.kernels.triton_gated_act import _silu_mul_kernel

    width = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    g, u = unit_stride_rows(gate, width), unit_stride_rows(up, width)
    if g.shape[0] == 0 or width == 0:
        return out
    launch = pdl_launch(gate.device)
    _silu_mul_kernel[(g.shape[0], -(-width // BLOCK))](
        g, u, out, g.stride(0), u.stride(0), width,
        BLOCK=BLOCK, ACCURATE=gate.is_cuda, PDL=bool(launch), num_warps=4, **launch,
    )  # fmt: skip
    return out
