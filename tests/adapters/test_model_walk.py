"""A generate call reads what it needs off the model's modules in one walk
(``model_walk.ModelWalk``): every tensor once, in torch's order, and the walk not kept past
the call."""

from __future__ import annotations

import torch
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.model_walk import ModelWalk
from nanoserve.adapters.prefix_salt import drops_out, length_dependent_rope
from nanoserve.adapters.user_hooks import scan_hooks


def test_walk_lists_what_the_model_holds_in_torchs_order():
    """Tied embeddings (one parameter in two modules) and a plain buffer: the walk's
    parameters and buffers are ``model.parameters()`` and ``model.buffers()``, the same
    tensors in the same order, and its answers are the walking functions'. Planted: the
    tied weight listed twice (no dedup) failed."""
    model = tiny_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.model.layers[1].register_buffer("extra", torch.randn(3))
    model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, a, out: out)
    model.model.layers[0].mlp.dropout = torch.nn.Dropout(0.1)  # training mode: drops out
    walk = ModelWalk(model)
    params, buffers = list(model.parameters()), list(model.buffers())
    assert len(walk.parameters) == len(params)
    assert all(a is b for a, b in zip(walk.parameters, params, strict=True))
    assert len(walk.buffers) == len(buffers)
    assert all(a is b for a, b in zip(walk.buffers, buffers, strict=True))
    assert walk.hooks == scan_hooks(model) and walk.hooks.rows is not None
    assert walk.dropout == drops_out(model) and walk.dropout is not None
    assert walk.rope == length_dependent_rope(model)


def counting_visits(model, monkeypatch) -> list:
    """A list that grows by one for every module ``named_modules`` yields from ``model``
    (walks nested in ``parameters()`` and ``modules()`` included)."""
    visits, walk = [], torch.nn.Module.named_modules

    def named_modules(self, *args, **kwargs):
        for item in walk(self, *args, **kwargs):
            if self is model:
                visits.append(1)
            yield item

    monkeypatch.setattr(torch.nn.Module, "named_modules", named_modules)
    return visits


def test_a_call_walks_the_modules_once(monkeypatch):
    """A patched greedy call (prefix salt, hooks, dropout, rope, pool fit and the decode
    graphs' check all asked) visits each module about once, plus the few modules that
    ``model.dtype``/``model.device`` look at; the walk is not kept on the returned cache.
    Planted: drops_out walking again in the call (hf.py) failed the count."""
    model = tiny_model("llama")
    modules = len(list(model.modules()))
    nanoserve.patch_model(model, block_size=4)
    inputs = padded_batch([7, 3], 7)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=4, do_sample=False)  # the pool, the graphs
        visits = counting_visits(model, monkeypatch)
        out = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True
        )
    assert modules <= len(visits) < modules + 20, (len(visits), modules)
    assert out.past_key_values.walk is None
