"""RMSNorm: Triton (interpreter) against the reference and against transformers'
LlamaRMSNorm, odd widths, strided rows, bad input; the residual add and the norm in one
launch (``add_rms_norm``)."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import needs_interpreter, ulps
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from nanoserve.kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("shape", "width"),
    [((1,), 64), ((3,), 80), ((2, 5), 96), ((33,), 128), ((4,), 576), ((2,), 7), ((1,), 1)],
)
def test_matches_llama_rms_norm(shape, width, dtype):
    """Planted: the mean over the padded block (BLOCK) instead of D, and the product with
    the weight taken before rounding the normed row: each failed."""
    gen = torch.Generator().manual_seed(width)
    x = (3 * torch.randn(*shape, width, generator=gen)).to(dtype)
    module = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(width, generator=gen))
        stock = module(x)
    out = rms_norm(x, module.weight.detach(), 1e-5, backend="triton")
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(rms_norm_ref(x, module.weight.detach(), 1e-5), stock)
    # another summation order (and rsqrt's last bits): in float32 every element of a row
    # may move by a few units in the last place; in float16 the rounding of the normed row
    # hides it, so most outputs are bit-equal and the rest one or two units apart
    if dtype == torch.float32:
        assert ulps(out, stock).max() <= 8
    else:
        assert ulps(out, stock).max() <= 2.01
        assert (out == stock).float().mean() >= 0.9


@needs_interpreter
def test_strided_rows_and_copied_layouts():
    """q of a fused q/k/v output: rows [B, S, H, D] whose heads sit inside wider rows."""
    fused = torch.randn(2, 1, 3 * 64).to(torch.float16)
    q = fused[..., :128].view(2, 1, 2, 64)
    weight = torch.randn(64).to(torch.float16)
    expected = rms_norm_ref(q, weight, 1e-6)
    assert ulps(rms_norm(q, weight, 1e-6, backend="triton"), expected).max() <= 2.01
    t = torch.randn(64, 6).to(torch.float16).T  # D not the unit-stride dimension: copied
    out = rms_norm(t, weight, 1e-6, backend="triton")
    assert ulps(out, rms_norm_ref(t, weight, 1e-6)).max() <= 2.01
    empty = torch.empty(0, 64, dtype=torch.float16)
    assert rms_norm(empty, weight, 1e-6, backend="triton").shape == (0, 64)


@pytest.mark.parametrize(
    ("x", "weight", "eps", "message"),
    [
        (torch.zeros(()), torch.zeros(1), 1e-6, "x: expected"),
        (torch.zeros(2, 0), torch.zeros(0), 1e-6, "x: expected"),
        (torch.zeros(2, 8), torch.zeros(7), 1e-6, "weight: expected"),
        (torch.zeros(2, 8), torch.zeros(8, dtype=torch.float16), 1e-6, "weight: expected"),
        (torch.zeros(2, 8), torch.zeros(8), -1.0, "eps"),
        (torch.zeros(2, 8), torch.zeros(8), None, "eps"),
        (torch.ones(2, 8, dtype=torch.int32), torch.ones(8, dtype=torch.int32), 1e-6, "x: exp"),
        (torch.ones(2, 8).to(torch.float8_e4m3fn), torch.ones(8), 1e-6, "x: expected float16"),
    ],
)
def test_bad_input_names_the_argument(x, weight, eps, message):
    with pytest.raises(ValueError, match=message):
        rms_norm(x, weight, eps)


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "width"), [(1, 64), (3, 80), (5, 96), (33, 128), (2, 7)])
def test_add_rms_norm_is_the_add_then_the_norm(rows, width, dtype):
    """The sum bit-equal to PyTorch's add (rounded once, in x's dtype) and the norm bit-equal
    to ``rms_norm`` of that sum (one kernel, the same roundings); both near LlamaRMSNorm's.
    Planted: the sum left in float32 for the norm (not rounded first), and the residual read
    with x's row stride: each failed."""
    gen = torch.Generator().manual_seed(rows * width)
    x = (3 * torch.randn(rows, width, generator=gen)).to(dtype)
    wide = (3 * torch.randn(rows, 2 * width, generator=gen)).to(dtype)
    residual = wide[:, ::2] if width > 64 else wide[:, :width]  # strided rows or copied
    weight = torch.randn(width, generator=gen).to(dtype)
    total, normed = add_rms_norm(x, residual, weight, 1e-5, backend="triton")
    assert total.shape == normed.shape == x.shape and total.is_contiguous()
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, rms_norm(total, weight, 1e-5, backend="triton"))
    ref_total, ref_normed = add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(ref_total, total)
    module = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        assert torch.equal(ref_normed, module(total))
    assert ulps(normed, ref_normed).max() <= (8 if dtype == torch.float32 else 2.01)


@pytest.mark.parametrize(
    ("residual", "message"),
    [
        (None, "residual: expected a tensor"),
        (torch.zeros(2, 7), "residual: expected x's shape"),
        (torch.zeros(2, 8, dtype=torch.float16), "residual: expected x's shape"),
        (torch.zeros(1, 8), "residual: expected x's shape"),  # no broadcasting
    ],
)
def test_add_rms_norm_bad_residual_names_it(residual, message):
    with pytest.raises(ValueError, match=message):
        add_rms_norm(torch.zeros(2, 8), residual, torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="weight: expected"):
        add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(7), 1e-6)
