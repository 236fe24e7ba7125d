"""Misuse of a patched model ends as stock's exact tokens or as a clear error raised before
anything changes (issue 13): copies, threads, shared configs, failed patches and calls,
right padding, dtype changes under a returned cache, options nanoserve cannot serve."""

from __future__ import annotations

import copy
import io
import pickle
import threading
import warnings
import weakref

import pytest
import torch
import transformers
from helpers import cache_name, patched, sharpen
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.step import state_of

GREEDY = dict(do_sample=False, eos_token_id=None)


def stock_generate(model, **kwargs):
    with torch.no_grad():
        return model.generate(**kwargs)


def continued(inputs, sequences):
    """generate kwargs that continue ``sequences`` (the mask grown by the new columns; each
    prompt's mask repeated for its ``num_return_sequences`` copies)."""
    mask = inputs["attention_mask"]
    mask = mask.repeat_interleave(sequences.shape[0] // mask.shape[0], dim=0)
    grown = torch.ones(mask.shape[0], sequences.shape[1] - mask.shape[1], dtype=mask.dtype)
    return dict(input_ids=sequences, attention_mask=torch.cat([mask, grown], dim=1))


def stock_and_continued(model, inputs, opts, more: int):
    """Stock's output of ``generate(**inputs, **opts)`` and of its continuation by ``more``
    greedy tokens through the returned cache."""
    first = stock_generate(model, **inputs, **opts)
    following = stock_generate(
        model, **continued(inputs, first.sequences), max_new_tokens=more,
        **{cache_name(model): first.past_key_values}, **GREEDY,
    )  # fmt: skip
    return first, following


def test_deepcopy_of_a_patched_model_runs_its_own_weights():
    """The copy's forward and generate are bound to the copy, with a state of its own; its
    weights changed after the copy are the ones it runs, and unpatching it works."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    opts = dict(max_new_tokens=8, **GREEDY)
    nanoserve.patch_model(model, block_size=4)
    try:
        clone = copy.deepcopy(model)
        with torch.no_grad():
            for p in clone.parameters():
                p.mul_(-1.5)
        assert state_of(clone) is not state_of(model)
        twin = nanoserve.unpatch_model(copy.deepcopy(clone))  # the clone's weights, stock
        assert state_of(twin) is None and "forward" not in twin.__dict__
        expected = stock_generate(twin, **inputs, **opts)
        with torch.no_grad():
            out = clone.generate(**inputs, **opts)
            original = model.generate(**inputs, **opts)
        assert torch.equal(out, expected)
        assert not torch.equal(out, original)  # the clone did not run the original's weights
        nanoserve.unpatch_model(clone)
        assert state_of(clone) is None
        assert clone.config._attn_implementation != "nanoserve_paged"
        assert "generate" not in clone.__dict__ and "forward" not in clone.__dict__
    finally:
        nanoserve.unpatch_model(model)
    assert torch.equal(original, stock_generate(model, **inputs, **opts))


def test_pickling_a_patched_model_is_refused_and_changes_nothing():
    """pickle / torch.save of a patched model is a TypeError naming pickle and what to do
    (it was an AttributeError about a local object); the model still gives stock's tokens,
    and once unpatched it pickles and loads as stock. Planted: PatchState.__reduce__
    removed: failed on the message."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    opts = dict(max_new_tokens=5, **GREEDY)
    stock = stock_generate(model, **inputs, **opts)
    nanoserve.patch_model(model, block_size=4)
    for save in (pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(TypeError, match="^pickle: .*unpatch_model"):
            save(model)
        assert torch.equal(stock_generate(model, **inputs, **opts), stock)
    nanoserve.unpatch_model(model)
    loaded = pickle.loads(pickle.dumps(model))
    assert torch.equal(stock_generate(loaded, **inputs, **opts), stock)


@pytest.mark.parametrize("run", range(3))
def test_two_threads_on_one_patched_model_get_stock_tokens(run):
    model = tiny_model("llama")
    batches = [padded_batch([11, 3, 7], 11, seed=run), padded_batch([5], 5, seed=run + 10)]
    opts = dict(max_new_tokens=12, **GREEDY)
    expected = [stock_generate(model, **b, **opts) for b in batches]
    results, errors = [None, None], []
    start = threading.Barrier(2)

    def worker(i):
        try:
            start.wait()
            with torch.no_grad():
                results[i] = model.generate(**batches[i], **opts)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    with patched(model, block_size=4):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for out, want in zip(results, expected, strict=True):
        assert torch.equal(out, want)


def test_two_models_sharing_one_config_stay_independent():
    """Patching (and unpatching) one model never breaks another built on the same config
    object, patched or not."""
    first = tiny_model("llama", seed=0)
    torch.manual_seed(5)
    second = transformers.LlamaForCausalLM(first.config).eval()
    assert second.config is first.config
    inputs = padded_batch([8, 5], 8)
    opts = dict(max_new_tokens=6, **GREEDY)
    stock = [stock_generate(m, **inputs, **opts) for m in (first, second)]

    def both():
        return [stock_generate(m, **inputs, **opts) for m in (first, second)]

    nanoserve.patch_model(first)
    assert all(torch.equal(a, b) for a, b in zip(both(), stock, strict=True))  # second unpatched
    nanoserve.patch_model(second)
    assert all(torch.equal(a, b) for a, b in zip(both(), stock, strict=True))
    nanoserve.unpatch_model(second)
    assert first.config._attn_implementation == "nanoserve_paged"  # first is still patched
    assert all(torch.equal(a, b) for a, b in zip(both(), stock, strict=True))
    nanoserve.patch_model(second)
    nanoserve.unpatch_model(first)
    assert all(torch.equal(a, b) for a, b in zip(both(), stock, strict=True))
    nanoserve.unpatch_model(second)
    assert first.config._attn_implementation == "sdpa"
    assert all(torch.equal(a, b) for a, b in zip(both(), stock, strict=True))


def test_a_patched_model_dropped_without_unpatching_gives_the_config_back():
    """A patched model collected without ``unpatch_model`` no longer counts as patched: the
    config it shared goes back to its attention once no patched model uses it (a model
    saved with that config then loads where nanoserve is not imported), and stays switched
    while another patched model does. (Found by a probe: the count of patched models never
    fell, and the config named nanoserve's attention for good.)"""
    import gc

    first = tiny_model("llama", seed=0)
    second = transformers.LlamaForCausalLM(first.config).eval()
    third = transformers.LlamaForCausalLM(first.config).eval()
    config = first.config
    nanoserve.patch_model(first)
    nanoserve.patch_model(third)
    del first
    gc.collect()
    assert config._attn_implementation == "nanoserve_paged"  # third is patched
    nanoserve.patch_model(second)
    nanoserve.unpatch_model(second)
    assert config._attn_implementation == "nanoserve_paged"
    del third
    gc.collect()
    assert config._attn_implementation == "sdpa"
    nanoserve.patch_model(second)
    nanoserve.unpatch_model(second)
    assert second.config._attn_implementation == "sdpa"
    finalizers = len(weakref.finalize._registry)  # unpatching takes its finalizer back
    for _ in range(5):
        nanoserve.patch_model(second)
        nanoserve.unpatch_model(second)
    assert len(weakref.finalize._registry) == finalizers


def test_prompt_lookup_over_a_left_padded_cache_is_refused_saying_why():
    """transformers feeds a continuation's whole input again over the cache under prompt
    lookup, a left-padded row's padding included, which a paged cache cannot store: the
    refusal says so (it blamed right padding), and the cache continues as stock's after."""
    model = tiny_model("llama")
    inputs = padded_batch([5], 8)
    opts = dict(max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    stock, following = stock_and_continued(copy.deepcopy(model), inputs, opts, 3)
    with patched(model, block_size=4):
        first = stock_generate(model, **inputs, **opts)
        more = dict(**continued(inputs, first.sequences), max_new_tokens=3, **GREEDY)
        cache = {cache_name(model): first.past_key_values}
        # (before 5.24 such a continuation is refused first, for transformers' own reasons)
        refused = "whole input again over its cache|needs transformers >= 5.24"
        with pytest.raises(ValueError, match=refused):
            stock_generate(model, **more, **cache, prompt_lookup_num_tokens=2)
        assert torch.equal(stock_generate(model, **more, **cache), following)


class _DraftFailed(Exception):
    pass


def test_a_call_failing_in_an_early_exit_draft_keeps_every_layer():
    """transformers' early-exit drafting (``assistant_early_exit``) lowers
    ``config.num_hidden_layers`` around each draft and restores it only when the draft
    returns; a patched call that fails inside a draft (a refusal, a hook) leaves it as it
    was, so the next call runs every layer and gives stock's tokens. (Found by a probe: a
    refusal raised in a draft left the model running one of its two layers.)"""
    model = tiny_model("llama", seed=0)
    stock = copy.deepcopy(model)
    inputs = padded_batch([5], 5)

    def fail_in_drafts(module, args):
        if model.config.num_hidden_layers == 1:
            raise _DraftFailed

    handle = model.model.layers[0].register_forward_pre_hook(fail_in_drafts)
    with patched(model, block_size=4):
        with pytest.raises(_DraftFailed), torch.no_grad():
            model.generate(**inputs, assistant_early_exit=1, max_new_tokens=4, **GREEDY)
        assert model.config.num_hidden_layers == 2
        handle.remove()
        got = stock_generate(model, **inputs, max_new_tokens=6, **GREEDY)
    assert torch.equal(got, stock_generate(stock, **inputs, max_new_tokens=6, **GREEDY))


def _snapshot(model):
    return (model.config._attn_implementation, dict(model.__dict__))


def test_a_failed_patch_changes_nothing(monkeypatch):
    model = tiny_model("llama")
    before = _snapshot(model.model)
    with pytest.raises(ValueError, match="^model: LlamaModel has no generate"):
        nanoserve.patch_model(model.model)
    assert _snapshot(model.model) == before
    before = _snapshot(model)
    with pytest.raises(ValueError, match="^backend"):
        nanoserve.patch_model(model, backend="cuda")
    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(NotImplementedError, match=r"transformers >= 5\.17, < 6; this is 4\.57"):
        nanoserve.patch_model(model)
    assert _snapshot(model) == before
    monkeypatch.undo()

    def broken(self, name):  # fails halfway through the patch, after the state is attached
        raise RuntimeError("set_attn_implementation failed")

    monkeypatch.setattr(type(model), "set_attn_implementation", broken)
    with pytest.raises(RuntimeError, match="set_attn_implementation failed"):
        nanoserve.patch_model(model)
    monkeypatch.undo()
    assert _snapshot(model) == before


class LoraLikeWrapper(torch.nn.Module):
    """The shape of peft's PeftModelForCausalLM: a module with generate and get_base_model,
    not a GenerationMixin."""

    def __init__(self, model):
        super().__init__()
        self.base_model = model

    def get_base_model(self):
        return self.base_model

    def generate(self, *args, **kwargs):
        return self.base_model.generate(*args, **kwargs)


def test_a_wrapper_model_is_refused_naming_the_model_inside():
    """Patching peft's wrapper said it "has no generate()"; the error now names the way in.
    Patching the inner model and calling the wrapper's generate gives stock's tokens."""
    model = tiny_model("llama")
    wrapper = LoraLikeWrapper(model)
    with pytest.raises(ValueError, match=r"patch_model\(model.get_base_model\(\)\)"):
        nanoserve.patch_model(wrapper)
    assert state_of(model) is None
    inputs = padded_batch([9, 4], 9)
    with torch.no_grad():
        stock = wrapper.generate(**inputs, max_new_tokens=5, do_sample=False)
        with patched(wrapper.get_base_model()):
            assert torch.equal(wrapper.generate(**inputs, max_new_tokens=5, do_sample=False), stock)


def test_right_padding_is_refused_before_anything_changes():
    model = tiny_model("llama")
    left = padded_batch([9, 4], 9)
    right = dict(input_ids=left["input_ids"].clone(), attention_mask=left["attention_mask"].flip(1))
    opts = dict(max_new_tokens=5, **GREEDY)
    with patched(model, block_size=4), torch.no_grad():
        with pytest.raises(ValueError, match='padding_side="left"'):
            model.generate(**right, **opts)
        assert nanoserve.adapters.last_cache(model) is None  # no cache was made
        out = model.generate(**left, **opts)
    assert torch.equal(out, stock_generate(model, **left, **opts))


def test_a_padded_later_turn_on_a_returned_cache_is_refused_before_anything_changes():
    """A later chat turn padded inside a continued sequence (a zero in the mask's new
    columns), by generate and by a forward of the caller's own on a returned cache: stock
    masks those keys, the paged cache would store them, so both refuse with a ValueError
    naming attention_mask and the padded turn, and the cache is as it was (then continued
    unpadded, stock's tokens)."""
    model = tiny_model("llama")
    inputs = padded_batch([7, 5], 7)
    turn = torch.randint(3, 97, (2, 4), generator=torch.Generator().manual_seed(4))
    opts = dict(max_new_tokens=3, return_dict_in_generate=True, **GREEDY)

    def turn_inputs(out):
        ids = torch.cat([out.sequences, turn], 1)
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, ids.shape[1] - 7).long()], 1)
        return ids, mask

    stock_first = stock_generate(model, **inputs, **opts)
    ids, mask = turn_inputs(stock_first)
    past = {cache_name(model): stock_first.past_key_values}
    stock_more = stock_generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=3,
                                **past, **GREEDY)  # fmt: skip
    holed = mask.clone()
    holed[0, -3] = 0  # row 0's turn padded inside
    with patched(model, block_size=4), torch.no_grad():
        first = model.generate(**inputs, **opts)
        cache = first.past_key_values
        lens = cache.paged.seq_lens()
        refused = "attention_mask: padding after a real token .*later chat turn padded"
        with pytest.raises(ValueError, match=refused):
            model.generate(input_ids=ids, attention_mask=holed, max_new_tokens=3,
                           **{cache_name(model): cache}, **GREEDY)  # fmt: skip
        with pytest.raises(ValueError, match=refused):
            model(input_ids=ids[:, -5:], attention_mask=holed, **{cache_name(model): cache})
        assert cache.paged.seq_lens() == lens
        more = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                              **{cache_name(model): cache}, **GREEDY)  # fmt: skip
    assert torch.equal(more, stock_more)


