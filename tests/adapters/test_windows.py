"""Sliding windows changed after the model was built or patched (``adapters/windows.py``).

transformers' masks follow ``config.sliding_window`` and ``config.layer_types`` at every
forward, while attention modules keep what they were built with and nanoserve's pools what
``patch_model`` laid out. Each change is refused before anything runs, naming the config
field; putting the config back (or patching again) gives stock's tokens.
"""

from __future__ import annotations

import pytest
import torch
from helpers import patched
from test_families import padded_batch
from test_families import tiny_model as llama_family_model
from test_misuse import cache_name
from test_new_families import tiny_model as gemma_family_model

import nanoserve
from nanoserve.adapters.step import state_of

GREEDY = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)


def generate(model, inputs):
    with torch.no_grad():
        return model.generate(**inputs, **GREEDY)


def test_a_config_window_changed_before_patching_is_refused():
    """Qwen2's sliding layer holds window 6; the config now says 12, which stock's masks use
    (nanoserve would attend within the module's 6: other tokens than stock's, found by a CPU
    probe). Planted: the check left out, patch_model went through."""
    model = llama_family_model("qwen2-sliding")
    model.config.sliding_window = 12
    with pytest.raises(ValueError, match="config.sliding_window: layer 1"):
        nanoserve.patch_model(model)
    assert state_of(model) is None  # refused before anything changed


@pytest.mark.parametrize("change", [12, None])
def test_a_window_widened_after_patching_is_refused_until_restored(change):
    """Mistral's pool releases blocks past its window: a window widened (or dropped) after
    patch_model is refused by generate naming the config, and the restored config runs
    stock's tokens. Planted: the check left out, the first forward met a RuntimeError
    blaming the cache."""
    model = llama_family_model("mistral")
    inputs = padded_batch([19, 5], 19)
    stock = generate(model, inputs)
    with patched(model, block_size=4):
        model.config.sliding_window = change
        with pytest.raises(ValueError, match="changed after patch_model"):
            generate(model, inputs)
        model.config.sliding_window = 7
        assert torch.equal(generate(model, inputs), stock)


def test_a_window_narrowed_after_patching_runs_stocks_tokens():
    """Mistral's attention reads the config's window at every forward, and a pool that keeps
    a wider one holds all it needs: a narrower window runs, as stock does."""
    model = llama_family_model("mistral")
    inputs = padded_batch([19, 5], 19)
    with patched(model, block_size=4):
        model.config.sliding_window = 3
        ours = generate(model, inputs)
    assert torch.equal(ours, generate(model, inputs))


def test_patching_again_follows_the_new_window():
    model = llama_family_model("mistral")
    inputs = padded_batch([19, 5], 19)
    model.config.sliding_window = 12
    stock = generate(model, inputs)
    with patched(model, block_size=4):
        assert torch.equal(generate(model, inputs), stock)


@pytest.mark.parametrize("field", ["sliding_window", "layer_types"])
def test_gemma2_layer_groups_changed_after_patching_are_refused(field):
    """Gemma 2's layer groups (pools per window) come from both fields."""
    model = gemma_family_model("gemma2")
    inputs = padded_batch([19, 5], 19)
    with patched(model, block_size=4):
        if field == "sliding_window":
            model.config.sliding_window += 5
        else:
            model.config.layer_types = ["full_attention"] * len(model.config.layer_types)
        with pytest.raises(ValueError, match="changed after patch_model"):
            generate(model, inputs)


def test_a_forward_of_the_callers_own_checks_the_windows_too():
    model = llama_family_model("qwen2-sliding")
    inputs = padded_batch([9], 9)
    with patched(model):
        cache = nanoserve.PagedCache(nanoserve.PagedKVCache(2, 8, 16))
        model.config.sliding_window = 12
        with pytest.raises(ValueError, match="config.sliding_window"), torch.no_grad():
            model(**inputs, **{cache_name(model): cache}, use_cache=True)


@pytest.mark.parametrize("family", ["llama", "gemma", "llama, one layer sliding"])
def test_a_window_the_attention_ignores_is_refused_at_patch_time(family):
    """A config carrying sliding_window for a model whose attention ignores it (configs
    converted from Mistral or Qwen2 keep the field), on every layer or on the layers
    ``layer_types`` marks sliding: stock's DynamicCache then keeps only the last window of
    keys for those layers' decode steps while its prefill sees all, which the paged cache
    does not reproduce, so patch_model refuses, naming config.sliding_window, before
    anything changes; with the fields cleared, stock's tokens. (Found by probes: every
    patched generate raised a RuntimeError from the first attention call; with a mixed
    ``layer_types`` the patch was taken and every step attended to all positions.)"""
    import copy

    model = gemma_family_model(family) if family == "gemma" else llama_family_model("llama")
    model.config.sliding_window = 4
    if family.endswith("sliding"):
        model.config.layer_types = ["sliding_attention", "full_attention"]
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="^config.sliding_window: 4 .*ignores it"):
        nanoserve.patch_model(model)
    assert model.config._attn_implementation == before
    model.config.sliding_window = None
    if family.endswith("sliding"):
        model.config.layer_types = ["full_attention", "full_attention"]
    stock = copy.deepcopy(model)
    inputs = padded_batch([9, 5], 9)
    with torch.no_grad():
        want = stock.generate(**inputs, max_new_tokens=6, do_sample=False)
        nanoserve.patch_model(model)
        got = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def test_a_windowed_assistant_keeps_the_drafts_the_main_model_rejects():
    """A patched sliding-window model as ``assistant_model``: the main model rejects its
    drafts and transformers crops them from its cache before the next drafting call,
    which then needs the positions before them. Its pool keeps the call's drafts past the
    window (found by a probe: the crop went back past what the window kept, and the next
    call raised a ValueError naming new_token_mask)."""
    draft = llama_family_model("mistral", seed=2, sliding_window=7)
    main = llama_family_model("llama", seed=1)
    for model in (main, draft):
        model.generation_config.pad_token_id = None  # no mask inferred from generated ids
    draft.generation_config.assistant_confidence_threshold = 0.0  # draft the whole budget
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    opts = dict(max_new_tokens=80, do_sample=False, eos_token_id=None, assistant_model=draft)
    with torch.no_grad():
        try:
            stock = main.generate(ids, **opts)
        except RuntimeError as e:  # 5.17's own sliding-window assistant: a mask of 7 columns
            pytest.skip(f"stock transformers fails on this call here ({str(e)[:60]})")
        with patched(draft):
            assert torch.equal(main.generate(ids, **opts), stock)


