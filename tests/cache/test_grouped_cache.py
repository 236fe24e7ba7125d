"""A GroupedKVCache (global and sliding layer groups, each its own pools and tables) reads as
a cache that keeps every block, holds a bounded number of blocks in its sliding group, and
grows, reorders, crops and attaches prefixes in every group alike."""

from __future__ import annotations

import os

import pytest
import torch
from test_window_release import masks

from nanoserve import PagedKVCache
from nanoserve.cache import GroupedKVCache, OutOfBlocks, block_digests
from nanoserve.kernels import paged_decode_attention, paged_extend_attention

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4
NEEDS_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)
GROUPS = [([0, 2], None), ([1, 3], 5)]  # layers 0 and 2 global, 1 and 3 within 5 positions


def poison_free_blocks(store: PagedKVCache) -> None:
    """NaN into every block of ``store`` no sequence holds (a read of one shows)."""
    free = [b for b in range(store.allocator.num_blocks) if store.allocator.refcount(b) == 0]
    for pool in (*store.key_pools, *store.value_pools):
        if pool is not None:
            pool[free] = float("nan")


def attend(meta, pools, query, mask, window, backend):
    packed = query.flatten(0, 1)[meta.token_index]
    opts = dict(sliding_window=window, backend=backend)
    if mask.shape[1] == 1 and bool(mask.all()):
        return paged_decode_attention(packed, *pools, meta.block_tables, meta.seq_lens, **opts)
    return paged_extend_attention(
        packed, *pools, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, **opts
    )


