import numpy as np
import pytest

from nanoserve import BlockAllocator, BlockTable, OutOfBlocks


def test_allocate_free_and_lifo_reuse():
    alloc = BlockAllocator(4)
    first = alloc.allocate(3)
    assert sorted(first) == [0, 1, 2] and alloc.num_free == 1
    alloc.free([first[1]])
    assert alloc.refcount(first[1]) == 0
    assert alloc.allocate(1) == [first[1]]  # the most recently freed block comes back first


def test_out_of_blocks_names_figures_and_allocates_nothing():
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocks) as info:
        alloc.allocate(2)
    message = str(info.value)
    assert "needed 2" in message and "1 free of 4" in message and "num_blocks" in message
    assert alloc.num_free == 1


def test_double_free_and_unknown_ids_raise():
    alloc = BlockAllocator(2)
    (block,) = alloc.allocate(1)
    alloc.free([block])
    with pytest.raises(ValueError, match="block_ids"):
        alloc.free([block])
    with pytest.raises(ValueError, match="block_ids"):
        alloc.free([7])
    with pytest.raises(ValueError, match="block_ids"):
        alloc.incref([block])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


def test_free_more_often_than_referenced_changes_nothing():
    alloc = BlockAllocator(2)
    (block,) = alloc.allocate(1)
    with pytest.raises(ValueError, match="block_ids"):
        alloc.free([block, block])
    assert alloc.refcount(block) == 1


def test_block_table_slots_follow_the_blocks():
    alloc = BlockAllocator(8)
    alloc.allocate(1)  # so the table's blocks do not start at 0
    table = BlockTable(alloc, block_size=4)
    slots = table.append(6)
    ids = table.block_ids
    assert len(ids) == 2
    assert slots == [ids[p // 4] * 4 + p % 4 for p in range(6)]
    assert [table.slot(p) for p in range(6)] == slots
    with pytest.raises(ValueError, match="pos"):
        table.slot(6)


def test_block_table_append_is_all_or_nothing():
    alloc = BlockAllocator(2)
    table = BlockTable(alloc, block_size=4)
    table.append(5)
    with pytest.raises(OutOfBlocks):
        table.append(4)  # needs a third block
    assert table.num_tokens == 5 and alloc.num_free == 0
    assert table.append(3) == [table.slot(p) for p in range(5, 8)]


def test_fork_shares_and_copies_on_write():
    alloc = BlockAllocator(8)
    parent = BlockTable(alloc, block_size=4)
    parent.append(6)
    child = parent.fork()
    assert all(alloc.refcount(b) == 2 for b in parent.block_ids)
    child.append(1)  # writes into the shared, partly filled second block
    assert child.block_ids[0] == parent.block_ids[0]
    assert child.block_ids[1] != parent.block_ids[1]
    assert child.pending_copies == [(parent.block_ids[1], child.block_ids[1])]
    assert alloc.refcount(parent.block_ids[1]) == 1
    child.free()
    parent.free()
    assert alloc.num_free == 8


def test_truncate_releases_trailing_blocks():
    alloc = BlockAllocator(8)
    table = BlockTable(alloc, block_size=4)
    table.append(9)
    table.truncate(4)
    assert table.num_tokens == 4 and len(table.block_ids) == 1 and alloc.num_free == 7
    with pytest.raises(ValueError, match="num_tokens"):
        table.truncate(5)


def test_bools_are_not_counts_or_block_ids():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(True)
    alloc = BlockAllocator(4)
    with pytest.raises(ValueError, match="^n"):
        alloc.allocate(True)
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(alloc, block_size=True)
    (block,) = alloc.allocate(1)
    assert block == 0
    with pytest.raises(ValueError, match="block_id"):
        alloc.refcount(False)  # not block 0
    with pytest.raises(ValueError, match="block_ids"):
        alloc.free([False])
    with pytest.raises(ValueError, match="block_ids"):
        alloc.incref([False])
    assert alloc.refcount(0) == 1
    table = BlockTable(alloc, block_size=4)
    with pytest.raises(ValueError, match="^n"):
        table.append(True)
    table.append(2)
    with pytest.raises(ValueError, match="num_tokens"):
        table.truncate(True)
    assert table.num_tokens == 2


def test_numpy_ints_are_block_ids_and_counts():
    alloc = BlockAllocator(np.int64(4))
    assert alloc.num_blocks == 4 and type(alloc.num_blocks) is int
    blocks = alloc.allocate(np.int64(2))
    assert blocks == [0, 1]
    alloc.incref([np.int64(1)])
    assert alloc.refcount(np.int32(1)) == 2
    alloc.free([np.int64(1), np.int64(1)])
    assert alloc.refcount(np.int64(1)) == 0
    # the freed id went back as a plain int
    assert [type(b) for b in alloc.allocate(1)] == [int]
    table = BlockTable(alloc, block_size=np.int64(4))
    assert type(table.block_size) is int
    assert table.append(5) == [table.slot(p) for p in range(5)]
    with pytest.raises(ValueError, match="block_ids"):
        alloc.free([np.float64(0)])


def test_failed_append_leaves_the_version():
    alloc = BlockAllocator(2)
    table = BlockTable(alloc, block_size=4)
    table.append(5)
    version = table.version
    with pytest.raises(OutOfBlocks):
        table.append(4)
    assert table.version == version
    table.append(3)  # fills the last block: no new block, same ids
    assert table.version == version
    table.truncate(4)
    assert table.version == version + 1


def test_grow_appends_free_blocks_after_the_free_ones():
    alloc = BlockAllocator(2)
    first = alloc.allocate(1)
    alloc.grow(3)
    assert alloc.num_blocks == 5 and alloc.num_free == 4 and alloc.num_used == 1
    assert alloc.allocate(1) != first and alloc.allocate(3) == [2, 3, 4]
    with pytest.raises(ValueError, match="^n"):
        alloc.grow(True)
