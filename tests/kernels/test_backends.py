"""backend="torch" passed explicitly to each public op: the reference's result, and no
Triton kernel launched (every launcher raises here), for float32 and float16 on CPU."""

from __future__ import annotations

import os

import pytest
import torch
from fp8_inputs import make_fp8_paged_kv
from kernel_inputs import make_paged_kv, rel_err

from nanoserve.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_extend_attention,
    paged_extend_attention_ref,
    slot_scatter,
    slot_scatter_ref,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
OPTIONS = dict(sliding_window=6, softcap=20.0, scale=0.2)


@DTYPES
def test_decode_torch_backend(dtype, forbid_triton):
    key_cache, value_cache, tables, seq_lens = make_paged_kv([9, 20, 0], 2, 32, 8, dtype)
    args = (torch.randn(3, 4, 32).to(dtype), key_cache, value_cache, tables, seq_lens)
    out = paged_decode_attention(*args, **OPTIONS, backend="torch")
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.equal(out, paged_decode_attention_ref(*args, **OPTIONS))


@DTYPES
def test_extend_torch_backend(dtype, forbid_triton):
    key_cache, value_cache, tables, seq_lens = make_paged_kv([9, 20, 0], 2, 32, 8, dtype)
    cu = torch.tensor([0, 4, 11, 11], dtype=torch.int32)
    args = (torch.randn(11, 4, 32).to(dtype), key_cache, value_cache, tables, seq_lens, cu)
    out = paged_extend_attention(*args, **OPTIONS, backend="torch")
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.equal(out, paged_extend_attention_ref(*args, **OPTIONS))


@DTYPES
def test_scatter_torch_backend(dtype, forbid_triton):
    shape = (4, 8, 2, 32)
    key, value = torch.randn(5, 2, 32).to(dtype), torch.randn(5, 2, 32).to(dtype)
    slots = torch.tensor([3, -1, 31, 0, 17])
    ref_k, ref_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slot_scatter_ref(key, value, ref_k, ref_v, slots)
    key_cache, value_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    slot_scatter(key, value, key_cache, value_cache, slots, backend="torch")
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    assert torch.equal(key_cache.view(-1, 2, 32)[31], key[2])


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton's CPU interpreter only",
)
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_interpreted_bfloat16_attention_is_refused(op):
    """The interpreter's ``tl.dot`` on bfloat16 gives wrong sums (a probe measured the
    attention kernels off by ~1e9 from the reference): backend="triton" on bfloat16 CPU
    tensors raises naming ``backend`` instead of answering; "auto" runs the reference.
    Planted: without the refusal, the kernel returned an answer (the test saw no error)."""
    key_cache, value_cache, tables, seq_lens = make_paged_kv([9, 20], 2, 32, 8, torch.bfloat16)
    if op == "decode":
        args = (torch.randn(2, 4, 32).bfloat16(), key_cache, value_cache, tables, seq_lens)
        run, ref = paged_decode_attention, paged_decode_attention_ref
    else:
        cu = torch.tensor([0, 4, 7], dtype=torch.int32)
        query = torch.randn(7, 4, 32).bfloat16()
        args = (query, key_cache, value_cache, tables, seq_lens, cu)
        run, ref = paged_extend_attention, paged_extend_attention_ref
    with pytest.raises(ValueError, match="^backend: 'triton' under TRITON_INTERPRET=1"):
        run(*args, backend="triton")
    assert torch.equal(run(*args, backend="auto"), ref(*args))


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton's CPU interpreter only",
)
@pytest.mark.parametrize("gated", [False, True])
def test_interpreted_bfloat16_linear_is_refused(gated):
    """The small-batch linear kernel's products are ``tl.dot`` too: in the interpreter a
    bfloat16 x came back off by ~3e11 (a (3, 256) x (256, 64) product), silently. Refused
    naming ``backend``; "auto" runs the reference; float16 still runs the kernel. Planted:
    without the refusal, the kernel answered (no error)."""
    from nanoserve.kernels.small_batch_linear import small_batch_linear, small_batch_linear_ref

    x = torch.randn(3, 256).bfloat16()
    weights = [torch.randn(64, 256).bfloat16() / 16 for _ in range(2 if gated else 1)]
    with pytest.raises(ValueError, match="^backend: 'triton' under TRITON_INTERPRET=1"):
        small_batch_linear(x, weights, gated=gated, backend="triton")
    auto = small_batch_linear(x, weights, gated=gated, backend="auto")
    assert torch.equal(auto, small_batch_linear_ref(x, weights, gated=gated))
    half = [w.half() for w in weights]
    out = small_batch_linear(x.half(), half, gated=gated, backend="triton")
    ref = small_batch_linear_ref(x.half(), half, gated=gated)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton's CPU interpreter only",
)
def test_interpreted_fp8_extend_with_a_bfloat16_query_is_refused():
    """The extend kernel meets FP8 tiles in the query's dtype: with a bfloat16 query the
    interpreter's tl.dot ran in bfloat16 and answered off by ~1e8 (a probe found it); it is
    refused naming ``backend``. Decode meets FP8 tiles in float16 and still answers, within
    bfloat16's row tolerance of the dequantized reference. Planted, reverted: the query left
    out of the extend check: no error."""
    kc, vc, ks, vs, k64, v64, tables, seq_lens = make_fp8_paged_kv([9, 20], 2, 32, 8)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    query = torch.randn(7, 4, 32).bfloat16()
    scales = dict(k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="^backend: 'triton' under TRITON_INTERPRET=1"):
        paged_extend_attention(query, kc, vc, tables, seq_lens, cu, backend="triton", **scales)
    decode_query = torch.randn(2, 4, 32).bfloat16()
    out = paged_decode_attention(decode_query, kc, vc, tables, seq_lens, backend="triton", **scales)
    ref = paged_decode_attention_ref(decode_query.double(), k64, v64, tables, seq_lens)
    # bfloat16 rounding: the row tolerance of the GPU FP8 tests (an absolute bound flaked at
    # outputs near 3.6, where bfloat16's spacing is 0.016)
    assert rel_err(out, ref) < 2e-2
