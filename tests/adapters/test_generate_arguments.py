"""generate's arguments as stock reads them: a generation config passed by position, one
that leaves options to the model's generation config, integer ids of another dtype, and
kept scores that are tensors of their own. The pool is sized from what the call will do,
so misreading an option there fails the call (OutOfBlocks) where stock works."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from helpers import patched
from test_decode_loop import eos_early
from test_families import padded_batch, tiny_model
from transformers import GenerationConfig

import nanoserve


def both(model, call, seed=None):
    """(stock's output, the patched model's output, the loop that ran) of ``call()``."""
    outs = []
    for patch in (False, True):
        if seed is not None:
            torch.manual_seed(seed)
        with patched(model) if patch else nullcontext(), torch.no_grad():
            outs.append(call())
            loop = nanoserve.decode_graph_stats(model)["decode_loop"] if patch else None
    return (*outs, loop)


@pytest.mark.parametrize("copies", [1, 4])
def test_a_generation_config_passed_by_position(copies):
    """``generate(ids, GenerationConfig(...))``: its max_new_tokens (past the model's
    default length) and num_return_sequences size the pool. Planted, reverted: only the
    keyword read: OutOfBlocks ("needed 1, 0 free")."""
    model = tiny_model("llama", seed=10)
    inputs = padded_batch([13, 6, 2], 13)
    config = GenerationConfig(
        max_new_tokens=60, do_sample=copies > 1, num_return_sequences=copies,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip

    def call():
        return model.generate(inputs["input_ids"], config, attention_mask=inputs["attention_mask"])

    stock, ours, loop = both(model, call, seed=5)
    assert stock.shape == (3 * copies, 13 + 60)
    assert torch.equal(stock, ours) and loop == "nanoserve"


def test_a_passed_config_takes_the_models_other_options():
    """The model's generation config sets max_length 100 and num_return_sequences 3; the
    passed config sets neither: transformers fills them from the model's, and so must the
    pool's size. Planted, reverted: no fallback to the model's config: OutOfBlocks."""
    model = tiny_model("llama", seed=10)
    model.generation_config.max_length = 100
    model.generation_config.num_return_sequences = 3
    inputs = padded_batch([13, 6, 2], 13)
    config = GenerationConfig(do_sample=True, top_k=0, eos_token_id=None, pad_token_id=0)
    stock, ours, _ = both(model, lambda: model.generate(**inputs, generation_config=config), 3)
    assert stock.shape == (9, 100)
    assert torch.equal(stock, ours)


@pytest.mark.parametrize("dict_out", [False, True], ids=["tensor", "dict"])
def test_int32_ids_give_int64_sequences(dict_out):
    """Stock's sequences are int64 whatever the prompt's integer dtype (its concatenation
    promotes them); rows finishing early leave the batch (tensor output). Planted, reverted:
    the sequences in the prompt's dtype: int32 out, and a crash where rows left."""
    model = eos_early(tiny_model("llama", seed=10), 3.0)  # rows end after 6, 13 and 4 tokens
    inputs = padded_batch([13, 6, 2], 13)
    inputs["input_ids"] = inputs["input_ids"].int()
    extra = dict(return_dict_in_generate=True) if dict_out else {}
    stock, ours, loop = both(model, lambda: model.generate(**inputs, max_new_tokens=30, **extra))
    if dict_out:
        stock, ours = stock.sequences, ours.sequences
    assert stock.dtype == ours.dtype == torch.int64
    assert torch.equal(stock, ours) and loop == "nanoserve"


def test_kept_scores_are_not_the_kept_logits():
    """With ``min_new_tokens`` the only processor, stock's scores past the minimum are a copy
    of the logits (each processor returns a new tensor); so are nanoserve's. Planted,
    reverted: the processed scores kept as they came: a write into ``scores[4]`` changed
    ``logits[4]``."""
    model = tiny_model("llama", seed=10)
    inputs = padded_batch([13, 6], 13)
    opts = dict(max_new_tokens=6, min_new_tokens=2, return_dict_in_generate=True,
                output_scores=True, output_logits=True, eos_token_id=2)  # fmt: skip
    stock, ours, loop = both(model, lambda: model.generate(**inputs, **opts))
    assert loop == "nanoserve"
    for out in (stock, ours):
        assert out.scores[4] is not out.logits[4]
        assert torch.equal(out.scores[4], out.logits[4])
    for a, b in zip(stock.scores, ours.scores, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("by_position", [False, True])
def test_a_callers_max_length_criteria_sizes_the_pool(by_position):
    """A ``MaxLengthCriteria`` passed in ``stopping_criteria`` replaces generate's own (its
    max_new_tokens then bounds nothing): the pool holds its length. Planted, reverted: the
    criteria not read: OutOfBlocks ("needed 1, 0 free") where stock returned 67 columns."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    model = tiny_model("llama", seed=10)
    inputs = padded_batch([7, 4, 6], 7)
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=67)])
    opts = dict(max_new_tokens=3, eos_token_id=None, do_sample=False)
    if by_position:
        args = (inputs["input_ids"], None, None, criteria)
        kwargs = dict(attention_mask=inputs["attention_mask"], **opts)
    else:
        args, kwargs = (), dict(**inputs, stopping_criteria=criteria, **opts)
    stock, ours, loop = both(model, lambda: model.generate(*args, **kwargs))
    assert stock.shape == (3, 67) and torch.equal(stock, ours)
    assert loop == "nanoserve"


def test_a_keyword_given_as_none_overrides_the_models_config():
    """``max_new_tokens=None, max_length=L`` on a model whose generation config sets
    max_new_tokens (as hub configs do): transformers sets the call's keywords last, None
    included, so the call runs to ``max_length``; the pool is sized for that. Found by a
    probe: the model's max_new_tokens sized the pool (OutOfBlocks). Planted: a keyword of
    None read as not given: OutOfBlocks."""
    model = tiny_model("llama", seed=10)
    model.generation_config.max_new_tokens = 4
    inputs = padded_batch([13, 6, 2], 13)
    call = lambda: model.generate(  # noqa: E731
        **inputs, max_new_tokens=None, max_length=60, do_sample=False, eos_token_id=None
    )
    stock, ours, loop = both(model, call)
    assert stock.shape[1] == 60 and torch.equal(ours, stock) and loop == "nanoserve"


def test_the_loop_reported_is_the_latest_calls():
    """``decode_graph_stats(model)["decode_loop"]`` after a beam search or prompt-lookup
    call that follows a sampled one: None (transformers' own loops ran), then "nanoserve"
    again for greedy. Found by a probe: the sampled call's "nanoserve" stayed. Planted: no
    reset at a call's start: failed."""
    model = tiny_model("llama", seed=10)
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    opts = dict(input_ids=ids, max_new_tokens=4, eos_token_id=None)
    seen = []
    with patched(model), torch.no_grad():
        for extra in (dict(do_sample=True), dict(num_beams=2), dict(do_sample=True),
                      dict(prompt_lookup_num_tokens=2), dict(do_sample=False)):  # fmt: skip
            model.generate(**opts, **extra)
            seen.append(nanoserve.decode_graph_stats(model)["decode_loop"])
    assert seen == ["nanoserve", None, "nanoserve", None, "nanoserve"]
