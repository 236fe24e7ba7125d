import functools
import os
import random

import numpy as np
import pytest
import torch

from nanoserve import BlockAllocator, BlockTable, OutOfBlocks, PagedKVCache
from nanoserve.cache import block_digests
from nanoserve.cache.block_table import DROPPED
from nanoserve.cache.paged_cache import filled_slots
from nanoserve.kernels import paged_decode_attention_ref, slot_scatter_ref
from nanoserve.kernels.reference import attend_sequence, gather_history

HEADS, DIM = 2, 8


def scatter_blocks(cache: PagedKVCache, n: int) -> None:
    """Take and release blocks in a shuffled order so later tables get out-of-order ids."""
    taken = cache.allocator.allocate(n)
    random.Random(0).shuffle(taken)
    cache.allocator.free(taken)


def read_back(cache: PagedKVCache, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain read path: sequence ``seq``'s K, V [seq_len, Hkv, D] in ``layer``, oldest
    first, gathered through its block table."""
    table = cache.tables[seq]
    key_pool, value_pool = cache.key_pools[layer], cache.value_pools[layer]
    ids = torch.tensor(table.block_ids, dtype=torch.int64, device=key_pool.device)
    return (
        gather_history(key_pool, ids, table.num_tokens),
        gather_history(value_pool, ids, table.num_tokens),
    )


def step(cache: PagedKVCache, mask: torch.Tensor, layers: int, dtype=torch.float32):
    """Run one model step: new K/V per layer in the padded layout; returns them [S, q, H, D]."""
    cache.begin_step(mask, "cpu")
    written = []
    for layer in range(layers):
        k = torch.randn(*mask.shape, HEADS, DIM, dtype=dtype)
        v = torch.randn(*mask.shape, HEADS, DIM, dtype=dtype)
        cache.write(layer, k.flatten(0, 1), v.flatten(0, 1))
        written.append((k, v))
    return written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_a_contiguous_cache_byte_for_byte(dtype):
    layers, block_size = 3, 4
    cache = PagedKVCache(layers, num_blocks=32, block_size=block_size)
    scatter_blocks(cache, 32)
    # a left-padded prefill of 3 rows, then decode steps
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    contiguous = [[([], []) for _ in range(3)] for _ in range(layers)]
    for step_mask in [mask] + [torch.ones(3, 1, dtype=torch.bool)] * 6:
        for layer, (k, v) in enumerate(step(cache, step_mask, layers, dtype)):
            for row in range(3):
                contiguous[layer][row][0].append(k[row][step_mask[row]])
                contiguous[layer][row][1].append(v[row][step_mask[row]])
    assert cache.tables[0].block_ids != sorted(cache.tables[0].block_ids) or any(
        t.block_ids != list(range(t.block_ids[0], t.block_ids[0] + len(t.block_ids)))
        for t in cache.tables
    ), "blocks should be scattered"
    for layer in range(layers):
        for row in range(3):
            k, v = read_back(cache, layer, row)
            assert torch.equal(k, torch.cat(contiguous[layer][row][0]))
            assert torch.equal(v, torch.cat(contiguous[layer][row][1]))
    assert cache.seq_lens() == [3 + 6, 5 + 6, 1 + 6]
    assert cache.key_pools[0].dtype == dtype


def test_pads_are_never_stored():
    cache = PagedKVCache(1, num_blocks=8, block_size=4)
    mask = torch.tensor([[0, 0, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    meta = cache.begin_step(mask, "cpu")
    assert meta.slot_mapping.tolist()[:3] == [-1, -1, -1]
    assert meta.token_index.tolist() == [3, 4, 5, 6, 7]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 5] and meta.seq_lens.tolist() == [1, 4]
    stats = cache.stats()
    assert stats["tokens"] == 5 and stats["blocks_used"] == 2


def test_out_of_blocks_loses_nothing():
    cache = PagedKVCache(2, num_blocks=3, block_size=4)
    written = step(cache, torch.ones(2, 4, dtype=torch.bool), 2)
    before = [t.block_ids for t in cache.tables]
    free = cache.allocator.num_free
    with pytest.raises(OutOfBlocks, match="num_blocks"):
        cache.begin_step(torch.ones(2, 1, dtype=torch.bool), "cpu")  # needs 2 blocks, 1 free
    assert [t.block_ids for t in cache.tables] == before and cache.allocator.num_free == free
    assert cache.seq_lens() == [4, 4]
    for layer, (k, _) in enumerate(written):
        for row in range(2):
            assert torch.equal(read_back(cache, layer, row)[0], k[row])


@pytest.mark.parametrize("change", ["failed begin_step", "reorder", "drop_last", "truncate_rows"])
def test_no_write_lands_through_a_step_that_no_longer_holds(change):
    """After a begin_step that ran out of blocks (the last step stays: nothing changed) a
    second write of a layer into that step is refused; after a beam reorder, a drop_last or
    a truncate_rows (the step's slots were the old rows') any write without a new
    begin_step is. Every cached token stays. Found by a probe: the write was accepted and
    overwrote cached K/V (after a reorder, in a block two rows share). Planted: no check of
    a layer written twice: the first case overwrote; the step kept after the changes: the
    others did."""
    blocks = 3 if change == "failed begin_step" else 8
    cache = PagedKVCache(1, num_blocks=blocks, block_size=4)
    written = step(cache, torch.ones(2, 4, dtype=torch.bool), 1)
    if change == "failed begin_step":
        with pytest.raises(OutOfBlocks):
            cache.begin_step(torch.ones(2, 1, dtype=torch.bool), "cpu")
        rows = 2 * 4  # the last step's
    else:  # a step begun, not yet written, then the rows change under it
        cache.begin_step(torch.ones(2, 1, dtype=torch.bool), "cpu")
        rows = 2
        if change == "reorder":
            cache.reorder([0, 0])
        elif change == "drop_last":
            cache.drop_last(1)
        else:
            cache.truncate_rows([4, 4])
    with pytest.raises(RuntimeError, match="begin_step"):
        cache.write(0, torch.full((rows, HEADS, DIM), 9.0), torch.full((rows, HEADS, DIM), 9.0))
    sources = [0, 0] if change == "reorder" else [0, 1]
    for seq, row in enumerate(sources):
        assert torch.equal(read_back(cache, 0, seq)[0][:4], written[0][0][row])


def test_rows_no_pool_can_take_change_no_pool():
    """A write of integer rows, or of rows with no heads, into a cache given another cache's
    pools: refused before the layer's pool is replaced and the pools' cached prefixes
    dropped. Found by a probe: the given pool was replaced by an int32 one and the prefix
    blocks cleared before slot_scatter refused. Planted: the rows' checks after the pools:
    the pool was replaced."""
    first = PagedKVCache(1, num_blocks=4, block_size=2, backend="torch")
    step(first, torch.ones(1, 4, dtype=torch.bool), 1)
    first.publish(0, block_digests([1, 2, 3, 4], 2))
    first.reset()
    pools, allocator = first.pool_lists, first.allocator
    pool = pools[0][0]
    cache = PagedKVCache(1, num_blocks=4, block_size=2, pools=pools, allocator=allocator)
    cache.begin_step(torch.ones(1, 1, dtype=torch.bool), "cpu")
    for rows in (torch.ones(1, HEADS, DIM, dtype=torch.int32), torch.ones(1, 0, DIM)):
        with pytest.raises(ValueError, match="^key: "):
            cache.write(0, rows, rows.clone())
        assert pools[0][0] is pool and allocator.num_cached == 2


def test_reorder_shares_blocks_and_copies_on_write():
    cache = PagedKVCache(1, num_blocks=16, block_size=4)
    ((k0, _),) = step(cache, torch.ones(2, 6, dtype=torch.bool), 1)
    cache.reorder([1, 1])  # both beams continue from old row 1
    assert cache.tables[0].block_ids == cache.tables[1].block_ids
    ((k1, _),) = step(cache, torch.ones(2, 1, dtype=torch.bool), 1)
    for row in range(2):
        expected = torch.cat([k0[1], k1[row]])
        assert torch.equal(read_back(cache, 0, row)[0], expected)
    first = cache.tables[0].block_ids
    assert first[0] == cache.tables[1].block_ids[0]  # the full block is still shared
    assert cache.allocator.refcount(first[0]) == 2
    with pytest.raises(ValueError, match="indices"):
        cache.reorder([5])


def test_bad_reorder_and_truncate_change_nothing():
    """reorder with an index that is not an int, and truncate_rows with a missing or too
    large length, raise naming the argument before any row changes (a probe found row 0 cut
    before the error, and a fork's references leaked by a float index). Planted, reverted:
    the checks removed: a raw TypeError from the float index, after a fork."""
    cache = PagedKVCache(1, num_blocks=8, block_size=4)
    step(cache, torch.ones(2, 6, dtype=torch.bool), 1)

    def snapshot():
        tables = [list(t.block_ids) for t in cache.tables]
        counts = [cache.allocator.refcount(b) for t in tables for b in t]
        return cache.seq_lens(), tables, counts

    before = snapshot()
    for bad in ([0, 0.5], [True, False], [0, 2]):
        with pytest.raises(ValueError, match="^indices"):
            cache.reorder(bad)
        assert snapshot() == before
    for bad in ([2], [2, 9], [2, -1], [2.0, 1]):
        with pytest.raises(ValueError, match="^lengths"):
            cache.truncate_rows(bad)
        assert snapshot() == before
    cache.truncate_rows([2, 6])
    assert cache.seq_lens() == [2, 6]


def test_a_hold_ends_once():
    """hold() then restore() makes the held tables the live rows; a release() of them after
    (the try / except / finally pattern) freed every row silently, and a second restore
    kept nothing; a restore of a released hold emptied every row. Each is refused naming
    ``held``, and the rows stay. Planted, reverted: the check removed: seq_lens [0, 0] after
    the release; released tables not marked: [0, 0] after the restore."""
    cache = PagedKVCache(1, num_blocks=8, block_size=4)
    step(cache, torch.ones(2, 5, dtype=torch.bool), 1)
    held = cache.hold()
    step(cache, torch.ones(2, 1, dtype=torch.bool), 1)
    cache.restore(held)
    assert cache.seq_lens() == [5, 5]
    for end in (cache.release, cache.restore):
        with pytest.raises(ValueError, match="^held: "):
            end(held)
        assert cache.seq_lens() == [5, 5]
    again = cache.hold()
    cache.release(again)
    assert cache.seq_lens() == [5, 5]
    with pytest.raises(ValueError, match="^held: "):  # (a probe: every row emptied)
        cache.restore(again)
    assert cache.seq_lens() == [5, 5]
    step(cache, torch.ones(2, 1, dtype=torch.bool), 1)
    assert cache.seq_lens() == [6, 6]
    other = PagedKVCache(1, num_blocks=8, block_size=4)
    for not_held in ([], list(cache.hold()), other.hold()):  # ([] emptied every row)
        with pytest.raises(ValueError, match="^held: "):
            cache.restore(not_held)
        assert cache.seq_lens() == [6, 6]


def test_numpy_ints_and_arrays_are_taken_as_ints():
    """Row indices, lengths and counts from numpy (an int64, a 1-d integer array) are taken
    as torch tensors and lists of ints are; a float array is refused naming the argument.
    (A probe: reorder and truncate_rows refused arrays, drop_last an np.int64.)"""
    cache = PagedKVCache(1, num_blocks=8, block_size=4)
    step(cache, torch.ones(2, 5, dtype=torch.bool), 1)
    step(cache, torch.tensor([[True], [False]]), 1)
    cache.reorder(np.array([1, 0]))
    assert cache.seq_lens() == [5, 6]
    cache.drop_last(np.int64(1))
    assert cache.seq_lens() == [4, 5]
    cache.truncate_rows(np.array([3, 2], dtype=np.int32))
    assert cache.seq_lens() == [3, 2]
    with pytest.raises(ValueError, match="^indices: expected a 1-d integer array"):
        cache.reorder(np.array([1.0, 0.0]))
    assert cache.seq_lens() == [3, 2]


def test_free_and_reuse_stress_never_leaks_stale_data():
    """A thousand sequences of random lengths come and go through a small pool; blocks are
    poisoned with NaN as they are freed, and every live sequence still reads back exactly
    its own K/V and attends to them as a contiguous cache would."""
    rng = random.Random(1234)
    num_blocks, block_size = 20, 4
    alloc = BlockAllocator(num_blocks)
    k_pool = torch.full((num_blocks, block_size, HEADS, DIM), float("nan"))
    v_pool = torch.full_like(k_pool, float("nan"))
    live: list[tuple[BlockTable, torch.Tensor, torch.Tensor]] = []
    started = 0
    while started < 1000:
        if live and (rng.random() < 0.4 or alloc.num_free < 4):
            table, _, _ = live.pop(rng.randrange(len(live)))
            freed = table.block_ids
            table.free()
            k_pool[freed] = float("nan")
            v_pool[freed] = float("nan")
            continue
        if live and rng.random() < 0.5:
            i = rng.randrange(len(live))
            table, k_hist, v_hist = live[i]
            n = rng.randint(1, 5)
        else:
            table, k_hist, v_hist = BlockTable(alloc, block_size), None, None
            n = rng.randint(1, 3 * block_size + 1)
        try:
            slots = table.append(n)
        except OutOfBlocks:
            continue
        k_new, v_new = torch.randn(n, HEADS, DIM), torch.randn(n, HEADS, DIM)
        slot_scatter_ref(k_new, v_new, k_pool, v_pool, torch.tensor(slots))
        if k_hist is None:
            started += 1
            live.append((table, k_new, v_new))
        else:
            live[i] = (table, torch.cat([k_hist, k_new]), torch.cat([v_hist, v_new]))
        for table, k_hist, v_hist in live:
            ids = torch.tensor(table.block_ids)
            assert torch.equal(gather_history(k_pool, ids, table.num_tokens), k_hist)
            assert torch.equal(gather_history(v_pool, ids, table.num_tokens), v_hist)
    width = max(len(t.block_ids) for t, _, _ in live)
    tables = torch.zeros(len(live), width, dtype=torch.int32)
    for row, (t, _, _) in enumerate(live):
        tables[row, : len(t.block_ids)] = torch.tensor(t.block_ids, dtype=torch.int32)
    lens = torch.tensor([t.num_tokens for t, _, _ in live], dtype=torch.int32)
    query = torch.randn(len(live), HEADS * 2, DIM)
    out = paged_decode_attention_ref(query, k_pool, v_pool, tables, lens)
    assert torch.isfinite(out).all()
    for row, (_, k_hist, v_hist) in enumerate(live):
        expected = attend_sequence(
            query[row : row + 1], k_hist, v_hist, scale=DIM**-0.5, sliding_window=None, softcap=None
        )
        torch.testing.assert_close(out[row : row + 1], expected)
    for table, _, _ in live:
        table.free()
    assert alloc.num_free == num_blocks


def test_write_before_begin_step_is_an_error():
    cache = PagedKVCache(1, num_blocks=4, block_size=4)
    with pytest.raises(RuntimeError, match="begin_step"):
        cache.write(0, torch.zeros(1, HEADS, DIM), torch.zeros(1, HEADS, DIM))
    with pytest.raises(ValueError, match="new_token_mask"):
        cache.begin_step(torch.ones(3, dtype=torch.bool), "cpu")


def test_drop_last_and_fixed_table_width():
    cache = PagedKVCache(1, num_blocks=16, block_size=4, table_width=5)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    ((k, _),) = step(cache, mask, 1)
    assert cache.step.block_tables.shape == (2, 5)  # fixed width, though 2 blocks suffice
    cache.drop_last(3)
    assert cache.seq_lens() == [2, 4]
    assert torch.equal(read_back(cache, 0, 0)[0], k[0, 2:4])
    assert cache.allocator.num_used == 2
    cache.drop_last(10)
    assert cache.seq_lens() == [0, 0] and cache.allocator.num_used == 0
    with pytest.raises(ValueError, match="^n"):
        cache.drop_last(-1)
    with pytest.raises(ValueError, match="^n"):  # a bool is an int, once dropping a token
        cache.drop_last(True)
    with pytest.raises(ValueError, match="table_width"):
        PagedKVCache(1, num_blocks=4, table_width=0)


def test_counts_must_be_ints():
    table = BlockTable(BlockAllocator(4), block_size=4)
    with pytest.raises(ValueError, match="^n"):
        table.append(torch.tensor(3))
    table.append(3)
    with pytest.raises(ValueError, match="num_tokens"):
        table.truncate(torch.tensor(1))
    # found by a probe: a negative count started no sequence silently, a float raised a
    # TypeError, a digest of another type was published and broke the next lookup;
    # planted, reverted: the checks removed: failed
    cache = PagedKVCache(1, num_blocks=4, block_size=4)
    for bad in (-2, 2.5):
        with pytest.raises(ValueError, match="^n: "):
            cache.add_sequences(bad)
    assert cache.num_seqs == 0
    block = cache.allocator.allocate(1)[0]
    with pytest.raises(ValueError, match="^digest: expected bytes"):
        cache.allocator.publish(block, "not bytes")
    assert cache.allocator.lookup(b"x" * 16) is None


def test_step_metadata_follows_every_table_change():
    """The block-table rows are cached across steps and rewritten only where a table
    changed; after any mix of growth, beam reorders (copy-on-write), drops and resets,
    every step's metadata equals what the tables say (``equal_lengths`` too: planted, the
    first and last rows compared only: failed)."""
    rng = random.Random(7)
    equal_seen = 0
    cache = PagedKVCache(1, num_blocks=200, block_size=4, table_width=2)
    scatter_blocks(cache, 200)
    for _ in range(300):
        action = rng.random()
        if cache.num_seqs and action < 0.15:
            cache.reorder([rng.randrange(cache.num_seqs) for _ in range(cache.num_seqs)])
        elif cache.num_seqs and action < 0.25:
            cache.drop_last(rng.randrange(6))
        elif action < 0.28:
            cache.reset()
        rows = cache.num_seqs or rng.randrange(1, 5)
        q = rng.choice([1, 1, 1, 3])
        mask = torch.rand(rows, q) < 0.8
        if cache.allocator.num_free < rows * 3:
            cache.reset()
            continue
        meta = cache.begin_step(mask, "cpu")
        tables = cache.tables
        width = max(2, max(t.num_blocks for t in tables))
        expected = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, table in enumerate(tables):
            expected[i, : table.num_blocks] = torch.tensor(table.block_ids, dtype=torch.int32)
        assert torch.equal(meta.block_tables, expected)
        assert meta.seq_lens.tolist() == cache.seq_lens()
        assert meta.equal_lengths == (len(set(cache.seq_lens())) == 1)
        equal_seen += meta.equal_lengths
        assert meta.cu_seqlens_q.diff().tolist() == mask.sum(1).tolist()
        assert torch.equal(meta.token_index, mask.flatten().nonzero().flatten())
        real = meta.slot_mapping[meta.token_index]
        assert (meta.slot_mapping >= 0).sum() == len(real) and (real >= 0).all()
        assert meta.cu_seqlens_q[0] == 0
    assert 0 < equal_seen < 300  # both answers met


def test_step_metadata_after_a_later_copy_on_write():
    """A row cached while its last block is shared, then swapped for a private copy in a
    later step (no new block): the step must show the new block id."""
    cache = PagedKVCache(1, num_blocks=16, block_size=4)
    cache.begin_step(torch.ones(1, 6, dtype=torch.bool), "cpu")
    cache.reorder([0, 0, 0])
    cache.begin_step(torch.tensor([[True], [False], [False]]), "cpu")  # row 0 copies
    meta = cache.begin_step(torch.tensor([[True], [True], [False]]), "cpu")  # row 1 copies
    assert meta.block_tables[1, 1] != meta.block_tables[2, 1]
    for i, table in enumerate(cache.tables):
        assert meta.block_tables[i, : table.num_blocks].tolist() == table.block_ids


def test_first_step_out_of_blocks_starts_no_sequence():
    cache = PagedKVCache(1, num_blocks=2, block_size=4)
    with pytest.raises(OutOfBlocks, match="num_blocks"):
        cache.begin_step(torch.ones(3, 4, dtype=torch.bool), "cpu")  # 3 blocks, 2 in the pool
    assert cache.num_seqs == 0 and cache.allocator.num_free == 2
    ((k, _),) = step(cache, torch.ones(2, 4, dtype=torch.bool), 1)  # a smaller batch fits
    assert cache.seq_lens() == [4, 4]
    for row in range(2):
        assert torch.equal(read_back(cache, 0, row)[0], k[row])


def test_sizes_are_ints_not_bools():
    for name in ("num_layers", "num_blocks", "block_size", "table_width"):
        sizes = {"num_layers": 1, "num_blocks": 4, "block_size": 4, "table_width": 1}
        sizes[name] = True
        with pytest.raises(ValueError, match=name):
            PagedKVCache(**sizes)
    cache = PagedKVCache(np.int64(2), np.int64(4), block_size=np.int64(4))
    assert (cache.num_layers, cache.block_size) == (2, 4)
    assert type(cache.num_layers) is int and type(cache.block_size) is int
    step(cache, torch.ones(1, 5, dtype=torch.bool), 2)
    assert cache.seq_lens() == [5]


def test_write_takes_only_a_layer_of_this_cache():
    cache = PagedKVCache(2, num_blocks=4, block_size=4)
    cache.begin_step(torch.ones(1, 2, dtype=torch.bool), "cpu")
    k = torch.randn(2, HEADS, DIM)
    for bad in (-1, -2, 2, 5, True, False, 1.0, "0", None):
        with pytest.raises(ValueError, match="layer_idx"):
            cache.write(bad, k, k)
    assert cache.key_pools == [None, None]  # nothing was written, no pool was made
    cache.write(np.int64(1), k, k)
    assert cache.key_pools[0] is None and torch.equal(read_back(cache, 1, 0)[0], k)


def test_an_empty_batch_is_an_error():
    cache = PagedKVCache(1, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="new_token_mask"):
        cache.begin_step(torch.ones(0, 3, dtype=torch.bool), "cpu")
    assert cache.num_seqs == 0 and cache.step is None
    step(cache, torch.ones(2, 3, dtype=torch.bool), 1)
    with pytest.raises(ValueError, match="new_token_mask"):
        cache.begin_step(torch.ones(0, 1, dtype=torch.bool), "cpu")
    assert cache.seq_lens() == [3, 3]
    # a step of zero columns stores nothing and is no error (as a row of padding is not)
    meta = cache.begin_step(torch.ones(2, 0, dtype=torch.bool), "cpu")
    assert meta.cu_seqlens_q.tolist() == [0, 0, 0] and meta.slot_mapping.numel() == 0
    assert cache.seq_lens() == [3, 3] and meta.seq_lens.tolist() == [3, 3]


@pytest.mark.parametrize(
    "mask", [[[True]], torch.full((1, 2), 0.5), torch.ones(1, 2, dtype=torch.int64)]
)
def test_a_step_mask_that_is_not_a_bool_tensor_is_refused(mask):
    """A list was an AttributeError; a float or int mask was cast (0.5 stored a token): now
    a ValueError naming ``new_token_mask``, with nothing changed. Planted, reverted: the
    check removed: failed."""
    cache = PagedKVCache(1, num_blocks=4, block_size=4)
    step(cache, torch.ones(1, 3, dtype=torch.bool), 1)
    with pytest.raises(ValueError, match="^new_token_mask: expected a bool tensor"):
        cache.begin_step(mask, "cpu")
    assert cache.seq_lens() == [3]


def test_a_written_layer_is_never_replaced():
    """A write that does not fit a layer this cache has stored into (another dtype, head
    count, head_dim or device, e.g. after model.to(torch.float64)) raises, and the layer's
    pool and the tokens in it stay as they were (replacing it zeroed the history)."""
    cache = PagedKVCache(2, num_blocks=4, block_size=4)
    written = step(cache, torch.ones(1, 3, dtype=torch.bool), 2)
    pools = list(cache.key_pools)
    kept = [p.clone() for p in pools]
    cache.begin_step(torch.ones(1, 1, dtype=torch.bool), "cpu")
    misfits = {
        "dtype torch.float32 -> torch.float64": torch.randn(1, HEADS, DIM, dtype=torch.float64),
        "heads 2 -> 3": torch.randn(1, 3, DIM),
        "head_dim 8 -> 16": torch.randn(1, HEADS, 16),
        "device cpu -> meta": torch.empty(1, HEADS, DIM, device="meta"),
    }
    for differs, key in misfits.items():
        with pytest.raises(ValueError, match=f"^key: .*{differs}"):
            cache.write(0, key, key.clone())
    assert all(a is b for a, b in zip(cache.key_pools, pools, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(cache.key_pools, kept, strict=True))
    for layer, (k, _) in enumerate(written):
        assert torch.equal(read_back(cache, layer, 0)[0][:3], k[0])


def test_reused_pools_are_replaced_only_until_written():
    """Pools handed in through ``pools=`` (a finished cache's memory) are used when they fit
    and replaced in the shared lists when they do not, as long as this cache has not
    written into them."""
    first = PagedKVCache(1, num_blocks=4, block_size=4)
    step(first, torch.ones(1, 3, dtype=torch.bool), 1)
    lists = (first.key_pools, first.value_pools)
    old = lists[0][0]
    same = PagedKVCache(1, num_blocks=4, block_size=4, pools=lists)
    step(same, torch.ones(1, 2, dtype=torch.bool), 1)
    assert same.key_pools[0] is old  # fits: the same memory
    wider = PagedKVCache(1, num_blocks=4, block_size=4, pools=lists)
    ((k, _),) = step(wider, torch.ones(1, 2, dtype=torch.bool), 1, dtype=torch.float64)
    assert lists[0][0] is not old and lists[0][0].dtype == torch.float64
    assert torch.equal(read_back(wider, 0, 0)[0], k[0])
    wider.begin_step(torch.ones(1, 1, dtype=torch.bool), "cpu")
    with pytest.raises(ValueError, match="dtype torch.float64 -> torch.float32"):
        wider.write(0, torch.randn(1, HEADS, DIM), torch.randn(1, HEADS, DIM))


def test_grow_keeps_every_token_and_adds_free_blocks():
    """A returned cache continued by a longer call grows its pool: the tokens and block ids
    stay, the new blocks are free, and a full pool can then take the step it refused."""
    cache = PagedKVCache(2, num_blocks=4, block_size=4)
    written = step(cache, torch.ones(2, 6, dtype=torch.bool), 2)
    ids = [t.block_ids for t in cache.tables]
    with pytest.raises(OutOfBlocks):
        cache.begin_step(torch.ones(2, 3, dtype=torch.bool), "cpu")
    cache.grow(4)
    assert cache.allocator.num_blocks == 8 and cache.allocator.num_free == 4
    assert cache.key_pools[0].shape[0] == 8 and [t.block_ids for t in cache.tables] == ids
    for layer, (k, v) in enumerate(written):
        for row in range(2):
            assert torch.equal(read_back(cache, layer, row)[0], k[row])
            assert torch.equal(read_back(cache, layer, row)[1], v[row])
    later = step(cache, torch.ones(2, 3, dtype=torch.bool), 2)
    assert torch.equal(read_back(cache, 1, 0)[0], torch.cat([written[1][0][0], later[1][0][0]]))
    with pytest.raises(ValueError, match="^n"):
        cache.grow(-1)


def test_a_failed_grow_changes_nothing(monkeypatch):
    """An allocation failing halfway (out of device memory) leaves every pool and the
    allocator as they were (before, layers ended with pools of different sizes)."""
    cache = PagedKVCache(2, num_blocks=4, block_size=4)
    step(cache, torch.ones(1, 5, dtype=torch.bool), 2)
    before = [p.clone() for p in (*cache.key_pools, *cache.value_pools)]
    real, calls = torch.Tensor.new_zeros, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("simulated")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_zeros", failing)
    with pytest.raises(torch.OutOfMemoryError):
        cache.grow(4)
    monkeypatch.undo()
    after = [*cache.key_pools, *cache.value_pools]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert cache.allocator.num_blocks == 4


def test_a_pool_that_does_not_fit_is_not_replaced_under_attached_prefix_blocks():
    """A later cache took the pools and allocator of a finished one and attached a cached
    prefix: a write of another dtype must not swap the pool for zeros under it."""
    from nanoserve.cache import block_digests

    first = PagedKVCache(1, num_blocks=4, block_size=4)
    step(first, torch.ones(1, 4, dtype=torch.bool), 1)
    digests = block_digests([1, 2, 3, 4], 4)
    first.publish(0, digests)
    later = PagedKVCache(
        1, 4, 4, pools=(first.key_pools, first.value_pools), allocator=first.allocator
    )
    later.add_sequences(1)
    assert later.attach_prefix(0, digests) == 4
    later.begin_step(torch.ones(1, 1, dtype=torch.bool), "cpu")
    with pytest.raises(ValueError, match="^key: .*dtype torch.float32 -> torch.float64"):
        later.write(
            0,
            torch.zeros(1, HEADS, DIM, dtype=torch.float64),
            torch.zeros(1, HEADS, DIM, dtype=torch.float64),
        )
    other = PagedKVCache(
        1, 4, 4, pools=(first.key_pools, first.value_pools), allocator=first.allocator
    )
    other.begin_step(torch.ones(1, 1, dtype=torch.bool), "cpu")
    other.write(
        0,
        torch.zeros(1, HEADS, DIM, dtype=torch.float64),
        torch.zeros(1, HEADS, DIM, dtype=torch.float64),
    )
    assert other.allocator.num_cached == 0  # the replaced memory's prefixes are forgotten


def _filled_slots_by_block(tables, block_size: int) -> int:
    """The slot count the plain way: every block of every table at its fill, a shared block
    at its fullest."""
    filled: dict[int, int] = {}
    for table in tables:
        for i, block in enumerate(table.block_ids):
            if block != DROPPED:
                in_block = min(block_size, table.num_tokens - i * block_size)
                filled[block] = max(filled.get(block, 0), in_block)
    return sum(filled.values())


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_filled_slots_counts_shared_and_dropped_blocks_once(block_size):
    """Random tables grown, forked (blocks shared, a partly filled one copied on write),
    truncated and released under a window: ``filled_slots`` equals the count block by
    block. Planted: a shared partly filled block counted in each table failed."""
    gen = random.Random(int.from_bytes(os.urandom(4), "little"))
    for _ in range(40):
        allocator = BlockAllocator(400)
        tables = [BlockTable(allocator, block_size)]
        for _ in range(gen.randrange(1, 12)):
            table = gen.choice(tables)
            action = gen.random()
            if action < 0.5:
                table.append(gen.randrange(0, 3 * block_size + 2))
            elif action < 0.7:
                tables.append(table.fork())
            elif table.num_tokens:
                table.truncate(gen.randrange(0, table.num_tokens + 1))
        for table in tables:  # (a window's release comes last: no table grows after it)
            if gen.random() < 0.3:
                table.drop_before(gen.randrange(0, table.num_tokens + 1))
        assert filled_slots(tables, block_size) == _filled_slots_by_block(tables, block_size)


@pytest.mark.parametrize("device", ["nope", "cuda:7", 3.5])
def test_a_step_for_a_device_there_is_not_changes_nothing(device):
    """begin_step for a device that is no device, or a GPU this machine lacks: ValueError
    naming ``device``, raised before any table grows; the next step runs as if it never
    came. Planted: without the check, torch's own error (naming no argument) came after
    the tables grew."""
    if isinstance(device, str) and device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that GPU")
    cache = PagedKVCache(num_layers=1, num_blocks=8, block_size=4)
    cache.begin_step(torch.ones(2, 5, dtype=torch.bool), device="cpu")
    key = torch.randn(10, 2, 8)
    cache.write(0, key, key)

    lens, blocks = cache.seq_lens(), [list(t.block_ids) for t in cache.tables]
    with pytest.raises(ValueError, match="^device: "):
        cache.begin_step(torch.ones(2, 4, dtype=torch.bool), device=device)
    assert cache.seq_lens() == lens and [list(t.block_ids) for t in cache.tables] == blocks
    cache.begin_step(torch.ones(2, 1, dtype=torch.bool), device="cpu")
    assert cache.seq_lens() == [6, 6]


def test_held_rows_come_back_whole_and_no_block_leaks():
    """``hold`` keeps the rows' blocks through a beam reorder, a window's release and new
    tokens; ``restore`` gives back the same tables and contents, ``release`` the blocks the
    hold kept: the free count returns to what each path leaves without a hold."""
    cache = PagedKVCache(1, num_blocks=24, block_size=4, sliding_window=5)
    cache.add_sequences(2)
    step(cache, torch.ones(2, 10, dtype=torch.bool), 1)
    tables = [t.block_ids for t in cache.tables]
    kept = cache.key_pools[0].clone()
    free = cache.allocator.num_free

    def run_a_call():
        cache.reorder([1, 1])
        for _ in range(6):
            step(cache, torch.ones(2, 1, dtype=torch.bool), 1)
            cache.step = None

    held = cache.hold()
    run_a_call()
    assert cache.tables[0].dropped > 0
    cache.restore(held)
    assert [t.block_ids for t in cache.tables] == tables
    assert cache.allocator.num_free == free
    rows = [i for t in tables for i in t if i >= 0]
    assert torch.equal(cache.key_pools[0][rows], kept[rows])
    held = cache.hold()
    run_a_call()
    after_call = [t.block_ids for t in cache.tables]
    cache.release(held)
    assert [t.block_ids for t in cache.tables] == after_call
    released = cache
    cache = PagedKVCache(1, num_blocks=24, block_size=4, sliding_window=5)  # no hold
    cache.add_sequences(2)
    step(cache, torch.ones(2, 10, dtype=torch.bool), 1)
    run_a_call()
    assert released.allocator.num_free == cache.allocator.num_free


PREFIX_MISUSE = {
    "attach_prefix a negative seq": ("seq", lambda c: c.attach_prefix(-1, [])),
    "attach_prefix past the rows": ("seq", lambda c: c.attach_prefix(3, [])),
    "attach_prefix a filled seq": ("seq", lambda c: c.attach_prefix(0, [b"x" * 16])),
    "attach_prefix a string": ("digests", lambda c: c.attach_prefix(2, "abc")),
    "publish a negative seq": ("seq", lambda c: c.publish(-1, [b"x" * 16])),
    "publish a string": ("digests", lambda c: c.publish(0, "abc")),
    "publish first < 0": ("first", lambda c: c.publish(0, [b"x" * 16], first=-1)),
}


@pytest.mark.parametrize("case", list(PREFIX_MISUSE))
def test_prefix_misuse_is_refused_before_anything_changes(case):
    """A negative ``seq`` picked the last row (attached or published another row's blocks),
    a string of digests published one block per character; now each is a ValueError naming
    the argument, nothing taken, attached or published (GroupedKVCache checked these
    already). Planted, reverted: the seq check left out: the negative cases failed."""
    cache = PagedKVCache(1, num_blocks=16, block_size=4)
    step(cache, torch.tensor([[True] * 8, [True] * 8, [False] * 8]), 1)  # row 2 empty
    cache.publish(1, [b"y" * 16, b"z" * 16])
    before = (cache.seq_lens(), [t.block_ids for t in cache.tables], cache.allocator.num_used)
    name, misuse = PREFIX_MISUSE[case]
    with pytest.raises(ValueError, match=f"^{name}:"):
        misuse(cache)
    after = (cache.seq_lens(), [t.block_ids for t in cache.tables], cache.allocator.num_used)
    assert after == before
    assert cache.allocator.lookup(b"x" * 16) is None
    assert cache.attach_prefix(2, [b"y" * 16, b"z" * 16]) == 8  # the real prefix still serves


def test_rows_a_kernel_stored_are_taken_without_a_scatter():
    """``store_target`` offers a layer's pools and the step's slots only once the pools
    exist in the rows' dtype and shape, for the step's row count, before the layer's write;
    ``write(..., stored=)`` then keeps what the caller stored (no scatter; counted), while a
    target of another step or of pools since replaced scatters as without. Planted: the
    slot-mapping identity check dropped from ``write`` (the stale target: failed), the
    pools' identity check dropped (the replaced pools: failed)."""
    from nanoserve.kernels.slot_scatter import slot_scatter_ref

    cache = PagedKVCache(2, num_blocks=8, block_size=4)
    offer = functools.partial(cache.store_target, rows=2, device="cpu", kv_heads=HEADS, dim=DIM)
    assert offer(0, dtype=torch.float32) is None  # no step yet
    cache.begin_step(torch.ones(2, 3, dtype=torch.bool), "cpu")
    assert offer(0, dtype=torch.float32) is None  # no pools yet
    step(cache, torch.ones(2, 3, dtype=torch.bool), 2)  # (its begin_step replaced the first)
    cache.begin_step(torch.ones(2, 1, dtype=torch.bool), "cpu")
    for refused in [
        dict(layer_idx=0, dtype=torch.float16),  # another dtype than the pools'
        dict(layer_idx=0, dtype=torch.float32, kv_heads=HEADS + 1),  # another row shape
        dict(layer_idx=0, dtype=torch.float32, rows=3),  # other rows than the step's
        dict(layer_idx=2, dtype=torch.float32),  # no such layer
        dict(layer_idx="0", dtype=torch.float32),
        dict(layer_idx=True, dtype=torch.float32),
    ]:
        assert offer(**refused) is None
    target = offer(0, dtype=torch.float32)
    assert target.key_pool is cache.key_pools[0] and target.value_pool is cache.value_pools[0]
    k, v = torch.randn(2, HEADS, DIM), torch.randn(2, HEADS, DIM)
    slot_scatter_ref(k, v, target.key_pool, target.value_pool, target.slot_mapping)
    # rows other than the stored ones, so that a scatter would show
    cache.write(0, torch.zeros(2, HEADS, DIM), torch.zeros(2, HEADS, DIM), stored=target)
    assert cache.stores_taken == 1
    assert torch.equal(read_back(cache, 0, 0)[0][-1], k[0])
    assert torch.equal(read_back(cache, 0, 1)[1][-1], v[1])
    assert offer(0, dtype=torch.float32) is None  # written
    # a target from this step's layer 1, kept into the next step: scattered
    stale = offer(1, dtype=torch.float32)
    cache.write(1, k, v)
    cache.begin_step(torch.ones(2, 1, dtype=torch.bool), "cpu")
    cache.write(0, k, v)
    cache.write(1, k * 2, v * 2, stored=stale)
    assert torch.equal(read_back(cache, 1, 0)[0][-1], k[0] * 2)
    # a target whose pools were replaced since (same slots): scattered
    cache.begin_step(torch.ones(2, 1, dtype=torch.bool), "cpu")
    replaced = offer(0, dtype=torch.float32)
    replaced = replaced._replace(key_pool=replaced.key_pool.clone())
    cache.write(0, k * 3, v * 3, stored=replaced)
    assert torch.equal(read_back(cache, 0, 1)[0][-1], k[1] * 3)
    assert cache.stores_taken == 1


def test_quantized_pools_offer_no_store_target():
    cache = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=torch.float8_e4m3fn)
    step(cache, torch.ones(1, 2, dtype=torch.bool), 1)
    cache.begin_step(torch.ones(1, 1, dtype=torch.bool), "cpu")
    assert cache.store_target(0, 1, torch.float32, "cpu", HEADS, DIM) is None
