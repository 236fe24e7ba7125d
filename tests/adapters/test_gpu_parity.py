"""On a CUDA GPU, on the Triton kernels: random-weight models of SmolLM2-135M's and
Llama-3.2-1B's shapes (fewer layers) and a tiny one of head_dim 8, a left-padded batch, 64
greedy tokens.

Every run is forced onto the stock sdpa run's tokens (a logits processor), so the per-step
logits are compared on the same inputs even where random weights make near-ties.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import ForceTokens, patched, sharpen
from transformers import LogitsProcessorList

import nanoserve

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
}
# Tiny test models' head dim (8), under the attention kernels' least tile of 16.
TINY_SHAPES = {
    "tiny-head-dim-8": dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
NEW_TOKENS = 64
DEVICE = "cuda"


def make_model(shape: str, dtype: torch.dtype):
    config = transformers.LlamaConfig(
        **{**SHAPES, **TINY_SHAPES}[shape],
        num_hidden_layers=4,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = sharpen(transformers.LlamaForCausalLM(config))
    return model.to(DEVICE, dtype).eval()


def padded_batch(vocab: int):
    gen = torch.Generator().manual_seed(1)
    lengths, width = [37, 20, 5, 64], 64
    ids = torch.randint(3, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return dict(input_ids=ids.masked_fill(mask == 0, 0).to(DEVICE), attention_mask=mask.to(DEVICE))


def run(model, inputs, target=None):
    """Per-step logits [steps, B, vocab] (float32) and the sequences of a greedy run."""
    opts = dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    if target is not None:
        opts["logits_processor"] = LogitsProcessorList([ForceTokens(target)])
    with torch.no_grad():
        out = model.generate(**inputs, **opts)
    return torch.stack(out.logits).float(), out.sequences


@pytest.mark.parametrize("shape", [*SHAPES, *TINY_SHAPES])
def test_float32_logits_match_stock(shape):
    model = make_model(shape, torch.float32)
    inputs = padded_batch(model.config.vocab_size)
    stock, tokens = run(model, inputs)
    with patched(model):
        paged, paged_tokens = run(model, inputs, target=tokens)
    assert torch.equal(paged_tokens, tokens)
    assert stock.shape[0] == NEW_TOKENS
    scale = stock.abs().max().item()
    err = (paged - stock).abs().max().item()
    print(f"{shape} float32: max |paged - stock| = {err:.3g} (logits up to {scale:.3g})")
    torch.testing.assert_close(paged, stock, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_bfloat16_no_further_from_sdpa_than_eager(shape):
    model = make_model(shape, torch.bfloat16)
    inputs = padded_batch(model.config.vocab_size)
    sdpa, tokens = run(model, inputs)
    model.set_attn_implementation("eager")
    eager, _ = run(model, inputs, target=tokens)
    model.set_attn_implementation("sdpa")
    with patched(model):
        paged, _ = run(model, inputs, target=tokens)
        # the graph steps' norms, q/k/v, rotary (its tables too, the rotation itself and the
        # K/V rows' store in the q/k/v launch) and MLPs ran through nanoserve's kernels
        fused = nanoserve.decode_graph_stats(model)["fused_decode"]
        expected = {"attention": 4, "mlp": 4, "norm": 9, "rotary": 4, "residual": 8}
        assert fused == {**expected, "rotary_table": 1, "rotary_qkv": 4, "kv_store": 4}
    eager_err = (eager - sdpa).abs()
    paged_err = (paged - sdpa).abs()
    print(
        f"{shape} bfloat16 vs sdpa: paged max {paged_err.max():.3g} mean {paged_err.mean():.3g}; "
        f"eager max {eager_err.max():.3g} mean {eager_err.mean():.3g}"
    )
    assert paged_err.mean() <= eager_err.mean()
    assert paged_err.max() <= eager_err.max()
