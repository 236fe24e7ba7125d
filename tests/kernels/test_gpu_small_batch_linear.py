"""GPU tests (``pytest -m gpu``): the small-batch linear kernel in bfloat16 and float16 on
CUDA at the projections' real sizes, against the float32 reference. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.small_batch_linear import small_batch_linear, small_batch_linear_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = [  # (K, output sizes, gated, bias)
    (2048, (2048, 512, 512), False, False),  # 1B q/k/v
    (896, (896, 128, 128), False, True),  # Qwen2-0.5B q/k/v, biases
    (2048, (8192, 8192), True, False),  # 1B gate/up
    (8192, (2048,), False, False),  # 1B down: K in four shares
    (576, (1536, 1536), True, False),  # SmolLM2 gate/up: K under one 256-tile multiple
    (1536, (576,), False, False),  # SmolLM2 down
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize(("k", "sizes", "gated", "bias"), CASES)
def test_within_one_rounding_of_the_reference(k, sizes, gated, bias, rows, dtype):
    gen = torch.Generator(device="cuda").manual_seed(rows * k)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype) for n in sizes]
    biases = None
    if bias:
        biases = [torch.randn(n, device="cuda", generator=gen).to(dtype) for n in sizes]
    out = small_batch_linear(x, weights, biases, gated=gated)
    ref = small_batch_linear_ref(x, weights, biases, gated=gated)
    assert torch.isfinite(out).all()
    assert (out == ref).float().mean() > 0.9  # mostly bit-equal
    if gated:
        # a last-bit difference in gate or up carries through silu and the product
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < (4e-3 if dtype == torch.bfloat16 else 5e-4)
    else:
        # both accumulate in float32 and round once, in other orders: at most one unit in
        # the last place apart
        ulp = torch.finfo(dtype).eps * ref.float().abs().clamp(min=torch.finfo(dtype).tiny)
        excess = (out.float() - ref.float()).abs() / ulp
        assert excess.max() <= 1.01, f"max {excess.max():.2f} ulp"
