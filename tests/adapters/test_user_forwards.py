"""Forwards of the caller's that run with the patched model's: a subclass overriding
``forward`` and wrappers set on ``model.forward``. Stock runs them at every step on the whole
batch, so they may treat each row apart (per-request steering by batch index): nanoserve's
loop must not shrink the batch they see, and rows they may compute apart share nothing. The
mask generate infers from ``pad_token_id`` is here too: a prompt holding the pad id after its
first real token runs as stock runs it."""

from __future__ import annotations

import copy
import functools
import types

import torch
from helpers import sharpen
from test_decode_loop import EOS
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.user_hooks import scan_hooks

ROWS = 4


def _bias_by_row(vocab: int) -> torch.Tensor:
    """[ROWS, vocab]: row r prefers token 10 + r, rows 0 and 1 EOS above it (they end first)."""
    bias = torch.zeros(ROWS, vocab)
    for row in range(ROWS):
        bias[row, 10 + row] = 30.0
    bias[:2, EOS] = 60.0
    return bias


def _steered(logits: torch.Tensor, bias: torch.Tensor, seen: list) -> torch.Tensor:
    seen.append(logits.shape[0])
    return logits + bias[: logits.shape[0], None, :]


def _steering_subclass(model, bias: torch.Tensor, seen: list):
    """``model`` turned into an instance of a subclass of its class whose ``forward`` adds a
    logit bias per row of the batch, by batch index."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        out = super(type(self), self).forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )
        out.logits = _steered(out.logits, bias, seen)
        return out

    model.__class__ = type("Steered", (type(model),), {"forward": forward})
    return model


def _steering_wrapper(model, bias: torch.Tensor, seen: list) -> None:
    """A wrapper set on ``model.forward`` adding a logit bias per row, by batch index."""
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        out.logits = _steered(out.logits, bias, seen)
        return out

    model.forward = forward


def _stock_and_patched(make, when="before"):
    """Greedy tokens and the batch sizes the steering saw, stock then patched (``when``: the
    steering set before or after ``patch_model``), and the patched call's loop."""
    results = []
    inputs = padded_batch([9, 6, 9, 3], 9)
    for patch in (False, True):
        model = tiny_model("llama", seed=4)
        bias, seen = _bias_by_row(model.config.vocab_size), []
        if patch and when == "after":
            nanoserve.patch_model(model)
        model = make(model, bias, seen) or model
        if patch and when == "before":
            nanoserve.patch_model(model)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        loop = nanoserve.decode_graph_stats(model)["decode_loop"] if patch else None
        results.append((out, seen, loop))
    return results


def test_a_subclass_forward_sees_every_row_as_in_stock():
    """A subclass's forward steers each row by batch index; rows 0 and 1 end at once. Planted:
    the subclass's forward not looked at (nanoserve's loop ran, shrinking the batch it saw):
    other tokens than stock's."""
    (stock, stock_seen, _), (ours, seen, loop) = _stock_and_patched(_steering_subclass)
    assert torch.equal(stock, ours)
    assert seen == stock_seen and set(seen) == {ROWS}
    assert loop.startswith("stock: Steered.forward (a class forward of the caller's)"), loop
    assert (stock[:2, 9:] == EOS).any(dim=1).all()


def test_a_wrapper_set_before_patching_sees_every_row_as_in_stock():
    """The same steering as a wrapper set on the instance before ``patch_model`` (the patched
    forward calls it at every step). Planted: such a wrapper taken for the model's own
    forward: other tokens than stock's."""
    (stock, stock_seen, _), (ours, seen, loop) = _stock_and_patched(_steering_wrapper)
    assert torch.equal(stock, ours)
    assert seen == stock_seen and set(seen) == {ROWS}
    assert loop.startswith("stock: a wrapper set on model.forward before patch_model"), loop


def test_a_wrapper_set_after_patching_sees_every_row_as_in_stock():
    """The steering set on ``model.forward`` after patching (it holds the patched forward):
    HF's loop runs. Planted: the model's wrapped forward not looked at: other tokens than
    stock's."""
    (stock, stock_seen, _), (ours, seen, loop) = _stock_and_patched(_steering_wrapper, "after")
    assert torch.equal(stock, ours)
    assert seen == stock_seen and set(seen) == {ROWS}
    assert loop.startswith("stock: a wrapper set on model.forward after patch_model"), loop


