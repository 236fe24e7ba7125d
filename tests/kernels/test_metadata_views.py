"""Metadata passed as strided views (a step-sliced seq_lens, a table that is a column slice of
a wider one or a transpose, a strided slot_mapping) gives what contiguous metadata gives,
through every public op and through the Triton launchers called directly.

Before the launchers made such views dense, the kernels read them as if dense: these tests
failed (wrong attention, or the scatter writing other slots) on that code.
"""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import TOLERANCE, make_paged_kv, needs_interpreter, rel_err

from nanoserve.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_extend_attention,
    paged_extend_attention_ref,
    slot_scatter,
    slot_scatter_ref,
)
from nanoserve.kernels.triton_decode import paged_decode_attention_triton
from nanoserve.kernels.triton_extend import paged_extend_attention_triton
from nanoserve.kernels.triton_scatter import slot_scatter_triton

pytestmark = needs_interpreter

HKV, GROUP, DIM, BLOCK = 2, 2, 32, 8


def every_other(t: torch.Tensor, filler) -> torch.Tensor:
    """A view equal to ``t`` along its last dim, stride 2, with ``filler`` in between."""
    wide = torch.stack([t, torch.as_tensor(filler, dtype=t.dtype).expand_as(t)], dim=-1)
    return wide.flatten(-2)[..., ::2]


def table_views(tables: torch.Tensor, nan_block: int) -> dict[str, torch.Tensor]:
    """The same table as views a dense reading gets wrong (and one it gets right)."""
    width = tables.shape[1]
    offset = torch.full((tables.shape[0], width + 5), nan_block, dtype=tables.dtype)
    offset[:, 3 : 3 + width] = tables
    views = {
        "column-stride-2": every_other(tables, nan_block),
        "transposed": tables.t().contiguous().t(),
        "column-slice": offset[:, 3 : 3 + width],  # dense rows, wider row stride
    }
    for view in views.values():
        assert torch.equal(view, tables)
    return views


def _inputs(lens):
    key_cache, value_cache, tables, seq_lens = make_paged_kv(lens, HKV, DIM, BLOCK, torch.float32)
    nan_block = int(tables[0, -1])  # the extra column points at a NaN block
    return key_cache, value_cache, tables, seq_lens, nan_block


@pytest.mark.parametrize("table_view", ["column-stride-2", "transposed", "column-slice"])
def test_decode_metadata_views(table_view, poison_outputs):
    lens = [5, 40, 17]
    key_cache, value_cache, tables, seq_lens, nan_block = _inputs(lens)
    query = torch.randn(len(lens), HKV * GROUP, DIM)
    ref = paged_decode_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens
    )
    capacity = tables.shape[1] * BLOCK  # a dense read of the filler reaches NaN blocks
    lens_view = every_other(seq_lens, capacity)
    tables_view = table_views(tables, nan_block)[table_view]
    args = (query, key_cache, value_cache, tables_view, lens_view)
    outs = {
        "ref": paged_decode_attention_ref(*args),
        "torch": paged_decode_attention(*args, backend="torch"),
        "triton": paged_decode_attention(*args, backend="triton"),
        "triton-unchecked": paged_decode_attention(*args, backend="triton", check=False),
        "launcher-split": paged_decode_attention_triton(
            *args, scale=DIM**-0.5, sliding_window=None, softcap=None, num_splits=2
        ),
    }
    for name, out in outs.items():
        assert rel_err(out, ref) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize("table_view", ["column-stride-2", "transposed", "column-slice"])
def test_extend_metadata_views(table_view, poison_outputs):
    history, new = [3, 20, 0], [4, 9, 13]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens, nan_block = _inputs(lens)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), HKV * GROUP, DIM)
    ref = paged_extend_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens, cu,
        sliding_window=11,
    )  # fmt: skip
    capacity = tables.shape[1] * BLOCK
    lens_view = every_other(seq_lens, capacity)
    # cu as [c0, c0, c1, c1, ...][::2]: a dense read sees [c0, c0, c1, ...]
    cu_view = torch.stack([cu, cu], dim=-1).flatten()[::2]
    assert torch.equal(cu_view, cu) and cu_view.stride(0) == 2
    tables_view = table_views(tables, nan_block)[table_view]
    args = (query, key_cache, value_cache, tables_view, lens_view, cu_view)
    outs = {
        "ref": paged_extend_attention_ref(*args, sliding_window=11),
        "torch": paged_extend_attention(*args, sliding_window=11, backend="torch"),
        "triton": paged_extend_attention(*args, sliding_window=11, backend="triton"),
        "triton-unchecked": paged_extend_attention(
            *args, sliding_window=11, backend="triton", check=False
        ),
        "launcher": paged_extend_attention_triton(
            *args, scale=DIM**-0.5, sliding_window=11, softcap=None
        ),
    }
    for name, out in outs.items():
        assert rel_err(out, ref) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_scatter_strided_slot_mapping(index_dtype):
    num_tokens, num_blocks = 11, 4
    shape = (num_blocks, BLOCK, HKV, DIM)
    key = torch.randn(num_tokens, HKV, DIM)
    value = torch.randn(num_tokens, HKV, DIM)
    slots = torch.randperm(num_blocks * BLOCK)[:num_tokens].to(index_dtype)
    slots[3] = -1
    # between the real slots: other free slots a dense read would write to
    free = torch.tensor(
        [s for s in range(num_blocks * BLOCK) if s not in slots.tolist()][:num_tokens],
        dtype=index_dtype,
    )
    view = torch.stack([slots, free], dim=-1).flatten()[::2]
    assert torch.equal(view, slots) and view.stride(0) == 2
    ref_k, ref_v = torch.zeros(shape), torch.zeros(shape)
    slot_scatter_ref(key, value, ref_k, ref_v, slots)
    writers = {
        "ref": lambda k, v: slot_scatter_ref(key, value, k, v, view),
        "torch": lambda k, v: slot_scatter(key, value, k, v, view, backend="torch"),
        "triton": lambda k, v: slot_scatter(key, value, k, v, view, backend="triton"),
        "triton-unchecked": lambda k, v: slot_scatter(
            key, value, k, v, view, backend="triton", check=False
        ),
        "launcher": lambda k, v: slot_scatter_triton(key, value, k, v, view),
    }
    for name, write in writers.items():
        key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
        write(key_cache, value_cache)
        assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v), name


def test_dense_metadata_is_passed_through_uncopied():
    """Dense metadata (what the cache builds, and what a captured graph holds) is used as is:
    no copy, so in-place updates before a replay reach the kernels."""
    from nanoserve.kernels.dispatch import unit_stride

    table = torch.zeros(3, 4, dtype=torch.int32)
    lens = torch.ones(3, dtype=torch.int32)
    for dense in (table, table[:, 1:3], lens, lens[1:], lens[::2][:1], torch.zeros(0)):
        assert unit_stride(dense) is dense
    for strided in (table[:, ::2], table.t(), lens[::2]):
        copy = unit_stride(strided)
        assert copy.is_contiguous() and torch.equal(copy, strided)
