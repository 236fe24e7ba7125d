"""Short extend steps over cached tokens through the graph runner's static buffers.

A later chat turn over a cached system prompt, the rows' own tokens after a shared prefix,
and prefill chunks after the first run as CUDA graphs of [rows, columns] buckets: rows left
padded to the bucket's columns, each row's padding a sequence of its own. On CPU the runner
executes those buffers eagerly (``DecodeGraphs(capture=False)``); the GPU test captures.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BACKENDS,
    NEEDS_INTERPRETER,
    check_launches,
    count_triton_launches,
    sharpen,
    spy_packed,
)
from test_families import tiny_model

import nanoserve
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.extend_static import column_bucket
from nanoserve.adapters.step import state_of

GREEDY = dict(do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
VOCAB = 97


def test_column_buckets():
    sizes = (1, 16, 17, 32, 33, 64, 65, 200, 256, 257, 384, 385, 1000, 4096, 4097)
    assert [column_bucket(n) for n in sizes] == [
        None, None, 32, 32, 64, 64, 128, 256, 256, 384, 384, 512, 1024, 4096, None,
    ]  # fmt: skip


def chat_batch(system: torch.Tensor, own: list[int], gen: torch.Generator, device="cpu"):
    """Rows of ``system`` followed by their own random tokens (``own``: how many), left
    padded with id 0."""
    rows = [torch.cat([system, torch.randint(3, VOCAB, (n,), generator=gen)]) for n in own]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def check_calls(model, calls, patch_options, graphs, new_tokens=4, tolerance=1e-5):
    """Each call of ``calls`` on the patched model gives stock's tokens and logits (within
    ``tolerance``); returns the extend replays of each call."""
    with torch.no_grad():
        # a process's first stock call can take other CPU kernels (seen: logits 1.4e-3 off
        # the later calls' with some PYTHONHASHSEED values): the references come after it
        model.generate(**calls[0], max_new_tokens=1, do_sample=False, eos_token_id=None)
        stock = [model.generate(**call, max_new_tokens=new_tokens, **GREEDY) for call in calls]
    nanoserve.patch_model(model, **patch_options)
    if graphs is not None:
        state_of(model).graphs = graphs
    replays = []
    try:
        for call, expected in zip(calls, stock, strict=True):
            before = nanoserve.decode_graph_stats(model)["extend_replays"]
            with torch.no_grad():
                out = model.generate(**call, max_new_tokens=new_tokens, **GREEDY)
            assert torch.equal(out.sequences, expected.sequences)
            for ours, theirs in zip(out.logits, expected.logits, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
            del out  # a cache the caller holds keeps its pool (and prefixes) from the next call
            stats = nanoserve.decode_graph_stats(model)
            assert stats["extend_disabled"] is None, stats
            replays.append(stats["extend_replays"] - before)
    finally:
        nanoserve.unpatch_model(model)
    return replays


@BACKENDS
def test_later_turns_over_a_cached_prompt_match_stock(backend, monkeypatch):
    """Three calls share a 40-token system prompt; their rows' own 17..33 tokens (the
    buckets of 32 and 64 columns, 3 rows padding the bucket of 4) extend the cached prompt
    through the static buffers. Planted: the rows' cached lengths one short, or their block
    tables in the padding sequences' places: failed."""
    model = sharpen(tiny_model("llama"))
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, VOCAB, (40,), generator=gen)
    calls = [chat_batch(system, own, gen) for own in ([20, 25, 30], [18, 33], [17])]
    launches = count_triton_launches(monkeypatch)
    patch = {"block_size": 4, "backend": backend}
    replays = check_calls(model, calls, patch, DecodeGraphs(capture=False))
    check_launches(launches, backend)
    assert replays == [1, 1, 1]  # the first call's rows extend the prefix it computed


def test_prefill_chunks_after_the_first_take_the_extend_buffers():
    """``prefill_chunk_size=24``: the second and third chunks of a 70-token prompt extend
    what the first stored."""
    model = sharpen(tiny_model("llama"))
    gen = torch.Generator().manual_seed(1)
    call = chat_batch(torch.randint(3, VOCAB, (30,), generator=gen), [40, 20], gen)
    call["prefill_chunk_size"] = 24
    replays = check_calls(model, [call], {"block_size": 4}, DecodeGraphs(capture=False))
    assert replays == [2]