def look_ahead_and_crop(ahead: int):
    """A decoding loop of the caller's own (``custom_generate``): prefill, ask the cache to
    record its past, then six times run ``ahead`` greedy tokens, crop them off and feed one
    token. Returns the logits of the six fed tokens [6, B, V]."""

    def loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
             synced_gpus=False, streamer=None, **model_kwargs):  # fmt: skip
        name = cache_name(model)
        cache, mask = model_kwargs.get(name), torch.ones_like(input_ids)
        out = model(input_ids, attention_mask=mask, use_cache=True, **{name: cache})
        cache = out.past_key_values
        cache.activate_past_recording()
        token, logits = out.logits[:, -1:].argmax(-1), []
        for _ in range(6):
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            probe, probe_mask = token, mask
            for _ in range(ahead):
                step = model(probe, attention_mask=probe_mask, use_cache=True, **{name: cache})
                probe = step.logits[:, -1:].argmax(-1)
                probe_mask = torch.cat([probe_mask, torch.ones_like(probe)], 1)
            cache.crop(-ahead)
            out = model(token, attention_mask=mask, use_cache=True, **{name: cache})
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
        return torch.stack(logits)

    return loop


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_callers_loop_that_records_the_past_crops_past_the_window(family):
    """``activate_past_recording`` then a look-ahead of 20 tokens cropped off, past a window
    of 7 (Gemma 2: its sliding layer group): stock's sliding layers keep every token until
    the crop; the paged cache holds the window's blocks until each crop, and gives stock's
    logits (the next forward raised a ValueError naming new_token_mask: the window had
    released the positions the crop went back to; a probe found it). The tokens held between
    crops need room: in a pool sized for the window (a generate call grows none) that is
    OutOfBlocks naming ``num_blocks``. Planted, reverted: ``activate_past_recording`` doing
    nothing: failed both."""
    if family == "mistral":
        model = llama_family_model("mistral", seed=2, sliding_window=7)
    else:
        model = gemma_family_model("gemma2")
    assert model.config.sliding_window <= 8  # the look-ahead of 20 runs past it
    ids = torch.randint(3, 97, (2, 17), generator=torch.Generator().manual_seed(1))
    loop = look_ahead_and_crop(20)
    with torch.no_grad():
        try:
            stock = model.generate(ids, custom_generate=loop, max_new_tokens=1)
        except RuntimeError as e:  # 5.17's recording sliding layers: a mask one column off
            pytest.skip(f"stock transformers fails on this call here ({str(e)[:60]})")
        with patched(model, block_size=4, num_blocks=64):
            ours = model.generate(ids, custom_generate=loop, max_new_tokens=1)
        refused = pytest.raises(nanoserve.OutOfBlocks, match="num_blocks")
        with patched(model, block_size=4), refused:  # a pool sized for the window
            model.generate(ids, custom_generate=loop, max_new_tokens=1)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)


def test_a_crop_past_what_the_window_kept_is_refused_at_the_crop():
    """A returned cache of a windowed model (Mistral, window 7), past its window: ``crop``
    back within what the window kept continues with the tokens stock computes without a
    cache; one token deeper raises at the crop a ValueError naming ``tokens_to_remove`` and
    ``activate_past_recording`` (stock's sliding layers refuse such a crop too), and the
    cache is as it was. Planted: crop without the check: the ValueError came from the next
    call instead, naming ``new_token_mask``, which the caller never passed."""
    model = llama_family_model("mistral", seed=2, sliding_window=7)
    inputs = padded_batch([13, 9], 13)
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad(), patched(model, block_size=4):
        out = model.generate(**inputs, max_new_tokens=12, return_dict_in_generate=True,
                             **greedy)  # fmt: skip
        cache = out.past_key_values
        length, lens = cache.get_seq_length(), cache.paged.seq_lens()
        kept = next(k for k in range(length + 1) if not cache.paged.can_drop_last(k)) - 1
        assert 1 <= kept < length
        with pytest.raises(ValueError, match=rf"^tokens_to_remove: {-(kept + 1)} .*past_record"):
            cache.crop(-(kept + 1))
        assert cache.get_seq_length() == length and cache.paged.seq_lens() == lens
        cache.crop(-kept)
        ids = out.sequences[:, : length - kept + 1]
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, ids.shape[1] - 13).long()], 1)
        ours = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                              **{cache_name(model): cache}, **greedy)  # fmt: skip
    with torch.no_grad():
        stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **greedy)
    assert torch.equal(ours, stock)
