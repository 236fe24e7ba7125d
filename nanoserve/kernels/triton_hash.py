"""Triton kernel of the content hash (``content_hash.py`` defines it and holds the reference).

One launch per word width reads every tensor of that width once: each program takes one
work item (a run of at most ``CHUNK_WORDS`` words of one tensor, addressed as an offset
from the group's lowest-addressed tensor) and writes its two partial sums; torch adds them.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from nanoserve.kernels.content_hash import CHUNK_WORDS, LANES, chunk_table

BLOCK_WORDS = 2048
# device copies of recent work-item tables, keyed by what they are computed from
_TABLES: OrderedDict[tuple, tuple[int, torch.Tensor]] = OrderedDict()
_TABLES_KEPT = 8


@triton.jit
def _fmix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B).to(tl.uint32)  # (a no-op unless the constant widened the product)
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35).to(tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _hash_kernel(
    base, table, partials, num_items,
    INDEX_A: tl.constexpr, TENSOR_A: tl.constexpr, OFFSET_A: tl.constexpr,
    INDEX_B: tl.constexpr, TENSOR_B: tl.constexpr, OFFSET_B: tl.constexpr,
    WIDTH: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    item = tl.program_id(0)
    offset = tl.load(table + item)
    count = tl.load(table + num_items + item).to(tl.int32)
    start = tl.load(table + 2 * num_items + item)
    number = tl.load(table + 3 * num_items + item).to(tl.uint32)
    offset = tl.multiple_of(offset, ALIGN)
    key_a = _fmix32((number * TENSOR_A + OFFSET_A).to(tl.uint32))
    key_b = _fmix32((number * TENSOR_B + OFFSET_B).to(tl.uint32))
    acc_a = tl.zeros([BLOCK], dtype=tl.uint32)
    acc_b = tl.zeros([BLOCK], dtype=tl.uint32)
    lanes = tl.arange(0, BLOCK)
    for first in range(0, count, BLOCK):
        i = first + lanes
        inside = i < count
        word = tl.load(base + offset + i, mask=inside, other=0)
        if WIDTH == 4:
            word = word.to(tl.uint32, bitcast=True)
        elif WIDTH == 2:
            word = word.to(tl.uint16, bitcast=True).to(tl.uint32)
        else:  # uint8 words zero-extend
            word = word.to(tl.uint32)
        index = (start + i).to(tl.uint32)
        a = _fmix32(word ^ (index * INDEX_A).to(tl.uint32) ^ key_a)
        b = _fmix32(word ^ (index * INDEX_B).to(tl.uint32) ^ key_b)
        acc_a += tl.where(inside, a, 0)
        acc_b += tl.where(inside, b, 0)
    tl.store(partials + 2 * item, tl.sum(acc_a, axis=0).to(tl.int64) & 0xFFFFFFFF)
    tl.store(partials + 2 * item + 1, tl.sum(acc_b, axis=0).to(tl.int64) & 0xFFFFFFFF)


def group_sums_triton(
    items: list[tuple[int, torch.Tensor]], chunk_words: int = CHUNK_WORDS
) -> torch.Tensor:
    """int64 [2] on the words' device: the two sums over ``items`` (tensor number, words of
    one width), each partial reduced modulo 2**32 (the caller reduces the total)."""
    return prepare_group(items, chunk_words)()


def prepare_group(items: list[tuple[int, torch.Tensor]], chunk_words: int = CHUNK_WORDS):
    """``group_sums_triton(items, chunk_words)`` as a function of no arguments, laid out
    now and launched at each call: it reads the words' memory as it is then. It holds the
    lowest-addressed words tensor and the work-item table, not the others."""
    base, table = _device_table(items, chunk_words)
    width = base.element_size()
    # 16-byte aligned items let the loads be vectorized
    aligned = chunk_words * width % 16 == 0 and all(w.data_ptr() % 16 == 0 for _, w in items)
    return functools.partial(
        _launch,
        base,
        table,
        16 // width if aligned else 1,
        min(BLOCK_WORDS, triton.next_power_of_2(chunk_words)),
    )


def _launch(base: torch.Tensor, table: torch.Tensor, align: int, block: int) -> torch.Tensor:
    num_items = table.shape[1]
    partials = torch.empty(num_items, 2, dtype=torch.int64, device=base.device)
    (index_a, tensor_a, offset_a), (index_b, tensor_b, offset_b) = LANES
    _hash_kernel[(num_items,)](
        base, table, partials, num_items,
        INDEX_A=index_a, TENSOR_A=tensor_a, OFFSET_A=offset_a,
        INDEX_B=index_b, TENSOR_B=tensor_b, OFFSET_B=offset_b,
        WIDTH=base.element_size(), ALIGN=align, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return partials.sum(0)


def _device_table(items, chunk_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(base tensor, the work-item table on the device), the table built once per layout."""
    words = [w for _, w in items]
    key = (words[0].device, chunk_words, *((n, w.data_ptr(), w.numel()) for n, w in items))
    if key in _TABLES:
        _TABLES.move_to_end(key)
    else:
        base, table = chunk_table(items, chunk_words)
        _TABLES[key] = (base, table.to(words[0].device))
        while len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    base, table = _TABLES[key]
    return words[base], table