def test_steps_outside_the_buckets_run_eagerly():
    """A later turn of at most 16 tokens (the verify kernel's steps) stays eager, with
    stock's tokens."""
    model = sharpen(tiny_model("llama"))
    gen = torch.Generator().manual_seed(2)
    system = torch.randint(3, VOCAB, (40,), generator=gen)
    calls = [chat_batch(system, [12, 5], gen), chat_batch(system, [9, 16], gen)]
    replays = check_calls(model, calls, {"block_size": 4}, DecodeGraphs(capture=False))
    assert replays == [0, 0]


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_a_prompts_own_prefill_takes_the_extend_buffers(prefix_sharing):
    """Prompts with nothing cached (different random rows, left padded, 17..50 tokens) are
    prefilled through the extend buffers once an earlier call has made the pool, with
    stock's tokens; the first call, whose forward allocates the pools, stays eager. With
    ``prefix_sharing=False`` the prefill starts the sequences itself. Planted: the fresh
    prompt's prefill kept eager (as before): failed; its rows' lengths one long: failed."""
    model = sharpen(tiny_model("llama"))
    gen = torch.Generator().manual_seed(5)
    calls = [chat_batch(torch.empty(0, dtype=torch.long), own, gen)
             for own in ([45, 50, 38], [30, 41], [17], [33, 29, 20])]  # fmt: skip
    patch = {"block_size": 4, "prefix_sharing": prefix_sharing}
    replays = check_calls(model, calls, patch, DecodeGraphs(capture=False))
    assert replays == [0, 1, 1, 1]


