"""PagedCache's transformers ``Cache`` methods that generate itself does not call, driven by
hand through a patched tiny model's forward and compared with stock's ``DynamicCache``
given the same operations on the unpatched model: ``batch_select_indices``,
``batch_repeat_interleave``, ``reorder_cache``, ``reset`` and ``get_max_length``.

Block size 4 with prompts of 6, 3 and 5 real tokens: every row's last block is partly
filled, so copies made by repeat/reorder share a block that the next step writes (copy on
write)."""

from __future__ import annotations

import pytest
import torch
from helpers import cache_name, patched
from test_families import padded_batch, tiny_model
from transformers import DynamicCache

import nanoserve


def paged_cache(num_blocks: int = 32) -> nanoserve.PagedCache:
    return nanoserve.PagedCache(nanoserve.PagedKVCache(2, num_blocks, 4))


class Driver:
    """One cache fed forwards by hand: ``step`` appends columns (the mask grows with them)
    and records the logits of the real tokens."""

    def __init__(self, model, cache, lengths, width, seed=1):
        self.model, self.cache = model, cache
        inputs = padded_batch(lengths, width, seed=seed)
        self.mask = inputs["attention_mask"]
        self.logits = []
        self._forward(inputs["input_ids"], self.mask)

    def _forward(self, ids, new_mask):
        with torch.no_grad():
            out = self.model(
                input_ids=ids, attention_mask=self.mask, use_cache=True,
                **{cache_name(self.model): self.cache},
            ).logits  # fmt: skip
        self.logits.append(out[new_mask[:, -ids.shape[1] :].bool()])  # pad columns dropped

    def step(self, token_ids):
        ids = torch.tensor(token_ids).view(-1, 1)
        self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=1)
        self._forward(ids, self.mask)

    def rows(self, indices):
        """The mask follows a cache whose rows became ``indices`` of the old ones."""
        self.mask = self.mask[torch.as_tensor(indices)]


def select_scenario(driver):
    driver.step([11, 12, 13])
    driver.cache.batch_select_indices(torch.tensor([2, 0]))  # drop row 1, swap the others
    driver.rows([2, 0])
    driver.step([21, 22])
    driver.step([31, 32])


def repeat_scenario(driver):
    driver.cache.batch_repeat_interleave(2)  # rows a a b b c c, sharing their blocks
    driver.rows([0, 0, 1, 1, 2, 2])
    driver.step([11, 12, 13, 14, 15, 16])  # each copy writes its own token into the shared block
    driver.step([21, 22, 23, 24, 25, 26])
    driver.cache.reorder_cache(torch.tensor([1, 1, 4, 0, 5, 5]))  # beams forked and dropped
    driver.rows([1, 1, 4, 0, 5, 5])
    driver.step([31, 32, 33, 34, 35, 36])
    driver.step([41, 42, 43, 44, 45, 46])


@pytest.mark.parametrize(
    "scenario", [select_scenario, repeat_scenario], ids=["batch_select_indices", "repeat_reorder"]
)
def test_row_operations_match_dynamic_cache(scenario):
    """Planted in hf_cache.py: batch_select_indices ignoring its indices (rows kept in
    order) failed the select case; batch_repeat_interleave tiling (a b c a b c) instead of
    interleaving failed the repeat case; copy-on-write skipped (PagedKVCache's pending
    copies never applied) failed the repeat case."""
    model = tiny_model("llama")
    stock = Driver(model, DynamicCache(), [6, 3, 5], 6)
    scenario(stock)
    with patched(model):
        paged = Driver(model, paged_cache(), [6, 3, 5], 6)
        scenario(paged)
    assert paged.cache.get_seq_length() == stock.cache.get_seq_length()
    assert paged.cache.paged.num_seqs == stock.mask.shape[0]
    assert len(paged.logits) == len(stock.logits)
    for step, (a, b) in enumerate(zip(stock.logits, paged.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"forward {step}")


def test_reset_then_prefill_equals_a_fresh_cache():
    """After ``reset()`` the cache holds nothing (no columns, no rows, every block free)
    and a new batch of another size computes what a fresh cache computes, and stock.
    Planted: reset leaving ``columns`` (positions and mask sizes shifted) failed; reset
    leaving the block tables (the new batch's rows after the old ones) failed."""
    model = tiny_model("llama")
    with patched(model):
        used = paged_cache(num_blocks=8)
        old = Driver(model, used, [6, 3, 5], 6)
        old.step([11, 12, 13])
        used.reset()
        assert used.get_seq_length() == 0 and used.paged.num_seqs == 0
        assert used.paged.allocator.num_free == 8
        again = Driver(model, used, [2, 7], 7, seed=3)
        again.step([21, 22])
        fresh = Driver(model, paged_cache(num_blocks=8), [2, 7], 7, seed=3)
        fresh.step([21, 22])
    stock = Driver(model, DynamicCache(), [2, 7], 7, seed=3)
    stock.step([21, 22])
    assert used.get_seq_length() == stock.cache.get_seq_length() == 8
    for a, b, c in zip(fresh.logits, again.logits, stock.logits, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-5)


def test_get_max_length_is_unbounded_like_dynamic_cache():
    """The paged cache has no maximum length of its own (a returned cache grows its pool
    when continued): ``get_max_length`` says so as DynamicCache does, for the cache and per
    layer. Planted: get_max_length returning the pool's slots (num_blocks * block_size):
    failed."""
    model = tiny_model("llama")
    stock = Driver(model, DynamicCache(), [6, 3], 6)
    with patched(model):
        paged = Driver(model, paged_cache(), [6, 3], 6)
    expected = stock.cache.get_max_length()
    assert paged.cache.get_max_length() == expected
    for layer in range(2):
        assert paged.cache.get_max_length(layer) == stock.cache.get_max_length(layer)
    assert expected == -1  # what transformers documents as "no maximum"


def test_layers_is_empty_and_indexing_it_says_where_the_keys_are():
    """``cache.layers`` holds no per-layer tensors (the K/V live in paged pools): loops over
    it find none, as transformers' own loops expect, and ``cache.layers[0]`` is an
    IndexError that says so (it was a bare "list index out of range"; a probe found it).
    Planted, reverted: ``layers=[]``: failed."""
    cache = paged_cache()
    assert len(cache) == 2 and list(cache.layers) == [] and len(cache.layers) == 0
    with pytest.raises(IndexError, match=r"^layers\[0\]: a PagedCache keeps .* cache\.paged"):
        cache.layers[0]
