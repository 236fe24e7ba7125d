"""A PagedKVCache with a sliding window releases the blocks that fell out of it: attention
over it equals attention over a cache that keeps every block, its sequences hold a bounded
number of blocks, and the released table entries are never read."""

from __future__ import annotations

import os

import pytest
import torch

from nanoserve import PagedKVCache
from nanoserve.cache.block_table import DROPPED
from nanoserve.kernels import paged_decode_attention, paged_extend_attention

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4
BACKENDS = pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
            ),
        ),
    ],
)


def poison_free_blocks(cache: PagedKVCache) -> None:
    """NaN into every block no sequence holds, so a read of one shows in the result."""
    free = [b for b in range(cache.allocator.num_blocks) if cache.allocator.refcount(b) == 0]
    for pool in (*cache.key_pools, *cache.value_pools):
        pool[free] = float("nan")


def masks(lengths: list[int], chunk: int, decode_steps: int):
    """A left-padded prompt in chunks of ``chunk`` columns, then one-token decode steps."""
    width = max(lengths)
    prompt = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, n in enumerate(lengths):
        prompt[row, width - n :] = True
    yield from prompt.split(chunk, dim=1)
    for _ in range(decode_steps):
        yield torch.ones(len(lengths), 1, dtype=torch.bool)


def attend(cache: PagedKVCache, query: torch.Tensor, mask: torch.Tensor, window, backend):
    """This step's attention output for the real tokens [T, HEADS, DIM]."""
    meta = cache.step
    packed = query.flatten(0, 1)[meta.token_index]
    pools = cache.key_pools[0], cache.value_pools[0]
    opts = dict(sliding_window=window, backend=backend)
    if mask.shape[1] == 1 and bool(mask.all()):
        return paged_decode_attention(packed, *pools, meta.block_tables, meta.seq_lens, **opts)
    return paged_extend_attention(
        packed, *pools, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, **opts
    )


