"""GPU tests (``pytest -m gpu``): RMSNorm's kernel in bfloat16 and float16 on CUDA against
transformers' LlamaRMSNorm at real widths, alone and after a residual add. Skipped without a
CUDA device."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from nanoserve.kernels.rms_norm import add_rms_norm, rms_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("width", [64, 128, 576, 2048, 5120, 8192])
def test_matches_llama_rms_norm(width, rows, dtype):
    gen = torch.Generator(device="cuda").manual_seed(width + rows)
    x = (4 * torch.randn(rows, width, device="cuda", generator=gen)).to(dtype)
    module = LlamaRMSNorm(width, eps=1e-5).to("cuda", dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.3 * torch.randn(width, device="cuda", generator=gen))
        stock = module(x)
    out = rms_norm(x, module.weight.detach(), 1e-5)
    assert torch.isfinite(out).all()
    ulp = torch.finfo(dtype).eps * stock.double().abs().clamp(min=1e-30)
    assert ((out.double() - stock.double()).abs() / ulp).max() <= 2.01
    assert (out == stock).float().mean() >= 0.9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("width", [64, 576, 2048, 8192])
def test_add_rms_norm_is_the_add_then_the_norm(width, rows, dtype):
    """The sum bit-equal to PyTorch's add; the norm bit-equal to the kernel's own norm of
    that sum (what the unfused decode step computes)."""
    gen = torch.Generator(device="cuda").manual_seed(width * rows)
    x = (4 * torch.randn(rows, width, device="cuda", generator=gen)).to(dtype)
    residual = (4 * torch.randn(rows, width, device="cuda", generator=gen)).to(dtype)
    weight = (1 + 0.3 * torch.randn(width, device="cuda", generator=gen)).to(dtype)
    total, normed = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, rms_norm(total, weight, 1e-5))