def test_padding_sequences_read_no_table_entry_past_the_buffer(monkeypatch):
    """Prompts left padded far past their tokens (110 columns, 10-12 tokens) over a pool
    capped at 8 blocks of 4 (tables 8 wide): every step through the extend buffers keeps
    each sequence's block-table reads inside the buffer (a read past it is a fault or
    another allocation's bytes on a GPU), and the tokens are stock's. Planted: the
    ``fits_tables`` check dropped: failed (entry 28 of 16 read)."""
    from nanoserve.adapters import extend_static

    past_end = []
    load = extend_static.StaticExtend.load

    def checked_load(self, host, input_ids, position_ids):
        load(self, host, input_ids, position_ids)
        seqs = 2 * self.rows
        lens = self.host_buffer.numpy()[self.rows * self.columns :][:seqs]
        for seq, length in enumerate(lens.tolist()):
            last = seq * self.width + -(-length // 4) - 1  # block size 4
            if last >= seqs * self.width:
                past_end.append((seq, last, seqs * self.width))

    monkeypatch.setattr(extend_static.StaticExtend, "load", checked_load)
    model = sharpen(tiny_model("llama"))
    gen = torch.Generator().manual_seed(6)
    calls = []
    for own in ([10], [12], [9, 5], [11, 6]):
        call = chat_batch(torch.empty(0, dtype=torch.long), own, gen)
        width = 110
        pad = width - call["input_ids"].shape[1]
        call = {k: torch.nn.functional.pad(v, (pad, 0)) for k, v in call.items()}
        calls.append(call)
    for sharing in (False, True):
        patch = {"block_size": 4, "num_blocks": 8, "prefix_sharing": sharing}
        check_calls(model, calls, patch, DecodeGraphs(capture=False))
    assert not past_end, past_end[:3]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.gpu
def test_captured_extends_over_a_cached_prompt_match_stock():
    """Captured and replayed extend graphs (float32): later turns over a cached 64-token
    system prompt and prompts with nothing cached (300-odd tokens, the 384-column bucket)
    give stock's tokens. A bucket is captured the second time it comes (the first runs on
    its buffers without a graph) and replayed after. Planted: captured at once: failed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = sharpen(LlamaForCausalLM(config).eval())
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(3, VOCAB, (64,), generator=gen)
    # buckets (rows, columns): (4, 32) twice, (2, 64) twice, (1, 64) once, then (1, 384) twice
    own = ([20, 25, 30], [21, 29, 24], [18, 33], [19, 40], [40])
    calls = [chat_batch(system, n, gen, device="cuda") for n in own]
    nothing = torch.empty(0, dtype=torch.long)
    calls += [chat_batch(nothing, [n], gen, device="cuda") for n in (300, 310)]
    # one pool size for every call: each call takes over the last one's pool (and graphs)
    replays = check_calls(model, calls, {"num_blocks": 256}, None, new_tokens=6, tolerance=1e-4)
    assert replays == [0, 1, 0, 1, 0, 0, 1]
    nanoserve.patch_model(model)
    try:
        with torch.no_grad():
            for call in calls[:4]:
                model.generate(**call, max_new_tokens=6, do_sample=False, eos_token_id=None)
        stats = nanoserve.decode_graph_stats(model)
    finally:
        nanoserve.unpatch_model(model)
    assert stats["extend_replays"] == 2 and stats["extend_disabled"] is None, stats


def test_compile_decode_leaves_extend_steps_uncompiled(monkeypatch):
    """With ``compile_decode=True`` the decode steps run the compiled layers and the extend
    steps the stock ones (each bucket's shapes would compile them again). Planted: extend
    steps under the compiled layers: failed."""
    import contextlib

    from nanoserve.adapters import graph_forward

    entered = []
    monkeypatch.setattr(
        graph_forward,
        "_compiled",
        lambda model, state: entered.append(state.compile_decode) or contextlib.nullcontext(),
    )
    model = sharpen(tiny_model("llama"))
    gen = torch.Generator().manual_seed(4)
    system = torch.randint(3, VOCAB, (40,), generator=gen)
    calls = [chat_batch(system, own, gen) for own in ([20, 25], [30, 18])]
    graphs = DecodeGraphs(capture=False)
    patch = {"block_size": 4, "compile_decode": True}
    replays = check_calls(model, calls, patch, graphs)
    assert replays == [1, 1]
    assert entered == [True] * (graphs.replays - graphs.extend_replays)


@NEEDS_INTERPRETER
def test_turns_through_the_extend_buffers_take_the_split_packed_kernel(monkeypatch):
    """float16 turns over a cached prompt through the static buffers (padding sequences among
    the rows) run the packed kernel split over the history (132 SMs counted, 8 keys a split),
    and follow the tiled kernel's tokens and logits (float16 tolerance). Planted: the packed
    kernel's history one token short (ctx = seq_len - q_len - 1): the logits left the tiles'."""
    from types import SimpleNamespace

    from test_fused_decode import assert_follows

    from nanoserve.kernels import triton_extend, triton_verify

    model = sharpen(tiny_model("llama")).to(torch.float16)
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, VOCAB, (40,), generator=gen)
    calls = [chat_batch(system, own, gen) for own in ([20, 25, 30], [18, 33])]
    monkeypatch.setattr(triton_verify, "sm_count", lambda device: 132)
    monkeypatch.setattr(triton_verify, "TURN_SPLIT_KEYS", 8)
    splits = spy_packed(monkeypatch, "num_splits")

    def run():
        nanoserve.patch_model(model, block_size=4, backend="triton")
        state_of(model).graphs = DecodeGraphs(capture=False)
        outs = []
        try:
            for call in calls:
                with torch.no_grad():
                    out = model.generate(**call, max_new_tokens=4, **GREEDY)
                outs.append(SimpleNamespace(sequences=out.sequences, logits=out.logits))
                del out
            replays = nanoserve.decode_graph_stats(model)["extend_replays"]
        finally:
            nanoserve.unpatch_model(model)
        return outs, replays

    turns, replays = run()
    assert replays == len(calls) and splits and min(splits) > 1, (replays, splits)
    splits.clear()
    monkeypatch.setattr(triton_extend, "TURN_MAX_QUERY_LEN", 16)  # the tiled kernel
    tiles, _ = run()
    assert splits == []
    for plain, routed in zip(tiles, turns, strict=True):
        assert_follows(plain, routed)
