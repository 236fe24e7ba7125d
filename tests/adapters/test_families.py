"""Random-weight small configs of each supported family: per-step logits patched == stock."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from helpers import patched, stock_and_paged

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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_step_logits_match_stock(name):
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
    stock, paged = stock_and_paged(model, **inputs, **opts, patch_options={"block_size": 4})
    assert torch.equal(stock.sequences, paged.sequences)
    assert len(stock.logits) == len(paged.logits) == 14
    for step, (a, b) in enumerate(zip(stock.logits, paged.logits, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_mistral_window_really_shorter_than_prompt():
    model = tiny_model("mistral")
    assert model.config.sliding_window < 19


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
        assert nanoserve.cache_stats(model)["num_blocks"] == 3 + 2


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


@pytest.mark.parametrize("chunk", [3, 8, 16])
def test_chunked_prefill_matches_stock(chunk):
    """transformers' ``prefill_chunk_size``: the prompt comes in several forwards, the first
    ones all padding for the short rows; the block size (4) falls inside and across chunks."""
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
        with patched(model, block_size=4):
            paged = model.generate(**inputs, **opts, prefill_chunk_size=chunk)
            stats = nanoserve.cache_stats(model)
    assert torch.equal(paged, stock)
    assert widths[: -(-17 // chunk)] == [min(chunk, 17 - i) for i in range(0, 17, chunk)]
    assert stats["tokens"] == sum([2, 11, 17, 5]) + 4 * 7 - 4  # the last token is not stored