def test_a_generated_pad_id_in_a_continued_cache_is_refused():
    """Continuing a returned cache with no attention_mask: generate infers the mask from pad
    ids, and a generated token equal to pad_token_id becomes a hole among cached columns.
    Stock masks that key; the paged cache holds it, so the call must refuse, naming
    attention_mask (planted: without the whole-mask check on a continued cache's first
    forward the call ran on). With the mask passed, stock's tokens."""
    model = tiny_model("llama")
    prompt = padded_batch([6], 6)["input_ids"]
    opts = dict(max_new_tokens=6, return_dict_in_generate=True, **GREEDY)
    with patched(model, block_size=4), torch.no_grad():
        first = model.generate(input_ids=prompt, **opts)
        pad = int(first.sequences[0, prompt.shape[1] + 1])  # a token the model generated
        assert pad not in first.sequences[0, -1:].tolist()  # the hole is among cached columns
        more = dict(input_ids=first.sequences, max_new_tokens=4, pad_token_id=pad,
                    **{cache_name(model): first.past_key_values}, **GREEDY)  # fmt: skip
        with pytest.raises(ValueError, match="attention_mask: padding after a real token"):
            model.generate(**more)
        ones = torch.ones_like(first.sequences)
    stock_first = stock_generate(model, input_ids=prompt, **opts)
    stock_more = stock_generate(model, **{**more, cache_name(model): stock_first.past_key_values},
                                attention_mask=ones)  # fmt: skip
    with patched(model, block_size=4), torch.no_grad():
        first = model.generate(input_ids=prompt, **opts)
        paged_more = model.generate(**{**more, cache_name(model): first.past_key_values},
                                    attention_mask=ones)  # fmt: skip
    assert torch.equal(paged_more, stock_more)


