"""patch_model(kv_dtype="int8"): INT8 pools with per-slot scales under a stock generate call."""

from __future__ import annotations

import pytest
import torch
from helpers import BACKENDS, patched
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.kernels.quant import INT8_DTYPE, INT8_SCALE_DTYPE

GREEDY = dict(do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True)


def _generate(model, inputs, max_new_tokens=6, **options):
    with patched(model, block_size=4, **options), torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, **GREEDY)
        stats = nanoserve.cache_stats(model)
    return out, out.past_key_values, stats


def _close_while_tokens_agree(out, base, prompt_len, tolerance):
    """Per-step logits within ``tolerance`` (relative norm) while the tokens so far agree;
    returns the steps compared."""
    steps = 0
    for step in range(min(len(out.logits), len(base.logits))):
        if not torch.equal(
            out.sequences[:, : prompt_len + step], base.sequences[:, : prompt_len + step]
        ):
            break  # a token differed: later logits are of other prefixes
        a, b = out.logits[step], base.logits[step]
        assert ((a - b).norm() / b.norm()).item() < tolerance, step
        steps += 1
    return steps


@pytest.mark.parametrize("head_dim", [16, 40])
@BACKENDS
def test_int8_generate_stays_close_to_float_pools(backend, head_dim):
    """Per-step logits over INT8 pools stay within INT8's rounding of float32 pools' (closer
    than FP8's 0.05); the pools are int8 with float16 per-slot scales; the Triton path gives
    the torch references' logits. Planted: attention not passing the layer's scales (the
    kernels then refuse the pools) and a scatter storing values without their scales (the
    logits ran far off): both failed. Head dim 40: three key groups, the last one partial."""
    model = tiny_model("llama", head_dim=head_dim)
    inputs = padded_batch([9, 4, 7], 9)
    base, _, _ = _generate(model, inputs)
    out, cache, _ = _generate(model, inputs, kv_dtype="int8", backend=backend)
    paged = cache.paged
    assert all(p.dtype == INT8_DTYPE for p in paged.key_pools + paged.value_pools)
    for pool, k_scale, v_scale in zip(
        paged.key_pools, paged.key_scales, paged.value_scales, strict=True
    ):
        assert k_scale.dtype == v_scale.dtype == INT8_SCALE_DTYPE
        assert k_scale.shape == (*pool.shape[:3], -(-head_dim // 16))
        assert v_scale.shape == (*pool.shape[:3], 1)
    assert _close_while_tokens_agree(out, base, 9, 0.02) >= 1
    if backend == "triton":
        ref, _, _ = _generate(model, inputs, kv_dtype="int8", backend="torch")
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.logits, ref.logits, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_max_memory_holds_more_int8_rows():
    """max_memory sizes the pool in INT8 bytes, scales included, and cache_stats counts them:
    per (layer, KV head, token) 16 bytes of K and of V plus a 2-byte scale each, 36 bytes
    against float32's 128."""
    model = tiny_model("llama")
    inputs = padded_batch([6, 3], 6)
    _, _, plain = _generate(model, inputs, max_memory=20_000)
    _, _, int8 = _generate(model, inputs, max_memory=20_000, kv_dtype="int8")
    # 2 layers x 2 heads x 4 tokens a block: float32 2048 bytes, INT8 2 x 2 x 4 x 36 = 576
    assert plain["num_blocks"] == 20_000 // 2048 and int8["num_blocks"] == 20_000 // 576
    assert int8["bytes_reserved"] == int8["num_blocks"] * 576


def test_kept_pool_and_cached_prefix_give_a_fresh_calls_logits():
    """The next call reuses the kept INT8 pools and scales (the same tensors), and a prompt
    found in the prefix cache gives the tokens of the same call on fresh pools and its logits
    but for float32's last bits (the attention over the cached prefix sums in another order,
    as with float pools): a token's stored values depend on that token alone. Planted:
    scales allocated anew at each call (the cached prefixes then read zeros): failed."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 5], 9)
    options = dict(block_size=4, num_blocks=64, kv_dtype="int8")
    with patched(model, **options), torch.no_grad():
        fresh = model.generate(**inputs, max_new_tokens=6, **GREEDY)
    with patched(model, **options), torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=6, **GREEDY)
        pools = first.past_key_values.paged.key_pools
        scales = first.past_key_values.paged.key_scales
        del first
        model.generate(**padded_batch([1], 1), max_new_tokens=2, **GREEDY)
        again = model.generate(**inputs, max_new_tokens=6, **GREEDY)
        paged = again.past_key_values.paged
        assert paged.key_pools[0] is pools[0] and paged.key_scales[0] is scales[0]
        assert nanoserve.cache_stats(model)["prefix_hits"] == 2  # both prompts found
    assert torch.equal(fresh.sequences, again.sequences)
    for a, b in zip(fresh.logits, again.logits, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_int8_pools_in_every_layer_group():
    """Gemma 3 (a sliding and a global layer group, each its own store): every group's pools
    are INT8 with per-slot scales, and the logits stay within INT8's rounding."""
    from test_new_families import tiny_model as tiny_family

    model = tiny_family("gemma3")
    inputs = padded_batch([13, 6], 13)
    base, _, _ = _generate(model, inputs)
    out, cache, _ = _generate(model, inputs, kv_dtype="int8")
    groups = cache.paged.groups
    assert len(groups) == 2
    for group in groups:
        assert all(p.dtype == INT8_DTYPE for p in group.key_pools + group.value_pools)
        assert all(s is not None and s.dtype == INT8_SCALE_DTYPE for s in group.key_scales)
    a, b = out.logits[0], base.logits[0]  # the prefill's logits: the same prefix
    assert ((a - b).norm() / b.norm()).item() < 0.02


def test_copied_rows_copy_their_blocks_scales():
    """Copies of one prompt (num_return_sequences) share its blocks; the partly filled last
    one is copied when each copy writes its first new token, and its scales go with it: the
    copies' logits stay within INT8's rounding of float pools'. Planted: block copies
    leaving the scales behind: failed (the copied block's keys read as zeros)."""
    model = tiny_model("llama")
    inputs = padded_batch([9], 9)  # 9 tokens in blocks of 4: the last block is shared, partly
    sampled = {**GREEDY, "do_sample": True, "top_k": 1, "num_return_sequences": 3}
    torch.manual_seed(0)
    with patched(model, block_size=4), torch.no_grad():
        base = model.generate(**inputs, max_new_tokens=4, **sampled)
    torch.manual_seed(0)
    with patched(model, block_size=4, kv_dtype="int8"), torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, **sampled)
    assert _close_while_tokens_agree(out, base, 9, 0.02) >= 2


def test_a_continued_cache_keeps_its_scales_when_its_pool_grows():
    """A returned INT8 cache passed back to generate with more tokens to make grows its pool:
    the scales are copied into the larger tensors with the values, so the continuation
    stays within INT8's rounding of the same continuation over float pools. Planted
    (found in review): growth copying the values only: the scales were then made anew as
    zeros and the stored tokens read as zeros; failed."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 5], 9)
    runs = []
    for kv_dtype in (None, "int8"):
        with patched(model, block_size=4, kv_dtype=kv_dtype), torch.no_grad():
            first = model.generate(**inputs, max_new_tokens=3, **GREEDY)
            blocks = first.past_key_values.paged.allocator.num_blocks
            mask = torch.cat([inputs["attention_mask"], torch.ones(2, 3, dtype=torch.long)], 1)
            more = model.generate(
                input_ids=first.sequences, attention_mask=mask,
                past_key_values=first.past_key_values, max_new_tokens=24, **GREEDY,
            )  # fmt: skip
            assert more.past_key_values.paged.allocator.num_blocks > blocks  # it grew
        runs.append(more)
    assert _close_while_tokens_agree(runs[1], runs[0], 12, 0.02) >= 2


def test_the_decode_graphs_signature_covers_the_scales():
    """A captured step reads the scales by address: a cache whose pools stay but whose scales
    moved must not replay graphs captured over the old ones. Planted: the signature without
    the scales: failed."""
    from nanoserve.adapters.graph_forward import memory_signature

    model = tiny_model("llama")
    with patched(model, block_size=4, kv_dtype="int8"), torch.no_grad():
        out = model.generate(**padded_batch([5, 3], 5), max_new_tokens=2, **GREEDY)
        cache = out.past_key_values
        before = memory_signature(model, cache)
        assert memory_signature(model, cache) == before
        for scales in (cache.paged.key_scales, cache.paged.value_scales):
            kept = scales[1]
            scales[1] = kept.clone()
            assert memory_signature(model, cache) != before
            scales[1] = kept


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_returned_quantized_cache_refuses_rows_of_another_dtype(kv_dtype):
    """INT8/FP8 pools keep their dtype whatever the model's, so ``model.half()`` under a
    returned cache is caught by the dtype of the rows written: a clear error before any row
    grows, and back in float32 the continuation gives what an untouched cache gives.
    Planted: the check dropped (the half rows were stored beside the float32 ones): failed."""
    from helpers import cache_name
    from test_misuse import continued

    model = tiny_model("llama")
    inputs = padded_batch([9, 4], 9)
    greedy = dict(do_sample=False, eos_token_id=None)
    results = []
    with patched(model, block_size=4, kv_dtype=kv_dtype), torch.no_grad():
        for interrupt in (True, False):
            first = model.generate(
                **inputs, max_new_tokens=4, return_dict_in_generate=True, **greedy
            )
            cache = first.past_key_values
            following = dict(
                **continued(inputs, first.sequences), max_new_tokens=3,
                **{cache_name(model): cache}, **greedy,
            )  # fmt: skip
            if interrupt:
                lens, columns = cache.paged.seq_lens(), cache.get_seq_length()
                model.half()
                with pytest.raises(ValueError, match="^key: .*written from torch.float32 rows"):
                    model.generate(**following)
                assert cache.paged.seq_lens() == lens and cache.get_seq_length() == columns
                model.float()
            results.append(model.generate(**following))
    assert torch.equal(results[0], results[1])
