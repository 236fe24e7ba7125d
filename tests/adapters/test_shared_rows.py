"""Copies of one prompt in a batch are prefilled once and share their blocks (issue 14's
within-call case): repeated rows, ``num_return_sequences``, beams; the tokens stay stock's."""

from __future__ import annotations

import inspect
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


def forward_shapes(model, dim: int, monkeypatch):
    """A list that receives ``input_ids.shape[dim]`` of every forward of ``model``'s base
    model (0: the rows it ran, 1: the columns). It wraps the class's forward, not the
    instance's: a hook on a submodule would turn prefix sharing off (test_user_hooks.py)."""
    sizes, base = [], model.model
    original = type(base).forward

    def recording(self, *args, **kwargs):
        if self is base:
            sizes.append(kwargs["input_ids"].shape[dim])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(base), "forward", recording)
    return sizes


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_rows_are_prefilled_once(backend, monkeypatch):
    model = tiny_model("llama")
    inputs = repeated_batch()
    opts = dict(max_new_tokens=7, output_logits=True, return_dict_in_generate=True, **GREEDY)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
    sizes = forward_shapes(model, 0, monkeypatch)
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


def test_sharing_off_prefills_every_row(monkeypatch):
    model = tiny_model("llama")
    inputs = repeated_batch()
    sizes = forward_shapes(model, 0, monkeypatch)
    with patched(model, prefix_sharing=False), torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, **GREEDY)
        stats = nanoserve.cache_stats(model)
    assert sizes[0] == 6 and stats["rows_shared"] == 0
    with pytest.raises(ValueError, match="^prefix_sharing"):
        nanoserve.patch_model(model, prefix_sharing="no")


def test_num_return_sequences_sampling_and_beams_share_the_prompt(monkeypatch):
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
        sizes = forward_shapes(model, 0, monkeypatch)
        with patched(model, block_size=4), torch.no_grad():
            torch.manual_seed(11)
            paged = model.generate(**inputs, **opts)
        assert sizes[0] == 2, (opts, sizes)  # HF copied each prompt; they ran once
        assert torch.equal(stock, paged), opts
        monkeypatch.undo()


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


# -- prefixes stored by earlier calls ---------------------------------------------------------

SYSTEM = torch.randint(3, 97, (17,), generator=torch.Generator().manual_seed(8))


