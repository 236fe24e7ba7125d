"""Torch state around a patched call that stock's generate does not depend on: a default
device set by ``torch.device(...)`` / ``torch.set_default_device`` (nanoserve's host
tensors are made on the host whatever it is), and pools made under
``torch.inference_mode`` continued outside it (stock's cache grows by new tensors; the
paged pools are written in place)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import cache_name, patched
from test_families import padded_batch, tiny_model
from test_misuse import continued
from transformers import GenerationConfig

import nanoserve

GREEDY = dict(do_sample=False, eos_token_id=None)


def _generate(model, inputs, **kwargs):
    with torch.no_grad():
        return model.generate(**inputs, **kwargs)


@pytest.mark.parametrize(
    "options",
    [
        dict(max_new_tokens=6, **GREEDY),
        dict(max_new_tokens=6, do_sample=True, top_k=20, top_p=0.9, eos_token_id=3),
        dict(max_new_tokens=5, do_sample=True, num_return_sequences=2, min_new_tokens=2),
    ],
    ids=["greedy", "sampled", "copies"],
)
def test_a_default_device_context_changes_no_token(options):
    """Under ``with torch.device("meta")`` stock's generate runs as without it (transformers
    names every tensor's device): the patched model gives the same tokens, the second call
    on its cached prefixes too, and a continuation through the returned cache."""
    model = tiny_model("llama")
    stock = copy.deepcopy(model)
    inputs = padded_batch([9, 5], 9)
    results = {}
    for name, m in (("stock", stock), ("paged", model)):
        with patched(m, block_size=4) if name == "paged" else contextlib.nullcontext():
            runs = []
            for returned in (False, True):  # (a returned cache would hold the first pool)
                torch.manual_seed(3)
                with torch.device("meta"):
                    out = _generate(m, inputs, return_dict_in_generate=returned, **options)
                runs.append(out.sequences if returned else out)
            if name == "paged":
                assert nanoserve.cache_stats(m)["prefix_hits"] > 0
            following = continued(inputs, out.sequences)
            with torch.device("meta"):
                more = _generate(
                    m,
                    following,
                    max_new_tokens=3,
                    **{cache_name(m): out.past_key_values},
                    **GREEDY,
                )
            runs.append(more)
        results[name] = runs
    for got, want in zip(results["paged"], results["stock"], strict=True):
        assert got.device.type == "cpu"
        assert torch.equal(got, want)


def test_generate_batch_under_a_default_device_context():
    """``generate_batch`` pads its prompts on the host under ``torch.device("meta")`` too:
    each request's tokens equal stock generate's on its prompt alone."""
    model = tiny_model("llama")
    prompts = [[5, 9, 11, 40, 7], [12, 3], [8, 8, 9, 30, 31, 2, 17]]
    options = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = _generate(model, dict(input_ids=ids), **options)
        expected.append(out[0, len(prompt) :].tolist())
    with patched(model), torch.device("meta"):
        results = model.generate_batch(prompts, GenerationConfig(**options))
    got = [results[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    assert got == expected


def _first_turn(model, inputs):
    """A first turn under ``torch.inference_mode`` that returns its cache."""
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True, **GREEDY)


@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3"])
def test_a_cache_returned_under_inference_mode_continues_outside_it(kv_dtype):
    """Continued outside inference mode (generate, and a forward of the caller's own) as it
    would be inside it: the pools made under it are copied before their first write outside
    (the copy of a held, partly filled last block raised RuntimeError; a fixed pool, as a
    growing one would be made anew outside inference mode). A float32 cache gives stock's tokens and
    logits."""
    model = tiny_model("llama")
    stock = copy.deepcopy(model)
    inputs = padded_batch([10, 6], 10)  # 13 and 9 tokens cached: each last block shared, copied
    results = {}
    runs = [("inside", model), ("outside", model)] + ([("stock", stock)] if not kv_dtype else [])
    for name, m in runs:
        with (
            patched(m, block_size=4, num_blocks=32, kv_dtype=kv_dtype)
            if name != "stock"
            else contextlib.nullcontext()
        ):
            first = _first_turn(m, inputs)
            following = continued(inputs, first.sequences)
            cache = {cache_name(m): first.past_key_values}
            with torch.inference_mode() if name == "inside" else torch.no_grad():
                more = m.generate(**following, max_new_tokens=3, **cache, **GREEDY)
            first = _first_turn(m, inputs)
            columns = first.sequences.shape[1]
            mask = torch.cat([following["attention_mask"][:, :columns], torch.ones(2, 1)], 1)
            with torch.inference_mode() if name == "inside" else torch.no_grad():
                logits = m(
                    first.sequences[:, -1:].clone(),
                    attention_mask=mask.long(),
                    **{cache_name(m): first.past_key_values},
                ).logits
        results[name] = (more, logits.clone())
    for name in results:
        if name != "inside":
            assert torch.equal(results[name][0], results["inside"][0]), name
            torch.testing.assert_close(results[name][1], results["inside"][1])
