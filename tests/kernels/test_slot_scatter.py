"""Slot scatter: Triton (interpreter) writes exactly what the reference writes."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import needs_interpreter

from nanoserve.kernels import slot_scatter, slot_scatter_ref
from nanoserve.kernels.triton_scatter import slot_scatter_triton

pytestmark = needs_interpreter


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare bit patterns so NaN-poisoned untouched slots compare equal to themselves.
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim", "block_size", "dtype", "index_dtype"),
    [
        (1, 2, 64, 16, torch.float16, torch.int32),
        (7, 1, 80, 8, torch.float32, torch.int64),
        (100, 3, 96, 16, torch.float16, torch.int64),
        (33, 2, 128, 32, torch.float32, torch.int32),
    ],
)
def test_scatter_matches_reference(
    num_tokens, num_kv_heads, head_dim, block_size, dtype, index_dtype
):
    num_blocks = num_tokens // block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.rand(num_tokens) < 0.2] = -1
    slots = slots.to(index_dtype)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    slot_scatter_ref(key, value, ref_k, ref_v, slots)
    slot_scatter(key, value, key_cache, value_cache, slots, backend="triton")
    assert torch.equal(_bits(key_cache), _bits(ref_k))
    assert torch.equal(_bits(value_cache), _bits(ref_v))


def test_scatter_strided_key_and_all_padding():
    key_cache = torch.zeros(4, 8, 2, 64)
    value_cache = torch.zeros(4, 8, 2, 64)
    key = torch.randn(2, 5, 64).transpose(0, 1)  # [5, 2, 64] view, not contiguous
    value = torch.randn(5, 2, 64)
    slots = torch.tensor([3, -1, 31, 0, 17], dtype=torch.int32)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    slot_scatter_ref(key, value, ref_k, ref_v, slots)
    slot_scatter(key, value, key_cache, value_cache, slots, backend="triton")
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    before = key_cache.clone()
    slot_scatter(key, value, key_cache, value_cache, torch.full((5,), -1), backend="triton")
    assert torch.equal(key_cache, before)


@pytest.mark.parametrize("elements", [128, 256, 1024, 16384])
def test_scatter_tile_shapes(elements):
    """Head slices (fewer elements than a token), one token, many tokens with a ragged tail."""
    num_tokens, num_kv_heads, head_dim, block_size = 45, 3, 96, 8
    num_blocks = num_tokens // block_size + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=torch.float16)
    value_cache = torch.full(shape, float("nan"), dtype=torch.float16)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(torch.float16)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(torch.float16)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::5] = -1
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    slot_scatter_ref(key, value, ref_k, ref_v, slots)
    slot_scatter_triton(key, value, key_cache, value_cache, slots, config=(elements, 4))
    assert torch.equal(_bits(key_cache), _bits(ref_k))
    assert torch.equal(_bits(value_cache), _bits(ref_v))