@pytest.mark.parametrize("mask", ["none", "all ones", "a cached token masked"])
def test_a_continuation_whose_mask_disagrees_with_the_cache_is_refused(mask):
    """A returned cache of a left-padded batch holds no padding. Continued with a mask that
    marks its columns otherwise (none, or all ones, as generate infers when pad_token_id
    equals EOS: stock then attends the padding K/V it kept; or a cached real token masked:
    stock skips it), the call refuses naming attention_mask before the cache changes, and
    the right mask then gives stock's tokens. A forward of the caller's own with no mask on
    that cache refuses too. Planted: without the cached columns' check no case raised (the
    probes that found it gave other tokens than stock's)."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    opts = dict(max_new_tokens=3, return_dict_in_generate=True, **GREEDY)
    stock, stock_next = stock_and_continued(model, inputs, opts, 2)
    with patched(model, block_size=4), torch.no_grad():
        first = model.generate(**inputs, **opts)
        cache = first.past_key_values
        lens, columns = cache.paged.seq_lens(), cache.get_seq_length()
        right = continued(inputs, first.sequences)
        wrong = dict(right)
        if mask == "none":  # (generate then infers the mask from pad ids: none here)
            del wrong["attention_mask"]
            wrong["pad_token_id"] = model.config.vocab_size - 1
            assert not bool((first.sequences == wrong["pad_token_id"]).any())
        elif mask == "all ones":
            wrong["attention_mask"] = torch.ones_like(right["attention_mask"])
        else:
            wrong["attention_mask"] = right["attention_mask"].clone()
            wrong["attention_mask"][0, 0] = 0  # row 0 has no padding: a real token masked
        with pytest.raises(ValueError, match="attention_mask: "):
            model.generate(**wrong, max_new_tokens=2, **{cache_name(model): cache}, **GREEDY)
        assert cache.paged.seq_lens() == lens and cache.get_seq_length() == columns
        with pytest.raises(ValueError, match="attention_mask: none"):
            model(input_ids=first.sequences[:, -1:], **{cache_name(model): cache})
        assert cache.paged.seq_lens() == lens and cache.get_seq_length() == columns
        out = model.generate(**right, max_new_tokens=2, **{cache_name(model): cache}, **GREEDY)
    assert torch.equal(first.sequences, stock.sequences)
    assert torch.equal(out, stock_next)


def test_output_attentions_returns_stocks_weights():
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    inputs = padded_batch([7, 3], 7)
    opts = dict(max_new_tokens=3, output_attentions=True, return_dict_in_generate=True, **GREEDY)
    stock = stock_generate(model, **inputs, **opts)
    with patched(model), torch.no_grad():
        paged = model.generate(**inputs, **opts)
        with pytest.raises(ValueError, match="^output_attentions"):
            cache = nanoserve.PagedCache(nanoserve.PagedKVCache(2, 8, 4))
            model(**inputs, output_attentions=True, **{cache_name(model): cache})
    assert model.config._attn_implementation == "eager"
    assert torch.equal(stock.sequences, paged.sequences)
    assert len(stock.attentions) == len(paged.attentions) == 3
    for step_a, step_b in zip(stock.attentions, paged.attentions, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert a is not None and torch.equal(a, b)


@pytest.mark.parametrize("implementation", ["static", "paged", "offloaded"])
def test_cache_implementation_names_nanoserve(implementation):
    model = tiny_model("llama")
    with patched(model), pytest.raises(ValueError, match="^cache_implementation.*nanoserve"):
        model.generate(
            **padded_batch([4], 4), max_new_tokens=2, cache_implementation=implementation
        )


@pytest.mark.parametrize("source", ["model", "call", "config"])
def test_cache_implementation_dynamic_is_stocks_default(source):
    """ "dynamic" is the cache stock makes when none is named (a hub generation_config may
    set it), set on the model's config, in the call or in a passed config: the patched call
    runs on the paged cache, gives stock's tokens and leaves a passed config as it was.
    Planted: "dynamic" refused as the static caches are, and "dynamic" passed on to stock
    (which refuses a cache and a cache_implementation): each failed."""
    model = sharpen(tiny_model("llama"))
    opts = dict(max_new_tokens=6, **GREEDY)
    if source == "model":
        model.generation_config.cache_implementation = "dynamic"
    elif source == "call":
        opts["cache_implementation"] = "dynamic"
    else:
        config = copy.deepcopy(model.generation_config)
        config.cache_implementation = "dynamic"
        opts["generation_config"] = config
    inputs = padded_batch([5, 9], 9)
    stock = stock_generate(model, **inputs, **opts)
    with patched(model):
        paged = stock_generate(model, **inputs, **opts)
        assert nanoserve.cache_stats(model)["tokens"] > 0  # the paged pool held the call
    assert torch.equal(stock, paged)
    if source == "config":
        assert opts["generation_config"].cache_implementation == "dynamic"


def test_a_returned_cache_refuses_a_dtype_change_and_loses_nothing():
    """Continuing a returned cache after ``model.to(float64)`` raises naming the mismatch,
    before any row grows; back in float32 the continuation gives stock's tokens."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    opts = dict(max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    stock, stock_next = stock_and_continued(model, inputs, opts, 5)
    with patched(model, block_size=4), torch.no_grad():
        first = model.generate(**inputs, **opts)
        cache = first.past_key_values
        lens, columns = cache.paged.seq_lens(), cache.get_seq_length()
        following = dict(
            **continued(inputs, first.sequences), max_new_tokens=5,
            **{cache_name(model): cache}, **GREEDY,
        )  # fmt: skip
        model.to(torch.float64)
        with pytest.raises(ValueError, match="^key: .*dtype torch.float32 -> torch.float64"):
            model.generate(**following)
        assert cache.paged.seq_lens() == lens and cache.get_seq_length() == columns
        model.to(torch.float32)
        out = model.generate(**following)
    assert torch.equal(first.sequences, stock.sequences)
    assert torch.equal(out, stock_next)


