"""What may change between calls without moving a tensor: a module's attribute or class
(an activation swapped, a norm's eps, an attention's scaling), torch's numeric settings
(autocast, float32 matmul precision) and inference mode. Stock computes each call as the
model and torch stand; the patched model must too: its decode graphs are captured anew
(a replay runs the kernels and constants it was captured with) and its prefix cache serves
no block computed under other settings.

On CPU the graph runner runs its static buffers eagerly (``DecodeGraphs(capture=False)``),
so a stale graph cannot show in the tokens there: the CPU tests check that the graphs are
captured anew; the GPU test checks the tokens with real replays."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import sharpen
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.step import state_of

GREEDY = dict(do_sample=False, eos_token_id=None, max_new_tokens=6)
LOGITS = dict(GREEDY, output_logits=True, return_dict_in_generate=True)


class Doubled(torch.nn.Linear):
    """A Linear that doubles its output: swapped in holding the same weight tensor."""

    def forward(self, x):
        return super().forward(x) * 2


def _swap_v_proj(model):
    attention = model.model.layers[1].self_attn
    old = attention.v_proj
    new = Doubled(old.in_features, old.out_features, bias=False, device="meta")
    new.weight = old.weight
    attention.v_proj = new


def _set_all(model, kind: str, name: str, make):
    for module in model.modules():
        if type(module).__name__.endswith(kind):
            setattr(module, name, make(getattr(module, name)))


CHANGES = {
    "activation": lambda m: setattr(m.model.layers[1].mlp, "act_fn", torch.nn.GELU()),
    "norm eps": lambda m: _set_all(m, "RMSNorm", "variance_epsilon", lambda _: 0.5),
    "attention scaling": lambda m: _set_all(m, "Attention", "scaling", lambda s: s * 3),
    "rotary scaling": lambda m: setattr(m.model.rotary_emb, "attention_scaling", 1.7),
    "module class": _swap_v_proj,
}


def generate(model, inputs, **opts):
    """generate's output, without the returned cache (which would keep the patched model's
    pool and prefix blocks from the next call)."""
    with torch.no_grad():
        out = model.generate(**inputs, **{**GREEDY, **opts})
    for field in ("past_key_values", "cache"):
        if isinstance(out, dict) and out.get(field) is not None:
            out[field] = None
    return out


def counting_resets(graphs: DecodeGraphs) -> list:
    """A list that grows by one each time ``graphs`` drops its graphs."""
    resets, reset = [], graphs.reset

    def counted():
        resets.append(1)
        reset()

    graphs.reset = counted
    return resets


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_that_moves_no_tensor_captures_the_graphs_anew(change):
    """The change made to the patched model and to a stock copy between calls: stock's
    tokens, and the decode graphs dropped (to be captured anew) at the call after it, not
    before. Planted: the decode graphs' signature without the model's structure: not
    dropped."""
    model = sharpen(tiny_model("llama", seed=2))
    stock = copy.deepcopy(model)
    inputs = padded_batch([7, 3], 7)
    nanoserve.patch_model(model, block_size=4)
    graphs = state_of(model).graphs = DecodeGraphs(capture=False)
    resets = counting_resets(graphs)
    try:
        generate(model, inputs)
        generate(model, inputs)
        before = len(resets)
        generate(model, inputs)
        assert len(resets) == before  # kept
        CHANGES[change](model)
        CHANGES[change](stock)
        ours = generate(model, inputs)
        assert len(resets) == before + 1
    finally:
        nanoserve.unpatch_model(model)
    assert torch.equal(ours, generate(stock, inputs))


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_call_under_autocast_serves_no_later_plain_call(backend):
    """A call under ``torch.autocast`` (bfloat16) runs as stock does, and the plain float32
    call after it with the same prompt takes none of its blocks (they hold bfloat16-computed
    K/V): stock's tokens and float32 logits; the next plain call finds the plain call's
    blocks. Planted: the prefix salt without the numeric settings: the triton case served
    the autocast call's blocks (logits off by about 9 in the probe that found it); the
    reference scatter without its conversion: the auto case raised in index_put."""
    model = sharpen(tiny_model("llama", seed=3))
    stock = copy.deepcopy(model)
    ids = torch.randint(3, 97, (1, 13), generator=torch.Generator().manual_seed(3))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    nanoserve.patch_model(model, block_size=4, num_blocks=64, backend=backend)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            generate(model, inputs)
        ours = generate(model, inputs, **LOGITS)
        assert nanoserve.cache_stats(model)["prefix_hits"] == 0
        again = generate(model, inputs, **LOGITS)
        assert nanoserve.cache_stats(model)["prefix_hits"] == 1
    finally:
        nanoserve.unpatch_model(model)
    expected = generate(stock, inputs, **LOGITS)
    for out in (ours, again):
        assert torch.equal(out.sequences, expected.sequences)
        for got, want in zip(out.logits, expected.logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_torch_per_backend_precision_settings_between_calls():
    """torch's newer float32 precision settings, per backend
    (``torch.backends.mkldnn.matmul.fp32_precision``): each call runs as stock does under
    the setting of its time, and none serves its blocks to a call under another. Found by a
    probe: the numeric settings read ``torch.get_float32_matmul_precision()``, which torch
    refuses to answer once the newer settings are used: every patched call raised. Planted:
    that read unguarded: raised; the per-backend settings left out: the tf32 call found the
    bf16 call's blocks."""
    matmul = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has no per-backend float32 precision")
    model = sharpen(tiny_model("llama", seed=3))
    stock = copy.deepcopy(model)
    ids = torch.randint(3, 97, (1, 13), generator=torch.Generator().manual_seed(3))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    nanoserve.patch_model(model, block_size=4, num_blocks=64)
    try:
        for setting, hits in (("bf16", 0), ("tf32", 0), ("none", 0), ("none", 1)):
            matmul.fp32_precision = setting
            ours = generate(model, inputs)
            assert nanoserve.cache_stats(model)["prefix_hits"] == hits, setting
            assert torch.equal(ours, generate(stock, inputs)), setting
    finally:
        matmul.fp32_precision = "none"
        nanoserve.unpatch_model(model)


