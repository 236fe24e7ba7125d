"""Copies of one prompt in a batch are prefilled once and share their blocks (issue 14's
within-call case): repeated rows, ``num_return_sequences``, beams; the tokens stay stock's."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from helpers import patched
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.step import state_of

GREEDY = dict(do_sample=False, eos_token_id=None)
BACKENDS = ["auto"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def repeated_batch():
    """Rows A, B, A, A, C, B (left padded; A 11 tokens, B 6, C 3)."""
    base = padded_batch([11, 6, 3], 11, seed=4)
    order = [0, 1, 0, 0, 2, 1]
    return {k: v[order] for k, v in base.items()}


def first_forward_rows(model):
    """A list that receives the batch size of every forward of ``model``'s base model."""
    sizes = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    return sizes


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_rows_are_prefilled_once(backend):
    model = tiny_model("llama")
    inputs = repeated_batch()
    opts = dict(max_new_tokens=7, output_logits=True, return_dict_in_generate=True, **GREEDY)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    sizes = first_forward_rows(model)
    with patched(model, block_size=4, backend=backend), torch.no_grad():
        paged = model.generate(**inputs, **opts)
        stats = nanoserve.cache_stats(model)
    assert sizes[0] == 3 and sizes[1:] == [6] * 6  # the prefill ran A, B, C once each
    assert stats["rows_shared"] == 3 and stats["tokens_not_recomputed"] == 2 * 11 + 6
    assert torch.equal(stock.sequences, paged.sequences)
    for step, (a, b) in enumerate(zip(stock.logits, paged.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    # stored once: A's and B's full blocks are held by every copy (2 of A's 11, 1 of B's 6)
    assert stats["blocks_used"] < sum(-(-(n + 6) // 4) for n in (11, 6, 11, 11, 3, 6))


def test_sharing_off_prefills_every_row():
    model = tiny_model("llama")
    inputs = repeated_batch()
    sizes = first_forward_rows(model)
    with patched(model, prefix_sharing=False), torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, **GREEDY)
        stats = nanoserve.cache_stats(model)
    assert sizes[0] == 6 and stats["rows_shared"] == 0
    with pytest.raises(ValueError, match="^prefix_sharing"):
        nanoserve.patch_model(model, prefix_sharing="no")


def test_num_return_sequences_sampling_and_beams_share_the_prompt():
    model = tiny_model("llama")
    inputs = padded_batch([9, 5], 9, seed=2)
    cases = [
        dict(do_sample=True, top_k=20, num_return_sequences=3),
        dict(do_sample=False, num_beams=3, num_return_sequences=2),
    ]
    for opts in cases:
        opts = dict(max_new_tokens=6, eos_token_id=None, **opts)
        torch.manual_seed(11)
        with torch.no_grad():
            stock = model.generate(**inputs, **opts)
        sizes = first_forward_rows(model)
        with patched(model, block_size=4), torch.no_grad():
            torch.manual_seed(11)
            paged = model.generate(**inputs, **opts)
        assert sizes[0] == 2, (opts, sizes)  # HF copied each prompt; they ran once
        assert torch.equal(stock, paged), opts
        model.model._forward_pre_hooks.clear()


def test_chunked_prefill_and_static_buffers_with_repeated_rows():
    model = tiny_model("llama")
    inputs = repeated_batch()
    opts = dict(max_new_tokens=6, **GREEDY)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    with patched(model, block_size=4), torch.no_grad():
        chunked = model.generate(**inputs, **opts, prefill_chunk_size=4)
        state_of(model).graphs = DecodeGraphs(capture=False)
        replayed = model.generate(**inputs, **opts)
        replays = nanoserve.decode_graph_stats(model)["replays"]
    assert torch.equal(chunked, stock) and torch.equal(replayed, stock)
    assert replays == 5


def test_out_of_blocks_while_blocks_are_shared_loses_nothing():
    """A pool that holds the shared prefill but not every row's copy-on-write: OutOfBlocks,
    and every block's reference count still equals the tables holding it."""
    model = tiny_model("llama")
    inputs = repeated_batch()
    with patched(model, block_size=4, num_blocks=9), torch.no_grad():
        with pytest.raises(nanoserve.OutOfBlocks, match="num_blocks"):
            model.generate(**inputs, max_new_tokens=6, **GREEDY)
        paged = nanoserve.adapters.last_cache(model).paged
        owners = Counter(b for table in paged.tables for b in table.block_ids)
        for block in range(paged.allocator.num_blocks):
            assert paged.allocator.refcount(block) == owners.get(block, 0)
        assert paged.seq_lens()[0] >= 11 and paged.seq_lens()[0] == paged.seq_lens()[2]
