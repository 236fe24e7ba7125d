"""Paged extend attention: Triton (interpreter) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import TOLERANCE, make_paged_kv, needs_interpreter, rel_err

from nanoserve.kernels import paged_extend_attention, paged_extend_attention_ref

pytestmark = needs_interpreter

# (num_kv_heads, group, head_dim, block_size, history_lens, new_lens, window, softcap)
CASES = {
    "prefill-edges": (2, 4, 64, 16, [0, 0, 0, 0], [1, 15, 16, 17], None, None),
    "gqa7-d80-window": (1, 7, 80, 8, [30, 0], [5, 40], 12, None),
    "mha-d96-softcap": (2, 1, 96, 16, [50, 0, 17], [3, 2, 8], None, 20.0),
    "gqa8-d128-prefix": (1, 8, 128, 32, [31], [33], None, None),
    "empty-seq-between": (1, 4, 64, 8, [9, 4, 0], [4, 0, 6], 7, 5.0),
    "speculative-verify": (2, 2, 64, 16, [17, 40, 63, 1], [2, 8, 4, 3], None, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_extend_matches_reference(case, dtype, poison_outputs):
    num_kv_heads, group, head_dim, block_size, history, new, window, softcap = CASES[case]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        lens, num_kv_heads, head_dim, block_size, dtype
    )
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim).to(dtype)
    ref = paged_extend_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens, cu,
        sliding_window=window, softcap=softcap,
    )  # fmt: skip
    out = paged_extend_attention(
        query, key_cache, value_cache, tables, seq_lens, cu,
        sliding_window=window, softcap=softcap, backend="triton",
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == query.shape
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_extend_one_token_each_equals_decode(poison_outputs):
    key_cache, value_cache, tables, seq_lens = make_paged_kv([3, 26], 2, 64, 8, torch.float32)
    query = torch.randn(2, 4, 64)
    cu = torch.arange(3, dtype=torch.int32)
    out = paged_extend_attention(
        query, key_cache, value_cache, tables, seq_lens, cu, backend="triton"
    )
    ref = paged_extend_attention_ref(query, key_cache, value_cache, tables, seq_lens, cu)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
