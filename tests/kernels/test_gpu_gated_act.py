"""GPU tests (``pytest -m gpu``): silu_mul on CUDA is bit-equal to eager PyTorch's
``F.silu(gate) * up`` (what Llama's MLP computes between its products) in bfloat16, float16
and float32, at MLP widths and odd ones. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.gated_act import BLOCK, silu_mul

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 17, 2100])
@pytest.mark.parametrize("width", [1, BLOCK - 1, BLOCK + 1, 2816, 8192, 14336])
def test_bit_equal_to_eager(width, rows, dtype):
    """Planted: tl.exp and Triton's default division instead of libdevice's exp and an IEEE
    division (float32 last bits, some of which survive the 16-bit rounding): failed."""
    gen = torch.Generator(device="cuda").manual_seed(width + rows)
    gate = (6 * torch.randn(rows, width, device="cuda", generator=gen)).to(dtype)
    up = (2 * torch.randn(rows, width, device="cuda", generator=gen)).to(dtype)
    gate[0, :1] = float("inf")  # silu: inf, and for -inf what eager gives (-inf / inf)
    if width > 1:
        gate[0, 1] = float("-inf")
    out = silu_mul(gate, up)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())