@pytest.mark.parametrize("fixed", [False, True])
def test_a_returned_cache_given_no_new_column_is_refused(fixed):
    """Passing a returned cache back with input_ids no longer than what it holds (every
    column already cached: stock feeds and stores them all again) is a ValueError naming
    input_ids, raised before anything changes; the cache then continues to stock's tokens.
    Planted: the check in _paged_generate removed: both cases failed on the message (a
    misleading right-padding error)."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    opts = dict(max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    stock, stock_next = stock_and_continued(model, inputs, opts, 5)
    pool = dict(num_blocks=12) if fixed else {}
    with patched(model, block_size=4, **pool), torch.no_grad():
        first = model.generate(**inputs, **opts)
        cache = first.past_key_values
        lens, columns = cache.paged.seq_lens(), cache.get_seq_length()
        following = continued(inputs, first.sequences)
        for width in (columns, columns - 2):
            stale = {name: value[:, :width] for name, value in following.items()}
            with pytest.raises(ValueError, match=rf"^input_ids: {width} columns, .* {columns}"):
                model.generate(**stale, max_new_tokens=5, **{cache_name(model): cache}, **GREEDY)
            assert cache.paged.seq_lens() == lens and cache.get_seq_length() == columns
        out = model.generate(**following, max_new_tokens=5, **{cache_name(model): cache}, **GREEDY)
    assert torch.equal(first.sequences, stock.sequences)
    assert torch.equal(out, stock_next)


def test_attention_switched_after_patching_is_refused():
    """set_attn_implementation("sdpa"/"eager") on a patched model: generate, a returned
    cache passed back, and a forward with a PagedCache raise a ValueError naming
    attn_implementation before anything is stored (stock attention read the pools as its
    own cache: shape errors, or wrong tokens with a one-block pool, found by review);
    patching again gives stock's tokens. Planted: the check removed: failed (RuntimeError
    from stock attention, or no error)."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    opts = dict(max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    stock, stock_next = stock_and_continued(model, inputs, opts, 5)
    refused = pytest.raises(ValueError, match="^attn_implementation: 'sdpa' was set after")
    with patched(model, block_size=4), torch.no_grad():
        first = model.generate(**inputs, **opts)
        cache = first.past_key_values
        lens = cache.paged.seq_lens()
        following = dict(**continued(inputs, first.sequences), max_new_tokens=5,
                         **{cache_name(model): cache}, **GREEDY)  # fmt: skip
        model.set_attn_implementation("sdpa")
        with refused:
            model.generate(**inputs, **opts)
        with refused:
            model.generate(**following)
        with refused:
            model(input_ids=first.sequences[:, -1:], **{cache_name(model): cache})
        assert cache.paged.seq_lens() == lens
        nanoserve.patch_model(model, block_size=4)
        assert torch.equal(model.generate(**inputs, **opts).sequences, stock.sequences)
        assert torch.equal(model.generate(**following), stock_next)


