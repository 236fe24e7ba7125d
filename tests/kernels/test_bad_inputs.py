"""The public ops (Triton path) reject bad input with a ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import needs_interpreter

from nanoserve.kernels import paged_decode_attention, paged_extend_attention, slot_scatter

pytestmark = needs_interpreter


def _attention_args():
    pool = torch.randn(4, 8, 2, 64)
    return dict(
        query=torch.randn(2, 4, 64),
        key_cache=pool,
        value_cache=pool.clone(),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([9, 16], dtype=torch.int32),
    )


ATTENTION_BAD = [
    ("query", torch.randn(2, 3, 64)),
    ("query", torch.randn(2, 4, 64).half()),
    ("key_cache", torch.randn(4, 8, 2, 128)[..., ::2]),  # not contiguous
    ("value_cache", torch.randn(4, 8, 2, 32)),
    ("block_tables", torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)),
    ("block_tables", torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)),
    ("seq_lens", torch.tensor([9, 17], dtype=torch.int32)),
    ("seq_lens", torch.tensor([0, 16], dtype=torch.int32)),
]


@pytest.mark.parametrize(("name", "bad"), ATTENTION_BAD)
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_attention_bad_input(op, name, bad):
    args = _attention_args()
    args[name] = bad
    with pytest.raises(ValueError, match=f"^{name}"):
        if op == "decode":
            paged_decode_attention(**args, backend="triton")
        else:
            cu = torch.tensor([0, 1, 2], dtype=torch.int32)
            paged_extend_attention(**args, cu_seqlens_q=cu, backend="triton")


@pytest.mark.parametrize(
    ("kwarg", "value"),
    [("sliding_window", 0), ("softcap", 0.0), ("scale", -1.0), ("backend", "cuda")],
)
def test_attention_bad_keyword(kwarg, value):
    with pytest.raises(ValueError, match=f"^{kwarg}"):
        paged_decode_attention(**{"backend": "triton", **_attention_args(), kwarg: value})


def test_extend_bad_cu_seqlens():
    args = _attention_args()
    with pytest.raises(ValueError, match="^cu_seqlens_q"):
        paged_extend_attention(
            **args, cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32), backend="triton"
        )


def test_triton_refuses_float64():
    args = {k: v.double() if v.is_floating_point() else v for k, v in _attention_args().items()}
    with pytest.raises(ValueError, match="^backend"):
        paged_decode_attention(**args, backend="triton")
    paged_decode_attention(**args, backend="auto")  # auto falls back to the reference


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("slot_mapping", torch.tensor([0, 64])),
        ("slot_mapping", torch.tensor([5, 5])),
        ("slot_mapping", torch.tensor([1, 2, 3])),
        ("key", torch.randn(2, 3, 64)),
        ("value", torch.randn(2, 2, 64).half()),
        ("backend", "gpu"),
    ],
)
def test_scatter_bad_input_writes_nothing(name, bad):
    pool = torch.randn(4, 16, 2, 64)
    args = dict(
        key=torch.randn(2, 2, 64),
        value=torch.randn(2, 2, 64),
        key_cache=pool,
        value_cache=pool.clone(),
        slot_mapping=torch.tensor([3, 7]),
        backend="triton",
    )
    args[name] = bad
    before = pool.clone()
    with pytest.raises(ValueError, match=f"^{name}"):
        slot_scatter(**args)
    assert torch.equal(pool, before)