def system_prompt_batch(seed: int, rows: int = 2, user: int = 4):
    """``rows`` prompts: the same 17-token system prompt, then ``user`` tokens of their own
    (all rows one length: no padding, so positions agree on every transformers version)."""
    gen = torch.Generator().manual_seed(seed)
    users = torch.randint(3, 97, (rows, user), generator=gen)
    ids = torch.cat([SYSTEM.expand(rows, -1), users], dim=1)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_later_call_skips_the_system_prompt_an_earlier_one_stored(backend, monkeypatch):
    """The rows have no padding, so every forward's attention reads the query in place
    (no packing). Each step's logits are stock's: with that path planted to unflatten its
    output in the wrong order the tokens still agreed, and the logits did not."""
    model = tiny_model("llama")
    calls = [system_prompt_batch(seed) for seed in (1, 2, 3)]
    opts = dict(max_new_tokens=5, output_logits=True, return_dict_in_generate=True, **GREEDY)

    def generate(call):  # (tokens, logits): the output's cache is let go, the pool kept
        out = model.generate(**call, **opts)
        return out.sequences, out.logits

    with torch.no_grad():
        stock = [generate(c) for c in calls]
    widths = forward_shapes(model, 1, monkeypatch)
    with patched(model, block_size=4, backend=backend), torch.no_grad():
        first = generate(calls[0])
        stats = nanoserve.cache_stats(model)
        # within the first call: the 16 shared system-prompt tokens ran once, as a row of
        # their own (width 16), then each row its 5 others
        assert widths[:2] == [16, 5] and stats["prefix_hits"] == 2
        assert stats["tokens_not_recomputed"] == 16
        # 21 tokens a row, 5 full blocks: the 4 system-prompt blocks once, each row's fifth
        assert stats["cached_blocks"] == 4 + 2
        widths.clear()
        later = [generate(c) for c in calls[1:]]
        stats = nanoserve.cache_stats(model)
    for (tokens, logits), (stock_tokens, stock_logits) in zip([first, *later], stock, strict=True):
        assert torch.equal(tokens, stock_tokens)
        for step, (a, b) in enumerate(zip(logits, stock_logits, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    # 16 system-prompt tokens (4 full blocks) found; the first forward ran the 5 others
    assert widths[0] == 21 - 16 and stats["prefix_hits"] == 2
    assert stats["tokens_not_recomputed"] == 2 * 16


def test_prefixes_used_by_recent_calls_are_evicted_last():
    """Two system prompts in turns through a pool of 12 blocks of 4: each call needs 6 blocks
    and the two prompts hold 8, so every call evicts something. Least recently used first
    keeps both prompts (every call from the third finds its 16 tokens) and evicts the rows'
    own blocks. With the kept pool's release planted to order its cached blocks by when they
    were first stored, the fifth and sixth calls found nothing."""
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(3)
    systems = [torch.randint(3, 97, (1, 16), generator=gen) for _ in range(2)]
    calls = []
    for i in range(8):
        ids = torch.cat([systems[i % 2], torch.randint(3, 97, (1, 4), generator=gen)], dim=1)
        calls.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids)))
    opts = dict(max_new_tokens=3, **GREEDY)
    with torch.no_grad():
        stock = [model.generate(**c, **opts) for c in calls]
        found = []
        with patched(model, num_blocks=12, block_size=4):
            for call, expected in zip(calls, stock, strict=True):
                assert torch.equal(model.generate(**call, **opts), expected)
                found.append(nanoserve.cache_stats(model)["tokens_not_recomputed"])
    assert found == [0, 0] + [16] * 6


def test_a_prompt_partly_evicted_keeps_its_head():
    """A 32-token prompt (8 blocks of 4), then another prompt that needs some of its blocks
    in a 10-block pool, then the first prompt again: the eviction took the first prompt's
    last blocks, so its first 24 tokens are found, and the tokens are stock's. With the
    kept pool's release planted to give up blocks in block order (head first), nothing
    was found."""
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(3)
    first, other = (torch.randint(3, 97, (1, n), generator=gen) for n in (32, 12))
    calls = [dict(input_ids=ids, attention_mask=torch.ones_like(ids)) for ids in (first, other)]
    opts = dict(max_new_tokens=2, **GREEDY)
    with torch.no_grad():
        stock = [model.generate(**c, **opts) for c in calls]
        found = []
        with patched(model, num_blocks=10, block_size=4):
            for call, expected in zip([*calls, calls[0]], [*stock, stock[0]], strict=True):
                assert torch.equal(model.generate(**call, **opts), expected)
                found.append(nanoserve.cache_stats(model)["tokens_not_recomputed"])
    assert found == [0, 0, 24]


def test_new_weights_a_salt_or_a_release_find_nothing():
    """(A pool of 64 blocks: room for several calls' prompts, so one call's blocks are not
    evicted by the next call's.)"""
    model = tiny_model("llama")
    call = system_prompt_batch(1, rows=1)  # one row: every hit comes from an earlier call
    opts = dict(max_new_tokens=4, **GREEDY)

    def hits(**extra):
        with torch.no_grad():
            out = model.generate(**call, **opts, **extra)
        return nanoserve.cache_stats(model)["prefix_hits"], out

    with patched(model, block_size=4, num_blocks=64):
        hits()
        assert hits()[0] == 1
        with torch.no_grad():
            next(model.parameters()).add_(0.01)  # a training step, in place
        found, out = hits()
        assert found == 0  # K/V of the old weights are never served
        nanoserve.unpatch_model(model)
        with torch.no_grad():
            assert torch.equal(out, model.generate(**call, **opts))
        nanoserve.patch_model(model, block_size=4, num_blocks=64)
        hits(cache_salt="tenant a")
        assert hits(cache_salt="tenant b")[0] == 0
        assert hits(cache_salt="tenant a")[0] == 1
        nanoserve.release_memory(model)
        assert hits()[0] == 0
        with pytest.raises(ValueError, match="^cache_salt"):
            model.generate(**call, **opts, cache_salt=3)
    with patched(model, block_size=4, prefix_sharing=False):
        hits()
        assert hits()[0] == 0