@BACKENDS
@pytest.mark.parametrize("window, chunk", [(5, 3), (8, 16), (4, 1)])
def test_windowed_cache_attends_as_a_full_cache(window, chunk, backend):
    """Prompts of 13, 3 and 9 tokens (in chunks, padding first), then 30 decode steps: every
    step's attention output equals the full cache's. Block 0 holds NaN and is never a
    sequence's (released entries read as block 0), and every free block is NaN before each
    step: a kernel reading a released block or entry would give NaN. Each sequence holds at
    most ceil((window - 1 + new) / block_size) + 2 blocks (one of slack). Planted: begin_step
    releasing without the slack and from num_tokens - window + 2 (one position too many):
    failed every case."""
    gen = torch.Generator().manual_seed(window * 100 + chunk)
    full = PagedKVCache(1, num_blocks=64, block_size=BLOCK)
    windowed = PagedKVCache(1, num_blocks=16, block_size=BLOCK, sliding_window=window)
    assert windowed.allocator.allocate(1) == [0]  # kept NaN: what released entries point at
    lengths = [13, 3, 9]
    for mask in masks(lengths, chunk, decode_steps=30):
        rows, q = mask.shape
        kv = torch.randn(2, rows * q, KV_HEADS, DIM, generator=gen)
        query = torch.randn(rows, q, HEADS, DIM, generator=gen)
        outs = []
        for cache in (full, windowed):
            cache.begin_step(mask, "cpu")
            cache.write(0, kv[0], kv[1])
            if cache is windowed:
                cache.key_pools[0][0] = cache.value_pools[0][0] = float("nan")
            outs.append(attend(cache, query, mask, window, backend))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
        for table, new in zip(windowed.tables, mask.sum(dim=1).tolist(), strict=True):
            held = table.num_blocks - table.dropped
            assert held <= -(-(window - 1 + new) // BLOCK) + 2, (held, table.num_tokens)
        poison_free_blocks(windowed)
    assert windowed.seq_lens() == full.seq_lens() == [n + 30 for n in lengths]
    # the last step released every block a block before (its tokens before) - window + 1
    released = [(n + 29 - window + 1 - BLOCK) // BLOCK for n in lengths]
    assert [t.dropped for t in windowed.tables] == released
    stats = windowed.stats()
    assert stats["blocks_dropped_by_window"] == sum(released)
    assert stats["blocks_used"] == full.stats()["blocks_used"] - sum(released) + 1  # + block 0


def run_steps(cache: PagedKVCache, lengths: list[int], decode_steps: int) -> None:
    for mask in masks(lengths, max(lengths), decode_steps):
        cache.begin_step(mask, "cpu")
        kv = torch.randn(2, mask.numel(), KV_HEADS, DIM)
        cache.write(0, kv[0], kv[1])


def test_a_sequence_cut_back_past_its_window_takes_no_new_tokens():
    """A crop within the block of slack (a speculative step's rejected tokens, a decode
    loop's steps past a stop) leaves sequences that continue; a deeper drop_last is allowed,
    but a sequence whose next query would see released positions then refuses new tokens
    with a ValueError, and nothing changes."""
    cache = PagedKVCache(1, num_blocks=32, block_size=BLOCK, sliding_window=6)
    run_steps(cache, [10, 4], decode_steps=19)  # 29 and 23 tokens
    cache.begin_step(torch.ones(2, 4, dtype=torch.bool), "cpu")  # 4 candidate tokens
    kv = torch.randn(2, 8, KV_HEADS, DIM)
    cache.write(0, kv[0], kv[1])
    # released a block before 29 - 6 + 1 = 24 and 23 - 6 + 1 = 18: blocks 0-4 and 0-2
    assert [t.dropped for t in cache.tables] == [5, 3]
    cache.drop_last(4)  # back to 29 and 23 tokens: the next queries see from 24 and 18
    run_steps(cache, [1, 1], decode_steps=0)  # 30 and 24
    cache.drop_last(7)  # 23 and 17: row 0's next query would see position 18, released
    before = [(t.block_ids, t.num_tokens) for t in cache.tables]
    with pytest.raises(ValueError, match=r"^new_token_mask: sequence 0 was cut back to 23"):
        cache.begin_step(torch.tensor([[True], [False]]), "cpu")
    assert [(t.block_ids, t.num_tokens) for t in cache.tables] == before
    cache.begin_step(torch.tensor([[False], [True]]), "cpu")  # row 1 (sees from 13) can
    cache.drop_last(20)  # row 0 now ends inside its released blocks, row 1 is empty
    assert cache.seq_lens() == [3, 0] and cache.allocator.num_used == 0
    cache.reset()
    assert cache.allocator.num_used == 0


@pytest.mark.parametrize("window", [None, 3, 6, 9])
@pytest.mark.parametrize("held", [False, True])
def test_can_drop_last_says_what_begin_step_will_take(window, held):
    """``can_drop_last(n)`` answers, before anything changes, whether every sequence could
    take a new token after ``drop_last(n)``: the same answer ``begin_step`` gives after the
    drop, for every n from 0 past the longest row. Planted: the check without the table's
    own ``dropped`` bound after the cut (``min(dropped, blocks kept)``): failed (rows cut
    into their released blocks' range reported as able to continue, or the reverse)."""

    def filled() -> PagedKVCache:
        cache = PagedKVCache(1, num_blocks=64, block_size=BLOCK, sliding_window=window)
        if held:
            cache.hold_window()
        torch.manual_seed(0)
        run_steps(cache, [10, 4, 7], decode_steps=21)  # 31, 25 and 28 tokens
        return cache

    answers = []
    for n in range(0, 34):
        cache = filled()
        lens = cache.seq_lens()
        answer = cache.can_drop_last(n)
        assert cache.seq_lens() == lens  # a question, nothing changed
        cache.drop_last(n)
        try:
            cache.begin_step(torch.ones(3, 1, dtype=torch.bool), "cpu")
            took = True
        except ValueError as error:
            assert str(error).startswith("new_token_mask: sequence")
            took = False
        assert answer == took, f"drop_last({n})"
        answers.append(answer)
    assert all(answers) == (window is None or held)
    with pytest.raises(ValueError, match="^n: must be >= 0"):
        filled().can_drop_last(-1)


@pytest.mark.parametrize("kept", [None, 12])
def test_keep_past_window_lets_a_deeper_crop_continue(kept):
    """``keep_past_window(n)`` (an assistant model's drafting call: its rejected drafts are
    cropped before the next call) keeps n tokens past the window from the next step on, so a
    ``drop_last`` of n still continues; without it the same crop refuses new tokens. It
    never lowers the slack, and names its argument when it is not an index."""
    cache = PagedKVCache(1, num_blocks=64, block_size=BLOCK, sliding_window=6)
    run_steps(cache, [10], decode_steps=10)  # 20 tokens
    if kept is not None:
        cache.keep_past_window(kept)
        cache.keep_past_window(2)
        assert cache.window_slack == kept
    run_steps(cache, [1], decode_steps=11)  # 12 drafts: 32 tokens
    cache.drop_last(12)  # back to 20: the next query sees from 15
    step = torch.tensor([[True]])
    if kept is None:
        with pytest.raises(ValueError, match=r"^new_token_mask: sequence 0 was cut back"):
            cache.begin_step(step, "cpu")
    else:
        cache.begin_step(step, "cpu")
        assert cache.seq_lens() == [21]
    with pytest.raises(ValueError, match="^tokens: must be >= 0"):
        cache.keep_past_window(-1)


def test_forks_publish_and_reset_release_every_block():
    """Beam-style reorders share the held blocks (released entries stay released in every
    fork); publish skips released entries; a reset leaves no block in use."""
    cache = PagedKVCache(1, num_blocks=32, block_size=BLOCK, sliding_window=5)
    run_steps(cache, [9, 6], decode_steps=12)
    cache.reorder([0, 0, 1])
    assert cache.tables[0].block_ids == cache.tables[1].block_ids
    assert cache.tables[0].block_ids[0] == DROPPED
    run_steps_decode = torch.ones(3, 1, dtype=torch.bool)
    for _ in range(6):
        cache.begin_step(run_steps_decode, "cpu")
        kv = torch.randn(2, 3, KV_HEADS, DIM)
        cache.write(0, kv[0], kv[1])
    table = cache.tables[2]
    full = table.num_tokens // BLOCK
    cache.publish(2, [bytes([i]) * 16 for i in range(full)])
    published = full - table.dropped
    assert table.dropped > 0 and cache.allocator.num_cached == published
    cache.reset()
    assert cache.allocator.num_used == 0
    assert cache.allocator.num_cached == cache.allocator.num_evictable == published


def test_sliding_window_must_be_a_positive_int():
    with pytest.raises(ValueError, match="sliding_window"):
        PagedKVCache(1, num_blocks=4, block_size=BLOCK, sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window"):
        PagedKVCache(1, num_blocks=4, block_size=BLOCK, sliding_window=True)


def test_a_held_window_releases_blocks_only_when_told():
    """``hold_window``: steps release nothing for the window, so a ``drop_last`` of any
    depth can continue; ``release_past_window`` releases what the window no longer needs
    (the hold stays for later steps); without the hold the same drop is refused. Planted,
    reverted: the step releasing blocks whatever the hold: failed."""
    held = PagedKVCache(1, num_blocks=64, block_size=BLOCK, sliding_window=5)
    held.hold_window()
    run_steps(held, [9], decode_steps=30)  # 39 tokens, window 5
    assert held.blocks_dropped == 0
    held.drop_last(25)  # back to 14: the next query sees from position 10
    one = torch.ones(1, 1, dtype=torch.bool)
    held.begin_step(one, "cpu")
    held.release_past_window()
    dropped = held.blocks_dropped
    first_kept = held.tables[0].num_tokens - 5 + 1 - held.window_slack
    assert dropped == max(first_kept, 0) // BLOCK > 0
    for _ in range(12):  # still held: nothing more released
        held.begin_step(one, "cpu")
    assert held.blocks_dropped == dropped
    plain = PagedKVCache(1, num_blocks=64, block_size=BLOCK, sliding_window=5)
    run_steps(plain, [9], decode_steps=30)
    plain.drop_last(25)
    with pytest.raises(ValueError, match="^new_token_mask: sequence 0 was cut back"):
        plain.begin_step(one, "cpu")
