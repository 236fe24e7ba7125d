"""GPU tests (``pytest -m gpu``): the content hash kernel on CUDA tensors gives the reference's
digest, at sizes of real weights and over unaligned views. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.content_hash import content_digest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_kernel_digest_equals_the_reference_on_cuda():
    """Weights of a 1B layer's sizes in bf16 (many work items each), float32 and int64
    buffers, odd sizes and unaligned views (2- and 1-byte words), NaN and infinities; the
    same bytes on the CPU give the same digest; one flipped bit changes it."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(8192, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    odd = torch.randn(1001, device="cuda", generator=gen)
    tensors = [
        big,
        torch.randn(2048, device="cuda", generator=gen).to(torch.bfloat16),
        torch.arange(32, device="cuda", dtype=torch.float32),
        torch.randint(0, 2**40, (77,), device="cuda", generator=gen),
        odd.to(torch.bfloat16)[1:],  # 2 bytes into its storage
        odd.view(torch.uint8)[5:1000],  # 5 bytes in
        torch.tensor([float("nan"), float("inf"), -float("inf")], device="cuda"),
    ]
    digest = content_digest(tensors)
    assert digest == content_digest(tensors, backend="torch")
    fresh = [t.clone() for t in tensors[:4]]
    assert content_digest(fresh) == content_digest([t.cpu() for t in fresh], backend="torch")
    big.view(torch.int16)[5000, 77] ^= 1  # the lowest mantissa bit of one weight
    assert content_digest(tensors) != digest
