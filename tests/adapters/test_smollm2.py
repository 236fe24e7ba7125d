"""SmolLM2-135M-Instruct (real weights, float32, CPU): patched generate == stock generate."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import chat, patched, stock_and_paged

import nanoserve

QUESTIONS = [
    "What is the capital of France?",
    "Name a color.",
    "Write one sentence about the sea and the sky at night.",
]


def test_greedy_single_prompt(smollm2):
    model, tok = smollm2
    inputs = chat(tok, QUESTIONS[:1])
    stock, paged = stock_and_paged(model, **inputs, max_new_tokens=16, do_sample=False)
    assert torch.equal(stock, paged)
    assert "Paris" in tok.decode(paged[0])


def test_greedy_left_padded_batch(smollm2):
    model, tok = smollm2
    inputs = chat(tok, QUESTIONS)
    assert (inputs["attention_mask"] == 0).any()  # really padded
    stock, paged = stock_and_paged(model, **inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(stock, paged)


def test_beam_search(smollm2):
    model, tok = smollm2
    inputs = chat(tok, QUESTIONS[:2])
    stock, paged = stock_and_paged(
        model, **inputs, max_new_tokens=8, num_beams=3, do_sample=False, early_stopping=True
    )
    assert torch.equal(stock, paged)


def test_seeded_sampling_and_num_return_sequences(smollm2):
    model, tok = smollm2
    inputs = chat(tok, QUESTIONS[:2])
    opts = dict(max_new_tokens=8, do_sample=True, top_k=50, num_return_sequences=2)
    stock, paged = stock_and_paged(model, seed=7, **inputs, **opts)
    assert paged.shape[0] == 4
    assert torch.equal(stock, paged)
    with patched(model), torch.no_grad():
        torch.manual_seed(7)
        again = model.generate(**inputs, **opts)
    assert torch.equal(again, paged)


def test_streamer_text_equals_stock(smollm2):
    """The patched model streams what stock streams, and that is stock's returned text.
    Planted: the torch reference decode dropping the newest key (seq_lens - 1): failed (the
    old check, streamed text == the patched output's own text, passed with it)."""
    from transformers import TextStreamer

    class Collect(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            self.text = getattr(self, "text", "") + text

    model, tok = smollm2
    inputs = chat(tok, QUESTIONS[:1])

    def streamed(patch: bool):
        streamer = Collect(tok, skip_prompt=True)
        with patched(model) if patch else contextlib.nullcontext(), torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=10, do_sample=False, streamer=streamer)
        return streamer.text, out

    stock_text, stock = streamed(False)
    paged_text, paged = streamed(True)
    assert "Paris" in stock_text
    assert stock_text == tok.decode(stock[0, inputs["input_ids"].shape[1] :])
    assert paged_text == stock_text
    assert torch.equal(paged, stock)


def test_stopping_criteria_and_per_row_eos(smollm2):
    """A stopping criterion (stop after a comma) and EOS end rows at different steps; the
    pad id (<|endoftext|>) differs from EOS, so the output shows where each row ended: one
    row EOS then pads, one the comma then pads, one running to max_new_tokens. Planted:
    patched generate dropping stopping_criteria, and dropping eos_token_id: both failed."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfterComma(StoppingCriteria):
        def __init__(self, token_id):
            self.token_id = token_id

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token_id

    model, tok = smollm2
    inputs = chat(tok, QUESTIONS)
    comma = tok.convert_tokens_to_ids(",")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    assert len({comma, end, pad}) == 3
    criteria = StoppingCriteriaList([StopAfterComma(comma)])
    new_tokens = 14
    stock, paged = stock_and_paged(
        model,
        **inputs,
        max_new_tokens=new_tokens,
        do_sample=False,
        stopping_criteria=criteria,
        eos_token_id=end,
        pad_token_id=pad,
    )
    assert torch.equal(stock, paged)
    ends = {}  # how each row ended: (last real token, its step)
    for row in paged[:, inputs["input_ids"].shape[1] :].tolist():
        n = len(row)
        while n and row[n - 1] == pad:
            n -= 1
        assert pad not in row[:n]
        ends[row[n - 1] if n < new_tokens else "max_new_tokens"] = n
    assert set(ends) == {end, comma, "max_new_tokens"}, ends
    assert len(set(ends.values())) == 3, ends  # three rows, three different last steps


def test_two_calls_independent(smollm2):
    model, tok = smollm2
    first, second = chat(tok, QUESTIONS[:1]), chat(tok, QUESTIONS[1:2])
    with patched(model), torch.no_grad():
        a = model.generate(**first, max_new_tokens=6, do_sample=False)
        b = model.generate(**second, max_new_tokens=6, do_sample=False)
        a_again = model.generate(**first, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        b_stock = model.generate(**second, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, a_again)
    assert torch.equal(b, b_stock)


def test_unpatch_restores_stock(smollm2):
    model, tok = smollm2
    before = (
        model.config._attn_implementation,
        dict(model.__dict__),
        len(model.model._forward_pre_hooks),
        len(model.model._forward_hooks),
    )
    nanoserve.patch_model(model)
    assert model.config._attn_implementation == "nanoserve_paged"
    nanoserve.unpatch_model(model)
    after = (
        model.config._attn_implementation,
        dict(model.__dict__),
        len(model.model._forward_pre_hooks),
        len(model.model._forward_hooks),
    )
    assert after == before
    inputs = chat(tok, QUESTIONS[:1])
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True
        )
    assert type(out.past_key_values).__name__ == "DynamicCache"


def test_pad_tokens_never_stored(smollm2):
    model, tok = smollm2
    inputs = chat(tok, ["Hi", QUESTIONS[2] + " Then write another one about mountains."])
    mask = inputs["attention_mask"]
    pads = int((mask == 0).sum())
    assert pads > 16  # long padding
    new = 3
    for sharing in (False, True):
        with patched(model, prefix_sharing=sharing), torch.no_grad():
            model.generate(**inputs, max_new_tokens=new, do_sample=False)
            stats = nanoserve.cache_stats(model)
        # the last generated token is never fed back, so each row stores new - 1 of them
        assert stats["tokens"] == int(mask.sum()) + mask.shape[0] * (new - 1)
        # every stored token holds a slot of its own, except the leading full blocks the two
        # chat prompts share (the chat template's system prompt), stored once with sharing
        shared = stats["tokens_not_recomputed"]
        assert (shared > 0) == sharing and shared % 16 == 0
        assert stats["slots_filled"] == stats["tokens"] - shared


def test_out_of_blocks_leaves_cache_consistent(smollm2):
    model, tok = smollm2
    inputs = chat(tok, QUESTIONS[:1])
    prompt = inputs["input_ids"].shape[1]
    blocks = -(-prompt // 16)  # room for the prompt and a few tokens, not for 40 more
    with patched(model, num_blocks=blocks), torch.no_grad():
        with pytest.raises(nanoserve.OutOfBlocks, match="num_blocks"):
            model.generate(**inputs, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        cache = nanoserve.adapters.last_cache(model)
        stored = blocks * 16  # every slot filled, the failed step stored nothing
        assert cache.get_seq_length() == stored
        assert nanoserve.cache_stats(model)["tokens"] == stored
        assert cache.paged.allocator.num_free == 0
        # what is stored is what stock computes for the first `stored` tokens
        short = stored - prompt + 1
        out = model.generate(**inputs, max_new_tokens=short, do_sample=False)
    with torch.no_grad():
        assert torch.equal(out, model.generate(**inputs, max_new_tokens=short, do_sample=False))