def test_a_replaced_weight_or_a_changed_buffer_finds_nothing():
    """The prefix salt covers every parameter and buffer of every module, whether it changed
    in place or was replaced: a new tensor for a weight, rotary frequencies scaled in place.
    (Planted to walk the parameters only, the buffer case found the stale prefix.)"""
    model = tiny_model("llama")
    call = system_prompt_batch(1, rows=1)
    opts = dict(max_new_tokens=4, **GREEDY)

    def hits():
        with torch.no_grad():
            out = model.generate(**call, **opts)
        return nanoserve.cache_stats(model)["prefix_hits"], out

    with patched(model, block_size=4, num_blocks=64):
        hits()
        assert hits()[0] == 1
        down = model.model.layers[-1].mlp.down_proj
        down.weight = torch.nn.Parameter(down.weight.detach() * 1.5)  # not in place
        assert hits()[0] == 0
        assert hits()[0] == 1  # the new weights' prefix is found again
        with torch.no_grad():
            model.model.rotary_emb.inv_freq.mul_(0.5)
        found, out = hits()
        assert found == 0
    with torch.no_grad():
        assert torch.equal(out, model.generate(**call, **opts))


def test_cached_prefixes_with_copies_padding_beams_and_graphs():
    """A later call mixing everything: copies of a stored prompt (num_return_sequences, then
    beams), rows of other lengths (left padding), and the static-buffer graph path. (A fixed
    pool of 64 blocks: the default pool of the small first call would be too small for the
    second, which then starts a new pool without the stored prefix.)"""
    model = tiny_model("llama")
    stored = system_prompt_batch(1)
    mixed = dict(
        input_ids=torch.cat([stored["input_ids"], torch.zeros(2, 3, dtype=torch.long)], 1),
        attention_mask=torch.cat(
            [stored["attention_mask"], torch.zeros(2, 3, dtype=torch.long)], 1
        ),
    )
    mixed = {k: v.roll(3, dims=1) for k, v in mixed.items()}  # left padded by 3 columns
    longer = system_prompt_batch(4, rows=1, user=7)
    batch = {
        k: torch.cat([mixed[k], torch.cat([torch.zeros(1, 0, dtype=torch.long), longer[k]], 1)])
        for k in mixed
    }
    runs = [
        dict(do_sample=True, top_k=20, num_return_sequences=2),
        dict(do_sample=False, num_beams=2),
    ]
    for opts in runs:
        opts = dict(max_new_tokens=5, eos_token_id=None, **opts)
        torch.manual_seed(3)
        with torch.no_grad():
            expected = model.generate(**batch, **opts)
        with patched(model, block_size=4, num_blocks=64), torch.no_grad():
            model.generate(**stored, max_new_tokens=2, **GREEDY)
            state_of(model).graphs = DecodeGraphs(capture=False)
            torch.manual_seed(3)
            out = model.generate(**batch, **opts)
            stats = nanoserve.cache_stats(model)
        assert torch.equal(out, expected), opts
        assert stats["prefix_hits"] == 3 and stats["rows_shared"] == 3, stats  # all 3 prompts hit


# -- review regressions ----------------------------------------------------------------------