@pytest.mark.parametrize(
    "chunk, backend",
    [(3, "torch"), (16, "torch"), pytest.param(3, "triton", marks=NEEDS_INTERPRETER)],
)
def test_grouped_cache_attends_as_a_full_cache(chunk, backend):
    """Prompts of 13, 3 and 9 tokens (in chunks), 30 decode steps with a beam-style reorder
    and a crop of 2 tokens half way: every layer's attention output equals a one-pool cache
    that keeps every block; free blocks of both groups hold NaN before each step. The
    sliding group holds at most ceil((window + slack) / block_size) + 1 blocks a row, the
    global group every block. Planted: the sliding layers reading the global group's
    tables (``for_layer`` returning group 0): failed; the sliding group releasing one
    block still inside the window: failed."""
    gen = torch.Generator().manual_seed(chunk)
    full = PagedKVCache(4, num_blocks=128, block_size=BLOCK)
    grouped = GroupedKVCache(GROUPS, num_blocks=[64, 24], block_size=BLOCK)
    global_group, sliding_group = grouped.groups
    slack = max(BLOCK, sliding_group.window_slack)
    bound = -(-(5 + slack) // BLOCK) + 1
    for step, mask in enumerate(masks([13, 3, 9], chunk, decode_steps=30)):
        if step == 12:
            for store in (full, grouped):
                store.reorder([2, 0, 0])
                store.drop_last(2)
        rows, q = mask.shape
        for store in (*grouped.groups, full):
            poison_free_blocks(store)
        full.begin_step(mask, "cpu")
        meta = grouped.begin_step(mask, "cpu")
        for layer in range(4):
            k, v = torch.randn(2, rows * q, KV_HEADS, DIM, generator=gen)
            query = torch.randn(rows, q, HEADS, DIM, generator=gen)
            window = 5 if layer % 2 else None
            expected = attend(full.step, full.write(layer, k, v), query, mask, window, backend)
            got = attend(
                meta.for_layer(layer), grouped.write(layer, k, v), query, mask, window, backend
            )
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"layer {layer}")
        assert grouped.seq_lens() == full.seq_lens()
        for table in sliding_group.tables:
            assert table.num_blocks - table.dropped <= bound
        assert [t.num_blocks - t.dropped for t in global_group.tables] == [
            -(-n // BLOCK) for n in grouped.seq_lens()
        ]
    assert sliding_group.blocks_dropped > 0 and global_group.blocks_dropped == 0
    stats = grouped.stats()
    assert (
        stats["blocks_used"] == global_group.allocator.num_used + sliding_group.allocator.num_used
    )
    assert stats["group1_window"] == 5 and stats["group0_window"] == 0
    assert stats["group1_blocks_used"] < stats["group0_blocks_used"]


def test_every_group_knows_whether_the_rows_are_of_one_length():
    """``equal_lengths`` (the decode launch follows it) is the same in the grouped step and
    in each group's own, before and after rows of different lengths catch up."""
    grouped = GroupedKVCache(GROUPS, num_blocks=[64, 24], block_size=BLOCK)
    answers = []
    for mask in ([[True] * 6, [False] * 3 + [True] * 3], [[True], [True]]):
        meta = grouped.begin_step(torch.tensor(mask), "cpu")
        assert {m.equal_lengths for m in meta.group_metas} == {meta.equal_lengths}
        answers.append(meta.equal_lengths)
    grouped.drop_last(1)
    grouped.reorder([0, 0])
    answers.append(grouped.begin_step(torch.ones(2, 1, dtype=torch.bool), "cpu").equal_lengths)
    assert answers == [False, False, True]


def test_a_step_grows_every_group_or_none():
    """The sliding group out of blocks: the global group's tables stay as they were."""
    grouped = GroupedKVCache(GROUPS, num_blocks=[16, 2], block_size=BLOCK)
    grouped.begin_step(torch.ones(1, 6, dtype=torch.bool), "cpu")  # 2 blocks in each group
    before = [t.block_ids for g in grouped.groups for t in g.tables]
    free = [g.allocator.num_free for g in grouped.groups]
    with pytest.raises(OutOfBlocks):
        grouped.begin_step(torch.ones(1, 4, dtype=torch.bool), "cpu")
    assert [t.block_ids for g in grouped.groups for t in g.tables] == before
    assert [g.allocator.num_free for g in grouped.groups] == free
    assert grouped.seq_lens() == [6]


def test_prefix_attaches_the_blocks_every_group_holds():
    """Published blocks found in both groups attach; a block one group evicted ends the
    prefix in every group, and the other group's extra references are returned."""
    grouped = GroupedKVCache(GROUPS, num_blocks=[16, 16], block_size=BLOCK)
    digests = block_digests(list(range(12)), BLOCK)
    grouped.begin_step(torch.ones(1, 12, dtype=torch.bool), "cpu")
    grouped.publish(0, digests)
    grouped.reset()
    sliding = grouped.groups[1].allocator
    second = sliding.lookup(digests[1])
    sliding.free([second])
    sliding.unpublish(second)  # evicted from the sliding group only
    grouped.add_sequences(1)
    assert grouped.attach_prefix(0, digests) == BLOCK
    assert [g.allocator.num_used for g in grouped.groups] == [1, 1]
    assert [g.tables[0].num_tokens for g in grouped.groups] == [BLOCK, BLOCK]


@pytest.mark.parametrize(
    "groups, message",
    [
        ([([0, 1], None), ([1, 2], 4)], "exactly one group"),
        ([([0, 2], None), ([3], 4)], "exactly one group"),
        ([([0], None), ([], 4)], "at least one layer"),
        ([([0], None), ([1], 0)], "window"),
        ([(0, None)], "layer_groups"),
    ],
)
def test_bad_layer_groups_are_refused(groups, message):
    with pytest.raises(ValueError, match="layer_groups") as error:
        GroupedKVCache(groups, num_blocks=[4] * len(groups))
    assert message in str(error.value)


def test_per_group_arguments_must_match_the_groups():
    with pytest.raises(ValueError, match="num_blocks"):
        GroupedKVCache(GROUPS, num_blocks=[4])
    grouped = GroupedKVCache(GROUPS, num_blocks=[4, 4])
    with pytest.raises(ValueError, match="layer_idx"):
        grouped.write(4, torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
    with pytest.raises(ValueError, match="indices"):
        grouped.reorder([0])  # no sequence yet
    assert grouped.num_seqs == 0


def _filled_cache() -> GroupedKVCache:
    """Two rows of 9 and 6 tokens, written into every layer (so the pools exist)."""
    grouped = GroupedKVCache(GROUPS, num_blocks=[16, 16], block_size=BLOCK)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    grouped.begin_step(mask, "cpu")
    for layer in range(4):
        k, v = torch.randn(2, 18, KV_HEADS, DIM)
        grouped.write(layer, k, v)
    return grouped


def _state(grouped: GroupedKVCache):
    return (
        grouped.seq_lens(),
        [[(t.block_ids, t.num_tokens) for t in g.tables] for g in grouped.groups],
        [g.allocator.num_free for g in grouped.groups],
        [g.allocator.num_blocks for g in grouped.groups],
        [tuple(p.shape) for p in grouped.key_pools],
        grouped.step,
    )


NO_SUCH_GPU = torch.cuda.device_count()  # (the first index this machine lacks)
MISUSE = {
    "add_sequences('2')": ("n", lambda c: c.add_sequences("2")),
    "add_sequences(-1)": ("n", lambda c: c.add_sequences(-1)),
    "reorder float": ("indices", lambda c: c.reorder([0, 1.5])),
    "reorder out of range": ("indices", lambda c: c.reorder([0, 5])),
    "reorder a string": ("indices", lambda c: c.reorder("01")),
    "truncate_rows short": ("lengths", lambda c: c.truncate_rows([3])),
    "truncate_rows past a row": ("lengths", lambda c: c.truncate_rows([3, 99])),
    "truncate_rows float": ("lengths", lambda c: c.truncate_rows([3, 2.0])),
    "attach_prefix seq": ("seq", lambda c: c.attach_prefix(5, [])),
    "publish digests": ("digests", lambda c: c.publish(0, "abc")),
    "publish seq": ("seq", lambda c: c.publish(-1, [])),
    "grow one negative": ("n", lambda c: c.grow([1, -1])),
    "grow a scalar": ("n", lambda c: c.grow(3)),
    "begin_step a list": ("new_token_mask", lambda c: c.begin_step([[True], [True]], "cpu")),
    "begin_step a float mask": (
        "new_token_mask",
        lambda c: c.begin_step(torch.full((2, 1), 0.5), "cpu"),
    ),
    "drop_last(True)": ("n", lambda c: c.drop_last(True)),
    "begin_step device": (
        "device",
        lambda c: c.begin_step(torch.ones(2, 1, dtype=torch.bool), "no-such-device"),
    ),
    "begin_step a GPU not there": (
        "device",
        lambda c: c.begin_step(torch.ones(2, 1, dtype=torch.bool), f"cuda:{NO_SUCH_GPU}"),
    ),
    "step a string": ("meta", lambda c: setattr(c, "step", "x")),
    "layer_window": ("layer_idx", lambda c: c.layer_window(7)),
    "scales": ("layer_idx", lambda c: c.scales(-1)),
    "scales_for": ("key_pool", lambda c: c.scales_for(None)),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_is_refused_before_any_group_changes(case):
    """Each public method given a wrong type or value raises ValueError naming the argument
    and leaves every group (tables, allocators, pools, step) as it was. Planted (found in
    review): without the up-front checks, truncate_rows and grow changed group 0 before
    failing on group 1, and most others raised TypeError / IndexError from inside."""
    name, misuse = MISUSE[case]
    grouped = _filled_cache()
    before = _state(grouped)
    with pytest.raises(ValueError, match=f"^{name}:"):
        misuse(grouped)
    assert _state(grouped) == before


def test_bad_per_group_argument_leaves_a_kept_allocator_as_it_was():
    """An allocator handed back for group 0 and a bad ``num_blocks`` for group 1: ValueError,
    and the allocator still holds its references (making group 0 would release them)."""
    grouped = _filled_cache()
    kept = grouped.groups[0].allocator
    used = kept.num_used
    assert used > 0
    with pytest.raises(ValueError, match="^num_blocks:"):
        GroupedKVCache(GROUPS, num_blocks=[16, 0], allocators=[kept, None], block_size=BLOCK)
    with pytest.raises(ValueError, match="^pools:"):
        GroupedKVCache(GROUPS, [16, 16], pools=[None, ([None], [None])], allocators=[kept, None])
    assert kept.num_used == used


def test_one_allocator_for_two_groups_is_refused():
    """Each group counts its own free blocks: one allocator handed to two groups let a step
    reserve the same blocks twice (a probe saw OutOfBlocks leave group 0 grown and group 1
    not). Refused, naming ``allocators``, with the allocator left as it was. Planted,
    reverted: the check removed: no error."""
    from nanoserve.cache import BlockAllocator

    shared = BlockAllocator(16)
    with pytest.raises(ValueError, match="^allocators: entry 1 is an earlier entry's"):
        GroupedKVCache(GROUPS, num_blocks=[16, 16], allocators=[shared, shared], block_size=BLOCK)
    assert shared.num_free == 16


def test_same_public_surface_as_one_pool_or_a_clear_error():
    """What a PagedKVCache has once: per layer (``key_scales``, ``scales``) or summed over
    the groups (``blocks_dropped``); what each group has its own of (``tables``,
    ``allocator``, ``pool_lists``) is an AttributeError naming ``groups[g]``."""
    grouped = _filled_cache()
    for layer in range(4):
        group, local = grouped._where[layer]
        assert grouped.key_pools[layer] is grouped.groups[group].key_pools[local]
        assert grouped.scales(layer) == (None, None) == grouped.groups[group].scales(local)
    assert grouped.key_scales == grouped.value_scales == [None] * 4
    assert grouped.kv_dtype is None and grouped.window_slack == BLOCK
    mask = torch.ones(2, 1, dtype=torch.bool)
    for _ in range(8):
        grouped.begin_step(mask, "cpu")
    assert grouped.blocks_dropped == sum(g.blocks_dropped for g in grouped.groups) > 0
    grouped.keep_past_window(3 * BLOCK)  # every group keeps it
    assert [g.window_slack for g in grouped.groups] == [3 * BLOCK] * len(grouped.groups)
    assert grouped.window_slack == 3 * BLOCK
    for name in ("tables", "allocator", "pool_lists"):
        with pytest.raises(AttributeError, match=rf"groups\[g\]\.{name}"):
            getattr(grouped, name)
