"""Gemma 2 and Gemma 3 (sliding and global layers) on a cache of two layer groups: the
sliding layers' pool releases the blocks that fell out of the window while the global
layers' pool keeps every block, and generate stays token-exact with stock (the generate
modes themselves: test_new_families.test_generate_modes_match_stock)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import patched
from test_families import padded_batch
from test_new_families import GREEDY, LOGITS, WINDOW, assert_logits_equal, tiny_model

import nanoserve
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.read_back import READ_BACK_LAG
from nanoserve.adapters.step import state_of

BLOCK = 4
# blocks a row holds at most in the sliding group (the cache's slack: hf.py's window_slack)
SLIDING_BOUND = math.ceil((WINDOW + max(BLOCK, READ_BACK_LAG)) / BLOCK) + 1


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_sliding_group_holds_a_window_while_the_global_group_grows(name):
    """Prompts of 19 and 7 tokens, 40 new ones: logits equal stock's at every step; the
    sliding group holds at most SLIDING_BOUND blocks a row, the global group every block of
    every row. Planted: the family giving no layer groups (one pool of every block): failed
    on the sliding group's blocks."""
    model = tiny_model(name)
    layout = nanoserve.adapters.family_for(model.config).layout(model.config)
    assert layout.sliding_window is None and len(layout.layer_groups) == 2
    inputs = padded_batch([19, 7], 19)
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=40, **LOGITS)
    with patched(model, block_size=BLOCK), torch.no_grad():
        paged = model.generate(**inputs, max_new_tokens=40, **LOGITS)
        stats = paged.past_key_values.stats()
    assert_logits_equal(stock, paged)
    lens = paged.past_key_values.paged.seq_lens()
    assert stats["layer_groups"] == 2 and stats["group1_window"] == WINDOW
    assert stats["group0_blocks_used"] == sum(-(-n // BLOCK) for n in lens)
    assert stats["group1_blocks_used"] <= SLIDING_BOUND * len(lens)
    assert stats["group1_blocks_dropped_by_window"] > 0
    sliding_layers, global_layers = stats["group1_layers"], stats["group0_layers"]
    assert (
        stats["bytes_holding_tokens"]
        < stats["group0_bytes_holding_tokens"] * (sliding_layers + global_layers) / global_layers
    )  # less than one pool of every block for every layer


@pytest.mark.parametrize("beams", [1, 3])
def test_static_decode_buffers_carry_each_groups_tables(beams):
    """The decode-graph runner's static buffers (run eagerly on the CPU) hold a slot mapping
    and block tables per group: a padded batch of 3 (a bucket of 4) and beams give stock's
    tokens. Planted: ``StaticStep.load`` writing group 0's tables into every group: failed."""
    model = tiny_model("gemma3")
    inputs = padded_batch([13, 6, 2], 13)
    opts = dict(max_new_tokens=14, num_beams=beams, **GREEDY)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    with patched(model, block_size=BLOCK), torch.no_grad():
        state_of(model).graphs = DecodeGraphs(capture=False)
        paged = model.generate(**inputs, **opts)
        stats = nanoserve.decode_graph_stats(model)
    assert torch.equal(stock, paged)
    assert stats["replays"] == 13


def test_pools_kept_reused_and_a_returned_cache_continued():
    """A second call reuses both groups' kept pools (the same tensors); a returned cache
    passed back grows each group to fit and continues as stock does."""
    model = tiny_model("gemma3")
    inputs = padded_batch([11, 5], 11)
    opts = dict(max_new_tokens=10, **GREEDY)
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=30, **GREEDY)
    with patched(model, block_size=BLOCK), torch.no_grad():
        state = state_of(model)
        model.generate(**inputs, **opts)
        pools = [kept.pools[0][0] for kept in (state.kept_pools, *state.kept_pools.others)]
        assert len(pools) == 2
        model.generate(**inputs, **opts)
        again = [kept.pools[0][0] for kept in (state.kept_pools, *state.kept_pools.others)]
        assert all(a is b for a, b in zip(pools, again, strict=True))
        first = model.generate(**inputs, return_dict_in_generate=True, **opts)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, 10, dtype=torch.long)], 1)
        more = model.generate(
            input_ids=first.sequences,
            attention_mask=mask,
            past_key_values=first.past_key_values,
            max_new_tokens=20,
            **GREEDY,
        )
    assert torch.equal(more, stock)