def test_copies_of_a_prompt_shorter_than_a_block_fit_the_default_pool():
    """9 copies of a 5-token prompt, block size 16: every copy writes into the one shared
    partial block; the last holder writes in place, so the pool sized for that fits (the
    reservation counted a copy for it too: OutOfBlocks, needed 9, 8 free)."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9]] * 9)
    opts = dict(max_new_tokens=2, **GREEDY)
    with torch.no_grad():
        stock = model.generate(input_ids=ids, **opts)
    with patched(model), torch.no_grad():
        assert torch.equal(model.generate(input_ids=ids, **opts), stock)


@pytest.mark.parametrize(
    "extra",
    [dict(prefill_chunk_size=16), dict(output_hidden_states=True, return_dict_in_generate=True)],
)
def test_copies_that_the_first_forward_cannot_share_still_fit(extra):
    """The pool is sized for shared copies only when the first forward shares them; where it
    cannot (chunked prefill shares the first chunk only; hidden states), the call still fits."""
    model = tiny_model("llama")
    ids = torch.randint(3, 97, (1, 64), generator=torch.Generator().manual_seed(2)).repeat(8, 1)
    opts = dict(max_new_tokens=2, **GREEDY, **extra)
    with torch.no_grad():
        stock = model.generate(input_ids=ids, **opts)
    with patched(model, block_size=4), torch.no_grad():
        out = model.generate(input_ids=ids, **opts)
    if isinstance(out, torch.Tensor):
        assert torch.equal(out, stock)
    else:
        assert torch.equal(out.sequences, stock.sequences)
        for a, b in zip(stock.hidden_states[0], out.hidden_states[0], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_tuple_output_with_repeated_rows():
    """``return_dict=False`` has no logits field to give every row: no sharing, no error."""
    model = tiny_model("llama")
    inputs = repeated_batch()
    with torch.no_grad():
        stock = model(**inputs, return_dict=False)[0]
        with patched(model):
            cache = nanoserve.PagedCache(nanoserve.PagedKVCache(2, 64, 4))
            params = inspect.signature(model.forward).parameters
            name = "cache" if "cache" in params else "past_key_values"
            out = model(**inputs, return_dict=False, use_cache=True, **{name: cache})
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], stock, rtol=1e-5, atol=1e-5)


def test_an_empty_prompt_beside_shared_and_stored_prefixes():
    """A row whose mask is all zeros, beside rows that share leading blocks (one call) and
    beside a row that finds its prompt stored (a second call): its logits are stock's, which
    come from the last column. Planted, reverted: the trimmed forward fed such a row its
    first column: its first logits moved by about 5 in both cases."""
    from helpers import sharpen

    model = sharpen(tiny_model("llama"))
    ids = torch.randint(3, 97, (3, 12), generator=torch.Generator().manual_seed(6))
    ids[1, :8] = ids[0, :8]  # rows 0 and 1 share two blocks of 4
    mask = torch.ones_like(ids)
    mask[2] = 0
    opts = dict(max_new_tokens=3, output_logits=True, return_dict_in_generate=True, **GREEDY)
    calls = [
        dict(input_ids=ids, attention_mask=mask),
        dict(input_ids=ids[[0, 2]], attention_mask=mask[[0, 2]]),
    ]
    with torch.no_grad():
        stock = [model.generate(**call, **opts) for call in calls]
        with patched(model, block_size=4, num_blocks=64):
            ours = []
            for call in calls:
                out = model.generate(**call, **opts)
                ours.append(
                    (out.sequences, out.logits, nanoserve.cache_stats(model)["prefix_hits"])
                )
                del out  # (a held output keeps its cache: the next call would take a fresh pool)
    assert [hits for *_, hits in ours] == [2, 1]  # shared within the first, stored for the second
    for theirs, (sequences, logits, _) in zip(stock, ours, strict=True):
        assert torch.equal(sequences, theirs.sequences)
        for a, b in zip(logits, theirs.logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
