"""Soft-capped attention at large softcaps, float32: the capped logits are the raw ones to
within float32, so the kernels must be as exact there as without a cap. On the interpreter
and, under ``-m gpu``, on CUDA.

Planted: ``tanh`` as 1 - 2 / (e^2x + 1) alone (no polynomial near 0) gave relative errors of
2e-4 (softcap 1e4) and 2e-2 (1e6) here."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_inputs import TOLERANCE, make_paged_kv, rel_err

from nanoserve.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_extend_attention,
    paged_extend_attention_ref,
)

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1"
        ),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [1e4, 1e6])
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_large_softcap_is_exact(op, softcap, device, poison_outputs):
    lens = [1, 15, 16, 17, 70]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        lens, 2, 64, 16, torch.float32, device=device
    )
    if op == "decode":
        query = torch.randn(len(lens), 8, 64, device=device)
        args = (query, key_cache, value_cache, tables, seq_lens)
        run, ref = paged_decode_attention, paged_decode_attention_ref
    else:
        new = torch.tensor([1, 3, 16, 1, 9])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), new.cumsum(0)]).to(device, torch.int32)
        query = torch.randn(int(new.sum()), 8, 64, device=device)
        args = (query, key_cache, value_cache, tables, seq_lens, cu)
        run, ref = paged_extend_attention, paged_extend_attention_ref
    doubled = [a.double() if a.is_floating_point() else a for a in args]
    expected = ref(*doubled, softcap=softcap)
    out = run(*args, softcap=softcap, backend="triton")
    assert out.shape == query.shape
    err = rel_err(out, expected)
    assert err < TOLERANCE[torch.float32], err