def test_a_call_under_inference_mode_then_one_under_no_grad():
    """The kept pool of a call under ``torch.inference_mode`` takes no write outside it: the
    next call under ``no_grad`` makes its own pool, with stock's tokens. Planted: the kept
    pool reused: "Inplace update to inference tensor outside InferenceMode"."""
    model = tiny_model("llama")
    stock = copy.deepcopy(model)
    inputs = padded_batch([9, 4], 9)
    nanoserve.patch_model(model, block_size=4)
    try:
        with torch.inference_mode():
            first = model.generate(**inputs, **GREEDY)
        second = generate(model, inputs)
        with torch.inference_mode():
            third = model.generate(**inputs, **GREEDY)
    finally:
        nanoserve.unpatch_model(model)
    expected = generate(stock, inputs)
    for out in (first, second, third):
        assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("change", [*CHANGES, "autocast", "tf32", "inference mode"])
def test_gpu_replays_follow_what_changed_between_calls(change):
    """On CUDA, float32, with real graph replays: after two calls (graphs captured) and a
    third that captures nothing (the signature is the same from call to call), the
    change, then a call on the patched model and on a stock copy given the same change:
    stock's tokens (for TF32: a call under TF32, then a plain one within float32's
    tolerance of stock). Found on the H200 before the fix: every structural change gave
    other tokens (33 replays of the graphs captured before it), and a plain call after an
    autocast call gave other tokens or NaN logits."""
    model = sharpen(tiny_model("llama", seed=2)).cuda()
    stock = copy.deepcopy(model)
    inputs = {k: v.cuda() for k, v in padded_batch([13, 6], 13).items()}
    nanoserve.patch_model(model, block_size=4)
    try:
        generate(model, inputs)
        generate(model, inputs)
        captures = nanoserve.decode_graph_stats(model)["captures"]
        generate(model, inputs)  # nothing changed: the graphs replay, none is captured anew
        stats = nanoserve.decode_graph_stats(model)
        assert stats["replays"] > 0 and stats["captures"] == captures, stats
        if change in CHANGES:
            CHANGES[change](model)
            CHANGES[change](stock)
        elif change == "autocast":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                generate(model, inputs)
        elif change == "tf32":
            precision = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("medium")
            try:
                generate(model, inputs)
            finally:
                torch.set_float32_matmul_precision(precision)
        else:
            with torch.inference_mode():
                model.generate(**inputs, **GREEDY)
        ours = generate(model, inputs, **LOGITS)
    finally:
        nanoserve.unpatch_model(model)
    expected = generate(stock, inputs, **LOGITS)
    assert torch.equal(ours.sequences, expected.sequences)
    for got, want in zip(ours.logits, expected.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=3e-5, atol=3e-5)
