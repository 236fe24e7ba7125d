"""patch_model(kv_dtype="fp8_e4m3"): FP8 pools under a stock generate call."""

from __future__ import annotations

import pytest
import torch
from helpers import BACKENDS, patched
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.kernels.quant import FP8_DTYPE

GREEDY = dict(do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True)


def _generate(model, inputs, **options):
    with patched(model, block_size=4, **options), torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, **GREEDY)
        cache = out.past_key_values
        stats = nanoserve.cache_stats(model)
    return out, cache, stats


@BACKENDS
def test_fp8_generate_stays_close_to_float_pools(backend):
    """Per-step logits over FP8 pools stay within FP8's rounding of float32 pools'; the pools
    are float8_e4m3fn with float32 scales per (layer, KV head); the Triton path (scatter
    bytes, fold of the scales) gives the torch references' logits. Planting a scatter that
    ignores the scales (stores x, not x / scale), or attention that does not pass the
    layer's scales to the kernels, failed this test."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 4, 7], 9)
    base, _, _ = _generate(model, inputs)
    forced = base.sequences  # compare the same tokens' logits
    out, cache, _ = _generate(model, inputs, kv_dtype="fp8_e4m3", backend=backend)
    paged = cache.paged
    assert all(p.dtype == FP8_DTYPE for p in paged.key_pools + paged.value_pools)
    assert all(s.dtype == torch.float32 and s.shape == (2,) for s in paged.key_scales)
    steps = min(len(out.logits), len(base.logits))
    for step in range(steps):
        a, b = out.logits[step], base.logits[step]
        if not torch.equal(out.sequences[:, : 9 + step], forced[:, : 9 + step]):
            break  # a token differed: later logits are of other prefixes
        assert ((a - b).norm() / b.norm()).item() < 0.05, step
    if backend == "triton":
        ref, _, _ = _generate(model, inputs, kv_dtype="fp8_e4m3", backend="torch")
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in zip(out.logits, ref.logits, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_max_memory_holds_more_fp8_rows():
    """max_memory sizes the pool in FP8 bytes: a float32 model's pool holds 4x the blocks
    (2x a 16-bit model's), and cache_stats counts 1 byte an element."""
    model = tiny_model("llama")
    inputs = padded_batch([6, 3], 6)
    _, _, plain = _generate(model, inputs, max_memory=20_000)
    _, _, fp8 = _generate(model, inputs, max_memory=20_000, kv_dtype="fp8_e4m3")
    # 2 layers x 2 (K, V) x 2 heads x 16 dims x 4 tokens: 2048 bytes a float32 block, 512 FP8
    assert plain["num_blocks"] == 20_000 // 2048 and fp8["num_blocks"] == 20_000 // 512
    assert fp8["bytes_reserved"] == fp8["num_blocks"] * 512


def test_kept_pool_and_scales_serve_the_next_call():
    """The next call reuses the kept FP8 pools and their scales as they are (the same
    tensors: captured graphs and cached prefixes stay valid)."""
    model = tiny_model("llama")
    inputs = padded_batch([6, 3], 6)
    with patched(model, block_size=4, num_blocks=32, kv_dtype="fp8_e4m3"), torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=3, **GREEDY)
        pools, scales = (
            first.past_key_values.paged.key_pools,
            first.past_key_values.paged.key_scales,
        )
        kept = [s.clone() for s in scales]
        del first
        second = model.generate(**inputs, max_new_tokens=3, **GREEDY)
        paged = second.past_key_values.paged
        assert paged.key_pools[0] is pools[0] and paged.key_scales[0] is scales[0]
        assert all(torch.equal(a, b) for a, b in zip(paged.key_scales, kept, strict=True))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(kv_dtype="int4"), "^kv_dtype"),
        (dict(kv_dtype="int8", kv_scale=1.0), "^kv_scale"),
        (dict(kv_dtype=torch.float16), "^kv_dtype"),
        (dict(kv_scale=1.0), "^kv_scale"),
        (dict(kv_dtype="fp8_e4m3", kv_scale=-1.0), "^kv_scale"),
        (dict(kv_dtype="fp8_e4m3", kv_scale=1e-46), "^kv_scale"),  # 0 in float32
        (dict(kv_dtype="fp8_e4m3", kv_scale=1e39), "^kv_scale"),  # inf in float32
    ],
)
def test_bad_fp8_options_leave_the_model_as_it_was(options, match):
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=match):
        nanoserve.patch_model(model, **options)
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match=match):
        nanoserve.PagedConfig(**options)


def test_fp8_pools_in_every_layer_group():
    """Gemma 3 (a sliding and a global layer group, each its own store): every group's pools
    are FP8 with scales, and the logits stay within FP8's rounding of float pools'. Planted:
    GroupedKVCache not passing kv_dtype to its groups: failed on the pools' dtype."""
    from test_new_families import tiny_model as tiny_family

    model = tiny_family("gemma3")
    inputs = padded_batch([13, 6], 13)
    base, _, _ = _generate(model, inputs)
    out, cache, _ = _generate(model, inputs, kv_dtype="fp8_e4m3")
    groups = cache.paged.groups
    assert len(groups) == 2
    for group in groups:
        assert all(p.dtype == FP8_DTYPE for p in group.key_pools + group.value_pools)
        assert all(s is not None and s.dtype == torch.float32 for s in group.key_scales)
    a, b = out.logits[0], base.logits[0]  # the prefill's logits: the same prefix
    assert ((a - b).norm() / b.norm()).item() < 0.05


def test_a_calls_tokens_do_not_depend_on_the_calls_before():
    """Kept FP8 pools keep their scales; the scales are fixed (not calibrated from the first
    call's prompt), so a call after a one-token call gives the same logits as the same call
    on fresh pools. Planted (found in review): scales calibrated from each pool's first
    write: a first call with a one-token prompt changed the second call's logits."""
    model = tiny_model("llama")
    inputs = padded_batch([9, 5], 9)
    options = dict(block_size=4, num_blocks=64, kv_dtype="fp8_e4m3")
    with patched(model, **options), torch.no_grad():
        fresh = model.generate(**inputs, max_new_tokens=6, **GREEDY)
    with patched(model, **options), torch.no_grad():
        model.generate(**padded_batch([1], 1), max_new_tokens=2, **GREEDY)
        after = model.generate(**inputs, max_new_tokens=6, **GREEDY)
    assert torch.equal(fresh.sequences, after.sequences)
    for a, b in zip(fresh.logits, after.logits, strict=True):
        assert torch.equal(a, b)
