"""GPU tests (``pytest -m gpu``): the rotary kernel in bfloat16, float16 and float32 on CUDA,
bit for bit against transformers' apply_rotary_pos_emb on the views the attention modules pass, at
real head counts and widths. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from nanoserve.kernels.rotary import apply_rotary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 17, 256])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim"),
    [(32, 8, 64), (32, 32, 80), (28, 4, 128), (32, 4, 96), (16, 8, 256), (40, 8, 128)],
)
def test_matches_transformers_bit_for_bit(q_heads, kv_heads, dim, rows, dtype):
    """Planted (run 2 of the tenth session): the compiler left free to fuse a product into
    the sum (Triton's default): every case failed, a quarter of the elements one unit off."""
    gen = torch.Generator(device="cuda").manual_seed(rows * dim + q_heads)
    width = (q_heads + 2 * kv_heads) * dim
    fused = (3 * torch.randn(rows, 1, width, device="cuda", generator=gen)).to(dtype)
    q = fused[..., : q_heads * dim].view(rows, 1, q_heads, dim).transpose(1, 2)
    k = fused[..., q_heads * dim : (q_heads + kv_heads) * dim].view(rows, 1, kv_heads, dim)
    k = k.transpose(1, 2)
    positions = torch.randint(0, 131072, (rows, 1, 1), device="cuda", generator=gen).float()
    freqs = positions / 500000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim)
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    out_q, out_k = apply_rotary(q, k, cos, sin)
    stock_q, stock_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.isfinite(out_q).all() and torch.isfinite(out_k).all()
    assert torch.equal(out_q, stock_q) and torch.equal(out_k, stock_k)
