"""Cached prefix blocks: chained digests, publish / lookup / evict in the allocator, and a
table that is cut back into a published block."""

from __future__ import annotations

import numpy as np
import pytest

from nanoserve import BlockAllocator, BlockTable, OutOfBlocks
from nanoserve.cache import block_digests


def test_digests_chain_over_everything_before():
    a = block_digests([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the partly filled third block has none
    assert block_digests([1, 2, 3, 4], 4) == a[:1]
    assert block_digests([9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # same tokens, other prefix
    assert block_digests([1, 2, 3, 4], 4, salt=b"tenant") != a[:1]
    assert len(a[0]) == 16 and len(set(a)) == 2


@pytest.mark.parametrize("same_blocks", [0, 1, 2, 3])
def test_digests_resumed_from_known_ones_equal_the_whole_chain(same_blocks):
    """A row that shares leading blocks with another resumes after that row's digests and
    gets exactly the digests it would compute alone (planted to resume one block early, the
    later digests differed)."""
    gen = np.random.default_rng(same_blocks)
    other = gen.integers(0, 1000, 17)
    tokens = np.concatenate([other[: 4 * same_blocks], gen.integers(1000, 2000, 14)])
    known = block_digests(other, 4, salt=b"s")[:same_blocks]
    assert block_digests(tokens, 4, salt=b"s", known=known) == block_digests(tokens, 4, salt=b"s")
    assert block_digests(tokens[:3], 4, known=known) == []  # no full block: none of them


def test_publish_lookup_and_evict_oldest_first():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(4)
    assert alloc.publish(blocks[0], b"a") and alloc.publish(blocks[1], b"b")
    assert not alloc.publish(blocks[2], b"a")  # the digest is taken
    assert not alloc.publish(blocks[0], b"c")  # the block is published already
    alloc.free([blocks[1]])
    alloc.free([blocks[0]])  # now b is the oldest evictable
    alloc.free(blocks[2:])
    assert (alloc.num_free, alloc.num_evictable, alloc.num_cached) == (4, 2, 2)
    assert alloc.lookup(b"a") == blocks[0] and alloc.refcount(blocks[0]) == 1
    assert alloc.lookup(b"a") == blocks[0] and alloc.refcount(blocks[0]) == 2
    assert alloc.lookup(b"nothing") is None
    taken = alloc.allocate(3)  # 2 free, then the oldest evictable: b
    assert blocks[1] in taken and alloc.lookup(b"b") is None and alloc.num_cached == 1
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)
    alloc.free(taken + [blocks[0], blocks[0]])
    alloc.clear_prefixes()
    assert alloc.num_cached == alloc.num_evictable == 0 and alloc.num_free == 4


def test_release_all_keeps_the_published_blocks_findable():
    alloc = BlockAllocator(3)
    blocks = alloc.allocate(3)
    alloc.publish(blocks[2], b"x")
    alloc.incref([blocks[2]])
    alloc.release_all()  # their owners are gone
    assert alloc.num_free == 3 and alloc.num_evictable == 1
    assert alloc.lookup(b"x") == blocks[2] and alloc.refcount(blocks[2]) == 1


def test_release_all_keeps_the_least_recently_used_first():
    """Blocks the owners held until the release were used last: evicted after the blocks
    already evictable, which keep their order (a block published first but used since is
    not the oldest). With release_all planted to order the evictable blocks by publication,
    b stayed and a was evicted."""
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    alloc.publish(a, b"a")
    alloc.publish(b, b"b")
    alloc.free([a, b])  # evictable, oldest first: a, b
    assert alloc.lookup(b"a") == a  # a is used again, by an owner the release drops
    alloc.release_all()
    assert alloc.num_free == 4 and alloc.num_evictable == 2
    alloc.allocate(3)  # the 2 free blocks, then the least recently used: b
    assert alloc.lookup(b"b") is None and alloc.lookup(b"a") == a


def test_a_released_prompt_is_evicted_tail_first():
    """A later prompt reaches a cached prefix from its first block on, so a released prompt
    gives up its last blocks first, both when its table is freed and when its owners are
    dropped at once (``release_all``, by the order the blocks were published). Planted: the
    table's blocks freed head first, or release_all by block id: the head went first."""
    for release in ("free", "release_all"):
        alloc = BlockAllocator(3)
        table = BlockTable(alloc, 2)
        table.append(6)
        digests = block_digests(list(range(6)), 2)
        for block, digest in zip(table.block_ids, digests, strict=True):
            alloc.publish(block, digest)
        if release == "free":
            table.free()
        else:
            alloc.release_all()
        assert alloc.num_evictable == 3
        alloc.allocate(2)  # the two tail blocks
        assert alloc.lookup(digests[0]) is not None, release
        assert alloc.lookup(digests[1]) is None and alloc.lookup(digests[2]) is None


def test_a_table_cut_back_into_a_published_block_unpublishes_it():
    """Its tail will be written over, so it must no longer be found by the tokens it held."""
    alloc = BlockAllocator(4)
    table = BlockTable(alloc, 4)
    table.append(8)
    for block, digest in zip(table.block_ids, block_digests(range(8), 4), strict=True):
        alloc.publish(block, digest)
    table.truncate(6)
    assert alloc.is_published(table.block_ids[0]) and not alloc.is_published(table.block_ids[1])
    assert alloc.lookup(block_digests(range(8), 4)[1]) is None
    table.truncate(4)  # a whole block: nothing in it changes
    assert alloc.is_published(table.block_ids[0])


def test_an_evicted_block_is_never_found_again():
    alloc = BlockAllocator(2)
    first = BlockTable(alloc, 2)
    first.append(4)
    digests = block_digests([7, 7, 7, 7], 2)
    for block, digest in zip(first.block_ids, digests, strict=True):
        alloc.publish(block, digest)
    first.free()
    second = BlockTable(alloc, 2)
    second.append(4)  # evicts both cached blocks
    assert alloc.lookup(digests[0]) is None and alloc.lookup(digests[1]) is None
    attached = BlockTable(alloc, 2)
    attached.adopt([])
    assert attached.num_tokens == 0
    with pytest.raises(ValueError, match="^block_ids"):
        second.adopt([0])


def test_a_later_cache_over_the_same_pools_finds_the_published_prefix():
    import torch
    from test_paged_cache import read_back, step

    from nanoserve import PagedKVCache

    first = PagedKVCache(2, num_blocks=8, block_size=4)
    (k0, v0), _ = step(first, torch.ones(1, 10, dtype=torch.bool), 2)
    tokens = list(range(100, 110))
    first.publish(0, block_digests(tokens, 4))
    assert first.allocator.num_cached == 2  # two full blocks; the third holds 2 tokens
    pools, allocator = (first.key_pools, first.value_pools), first.allocator
    del first  # the store is gone; its pools and allocator serve the next one
    later = PagedKVCache(2, num_blocks=8, block_size=4, pools=pools, allocator=allocator)
    later.add_sequences(2)
    assert later.attach_prefix(0, block_digests(tokens[:9], 4)) == 8
    assert later.attach_prefix(1, block_digests([5] + tokens[1:9], 4)) == 0  # other prefix
    k, v = read_back(later, 0, 0)
    assert torch.equal(k, k0[0, :8]) and torch.equal(v, v0[0, :8])
    later.begin_step(torch.tensor([[True] * 2, [True] * 2]), "cpu")
    assert later.seq_lens() == [10, 2]
    with pytest.raises(ValueError, match="^allocator"):
        PagedKVCache(2, num_blocks=4, block_size=4, allocator=allocator)


def test_publish_from_a_first_block_leaves_the_earlier_ones_as_they_were():
    """``publish(seq, digests, first)``: the attached blocks before ``first`` are published
    already and are not looked at again; the blocks from ``first`` on become findable."""
    import torch
    from test_paged_cache import step

    from nanoserve import PagedKVCache

    cache = PagedKVCache(2, num_blocks=8, block_size=4)
    step(cache, torch.ones(1, 12, dtype=torch.bool), 2)
    digests = block_digests(list(range(12)), 4)
    cache.publish(0, digests, first=1)
    allocator, blocks = cache.allocator, cache.tables[0].block_ids
    assert [allocator.is_published(b) for b in blocks] == [False, True, True]
    assert allocator.lookup(digests[0]) is None and allocator.lookup(digests[2]) == blocks[2]
