"""Gemma 2, Gemma 3 (text), Gemma and Phi-3 on the paged cache: tiny random-weight models in float32
on the CPU, every generate mode token-exact with stock, windows shorter than the prompts
(8 tokens, blocks of 4) and generation running past them."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch
import transformers
from helpers import (
    BACKENDS,
    NEEDS_INTERPRETER,
    ForceTokens,
    check_launches,
    count_triton_launches,
    patched,
    sharpen,
    stock_and_paged,
)
from test_families import SMALL, padded_batch

import nanoserve
from nanoserve.adapters import Family, family_for, supported_model_types

WINDOW = 8
CONFIGS = {
    # softcap 2.0 and scale 20 ** -0.5 (head_dim 32 would give 32 ** -0.5): both change stock's
    # logits here (test_config_features_change_stock). Eager: transformers 5.17 defaults
    # Gemma 2 to sdpa, which drops the softcap (5.24 runs it eager, as nanoserve does)
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=20,
            attn_logit_softcapping=2.0, final_logit_softcapping=30.0, attn_implementation="eager",
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(num_hidden_layers=6, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=20),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_hidden_layers=2, head_dim=32)),
}  # fmt: skip
GREEDY = dict(do_sample=False, eos_token_id=None)
LOGITS = dict(output_logits=True, return_dict_in_generate=True, **GREEDY)


def tiny_model(name: str, seed: int = 0, **overrides):
    """A random-weight model of family ``name``; its matrices drawn larger than HF's default
    init, so that attention scores reach the softcap and the window's edge shows."""
    config_name, model_name, extra = CONFIGS[name]
    config = getattr(transformers, config_name)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    return sharpen(getattr(transformers, model_name)(config).eval())


def assert_logits_equal(stock, paged):
    """Stock's tokens, and each step's float32 logits within 1e-5 of that step's largest
    stock logit: the paged attention sums in another order than stock's, and the sharpened
    weights carry the rounding to the logits (a Nemotron step differed by 2.0e-5 beside a
    largest logit of 8.9 on an AMD EPYC CPU; a wrong key or window differs by far more)."""
    assert torch.equal(stock.sequences, paged.sequences)
    assert len(stock.logits) == len(paged.logits)
    for step, (a, b) in enumerate(zip(stock.logits, paged.logits, strict=True)):
        bound = 1e-5 * max(a.abs().max().item(), 1.0)
        torch.testing.assert_close(b, a, rtol=0.0, atol=bound, msg=f"step {step}")


def test_registry_names_the_new_families():
    for model_type in ("gemma", "gemma2", "gemma3_text", "phi3"):
        assert model_type in supported_model_types()
    # Gemma 3's multimodal model (bidirectional attention over image tokens) is not served
    with pytest.raises(NotImplementedError, match="'gemma3'.*gemma3_text"):
        family_for(transformers.Gemma3Config())


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_bidirectional_gemma_is_refused(name):
    model = tiny_model(name, use_bidirectional_attention=True)
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        nanoserve.patch_model(model)
    assert "generate" not in model.__dict__


def test_config_features_change_stock():
    """What the tests below hold the paged path to is not trivial: in these configs the
    softcap, the query_pre_attn_scalar scale and the window each move stock's logits (a
    patched model ignoring one of them would differ from stock)."""
    inputs = padded_batch([19], 19)
    opts = dict(max_new_tokens=4, **LOGITS)

    def logits(name, **overrides):
        with torch.no_grad():
            return torch.stack(tiny_model(name, **overrides).generate(**inputs, **opts).logits)

    for name, overrides in (
        ("gemma2", dict(attn_logit_softcapping=None)),
        ("gemma2", dict(query_pre_attn_scalar=32)),
        ("gemma2", dict(sliding_window=64)),
        ("gemma3", dict(query_pre_attn_scalar=32)),
        ("gemma3", dict(sliding_window=64)),
        ("phi3", dict(sliding_window=None)),
    ):
        moved = (logits(name) - logits(name, **overrides)).abs().amax(dim=(1, 2))
        assert (moved > 1e-3).all(), (name, overrides, moved)
    layer_types = tiny_model("gemma3").config.layer_types
    assert layer_types.count("sliding_attention") == 5 and layer_types[-1] == "full_attention"


@BACKENDS
@pytest.mark.parametrize("name", list(CONFIGS))
def test_per_step_logits_match_stock(name, backend, monkeypatch):
    """A left-padded batch whose prompts are longer than the window (19, 11) and shorter (4),
    14 greedy steps: every row's generation runs past the window. "triton" runs the Triton
    kernels under the interpreter."""
    model = tiny_model(name)
    inputs = padded_batch([19, 11, 4], 19)
    launches = count_triton_launches(monkeypatch)
    stock, paged = stock_and_paged(
        model, **inputs, max_new_tokens=14, **LOGITS,
        patch_options={"block_size": 4, "backend": backend},
    )  # fmt: skip
    check_launches(launches, backend)
    assert len(paged.logits) == 14
    assert_logits_equal(stock, paged)