def test_a_forward_that_fails_midway_is_rolled_back():
    """A layer raising in the middle of a decode step (after layer 0 stored its K/V) leaves
    the returned cache as it was: a retry continues with stock's tokens."""
    model = tiny_model("llama")
    inputs = padded_batch([10, 6], 10)
    opts = dict(max_new_tokens=3, return_dict_in_generate=True, **GREEDY)
    stock, stock_next = stock_and_continued(model, inputs, opts, 6)

    def fail(*args):
        raise RuntimeError("layer 1 failed")

    with patched(model, block_size=4), torch.no_grad():
        first = model.generate(**inputs, **opts)
        cache = first.past_key_values
        lens = cache.paged.seq_lens()
        following = dict(
            **continued(inputs, first.sequences), max_new_tokens=6,
            **{cache_name(model): cache}, **GREEDY,
        )  # fmt: skip
        hook = model.model.layers[1].register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="layer 1 failed"):
            model.generate(**following)
        hook.remove()
        assert cache.paged.seq_lens() == lens
        out = model.generate(**following)
    assert torch.equal(out, stock_next)


def test_a_paged_cache_outside_a_patched_forward_is_an_error():
    model = tiny_model("llama")
    cache = nanoserve.PagedCache(nanoserve.PagedKVCache(2, 8, 4))
    inputs = padded_batch([4], 4)
    with patched(model), pytest.raises(RuntimeError, match="outside a paged step"):
        model.model(**inputs, use_cache=True, **{cache_name(model): cache})
    with pytest.raises(ValueError, match="^paged"):
        nanoserve.PagedCache(2)


def test_positional_arguments_reach_the_paged_forward():
    model = tiny_model("llama")
    inputs = padded_batch([6, 6], 6)
    with torch.no_grad():
        stock = model(inputs["input_ids"], inputs["attention_mask"]).logits
        with patched(model):
            cache = nanoserve.PagedCache(nanoserve.PagedKVCache(2, 8, 4))
            paged = model(inputs["input_ids"], inputs["attention_mask"], None, cache).logits
            assert cache.get_seq_length() == 6 and cache.paged.seq_lens() == [6, 6]
    torch.testing.assert_close(paged, stock, rtol=1e-5, atol=1e-5)


def test_pool_arguments_take_ints_not_bools_and_sane_blocks():
    import numpy as np

    model = tiny_model("llama")
    for name in ("block_size", "num_blocks", "max_memory"):
        with pytest.raises(ValueError, match=f"^{name}"):
            nanoserve.patch_model(model, **{name: True})
        assert state_of(model) is None
    with pytest.raises(ValueError, match="^block_size: must be at most 16384"):
        nanoserve.patch_model(model, block_size=10**9)
    assert state_of(model) is None
    nanoserve.patch_model(model, block_size=np.int64(4), num_blocks=np.int64(16))
    try:
        with torch.no_grad():
            model.generate(**padded_batch([5], 5), max_new_tokens=2, **GREEDY)
        stats = nanoserve.cache_stats(model)
        assert (stats["block_size"], stats["num_blocks"]) == (4, 16)
        assert type(stats["num_blocks"]) is int
    finally:
        nanoserve.unpatch_model(model)


def test_out_of_blocks_while_continuing_leaves_the_cache_as_given():
    """A continuation that runs out of blocks in a fixed pool raises OutOfBlocks and leaves
    the returned cache as it was passed in: the same continuation with a smaller
    max_new_tokens then gives stock's tokens. Planted, reverted: no roll-back: the cache kept
    the failed call's columns and the retry was refused (input_ids: 13 columns, the cache
    holds 20)."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4, 6], 9)
    opts = dict(max_new_tokens=3, return_dict_in_generate=True, **GREEDY)
    stock, stock_next = stock_and_continued(model, inputs, opts, 2)
    with patched(model, block_size=4, num_blocks=14), torch.no_grad():
        first = model.generate(**inputs, **opts)
        cache = first.past_key_values
        lens, columns = cache.paged.seq_lens(), cache.get_seq_length()
        following = dict(**continued(inputs, first.sequences), **{cache_name(model): cache})
        with pytest.raises(nanoserve.OutOfBlocks):
            model.generate(**following, max_new_tokens=40, **GREEDY)
        assert cache.paged.seq_lens() == lens and cache.get_seq_length() == columns
        out = model.generate(**following, max_new_tokens=2, **GREEDY)
    assert torch.equal(first.sequences, stock.sequences)
    assert torch.equal(out, stock_next)


def _quantize_dynamic(model, inplace=False):
    """torch's dynamic int8 quantization of every Linear (deprecated in torch, still used)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            model, {torch.nn.Linear}, dtype=torch.qint8, inplace=inplace
        )


def test_a_dynamically_quantized_model_runs_as_stock():
    """Dynamically quantized layers take one activation scale over all of a forward's tokens,
    so shared prefixes, padded buckets and a compacted batch would move its tokens: a call
    runs stock's generate (stock's cache and loop), and a PagedCache passed back after the
    model was quantized is refused before anything changes. Planted: the fallback dropped:
    the second call's shared prefix changed the logits (and, at 16 tokens, the tokens)."""
    model = _quantize_dynamic(sharpen(tiny_model("llama")))
    reference = copy.deepcopy(model)
    call = padded_batch([9, 5, 7], 9)
    call = {k: torch.cat([v, v[:1]]) for k, v in call.items()}  # a prompt twice
    more = torch.randint(3, 97, (4, 4), generator=torch.Generator().manual_seed(5))
    longer = continued(call, torch.cat([call["input_ids"], more], dim=1))  # the same prefixes
    opts = dict(max_new_tokens=16, output_logits=True, return_dict_in_generate=True, **GREEDY)
    with patched(model), torch.no_grad():
        outs = [model.generate(**c, **opts) for c in (call, longer)]
    for out, c in zip(outs, (call, longer), strict=True):
        stock = stock_generate(reference, **c, **opts)
        assert torch.equal(out.sequences, stock.sequences)
        for ours, theirs in zip(out.logits, stock.logits, strict=True):
            assert torch.equal(ours, theirs)
    model = sharpen(tiny_model("llama"))
    with patched(model), torch.no_grad():
        first = model.generate(**call, **opts)
        cache = first.past_key_values
        lens = cache.paged.seq_lens()
        _quantize_dynamic(model, inplace=True)
        following = dict(**continued(call, first.sequences), **{cache_name(model): cache})
        with pytest.raises(ValueError, match="quantized dynamically"):
            model.generate(**following, max_new_tokens=2, **GREEDY)
        assert cache.paged.seq_lens() == lens