def test_a_subclass_forward_that_offsets_each_row_shares_no_copy():
    """Three copies of one prompt, a subclass's forward adding a vector per row to the input
    embeddings (a soft prompt per request): no row may take another's prefill. Planted: the
    subclass's forward not looked at: the copies were shared and every row gave row 0's
    tokens."""
    vectors = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        embeds = self.get_input_embeddings()(input_ids) + vectors[: input_ids.shape[0], None, :]
        return super(type(self), self).forward(
            inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )

    model = sharpen(tiny_model("llama", seed=5))
    model.__class__ = type("RowPrompt", (type(model),), {"forward": forward})
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(1)).repeat(3, 1)
    opts = dict(input_ids=ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        stock = reference.generate(**opts)
        nanoserve.patch_model(model)
        ours = model.generate(**opts)
    assert torch.equal(stock, ours)
    assert nanoserve.cache_stats(model)["rows_shared"] == 0
    assert len({tuple(row) for row in stock[:, 20:].tolist()}) > 1  # the rows do differ


def test_library_forwards_keep_every_shortcut():
    """A subclass without a forward of its own, and accelerate's output cast set on the
    instance before patching, rule nothing out; a subclass's own forward rules out all three
    (planted: the class forward's module not read: ``(None, None, None)``)."""
    from accelerate.utils.operations import convert_outputs_to_fp32

    model = tiny_model("llama")
    model.__class__ = type("Renamed", (type(model),), {})
    nanoserve.patch_model(model)
    assert scan_hooks(model) == (None, None, None)
    nanoserve.unpatch_model(model)
    model.forward = types.MethodType(convert_outputs_to_fp32(type(model).forward), model)
    nanoserve.patch_model(model)
    assert scan_hooks(model) == (None, None, None)
    nanoserve.unpatch_model(model)
    model = _steering_subclass(tiny_model("llama"), torch.zeros(ROWS, 97), [])
    phrase = "Steered.forward (a class forward of the caller's)"
    assert scan_hooks(model) == (phrase, phrase, phrase)


def test_accelerates_hook_around_a_wrapper_of_the_callers_counts_the_wrapper():
    """accelerate's device hook set on the model before patching, around the model's own
    forward, rules nothing out; around a wrapper of the caller's it rules out all three, as
    the wrapper alone does. Planted: accelerate's wrapper taken as neutral whatever it
    wraps: ``(None, None, None)``."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = tiny_model("llama")
    add_hook_to_module(model, AlignDevicesHook(execution_device="cpu"))
    nanoserve.patch_model(model)
    assert scan_hooks(model) == (None, None, None)
    model = tiny_model("llama")
    _steering_wrapper(model, torch.zeros(ROWS, 97), [])
    add_hook_to_module(model, AlignDevicesHook(execution_device="cpu"))
    nanoserve.patch_model(model)
    phrase = "a wrapper set on model.forward before patch_model"
    assert scan_hooks(model) == (phrase, phrase, phrase)


def test_a_prompt_holding_the_pad_id_without_a_mask_runs_as_stock():
    """No attention_mask, and ids holding ``pad_token_id`` after a row's first real token:
    generate infers a mask with a hole there (or right padding), and stock attends around
    it; the same ids with the pad id only ahead of each row run on the paged cache. Planted:
    the inferred mask not checked: "attention_mask: padding after a real token" raised."""
    model = sharpen(tiny_model("llama", seed=6))
    reference = copy.deepcopy(model)
    nanoserve.patch_model(model)
    hole = torch.tensor([[5, 9, 0, 0, 7, 8, 11], [4, 6, 8, 10, 12, 14, 16]])
    right = torch.tensor([[5, 9, 7, 8, 11, 0, 0]])
    left = torch.tensor([[0, 0, 5, 9, 7, 8, 11], [4, 6, 8, 10, 12, 14, 16]])
    opts = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    for ids, paged in ((hole, False), (right, False), (left, True)):
        with torch.no_grad():
            stock = reference.generate(input_ids=ids, **opts)
            ours = model.generate(input_ids=ids, **opts)
        assert torch.equal(stock, ours)
        assert (nanoserve.decode_graph_stats(model)["decode_loop"] == "nanoserve") is paged
