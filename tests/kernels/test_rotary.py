"""Rotary embedding: Triton (interpreter) against transformers' apply_rotary_pos_emb (bit for
bit in float16), against float64 math, on strided views as the attention modules pass them,
odd head counts and widths, and bad input."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import needs_interpreter
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from nanoserve.kernels.rotary import apply_rotary, rotary_ref


def _inputs(batch, q_heads, k_heads, seq, dim, dtype, seed):
    """q and k as the attention modules hand them over: transposed views [B, H, S, D] of
    one projection output [B, S, (Hq + 2 Hk) * D]; cos and sin from real angles."""
    gen = torch.Generator().manual_seed(seed)
    fused = (2 * torch.randn(batch, seq, (q_heads + 2 * k_heads) * dim, generator=gen)).to(dtype)
    q = fused[..., : q_heads * dim].view(batch, seq, q_heads, dim).transpose(1, 2)
    k = fused[..., q_heads * dim :][..., : k_heads * dim].view(batch, seq, k_heads, dim)
    positions = torch.randint(0, 40000, (batch, seq, 1), generator=gen).double()
    freqs = positions / 500000.0 ** (torch.arange(0, dim, 2).double() / dim)
    angles = torch.cat((freqs, freqs), dim=-1)
    return q, k.transpose(1, 2), angles.cos().to(dtype), angles.sin().to(dtype)


def _float64(q, k, cos, sin):
    return rotary_ref(*(t.double() for t in (q, k, cos, sin)))


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("batch", "q_heads", "k_heads", "seq", "dim"),
    [
        (1, 4, 4, 1, 64),  # GQA 1
        (3, 8, 2, 1, 80),  # GQA 4, half-width 40 (not a power of two)
        (2, 8, 1, 1, 96),  # GQA 8
        (2, 6, 2, 3, 128),  # several tokens a row
        (1, 3, 1, 1, 2),  # the narrowest head
        (2, 40, 8, 1, 256),  # more heads than one program holds at this width
    ],
)
def test_matches_transformers(batch, q_heads, k_heads, seq, dim, dtype):
    """Planted: cos's second half read from the first (HALF dropped from the offset), the
    sum taken before rounding each product, and the last head block skipped: each failed."""
    q, k, cos, sin = _inputs(batch, q_heads, k_heads, seq, dim, dtype, seed=dim + q_heads)
    stock_q, stock_k = apply_rotary_pos_emb(q, k, cos, sin)
    out_q, out_k = apply_rotary(q, k, cos, sin, backend="triton")
    assert out_q.shape == q.shape and out_k.shape == k.shape
    assert out_q.dtype == out_k.dtype == dtype and out_q.is_contiguous()
    # eager's roundings, so bit for bit (float32 on CPU: no fused multiply-add either)
    assert torch.equal(out_q, stock_q) and torch.equal(out_k, stock_k)
    ref_q, ref_k = _float64(q, k, cos, sin)
    bound = 4 * torch.finfo(dtype).eps * 3  # |x| < ~12 here: a few ulps of the largest
    for out, ref in ((out_q, ref_q), (out_k, ref_k)):
        assert ((out.double() - ref).abs() / ref.abs().clamp(min=1)).max() <= bound


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
def test_cos_differs_between_halves_and_rows():
    """The kernel reads cos and sin whole (not one half twice) and per row and token."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 3, 16, generator=gen).to(torch.float16)
    k = torch.randn(2, 2, 3, 16, generator=gen).to(torch.float16)
    cos, sin = (torch.randn(2, 3, 16, generator=gen).to(torch.float16) for _ in range(2))
    out = apply_rotary(q, k, cos, sin, backend="triton")
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))


@needs_interpreter
def test_non_unit_stride_head_dim_and_empty_batch():
    q = torch.randn(1, 2, 1, 8).to(torch.float16)
    k_wide = torch.randn(1, 2, 1, 16).to(torch.float16)
    k = k_wide[..., ::2]  # head dimension strided: copied first
    cos, sin = torch.rand(1, 1, 8).to(torch.float16), torch.rand(1, 1, 8).to(torch.float16)
    out = apply_rotary(q, k, cos, sin, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(out, rotary_ref(q, k, cos, sin), strict=True))
    empty = torch.empty(0, 2, 1, 8, dtype=torch.float16)
    none = torch.empty(0, 1, 8, dtype=torch.float16)
    out_q, out_k = apply_rotary(empty, empty, none, none, backend="triton")
    assert out_q.shape == out_k.shape == (0, 2, 1, 8)


@pytest.mark.parametrize(
    ("q", "k", "cos", "message"),
    [
        (torch.zeros(2, 4, 1), torch.zeros(2, 4, 1, 8), torch.zeros(2, 1, 8), "q: expected"),
        (torch.zeros(2, 4, 1, 7), torch.zeros(2, 4, 1, 7), torch.zeros(2, 1, 7), "q: expected"),
        (torch.zeros(2, 4, 1, 8), torch.zeros(1, 4, 1, 8), torch.zeros(2, 1, 8), "k: expected"),
        (torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 2, 8), torch.zeros(2, 1, 8), "k: expected"),
        (torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), torch.zeros(1, 8), "cos: expected"),
        (
            torch.zeros(2, 4, 1, 8),
            torch.zeros(2, 4, 1, 8, dtype=torch.float16),
            torch.zeros(2, 1, 8),
            "k: expected",
        ),
        (  # integer q / k came back truncated from the reference
            torch.ones(2, 4, 1, 8, dtype=torch.int32),
            torch.ones(2, 4, 1, 8, dtype=torch.int32),
            torch.ones(2, 1, 8, dtype=torch.int32),
            "q: expected float16",
        ),
    ],
)
def test_bad_input_names_the_argument(q, k, cos, message):
    with pytest.raises(ValueError, match=message):
        apply_rotary(q, k, cos, torch.zeros(2, 1, q.shape[-1] if q.dim() == 4 else 8))
    with pytest.raises(ValueError, match="sin: expected"):
        good = torch.zeros(2, 4, 1, 8)
        apply_rotary(good, good, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8, dtype=torch.half))
