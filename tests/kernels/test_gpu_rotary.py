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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 17, 256])
@pytest.mark.parametrize(
    ("head_dim", "rope"),
    [
        (64, {"rope_type": "default", "rope_theta": 500000.0}),
        (128, {"rope_type": "default", "rope_theta": 10000.0}),
        (80, {"rope_type": "default", "rope_theta": 1000000.0}),
        (
            64,
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),  # fmt: skip
        (
            128,
            {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
            },
        ),  # fmt: skip
    ],
)
def test_cos_sin_tables_match_the_module_bit_for_bit(head_dim, rope, rows, dtype):
    """The tables against the rotary embedding module's own forward on CUDA (YaRN's
    attention scaling is not 1), frequencies in float32 and, after ``.to(dtype)`` as a
    model cast moves them, in the model's dtype. Planted (fifty-fifth session): Triton's
    ``tl.cos`` and ``tl.sin`` (the fast approximations) in place of libdevice's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from nanoserve.kernels.rotary import rotary_cos_sin

    config = LlamaConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
        max_position_embeddings=131072, rope_parameters=rope,
    )  # fmt: skip
    module = LlamaRotaryEmbedding(config).cuda()
    gen = torch.Generator(device="cuda").manual_seed(rows * head_dim)
    positions = torch.randint(0, 131072, (rows, 2), device="cuda", generator=gen)
    positions[0, 0] = 0
    x = torch.empty(1, dtype=dtype, device="cuda")
    for frequencies in (module.inv_freq, module.inv_freq.to(dtype)):
        module.inv_freq = frequencies
        stock_cos, stock_sin = module(x, positions)
        cos, sin = rotary_cos_sin(positions, frequencies, module.attention_scaling, dtype)
        assert torch.equal(cos, stock_cos) and torch.equal(sin, stock_sin)
