"""A step's rotary cos and sin tables: Triton (interpreter) against transformers' rotary
embedding module and against float64 math, at odd widths, strided and int32 positions,
scalings other than 1, frequencies held in 16 bits, an empty batch, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_inputs import needs_interpreter
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from nanoserve.kernels.rotary import rotary_cos_sin, rotary_cos_sin_ref


def _module(head_dim: int, theta: float = 500000.0) -> LlamaRotaryEmbedding:
    config = LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_theta=theta
    )
    return LlamaRotaryEmbedding(config)


def _float64(positions, inv_freq, scaling):
    """cos and sin in float64 of the float32 angles (the tables' angles are that product,
    rounded to float32 as eager rounds it; at 40,000 a float32 angle is off by 1e-3)."""
    freqs = (positions[..., None].float() * inv_freq.float()).double()
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * scaling, angles.sin() * scaling


def _within_one_rounding(out, ref64, dtype):
    """Each entry within a unit of ``dtype`` at its size (float32's cos and sin are within
    one unit of float32, and then rounded to ``dtype``)."""
    eps = torch.finfo(dtype).eps
    return ((out.double() - ref64).abs() <= eps * ref64.abs().clamp(min=2**-8) + 2**-24).all()


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("batch", "seq", "head_dim"),
    [(1, 1, 64), (3, 1, 80), (2, 5, 96), (1, 3, 128), (2, 2, 2), (1, 4, 256)],
)
def test_matches_the_module(batch, seq, head_dim, dtype):
    """Planted: the second half left unwritten, and the position read from the first row of
    each batch (the row stride dropped): each failed."""
    module = _module(head_dim)
    gen = torch.Generator().manual_seed(batch * 100 + head_dim)
    positions = torch.randint(0, 40000, (batch, seq), generator=gen)
    x = torch.empty(batch, seq, 8, dtype=dtype)
    stock_cos, stock_sin = module(x, positions)
    cos, sin = rotary_cos_sin(positions, module.inv_freq, 1.0, dtype, backend="triton")
    assert cos.shape == sin.shape == (batch, seq, head_dim) and cos.dtype == sin.dtype == dtype
    assert cos.is_contiguous() and sin.is_contiguous()
    assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
    # numpy's float32 cos and sin here against torch's: the same to a unit of float32
    assert torch.allclose(cos.float(), stock_cos.float(), rtol=0, atol=torch.finfo(dtype).eps)
    assert torch.allclose(sin.float(), stock_sin.float(), rtol=0, atol=torch.finfo(dtype).eps)
    ref_cos, ref_sin = _float64(positions, module.inv_freq, 1.0)
    assert _within_one_rounding(cos, ref_cos, dtype)
    assert _within_one_rounding(sin, ref_sin, dtype)


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
def test_strided_int32_positions_scaling_and_16_bit_frequencies():
    """Positions as a transposed int32 view, a YaRN-like scaling of 1.25, and frequencies
    held in bfloat16 (a model cast with ``.to``), which the module reads as float32.
    Planted: the scaling dropped from cos: failed."""
    module = _module(64, theta=10000.0)
    gen = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 9000, (6, 3), generator=gen, dtype=torch.int32).t()
    inv_freq = module.inv_freq.to(torch.bfloat16)
    cos, sin = rotary_cos_sin(positions, inv_freq, 1.25, torch.float32, backend="triton")
    ref_cos, ref_sin = rotary_cos_sin_ref(positions, inv_freq, 1.25, torch.float32)
    assert torch.allclose(cos, ref_cos, rtol=0, atol=4e-7 * 1.25)
    assert torch.allclose(sin, ref_sin, rtol=0, atol=4e-7 * 1.25)
    assert (cos.abs().amax() - 1.25).abs() < 1e-3  # position 0 is unlikely; the bound is near


@needs_interpreter
def test_empty_batch():
    module = _module(64)
    positions = torch.empty(0, 1, dtype=torch.long)
    cos, sin = rotary_cos_sin(positions, module.inv_freq, 1.0, torch.float16, backend="triton")
    assert cos.shape == sin.shape == (0, 1, 64)


@pytest.mark.parametrize(
    ("positions", "inv_freq", "scaling", "dtype", "message"),
    [
        (torch.zeros(3, dtype=torch.long), torch.ones(4), 1.0, torch.float16, "positions:"),
        (torch.zeros(1, 2), torch.ones(4), 1.0, torch.float16, "positions: expected an integer"),
        (torch.zeros(1, 2, dtype=torch.long), torch.ones(2, 2), 1.0, torch.float16, "inv_freq:"),
        (
            torch.zeros(1, 2, dtype=torch.long),
            torch.ones(4, dtype=torch.long),
            1.0,
            torch.float16,
            "inv_freq:",
        ),  # fmt: skip
        (torch.zeros(1, 2, dtype=torch.long), torch.ones(4), True, torch.float16, "scaling:"),
        (torch.zeros(1, 2, dtype=torch.long), torch.ones(4), math.inf, torch.float16, "scaling:"),
        (torch.zeros(1, 2, dtype=torch.long), torch.ones(4), 10**400, torch.float16, "scaling:"),
        (torch.zeros(1, 2, dtype=torch.long), torch.ones(4), 1.0, torch.int8, "dtype:"),
    ],
)
def test_bad_input_names_the_argument(positions, inv_freq, scaling, dtype, message):
    with pytest.raises(ValueError, match=message):
        rotary_cos_sin(positions, inv_freq, scaling, dtype)