MODES = {
    "beams": dict(num_beams=3, num_return_sequences=2, **GREEDY),
    "sampling": dict(do_sample=True, top_k=20, num_return_sequences=3, eos_token_id=None),
    "chunked": dict(prefill_chunk_size=5, **GREEDY),
    "no-sharing": dict(**GREEDY),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_modes_match_stock(name, mode):
    """Beams (rows reordered, blocks shared, copy on write), seeded sampling with copies of
    each prompt, chunked prefill (chunks of 5 over a window of 8 and blocks of 4), and the
    same prompts without prefix sharing; two rows repeat one prompt, so with sharing (the
    default) its prefill runs once."""
    model = tiny_model(name)
    inputs = padded_batch([13, 6, 13], 13)
    inputs["input_ids"][2] = inputs["input_ids"][0]
    options = {"block_size": 4, "prefix_sharing": mode != "no-sharing"}
    stock, paged = stock_and_paged(
        model, seed=3, **inputs, max_new_tokens=12, **MODES[mode], patch_options=options
    )
    assert torch.equal(stock, paged)
    if mode == "sampling":
        assert len({tuple(row.tolist()) for row in paged[:3, 13:]}) > 1  # really sampled


@pytest.mark.parametrize(
    "name, backend",
    [
        ("gemma2", "auto"),
        ("gemma3", "auto"),
        pytest.param("gemma3", "triton", marks=NEEDS_INTERPRETER),
    ],
)
def test_cached_prefix_longer_than_window(name, backend, monkeypatch):
    """A later call finds the 12 leading tokens (3 blocks, longer than the window) an earlier
    call stored, and runs only the rest of its prompt over them."""
    model = tiny_model(name)
    system = padded_batch([14], 14, seed=7)["input_ids"][0, :12]
    calls = []
    for seed in (8, 9):
        call = padded_batch([17, 15], 17, seed=seed)
        call["input_ids"][0, :12] = system
        call["input_ids"][1, 2:14] = system
        calls.append(call)
    opts = dict(max_new_tokens=10, **LOGITS)
    with torch.no_grad():
        stock = [model.generate(**call, **opts) for call in calls]
    launches = count_triton_launches(monkeypatch)
    with patched(model, block_size=4, backend=backend), torch.no_grad():
        paged = [model.generate(**call, **opts) for call in calls]
        stats = nanoserve.cache_stats(model)
    check_launches(launches, backend)
    assert stats["prefix_hits"] == 2
    for a, b in zip(stock, paged, strict=True):
        assert_logits_equal(a, b)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_hub_cache_implementation_hybrid_runs_paged(name):
    """Gemma checkpoints' generation_config says cache_implementation="hybrid", which stock
    drops (it then builds its dynamic sliding-window cache): a patched model generates on its
    paged cache, with stock's tokens."""
    model = tiny_model(name)
    model.generation_config.cache_implementation = "hybrid"
    inputs = padded_batch([11, 5], 11)
    stock, paged = stock_and_paged(
        model, **inputs, max_new_tokens=9, **LOGITS, patch_options={"block_size": 4}
    )
    assert_logits_equal(stock, paged)
    assert isinstance(paged.past_key_values, nanoserve.PagedCache)


# with decode_loop=True, Phi-3's own prepare_inputs_for_generation sends the call to HF's
# loop (decode_loop.stock_reason), which runs the switch
@pytest.mark.parametrize("decode_loop", [False, True])
def test_phi3_long_rope_switch_matches_stock(decode_loop):
    """Long-rope Phi-3 (original_max_position_embeddings 16): the call crosses 16 positions
    mid-generation, where Phi3's prepare_inputs_for_generation drops the cache and re-runs
    the sequence with the long factors; from then on the call runs on stock's cache, as
    stock's does. A prompt already past 16 runs that way from its first forward."""
    head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    rope = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0] * (head_dim // 2),
        long_factor=[1.0 + i % 4 for i in range(head_dim // 2)],
    )
    model = tiny_model(
        "phi3", max_position_embeddings=64, original_max_position_embeddings=16,
        rope_parameters=rope, sliding_window=None,
    )  # fmt: skip
    for lengths in ([11, 6], [19, 9]):
        inputs = padded_batch(lengths, max(lengths))
        stock, paged = stock_and_paged(
            model, **inputs, max_new_tokens=10, **LOGITS,
            patch_options={"block_size": 4, "decode_loop": decode_loop},
        )  # fmt: skip
        assert_logits_equal(stock, paged)


# -- memory for sliding layers: where every layer slides (Phi-3 here, Mistral), the blocks
# that fell out of the window are released -----------------------------------------------


@BACKENDS
def test_all_sliding_generation_far_past_the_window(backend, monkeypatch):
    """Phi-3 with a window of 8 on every layer, 60 greedy steps after prompts of 19 and 4
    tokens: per-step logits equal stock's while each row holds at most 4 blocks of 4 (the
    window's 3 and one of slack; the tokens stored need 36), in a pool fixed at 12 blocks.
    Planted: begin_step releasing without the slack and one position too early: failed."""
    model = tiny_model("phi3")
    assert nanoserve.adapters.family_for(model.config).layout(model.config).sliding_window == 8
    inputs = padded_batch([19, 4], 19)
    launches = count_triton_launches(monkeypatch)
    options = {"block_size": 4, "num_blocks": 12, "backend": backend}
    stock, paged = stock_and_paged(
        model, **inputs, max_new_tokens=60, **LOGITS, patch_options=options
    )
    check_launches(launches, backend)
    assert_logits_equal(stock, paged)
    stats = paged.past_key_values.stats()
    stored = [19 + 59, 4 + 59]  # the last token is not stored
    assert stats["tokens"] == sum(stored)
    full = sum(-(-n // 4) for n in stored)
    held, released = stats["blocks_used"], stats["blocks_dropped_by_window"]
    print(f"phi3, window 8: blocks held {held} of {full} (released {released})")
    assert full == 36 and held <= 2 * 4
    assert released == full - held


@pytest.mark.parametrize("block_size", [4, 1])
def test_eos_under_the_decode_loop_then_continue(block_size, monkeypatch):
    """One Phi-3 row (window 8, blocks of 4 or 1) that meets EOS after 21..28 tokens: nanoserve's
    decode loop learns of the stop a few steps late and crops those steps from the cache;
    the returned cache then continues for 8 more tokens, with the per-step logits of the
    same calls on a cache that releases nothing. The stop falls at every offset in a block.
    Planted: releasing without the block of slack: the continuation was refused
    (ValueError) at some stops; with blocks of 1, a slack of one block instead of the loop's
    READ_BACK_LAG tokens: refused at every stop."""
    model = tiny_model("phi3")
    inputs = padded_batch([19], 19)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        ahead = model.generate(**inputs, max_new_tokens=40, **GREEDY)[0, 19:].tolist()
    keep_all = Family.layout

    def two_calls(release: bool, eos: int):
        if not release:  # the same model on a cache that keeps every block
            monkeypatch.setattr(
                Family, "layout", lambda f, c: replace(keep_all(f, c), sliding_window=None)
            )
        opts = dict(max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
        with patched(model, block_size=block_size), torch.no_grad():
            first = model.generate(**inputs, **opts, return_dict_in_generate=True)
            assert nanoserve.decode_graph_stats(model)["decode_loop"] == "nanoserve"
            released = first.past_key_values.stats()["blocks_dropped_by_window"]
            more = dict(max_new_tokens=8, **LOGITS, **{name: first.past_key_values})
            mask = torch.ones_like(first.sequences)  # a generated pad id is a token here
            out = model.generate(input_ids=first.sequences, attention_mask=mask, **more)
        monkeypatch.undo()
        return first.sequences, out, released

    stops = set()
    for k in range(20, 28):
        first, out, released = two_calls(True, ahead[k])
        first_kept, out_kept, none = two_calls(False, ahead[k])
        assert released > 0 and none == 0
        assert torch.equal(first, first_kept)
        assert_logits_equal(out_kept, out)
        stops.add(first.shape[1] % block_size)
    assert len(stops) == block_size  # the stop falls at every offset in a block


def test_default_pool_of_all_sliding_rows_is_window_sized():
    """Ten rows of 2..11 prompt tokens and 40 new ones under a window of 8 (blocks of 4): the
    pool generate sizes holds each row's window (4 blocks a row past its prompt, one of
    them slack), not its whole length, and the call gives stock's tokens. Planted: sizing a
    row's window without the slack block: OutOfBlocks."""
    model = tiny_model("phi3")
    lengths = list(range(2, 12))
    inputs = padded_batch(lengths, 11)
    with torch.no_grad():
        stock = model.generate(**inputs, max_new_tokens=40, **GREEDY)
        with patched(model, block_size=4):
            paged = model.generate(**inputs, max_new_tokens=40, **GREEDY)
            stats = nanoserve.cache_stats(model)
    assert torch.equal(stock, paged)
    assert stats["num_blocks"] == 40  # ten rows of 4 blocks (a coarse size already)
    assert sum(-(-(n + 39) // 4) for n in lengths) == 118  # without the window


def test_a_layer_wider_than_the_cache_window_is_an_error():
    """A cache built by hand with a window that a layer's attention does not keep (a Llama
    attends to every position): the cache would release blocks the layer reads, so the paged
    forward raises naming the layer instead of computing on missing history. (A config whose
    sliding_window the attention ignores is refused earlier, by patch_model: test_windows.)"""
    config = transformers.LlamaConfig(**SMALL)  # 2 layers
    model = transformers.LlamaForCausalLM(config).eval()
    paged = nanoserve.PagedKVCache(2, 16, 4, sliding_window=6)
    refused = pytest.raises(RuntimeError, match="layer 0 of LlamaAttention attends to all")
    with patched(model, block_size=4), torch.no_grad(), refused:
        model(**padded_batch([9], 9), past_key_values=nanoserve.PagedCache(paged), use_cache=True)


# -- on a CUDA GPU, the Triton kernels and decode graphs: real head dims and widths, fewer
# layers, windows of 32 tokens under 64 new ones -------------------------------------------

GPU_SHAPES = {
    "gemma2-9b": (
        "gemma2",
        dict(
            vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        ),
    ),
    "gemma3-4b": (
        "gemma3",
        dict(
            vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        ),
    ),
    "phi3.5-mini": (
        "phi3",
        dict(
            vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=4,
            num_attention_heads=32, num_key_value_heads=32,
        ),
    ),
}  # fmt: skip
GPU_WINDOW = 32
GPU_NEW_TOKENS = 64
NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_model(shape: str, dtype: torch.dtype, device: str = "cuda", attn: str | None = None):
    name, dims = GPU_SHAPES[shape]
    extra = {"attn_implementation": attn} if attn else {}
    extra.update(sliding_window=GPU_WINDOW, max_position_embeddings=512)
    model = tiny_model(name, **dims, **extra)
    return model.to(device, dtype)


def gpu_batch(vocab: int, device: str = "cuda"):
    """Left-padded prompts of 37, 20, 5 and 64 tokens (two longer than the window)."""
    inputs = padded_batch([37, 20, 5, 64], 64, vocab=vocab)
    return {k: v.to(device) for k, v in inputs.items()}


def forced_logits(model, inputs, target=None):
    """Per-step logits [steps, B, vocab] (float32) and the sequences of a greedy run, forced
    onto ``target``'s tokens when given."""
    opts = dict(max_new_tokens=GPU_NEW_TOKENS, **LOGITS)
    if target is not None:
        opts["logits_processor"] = transformers.LogitsProcessorList([ForceTokens(target)])
    with torch.no_grad():
        out = model.generate(**inputs, **opts)
    return torch.stack(out.logits).float(), out.sequences


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_float32_logits_match_stock(shape, device="cuda"):
    """64 steps of per-step logits within 1e-5 (of the largest logit) of stock's, through the
    Triton kernels and the decode graphs (per layer group for Gemma). Phi-3 slides every
    layer, Gemma 2 / 3 keep their sliding layers in a pool of their own: blocks out of the
    window are released on the way."""
    model = gpu_model(shape, torch.float32, device)
    inputs = gpu_batch(model.config.vocab_size, device)
    stock, tokens = forced_logits(model, inputs)
    with patched(model):
        paged, paged_tokens = forced_logits(model, inputs, target=tokens)
        released = nanoserve.cache_stats(model)["blocks_dropped_by_window"]
    assert released > 0
    assert torch.equal(paged_tokens, tokens)
    assert stock.shape[0] == GPU_NEW_TOKENS
    scale = stock.abs().max().item()
    err = (paged - stock).abs().max().item()
    print(f"{shape} float32: max |paged - stock| = {err:.3g} (logits up to {scale:.3g})")
    assert err <= 1e-5 * scale


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_bfloat16_drift_within_stock_eager(shape, device="cuda"):
    """In bfloat16, the patched model's logits are on average no further from stock's
    float32 logits than stock eager attention's in bfloat16 are, on the same forced tokens
    (the largest error may land on either side: within twice eager's)."""
    model = gpu_model(shape, torch.float32, device, attn="eager")
    inputs = gpu_batch(model.config.vocab_size, device)
    exact, tokens = forced_logits(model, inputs)
    model.to(torch.bfloat16)
    eager, _ = forced_logits(model, inputs, target=tokens)
    with patched(model):
        paged, _ = forced_logits(model, inputs, target=tokens)
    eager_err, paged_err = (eager - exact).abs(), (paged - exact).abs()
    print(
        f"{shape} bfloat16 vs float32: paged max {paged_err.max():.3g} mean "
        f"{paged_err.mean():.3g}; eager max {eager_err.max():.3g} mean {eager_err.mean():.3g}"
    )
    assert paged_err.mean() <= eager_err.mean()
    assert paged_err.max() <= 2 * eager_err.max()
