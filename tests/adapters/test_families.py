"""Random-weight small configs of each supported family: per-step logits patched == stock."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from helpers import (
    BACKENDS,
    NEEDS_INTERPRETER,
    check_launches,
    count_triton_launches,
    patched,
    sharpen,
    spy_packed,
    stock_and_paged,
)

import nanoserve

SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 7}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2-sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
}


GREEDY = dict(do_sample=False, eos_token_id=None)


def tiny_model(name: str, seed: int = 0, **overrides):
    config_name, model_name, extra = CONFIGS[name]
    config = getattr(transformers, config_name)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


def padded_batch(lengths, width, vocab=97, seed=1):
    """Left-padded random prompts: dict(input_ids, attention_mask)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return dict(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask)


@BACKENDS
@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_step_logits_match_stock(name, backend, monkeypatch):
    """Every family, the sliding-window ones too, through the torch references ("auto" on
    CPU) and through the Triton kernels under the interpreter ("triton"). With the Triton
    decode window planted one key wider (kv_start = seq_len - window - 1) the triton cases of
    mistral and qwen2-sliding failed and their auto cases passed; with patch_model planted
    to drop ``backend`` (always "auto") every triton case failed on its launch count."""
    model = tiny_model(name)
    if name == "qwen2-sliding":
        assert "sliding_attention" in model.config.layer_types
    inputs = padded_batch([19, 11, 4], 19)
    opts = dict(
        max_new_tokens=14,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    launches = count_triton_launches(monkeypatch)
    stock, paged = stock_and_paged(
        model, **inputs, **opts, patch_options={"block_size": 4, "backend": backend}
    )
    check_launches(launches, backend)
    assert torch.equal(stock.sequences, paged.sequences)
    assert len(stock.logits) == len(paged.logits) == 14
    for step, (a, b) in enumerate(zip(stock.logits, paged.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_mistral_window_really_shorter_than_prompt():
    """The window changes what stock computes for this prompt (the same weights without a
    window give other logits), and the patched model follows the windowed stock, not the
    windowless one. Planted: paged attention dropping ``sliding_window`` (window = None in
    attention.py) failed it; so did the test's own config with sliding_window=64."""
    windowed, windowless = tiny_model("mistral"), tiny_model("mistral", sliding_window=None)
    inputs = padded_batch([19], 19)
    opts = dict(max_new_tokens=4, output_logits=True, return_dict_in_generate=True, **GREEDY)
    with torch.no_grad():
        plain = torch.stack(windowless.generate(**inputs, **opts).logits)
    stock, paged = stock_and_paged(windowed, **inputs, **opts, patch_options={"block_size": 4})
    stock, paged = torch.stack(stock.logits), torch.stack(paged.logits)
    # every step attends past the window (19 + step keys > 7): each step's logits move
    moved = (stock - plain).abs().amax(dim=(1, 2))
    assert (moved > 1e-3).all(), moved
    torch.testing.assert_close(paged, stock, rtol=1e-5, atol=1e-5)


def test_patched_forward_without_generate_is_stock():
    model = tiny_model("llama")
    inputs = padded_batch([9, 5], 9)
    with torch.no_grad():
        stock = model(**inputs).logits
        with patched(model):
            plain = model(**inputs).logits
            cached = model(**inputs, use_cache=True).logits
    torch.testing.assert_close(plain, stock, rtol=0, atol=0)
    torch.testing.assert_close(cached, stock, rtol=0, atol=0)


def test_patched_model_trains_as_stock():
    inputs = padded_batch([9, 5], 9)
    grads = []
    for patch in (False, True):
        model = tiny_model("llama").train()
        if patch:
            nanoserve.patch_model(model)
        loss = model(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        if patch:
            nanoserve.unpatch_model(model)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_user_passed_dynamic_cache_falls_back_to_stock():
    from transformers import DynamicCache

    model = tiny_model("qwen3")
    inputs = padded_batch([8, 3], 8)
    opts = dict(max_new_tokens=5, do_sample=False)
    # transformers 5.24 renamed the argument past_key_values to cache
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        stock = model.generate(**inputs, **opts, **{name: DynamicCache()})
        with patched(model):
            out = model.generate(**inputs, **opts, **{name: DynamicCache()})
    assert torch.equal(out, stock)


def test_unsupported_family_names_supported_ones():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(NotImplementedError, match="llama.*mistral.*qwen2.*qwen3"):
        nanoserve.patch_model(model)
    assert model.config._attn_implementation != "nanoserve_paged"


def test_pool_sizing_arguments():
    model = tiny_model("llama")
    inputs = padded_batch([6, 3], 6)
    with patched(model, block_size=4, max_memory=10_000), torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
        stats = nanoserve.cache_stats(model)
        # 2 layers x 2 (K, V) x 2 heads x 16 dims x 4 bytes x 4 tokens = 2048 bytes a block
        assert stats["num_blocks"] == 10_000 // 2048
        assert stats["bytes_reserved"] <= 10_000
    with pytest.raises(ValueError, match="num_blocks, max_memory"):
        nanoserve.patch_model(model, num_blocks=4, max_memory=1 << 20)
    with patched(model, block_size=4), torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, num_beams=2, do_sample=False)
        # default: 2 beams x (ceil((6 + 3) / 4) + ceil((3 + 3) / 4) + 1 spare a row): real
        # prompt tokens only, padding is never stored
        assert nanoserve.cache_stats(model)["num_blocks"] == 2 * (3 + 2 + 2)
    with patched(model, block_size=4), torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
        # 3 + 2 blocks needed, rounded up to the smallest pool size (sizing.coarse_blocks)
        assert nanoserve.cache_stats(model)["num_blocks"] == 8


def test_assisted_decoding_crops_and_matches_stock(monkeypatch):
    model = tiny_model("llama")
    draft = tiny_model("llama")
    with torch.no_grad():  # a draft that is sometimes wrong, so candidates get rejected
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    inputs = padded_batch([9], 9)
    opts = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    crops = []
    crop = nanoserve.PagedCache.crop
    monkeypatch.setattr(
        nanoserve.PagedCache, "crop", lambda self, n: (crops.append(n), crop(self, n))[1]
    )
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
        with patched(model), patched(draft):
            paged = model.generate(**inputs, **opts, assistant_model=draft)
    assert torch.equal(paged, stock)
    assert any(n < 0 for n in crops)


@pytest.mark.parametrize("prompt, block_size", [(8, 2), (112, 16)])
def test_prompt_lookup_fits_the_pool_it_sized(prompt, block_size):
    """Prompt lookup's verify step stores up to prompt_lookup_num_tokens candidates past
    max_length before cropping them; the pool nanoserve sizes itself has room for them.
    Planted: sizing for prompt + max_new_tokens alone raised OutOfBlocks (112-token case)."""
    model = sharpen(tiny_model("llama"))
    ids = torch.randint(3, 97, (1, prompt), generator=torch.Generator().manual_seed(3))
    ids[0, prompt // 2 :] = ids[0, : prompt - prompt // 2]  # repeats for the lookup to find
    for new in (10, 15, 16):
        opts = dict(max_new_tokens=new, do_sample=False, eos_token_id=None)
        stock, paged = stock_and_paged(
            model, input_ids=ids, prompt_lookup_num_tokens=3, **opts,
            patch_options={"block_size": block_size},
        )  # fmt: skip
        assert torch.equal(stock, paged)


def test_metadata_built_once_per_forward(monkeypatch):
    from nanoserve.cache import PagedKVCache

    model = tiny_model("qwen2-sliding")
    steps, forwards = [], []
    begin = PagedKVCache.begin_step
    monkeypatch.setattr(
        PagedKVCache, "begin_step", lambda self, *a, **k: (steps.append(1), begin(self, *a, **k))[1]
    )
    model.register_forward_hook(lambda *args: forwards.append(1))
    with patched(model), torch.no_grad():
        model.generate(**padded_batch([5, 3], 5), max_new_tokens=6, do_sample=False)
    assert model.config.num_hidden_layers == 2
    assert len(steps) == len(forwards) == 6


@NEEDS_INTERPRETER
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_few_new_tokens_take_the_packed_kernel(name, monkeypatch):
    """Steps of at most PACKED_MAX_QUERY_LEN new tokens a row (a 12-token prompt; the verify
    steps of prompt-lookup decoding, the first being the prompt with its candidates) pass the
    padded width as ``max_query_len`` and run the GQA-packed split-KV kernel: per-step logits
    and tokens are stock's. Planted: attention passing no ``max_query_len``: the packed
    kernel never ran, both cases failed."""

    model = tiny_model(name)
    inputs = padded_batch([12, 5], 12)
    bounds = spy_packed(monkeypatch, "max_query_len")
    opts = dict(max_new_tokens=6, output_logits=True, return_dict_in_generate=True, **GREEDY)
    patch = {"block_size": 4, "backend": "triton"}
    stock, paged = stock_and_paged(model, **inputs, **opts, patch_options=patch)
    assert bounds and max(bounds) == 12, bounds
    assert torch.equal(stock.sequences, paged.sequences)
    for step, (a, b) in enumerate(zip(stock.logits, paged.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    bounds.clear()
    lookup = dict(max_new_tokens=8, prompt_lookup_num_tokens=3, **GREEDY)
    # assisted decoding takes one row; a repeating prompt gives the lookup its candidates
    ids = inputs["input_ids"][:1, 8:].repeat(1, 3)
    one_row = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    stock, paged = stock_and_paged(model, **one_row, **lookup, patch_options=patch)
    # the prompt with the first candidates, then any later verify steps
    assert bounds and max(bounds) <= 12 + 3, bounds
    assert torch.equal(stock, paged)


@NEEDS_INTERPRETER
def test_turns_over_a_cached_history_take_the_split_packed_kernel(monkeypatch):
    """Chunks of 20 new tokens over the chunks before them (a float16 model, so a 16-bit
    family; 8 keys a split, so these short histories split) run the GQA-packed kernel split
    over the history, and follow the tiled kernel's logits and tokens (float16 tolerance).
    Planted: attention passing no ``max_query_len``: the packed kernel never ran."""
    from test_fused_decode import assert_follows

    from nanoserve.kernels import triton_extend, triton_verify

    model = tiny_model("llama").to(torch.float16)
    inputs = padded_batch([40, 33], 40)
    opts = dict(max_new_tokens=5, prefill_chunk_size=20, output_logits=True, **GREEDY)
    opts.update(return_dict_in_generate=True)
    splits = spy_packed(monkeypatch, "num_splits")
    monkeypatch.setattr(triton_verify, "TURN_SPLIT_KEYS", 8)
    patch = {"block_size": 4, "backend": "triton"}
    with patched(model, **patch), torch.no_grad():
        turns = model.generate(**inputs, **opts)
    assert splits and min(splits) > 1, splits
    splits.clear()
    monkeypatch.setattr(triton_extend, "TURN_MAX_QUERY_LEN", 16)  # the tiled kernel
    with patched(model, **patch), torch.no_grad():
        tiles = model.generate(**inputs, **opts)
    assert splits == []
    assert_follows(tiles, turns)


@pytest.mark.parametrize(
    "chunk, backend",
    [(3, "auto"), (8, "auto"), (16, "auto")]
    + [pytest.param(chunk, "triton", marks=NEEDS_INTERPRETER) for chunk in (3, 8)],
)
def test_chunked_prefill_matches_stock(chunk, backend, monkeypatch):
    """transformers' ``prefill_chunk_size``: the prompt comes in several forwards, the first
    ones all padding for the short rows; the block size (4) falls inside and across chunks.
    "triton" runs the later chunks through a Triton kernel over the paged history: chunks of
    at most 16 tokens (both here) take the GQA-packed kernel since attention passes the
    width as max_query_len. Planted in the tiled extend kernel, when it still ran them,
    q_pos = rows (a later chunk's causal positions counted from 0): both triton cases
    failed. (No triton case for chunk 16: its second forward is one token, a decode step, so
    it adds no extend over a history.) patch_model dropping ``backend``: every triton case
    failed on its launch count."""
    model = tiny_model("llama")
    inputs = padded_batch([2, 11, 17, 5], 17)
    opts = dict(max_new_tokens=7, do_sample=False, eos_token_id=None)
    widths = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
        widths.clear()
        launches = count_triton_launches(monkeypatch)
        with patched(model, block_size=4, backend=backend):
            paged = model.generate(**inputs, **opts, prefill_chunk_size=chunk)
            stats = nanoserve.cache_stats(model)
    check_launches(launches, backend)
    assert torch.equal(paged, stock)
    assert widths[: -(-17 // chunk)] == [min(chunk, 17 - i) for i in range(0, 17, chunk)]
    assert stats["tokens"] == sum([2, 11, 17, 5]) + 4 * 7 - 4  # the last token is not stored


@BACKENDS
def test_seeded_sampling_and_num_return_sequences(backend, monkeypatch):
    """Seeded multinomial sampling with 3 sequences a prompt equals stock's. Planted: Triton
    decode dropping the newest key (hi = min(lo + per_split, seq_len - 1)): the triton case
    failed, the auto case passed."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    opts = dict(max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=3)
    launches = count_triton_launches(monkeypatch)
    stock, paged = stock_and_paged(
        model, seed=5, **inputs, **opts, eos_token_id=None,
        patch_options={"block_size": 4, "backend": backend},
    )  # fmt: skip
    check_launches(launches, backend)
    assert paged.shape == (6, 9 + 8)
    assert torch.equal(stock, paged)
    new = paged[:, 9:]
    assert len({tuple(row.tolist()) for row in new[:3]}) > 1  # the copies really sampled apart


@BACKENDS
def test_beam_search(backend, monkeypatch):
    """Beam search (rows reordered every step, blocks shared by reference count, copy on
    write) equals stock's. Planted: Triton decode dropping the newest key failed the triton
    case; the cache's copy-on-write skipped failed both."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    opts = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, **GREEDY)
    launches = count_triton_launches(monkeypatch)
    stock, paged = stock_and_paged(
        model, **inputs, **opts, patch_options={"block_size": 4, "backend": backend}
    )
    check_launches(launches, backend)
    assert paged.shape == (4, 9 + 6)
    assert torch.equal(stock, paged)


def test_inputs_embeds_left_padded_match_stock():
    """generate from ``inputs_embeds`` with a left-padded ``attention_mask``: per-step logits
    equal stock's. Planted: new_token_mask ignoring the mask of a forward without input_ids
    (the pads stored and attended): failed."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 5, 2], 9)
    embeds = model.get_input_embeddings()(inputs["input_ids"]).detach()
    opts = dict(max_new_tokens=6, output_logits=True, return_dict_in_generate=True, **GREEDY)
    stock, paged = stock_and_paged(
        model, inputs_embeds=embeds, attention_mask=inputs["attention_mask"], **opts,
        patch_options={"block_size": 4},
    )  # fmt: skip
    assert paged.sequences.shape == (3, 6)  # from embeddings: only the new tokens come back
    assert torch.equal(stock.sequences, paged.sequences)
    for step, (a, b) in enumerate(zip(stock.logits, paged.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_four_d_attention_mask_is_refused():
    """A paged forward with a custom 4-D mask raises ValueError naming attention_mask before
    anything is stored. Planted: the dimension check removed (the 4-D mask then failed later
    as "does not cover"): failed on the message."""
    model = tiny_model("llama")
    inputs = padded_batch([5, 3], 5)
    mask = torch.full((5, 5), float("-inf")).triu(1).expand(2, 1, 5, 5)  # [B, 1, q, kv]
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = nanoserve.PagedCache(nanoserve.PagedKVCache(2, 8, 4))
    refused = pytest.raises(ValueError, match="^attention_mask: .* takes a 2-D")
    with patched(model), torch.no_grad(), refused:
        model(input_ids=inputs["input_ids"], attention_mask=mask, use_cache=True, **{name: cache})
    assert cache.get_seq_length() == 0 and cache.paged.num_seqs == 0


def test_bidirectional_config_is_refused():
    """is_causal=False: patch_model raises NotImplementedError and leaves the model as it
    was. Planted: llama.check removed: failed (patched without a word)."""
    model = tiny_model("llama", is_causal=False)
    attn = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match=r"is_causal=False"):
        nanoserve.patch_model(model)
    assert model.config._attn_implementation == attn
    assert "generate" not in model.__dict__ and "forward" not in model.__dict__


def test_max_memory_below_one_block_is_refused_at_patch_and_generate():
    """max_memory under one block (2048 bytes of float32 here) is a ValueError naming
    max_memory at patch_model, the model left unpatched; a model cast to a wider dtype
    after patching is refused when generate sizes the pool. Planted: the patch-time check
    removed: the first case failed (no error); the check in sizing.pool_size removed: the
    float64 case failed on the message."""
    model = tiny_model("llama")
    inputs = padded_batch([6, 3], 6)
    with pytest.raises(ValueError, match=r"^max_memory: 2047 bytes .* one block \(2048"):
        nanoserve.patch_model(model, block_size=4, max_memory=2047)
    assert "forward" not in model.__dict__ and "generate" not in model.__dict__
    refused = pytest.raises(ValueError, match=r"^max_memory: 2048 bytes .* one block \(4096")
    with patched(model, block_size=4, max_memory=2048), torch.no_grad(), refused:
        model.to(torch.float64)
        try:
            model.generate(**inputs, max_new_tokens=3, do_sample=False)
        finally:
            model.to(torch.float32)
    # one block is accepted as a size, then too small for this call: OutOfBlocks names it
    too_small = pytest.raises(nanoserve.OutOfBlocks, match="max_memory")
    with patched(model, block_size=4, max_memory=2048), torch.no_grad(), too_small:
        model.generate(**inputs, max_new_tokens=3, do_sample=False)


def test_torch_backend_equals_stock_and_launches_no_triton(monkeypatch):
    """backend="torch" passed explicitly: stock's per-step logits, and no Triton kernel,
    even under TRITON_INTERPRET=1 where Triton could run. Planted: patch_model turning
    "torch" into "triton": failed on the launch count (under the interpreter)."""
    model = tiny_model("qwen2-sliding")
    inputs = padded_batch([9, 4], 9)
    opts = dict(max_new_tokens=5, output_logits=True, return_dict_in_generate=True, **GREEDY)
    launches = count_triton_launches(monkeypatch)
    stock, paged = stock_and_paged(
        model, **inputs, **opts, patch_options={"block_size": 4, "backend": "torch"}
    )
    check_launches(launches, "torch")
    assert torch.equal(stock.sequences, paged.sequences)
    for step, (a, b) in enumerate(zip(stock.logits, paged.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")
