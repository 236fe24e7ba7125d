"""Decoder layers added or dropped after ``patch_model``: the paged pools are laid out for
the layers ``config.num_hidden_layers`` gave at patch time, so a layer whose attention
writes a cache layer past them is refused before the call runs anything (it failed halfway
through a forward before), and a model with fewer layers runs on the larger layout."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import sharpen
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.step import state_of

GREEDY = dict(do_sample=False, eos_token_id=None, max_new_tokens=5)


def _append_layer(model) -> None:
    """A copy of the last decoder layer appended as a new layer, sharing the model's config
    (as a user growing a model in place would), with config.num_hidden_layers updated."""
    layers = model.model.layers
    new = copy.deepcopy(layers[-1])
    for module in new.modules():
        if "config" in module.__dict__:
            module.config = model.config
    new.self_attn.layer_idx = len(layers)
    layers.append(new)
    model.config.num_hidden_layers = len(layers)


def _pair():
    model = sharpen(tiny_model("llama"))
    return model, copy.deepcopy(model)


def test_a_layer_added_after_patching_is_refused_before_any_forward():
    model, stock = _pair()
    inputs = padded_batch([7, 4], 7)
    nanoserve.patch_model(model)
    with torch.no_grad():
        model.generate(**inputs, **GREEDY)
        _append_layer(model)
        _append_layer(stock)
        forwards = []
        model.model.layers[0].register_forward_hook(lambda *_: forwards.append(1))
        with pytest.raises(ValueError, match=r"layers\.2\.self_attn \(layer_idx 2\).*patch_model"):
            model.generate(**inputs, **GREEDY)
        assert forwards == []  # refused before the prefill
        nanoserve.patch_model(model)
        out = model.generate(**inputs, **GREEDY)
        assert forwards  # (the hook sees the calls after patching again)
        assert torch.equal(out, stock.generate(**inputs, **GREEDY))
    nanoserve.unpatch_model(model)


def test_a_model_with_a_layer_past_its_config_is_refused_at_patch_time():
    model, _ = _pair()
    _append_layer(model)
    model.config.num_hidden_layers -= 1  # the config no longer counts the new layer
    with pytest.raises(ValueError, match=r"layer_idx 2.*config\.num_hidden_layers"):
        nanoserve.patch_model(model)
    assert state_of(model) is None


def test_a_layer_dropped_after_patching_runs_on_the_larger_layout():
    model, stock = _pair()
    inputs = padded_batch([7, 4], 7)
    nanoserve.patch_model(model)
    with torch.no_grad():
        model.generate(**inputs, **GREEDY)
        for m in (model, stock):
            del m.model.layers[1]
            m.config.num_hidden_layers = 1
        assert torch.equal(model.generate(**inputs, **GREEDY), stock.generate(**inputs, **GREEDY))
    nanoserve.unpatch_model(model)


def test_a_data_parallel_wrapper_is_refused_naming_the_model_inside():
    model, _ = _pair()
    with pytest.raises(ValueError, match=r"patch_model\(model\.module\)"):
        nanoserve.patch_model(torch.nn.DataParallel(model))
    assert state_of(model) is None