@pytest.mark.parametrize("fixed", ["num_blocks", "max_memory"])
def test_fixed_pool_sizes_cover_both_groups(fixed):
    """``num_blocks``: each group's pool has that many blocks; ``max_memory``: both groups'
    pools together take at most that many bytes. Either way generate matches stock."""
    model = tiny_model("gemma3")
    inputs = padded_batch([13, 6], 13)
    limit = {"num_blocks": 24, "max_memory": 200_000}[fixed]
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=20, **GREEDY)
    with patched(model, block_size=BLOCK, **{fixed: limit}), torch.no_grad():
        paged = model.generate(**inputs, max_new_tokens=20, **GREEDY)
        stats = nanoserve.cache_stats(model)
    assert torch.equal(stock, paged)
    if fixed == "num_blocks":
        assert stats["group0_num_blocks"] == stats["group1_num_blocks"] == limit
    else:
        assert 0 < stats["bytes_reserved"] <= limit
        assert stats["group0_num_blocks"] > 0 and stats["group1_num_blocks"] > 0


def test_chunked_prefill_sizes_the_sliding_pool_by_the_chunk():
    """Prompts of 40 and 37 tokens in chunks of 6: the sliding pool is sized for a chunk
    past the window (not the whole prompt, as one forward would store) and the call gives
    stock's tokens. Planted: the bound left the chunk out (a decode step's window only):
    OutOfBlocks."""
    model = tiny_model("gemma3")
    inputs = padded_batch([40, 37], 40)
    opts = dict(max_new_tokens=10, prefill_chunk_size=6, **GREEDY)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    with patched(model, block_size=BLOCK), torch.no_grad():
        paged = model.generate(**inputs, **opts)
        stats = nanoserve.cache_stats(model)
    assert torch.equal(stock, paged)
    assert stats["group1_num_blocks"] < stats["group0_num_blocks"] // 2
    assert stats["group0_num_blocks"] >= -(-50 // BLOCK) + -(-47 // BLOCK)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_assisted_generation_fits_the_default_pools(name):
    """Assisted generation verifies several tokens a step: with the default sizing the sliding
    group must hold them past its window. Stock's tokens, and sliding blocks still released.
    Planted (found in review): sizing the sliding pool by its window alone raised
    OutOfBlocks at the first multi-token verify step."""
    model = tiny_model(name)
    g = torch.Generator().manual_seed(7)
    base = torch.randint(3, 97, (6,), generator=g)
    ids = torch.cat([base, base, base, torch.randint(3, 97, (3,), generator=g)])[None]
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    assist = dict(assistant_model=tiny_model(name, seed=1), num_assistant_tokens=3,
                  num_assistant_tokens_schedule="constant")  # fmt: skip
    with torch.no_grad():
        try:
            stock = model.generate(**inputs, max_new_tokens=40, **GREEDY, **assist)
        except RuntimeError as error:  # transformers 5.17's own sliding-window masks
            pytest.skip(f"stock assisted generation fails on this transformers: {error}")
    with patched(model, block_size=BLOCK), torch.no_grad():
        paged = model.generate(**inputs, max_new_tokens=40, **GREEDY, **assist)
        stats = nanoserve.cache_stats(model)
    assert torch.equal(stock, paged)
    assert stats["group1_blocks_dropped_by_window"] > 0


def test_calls_whose_groups_grow_in_turn_share_one_kept_pool():
    """A short prompt with many new tokens (the global group grows), then a long prompt with
    few (the sliding group grows): the second call's pool takes each group's larger need, and
    from then on both calls reuse it. Planted (found in review): a new pool sized for the
    call alone: every call made its own pool (and would recapture its decode graphs)."""
    model = tiny_model("gemma3")
    calls = (([3], 60), ([40], 4), ([3], 60), ([40], 4))
    pools = []
    with patched(model, block_size=BLOCK), torch.no_grad():
        state = state_of(model)
        for lens, new in calls:
            inputs = padded_batch(lens, max(lens))
            out = model.generate(**inputs, max_new_tokens=new, **GREEDY)
            kept = state.kept_pools
            pools.append([k.pools[0][0] for k in (kept, *kept.others)])
            del out  # lets the kept pool serve the next call
    assert all(a is b for a, b in zip(pools[1], pools[2], strict=True))
    assert all(a is b for a, b in zip(pools[2], pools[3], strict=True))
    with torch.no_grad():
        stock = model.generate(**padded_batch([40], 40), max_new_tokens=4, **GREEDY)
    with patched(model, block_size=BLOCK), torch.no_grad():
        model.generate(**padded_batch([3], 3), max_new_tokens=60, **GREEDY)
        paged = model.generate(**padded_batch([40], 40), max_new_tokens=4, **GREEDY)
    assert torch.equal(stock, paged)


def test_a_continued_cache_grows_the_sliding_group_by_its_window():
    """A returned cache (prompts of 11 and 5 tokens, 6 new) passed back for 60 more tokens:
    stock's tokens, and the sliding group's pool grows only to its window's blocks a row
    while the global group's grows to every block. Planted (found in review): each group
    grown by every new token's blocks, as a global pool: the sliding pool grew as large as
    the global one."""
    model = tiny_model("gemma3")
    inputs = padded_batch([11, 5], 11)
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=66, **GREEDY)
    with patched(model, block_size=BLOCK), torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=6, return_dict_in_generate=True, **GREEDY)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, 6, dtype=torch.long)], 1)
        more = model.generate(
            input_ids=first.sequences,
            attention_mask=mask,
            past_key_values=first.past_key_values,
            max_new_tokens=60,
            **GREEDY,
        )
        stats = first.past_key_values.stats()
    assert torch.equal(more, stock)
    rows = 2
    assert stats["group0_num_blocks"] >= -(-77 // BLOCK) + -(-71 // BLOCK)
    # per row: the window's blocks, one for a copy on write, and what the first call left
    assert stats["group1_num_blocks"] <= rows * (SLIDING_BOUND + 1) + 8
    assert stats["group1_blocks_dropped_by_window"] > 0


def test_max_memory_keeps_one_split_for_calls_that_fit_it():
    """Under ``max_memory``, calls whose groups' needs differ in proportion (a long prompt
    with few new tokens, a short one with many) reuse the first call's kept split while it
    holds what each needs, and give stock's tokens. Planted (found in review): a kept pool
    served only a call asking for exactly its split: every call dropped it and made a new
    one (and would recapture its decode graphs)."""
    model = tiny_model("gemma3")
    calls = (([40], 4), ([3], 30), ([40, 9], 4))
    pools = []
    with patched(model, block_size=BLOCK, max_memory=400_000), torch.no_grad():
        state = state_of(model)
        for lens, new in calls:
            out = model.generate(**padded_batch(lens, max(lens)), max_new_tokens=new, **GREEDY)
            kept = state.kept_pools
            pools.append([k.pools[0][0] for k in (kept, *kept.others)])
            stats = nanoserve.cache_stats(model)
            assert stats["bytes_reserved"] <= 400_000
    with torch.no_grad():
        stock = model.generate(**padded_batch([40, 9], 40), max_new_tokens=4, **GREEDY)
    assert torch.equal(out, stock)
    for later in pools[1:]:
        assert all(a is b for a, b in zip(pools[0], later, strict=True))
