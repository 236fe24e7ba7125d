"""silu_mul: Triton (interpreter) against the reference and against Llama's MLP activation,
odd widths and block edges, strided rows, bad input."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import needs_interpreter, ulps

from nanoserve.kernels.gated_act import BLOCK, silu_mul, silu_mul_ref


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape", [(1, 1), (3, 7), (2, 5, 96), (4, BLOCK - 1), (2, BLOCK), (3, BLOCK + 1), (1, 2816)]
)
def test_matches_silu_times_up(shape, dtype):
    """The interpreter's exp is numpy's, not CUDA's: float32 within a few units in the last
    place, float16 (rounded twice, as eager rounds) bit-equal or one unit apart. On CUDA the
    results are bit-equal (test_gpu_gated_act.py). Planted: silu's result not rounded before
    the product, gate and up swapped, and the last block's column mask dropped (poisoned
    outputs): each failed."""
    gen = torch.Generator().manual_seed(sum(shape))
    gate = (4 * torch.randn(*shape, generator=gen)).to(dtype)
    up = (2 * torch.randn(*shape, generator=gen)).to(dtype)
    out = silu_mul(gate, up, backend="triton")
    ref = silu_mul_ref(gate, up)
    assert out.shape == gate.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(ref, torch.nn.functional.silu(gate) * up)
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        assert ulps(out, ref).max() <= 4
    else:
        assert ulps(out, ref).max() <= 2.01
        assert (out == ref).float().mean() >= 0.95


@needs_interpreter
def test_strided_rows_and_copied_layouts():
    """gate and up as halves of one wider row (strided rows), and a transposed tensor
    (copied first)."""
    both = torch.randn(5, 2 * 80).to(torch.float16)
    gate, up = both[:, :80], both[:, 80:]
    assert ulps(silu_mul(gate, up, backend="triton"), silu_mul_ref(gate, up)).max() <= 2.01
    t = torch.randn(80, 6).to(torch.float16).T
    out = silu_mul(t, t, backend="triton")
    assert ulps(out, silu_mul_ref(t, t)).max() <= 2.01
    empty = torch.empty(0, 80, dtype=torch.float16)
    assert silu_mul(empty, empty, backend="triton").shape == (0, 80)


@pytest.mark.parametrize(
    ("gate", "up", "message"),
    [
        (torch.zeros(()), torch.zeros(()), "gate: expected a tensor"),
        (torch.ones(2, 8, dtype=torch.int32), torch.ones(2, 8, dtype=torch.int32), "gate: exp"),
        (torch.zeros(2, 8), None, "up: expected a tensor"),
        (torch.zeros(2, 8), torch.zeros(2, 7), "up: expected gate's shape"),
        (torch.zeros(2, 8), torch.zeros(1, 8), "up: expected gate's shape"),  # no broadcasting
        (torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float16), "up: expected gate's"),
        (torch.zeros(2, 8, device="meta"), torch.zeros(2, 8, device="meta"), "gate: a meta"),
    ],
)
def test_bad_input_names_the_argument(gate, up, message):
    with pytest.raises(ValueError, match=message):
        silu_mul(gate, up)