def _set_is_causal(model, value: bool) -> None:
    for layer in model.model.layers:
        layer.self_attn.is_causal = value


def test_attention_modules_set_non_causal_run_as_stock():
    """``is_causal = False`` on the attention modules (the config left causal): stock's sdpa
    then attends both ways over an unpadded prompt. A call runs stock's generate; set back,
    the paged path runs again; a PagedCache passed back meanwhile is refused before anything
    changes. Found by a probe: the paged kernels stayed causal (other tokens, logits off by
    7). Planted: the module flag not read: failed (the paged loop ran)."""
    model = sharpen(tiny_model("llama"))
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    call = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    opts = dict(max_new_tokens=6, output_logits=True, return_dict_in_generate=True, **GREEDY)
    with patched(model), torch.no_grad():
        first = model.generate(**call, **opts)
        for value in (False, True):
            _set_is_causal(model, value)
            _set_is_causal(reference, value)
            out = model.generate(**call, **opts)
            loop = nanoserve.decode_graph_stats(model)["decode_loop"]
            assert loop.startswith("stock") if not value else loop == "nanoserve"
            stock = stock_generate(reference, **call, **opts)
            assert torch.equal(out.sequences, stock.sequences), value
            for ours, theirs in zip(out.logits, stock.logits, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        cache = first.past_key_values
        lens = cache.paged.seq_lens()
        _set_is_causal(model, False)
        following = dict(**continued(call, first.sequences), **{cache_name(model): cache})
        with pytest.raises(ValueError, match="is_causal is False"):
            model.generate(**following, max_new_tokens=2, **GREEDY)
        assert cache.paged.seq_lens() == lens


def test_a_mask_of_one_row_is_broadcast_over_the_rows():
    """An attention_mask of one row for a batch of several (stock broadcasts it): stock's
    tokens. Found by a probe: the pool sizing's concatenation raised a RuntimeError.
    Planted: the mask not broadcast: raised."""
    model = sharpen(tiny_model("llama"))
    ids = torch.randint(3, 97, (3, 9), generator=torch.Generator().manual_seed(6))
    call = dict(input_ids=ids, attention_mask=torch.ones(1, 9, dtype=torch.long))
    expected = stock_generate(model, **call, max_new_tokens=5, **GREEDY)
    with patched(model), torch.no_grad():
        assert torch.equal(model.generate(**call, max_new_tokens=5, **GREEDY), expected)


def test_one_dimensional_input_ids_are_named():
    """1-D input_ids (stock raises an IndexError from deep inside): a ValueError naming
    input_ids, before anything changes; the next call gives stock's tokens. Found by a
    probe: "not enough values to unpack" from the pool sizing. Planted: the check dropped:
    that message again."""
    model = tiny_model("llama")
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(8))
    expected = stock_generate(model, input_ids=ids, max_new_tokens=3, **GREEDY)
    with patched(model), torch.no_grad():
        with pytest.raises(ValueError, match=r"^input_ids: expected a 2-D tensor.*\(6,\)"):
            model.generate(input_ids=ids[0], max_new_tokens=3, **GREEDY)
        assert torch.equal(model.generate(input_ids=ids, max_new_tokens=3, **GREEDY), expected)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_row_of_padding_only_runs_as_stock(attention):
    """A batch with a row whose attention_mask is all zeros: eager attention gives it an
    answer of its own (even weights over every column), so under eager the call runs
    stock's generate; under sdpa the paged kernels answer it as stock does and the call
    runs paged. Stock's tokens and logits for every row either way; a call without such a
    row runs paged. Found by a probe: under eager attention the padded row's tokens
    differed (logits off by 3-4). Planted: no fallback: the eager case's tokens differed;
    the fallback for sdpa too: the sdpa case failed on the loop it ran."""
    model = sharpen(tiny_model("llama", attn_implementation=attention))
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1] = 0
    opts = dict(max_new_tokens=5, output_logits=True, return_dict_in_generate=True, **GREEDY)
    with patched(model), torch.no_grad():
        for call in (dict(input_ids=ids, attention_mask=mask), dict(input_ids=ids)):
            out = model.generate(**call, **opts)
            loop = nanoserve.decode_graph_stats(model)["decode_loop"]
            stock_ran = attention == "eager" and "attention_mask" in call
            assert loop.startswith("stock") if stock_ran else loop == "nanoserve"
            stock = stock_generate(reference, **call, **opts)
            assert torch.equal(out.sequences, stock.sequences)
            for ours, theirs in zip(out.logits, stock.logits, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_returned_cache_continued_after_unpatching_asks_for_the_patch():
    """A returned cache given to the unpatched model is refused by its first layer with a
    message that says to patch again, and loses nothing: patched again (another block size
    too), the continuation gives stock's tokens. Planted: the refused step's columns
    counted by the cache: failed."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4, 6], 9)
    opts = dict(max_new_tokens=3, return_dict_in_generate=True, **GREEDY)
    stock, stock_next = stock_and_continued(model, inputs, opts, 3)
    with patched(model, block_size=4), torch.no_grad():
        first = model.generate(**inputs, **opts)
    cache = first.past_key_values
    lens, columns = cache.paged.seq_lens(), cache.get_seq_length()
    following = dict(**continued(inputs, first.sequences), **{cache_name(model): cache})
    with pytest.raises(RuntimeError, match="patch the model again"), torch.no_grad():
        model.generate(**following, max_new_tokens=3, **GREEDY)
    assert cache.paged.seq_lens() == lens and cache.get_seq_length() == columns
    with patched(model, block_size=8), torch.no_grad():
        out = model.generate(**following, max_new_tokens=3, **GREEDY)
    assert torch.equal(first.sequences, stock.sequences)
    assert torch.equal(out, stock_next)


def test_a_cache_made_unfixed_grows_after_a_repatch_fixes_the_size():
    """A cache returned by a patch of unfixed size is continued after a re-patch with
    ``num_blocks``: its pool grows as it was made to (stock's tokens), and a cache made under
    the fixed size still raises OutOfBlocks where it outgrows it. Planted, reverted: the
    growth decided by the current patch's options: OutOfBlocks "Raise num_blocks" with
    num_blocks=50 and the old pool of a few blocks full."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4, 6], 9)
    opts = dict(max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
    stock, stock_next = stock_and_continued(model, inputs, opts, 30)
    try:
        nanoserve.patch_model(model, block_size=4)
        with torch.no_grad():
            first = model.generate(**inputs, **opts)
            nanoserve.patch_model(model, block_size=4, num_blocks=50)
            following = continued(inputs, first.sequences)
            out = model.generate(
                **following, max_new_tokens=30, **{cache_name(model): first.past_key_values},
                **GREEDY,
            )  # fmt: skip
            again = model.generate(**inputs, **opts)
            assert again.past_key_values.pool_fixed
            with pytest.raises(nanoserve.OutOfBlocks):
                model.generate(
                    **continued(inputs, again.sequences), max_new_tokens=200,
                    **{cache_name(model): again.past_key_values}, **GREEDY,
                )  # fmt: skip
    finally:
        nanoserve.unpatch_model(model)
    assert torch.equal(first.sequences, stock.sequences)
    assert torch.equal(out, stock_next)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_a_failed_continuation_gives_back_reordered_and_dropped_blocks(name):
    """A beam-search continuation (rows reordered) or a sliding window's (Mistral's tiny
    config: blocks released) that runs out of blocks leaves every row's blocks and contents
    as passed in: the same tables, and a forward of the caller's own gives an untouched
    cache's logits. Planted: the rows not held (only the columns cropped, as before): rows
    came back holding other rows' K/V (beams) and the released blocks stayed released."""
    model = sharpen(tiny_model(name))
    inputs = padded_batch([13, 6], 13)
    beams = dict(num_beams=2) if name == "llama" else {}
    opts = dict(max_new_tokens=4, return_dict_in_generate=True, **GREEDY, **beams)
    with patched(model, block_size=4, num_blocks=20 if beams else 8), torch.no_grad():
        first, untouched = (model.generate(**inputs, **opts) for _ in "ab")
        cache = first.past_key_values
        tables = [[t.block_ids for t in g.tables] for g in cache.paged.groups]
        following = dict(**continued(inputs, first.sequences), **{cache_name(model): cache})
        with pytest.raises(nanoserve.OutOfBlocks):
            model.generate(**following, max_new_tokens=60, **GREEDY, **beams)
        assert [[t.block_ids for t in g.tables] for g in cache.paged.groups] == tables
        rows, columns = cache.paged.num_seqs, cache.get_seq_length()
        mask = inputs["attention_mask"].repeat_interleave(rows // 2, 0)
        mask = torch.cat([mask, torch.ones(rows, columns + 1 - 13, dtype=mask.dtype)], dim=1)
        logits = [
            model(
                input_ids=torch.full((rows, 1), 7), attention_mask=mask,
                **{cache_name(model): c.past_key_values},
            ).logits
            for c in (first, untouched)
        ]  # fmt: skip
    assert torch.equal(logits[0], logits[1])


def test_continuing_without_use_cache_or_with_other_rows_is_refused():
    """``use_cache=False`` with a returned cache, and rows other than the cache holds (fewer,
    or copied by num_return_sequences), are ValueErrors naming the argument, raised before
    the cache changes; it then continues to stock's tokens. Planted, reverted: without the
    checks, use_cache=False stored a column before failing on a right-padding message, and
    other rows failed naming an internal function."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    opts = dict(max_new_tokens=3, return_dict_in_generate=True, **GREEDY)
    stock, stock_next = stock_and_continued(model, inputs, opts, 2)
    with patched(model, block_size=4), torch.no_grad():
        first = model.generate(**inputs, **opts)
        cache = first.past_key_values
        lens, columns = cache.paged.seq_lens(), cache.get_seq_length()
        following = dict(**continued(inputs, first.sequences), **{cache_name(model): cache})
        fewer = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in following.items()}
        cases = [
            ("^use_cache: False", dict(following, use_cache=False)),
            ("^input_ids: 1 rows, and the cache passed back holds 2", fewer),
            (
                "^input_ids: 4 rows \\(2 x 2 copies\\)",
                dict(following, do_sample=True, num_return_sequences=2),
            ),  # fmt: skip
        ]
        for message, call in cases:
            with pytest.raises(ValueError, match=message):
                model.generate(**{**GREEDY, **call}, max_new_tokens=2)
            assert cache.paged.seq_lens() == lens and cache.get_seq_length() == columns
        out = model.generate(**following, max_new_tokens=2, **GREEDY)
    assert torch.equal(first.sequences, stock.sequences)
    assert torch.equal(out, stock_next)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_gradients_through_a_paged_forward_are_stocks(backend):
    """A forward with a PagedCache while autograd records (grad mode, weights that require
    grad) runs the torch references, which autograd follows: every gradient is stock's. On
    CPU "auto" is the references already; "triton" (the interpreter) is what CUDA runs.
    Planted, reverted: the Triton kernels there too: q_proj's and v_proj's gradients were 0."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    inputs = padded_batch([9, 4], 9)
    reference(**inputs).logits.pow(2).mean().backward()
    with patched(model, block_size=4, backend=backend):
        cache = nanoserve.PagedCache(nanoserve.PagedKVCache(2, 32, 4, backend=backend))
        model(**inputs, **{cache_name(model): cache}).logits.pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_call_that_waited_while_another_thread_unpatched_runs_stock(monkeypatch):
    """A generate call reads the patch state, then waits for its lock while another thread
    unpatches the model: it runs as the model now stands (stock). Planted, reverted: no
    re-check after the lock: the call ran on the stale state and stock's forward refused the
    paged cache (RuntimeError)."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    stock = stock_generate(model, **inputs, max_new_tokens=4, **GREEDY)
    nanoserve.patch_model(model, block_size=4)

    def call():
        return stock_generate(model, **inputs, max_new_tokens=4, **GREEDY)

    out = call_that_waits(monkeypatch, model, call, lambda: nanoserve.unpatch_model(model))
    assert torch.equal(out, stock)


def call_that_waits(monkeypatch, model, call, meanwhile):
    """``call()``'s result, run in another thread that reads the patch state and then waits
    for its turn (the test holds the model's lock) while ``meanwhile()`` runs; an error of
    the call fails the test."""
    from nanoserve.adapters import hf

    reached, result = threading.Event(), {}
    read_state = hf._state

    def reading(m):
        reached.set()
        return read_state(m)

    monkeypatch.setattr(hf, "_state", reading)

    def run():
        try:
            result["out"] = call()
        except Exception as e:  # reported below
            result["error"] = e

    with state_of(model).lock:
        thread = threading.Thread(target=run)
        thread.start()
        assert reached.wait(60)
        thread.join(0.2)  # (it now waits for the lock)
        meanwhile()
    thread.join(120)
    assert "error" not in result, result.get("error")
    return result["out"]


def test_a_call_that_waited_while_another_thread_changed_the_weights(monkeypatch):
    """A generate call waits for its turn while a call in another thread holds the model
    (the test holds its lock) and a trainer updates the weights in place: once its turn
    comes it runs on the new weights, and the prompt's blocks stored under the old ones are
    not found. Found by a probe: the call read its modules and the weights' salt before the
    lock, found the old blocks and gave other tokens. Planted: the salt read before the
    lock again: other tokens, one prefix hit."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 90, (1, 22), generator=torch.Generator().manual_seed(5))
    opts = dict(input_ids=ids, max_new_tokens=6, **GREEDY)
    nanoserve.patch_model(model, block_size=4)
    stock_generate(model, **opts)  # stores the prompt's blocks
    stock_generate(model, **opts)
    assert nanoserve.cache_stats(model)["prefix_hits"] > 0  # (found again: the cache works)

    def call():
        return stock_generate(model, **opts), nanoserve.cache_stats(model)["prefix_hits"]

    def train_step():  # in place, on the patched model and on its reference alike
        with torch.no_grad():
            for m in (model, reference):
                m.model.layers[0].self_attn.k_proj.weight.mul_(-1.0)
                m.model.layers[1].self_attn.v_proj.weight.mul_(2.0)

    out, hits = call_that_waits(monkeypatch, model, call, train_step)
    assert hits == 0
    assert torch.equal(out, stock_generate(reference, **opts))
    nanoserve.unpatch_model(model)


def test_a_cache_built_for_a_shorter_window_is_refused_naming_it():
    """A user-built cache whose pool releases blocks a layer still attends to would return
    wrong tokens; it is an error saying the cache's window is shorter than the layer's (the
    message blamed nanoserve's family table alone before)."""
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=80, num_hidden_layers=2, sliding_window=32,
    )  # fmt: skip
    model = transformers.MistralForCausalLM(config).eval()
    ids = torch.randint(3, 128, (1, 40))
    short = nanoserve.PagedCache(nanoserve.PagedKVCache(2, 64, 16, sliding_window=8))
    with patched(model), pytest.raises(RuntimeError, match="shorter sliding window"):
        model.generate(ids, **{cache_name(model): short}, max_new_tokens=5, do_sample=False)


@pytest.mark.parametrize("name", ["prefill_chunk_size", "prompt_lookup_num_tokens"])
def test_continuing_with_chunks_or_prompt_lookup(name):
    """A returned cache continued by a call with new prompt tokens and chunked prefill or
    prompt lookup: on transformers 5.17 the patched tokens differed from stock's (and from
    the uncached ones; a CPU probe), so it is refused there before anything changes; from
    5.24 on, stock's tokens."""
    from nanoserve.adapters.versions import transformers_before

    model = tiny_model("llama", seed=1)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    extra = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(5))
    first_opts = dict(input_ids=ids, max_new_tokens=4, return_dict_in_generate=True, **GREEDY)

    def continue_it(first):
        longer = torch.cat([first.sequences, extra], dim=1)
        return stock_generate(
            model, input_ids=longer, attention_mask=torch.ones_like(longer), max_new_tokens=8,
            **{name: 3, cache_name(model): first.past_key_values}, **GREEDY,
        )  # fmt: skip

    stock = continue_it(stock_generate(model, **first_opts))
    with patched(model):
        first = stock_generate(model, **first_opts)
        if transformers_before("5.24"):
            length = first.past_key_values.get_seq_length()
            with pytest.raises(ValueError, match=f"^{name}: continuing a returned cache"):
                continue_it(first)
            assert first.past_key_values.get_seq_length() == length
        else:
            assert torch.equal(continue_it(first), stock)


@pytest.mark.parametrize("kind", ["prompt_lookup", "assistant"])
def test_continuing_with_draft_tokens_grows_for_the_whole_input(kind):
    """transformers' first assisted / prompt-lookup forward feeds every column of a
    continuation again on top of the returned cache (5.25 does), not only the new ones: the
    pool grows for that and the tokens are stock's (found by a probe: OutOfBlocks, the pool
    grown only for the columns the cache had not seen)."""
    from nanoserve.adapters.versions import transformers_before

    if kind == "prompt_lookup" and transformers_before("5.24"):
        pytest.skip("before 5.24 continuing with prompt lookup is refused (test above)")
    model, draft = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    pattern = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(4))
    ids, extra = pattern.repeat(1, 10), pattern.repeat(1, 8)
    draft_opts = {"prompt_lookup_num_tokens": 20} if kind == "prompt_lookup" else {}
    draft_opts |= {"assistant_model": draft} if kind == "assistant" else {}

    def continue_it():
        first = stock_generate(
            model, input_ids=ids, max_new_tokens=4, return_dict_in_generate=True, **GREEDY
        )
        longer = torch.cat([first.sequences, extra], dim=1)
        return stock_generate(
            model, input_ids=longer, attention_mask=torch.ones_like(longer), max_new_tokens=8,
            **draft_opts, **{cache_name(model): first.past_key_values}, **GREEDY,
        )  # fmt: skip

    stock = continue_it()
    with patched(model):
        assert torch.equal(continue_it(), stock)


@pytest.mark.parametrize("shape", [(2, 1, 1, 6), (2, 1, 6), (6,)])
def test_a_mask_that_is_not_2d_raises_naming_it(shape):
    """generate takes a 2-D attention_mask, and stock says so (ValueError; for a 1-D mask it
    fails first on an IndexError); a patched model raises a ValueError naming attention_mask,
    before sizing its pool. (Found by a probe: the pool sizing's torch.cat raised a
    RuntimeError first.)"""
    model = tiny_model("llama")
    inputs = padded_batch([6, 3], 6)
    mask = torch.ones(shape, dtype=torch.long)
    with pytest.raises(ValueError if len(shape) > 1 else IndexError):
        model.generate(inputs["input_ids"], attention_mask=mask, max_new_tokens=2)
    with patched(model), pytest.raises(ValueError, match="^attention_mask: .*2-D"):
        model.generate(inputs["input_ids"], attention_mask=mask, max_new_tokens=2)
