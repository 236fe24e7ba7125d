"""The dense and mixture-of-experts families (``dense.py``, ``moe.py``) on a CUDA GPU: real head
dims (64, 80, 128, 256) and GQA ratios with fewer layers and narrower MLPs, through the
Triton kernels and the decode graphs; a window of 32 tokens under 64 new ones. (Apart from
test_more_families.py so that pytest-xdist runs them beside it.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import patched
from test_families import padded_batch
from test_more_families import tiny_model
from test_new_families import NEEDS_GPU, forced_logits

import nanoserve

GPU_WINDOW = 32
GPU_SHAPES = {
    "mixtral-8x7b": (
        "mixtral",
        dict(
            hidden_size=4096,
            intermediate_size=512,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            vocab_size=32000,
            sliding_window=GPU_WINDOW,
        ),
    ),
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            moe_intermediate_size=256,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=16,
            num_experts_per_tok=4,
            vocab_size=32000,
        ),
    ),
    "olmo2-7b": (
        "olmo2",
        dict(
            hidden_size=4096,
            intermediate_size=1024,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
        ),
    ),
    "cohere2-8b": (
        "cohere2",
        dict(
            hidden_size=4096,
            intermediate_size=1024,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=4,
            sliding_window=GPU_WINDOW,
            vocab_size=32000,
        ),
    ),
    "exaone4-1.2b": (
        "exaone4",
        dict(
            hidden_size=2048,
            intermediate_size=1024,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            num_hidden_layers=4,
            sliding_window=GPU_WINDOW,
            sliding_window_pattern=4,
            vocab_size=32000,
        ),
    ),
    "pythia-1b": (
        "gpt_neox",
        dict(
            hidden_size=2048,
            intermediate_size=1024,
            num_attention_heads=8,
            rotary_pct=0.25,
            vocab_size=32000,
        ),
    ),
    "phi-2": (
        "phi",
        dict(
            hidden_size=2560,
            intermediate_size=1024,
            num_attention_heads=32,
            num_key_value_heads=32,
            partial_rotary_factor=0.4,
            vocab_size=32000,
        ),
    ),
}


def gpu_model(shape: str, dtype: torch.dtype = torch.float32, **overrides):
    name, dims = GPU_SHAPES[shape]
    model = tiny_model(name, **dims, max_position_embeddings=512, **overrides)
    return model.to("cuda", dtype)


def gpu_batch(model):
    inputs = padded_batch([37, 20, 5, 64], 64, vocab=model.config.vocab_size)
    return {k: v.cuda() for k, v in inputs.items()}


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_float32_logits_match_stock(shape):
    """64 steps of per-step logits within 1e-5 (of the largest logit) of stock's through the
    Triton kernels, on left-padded prompts of 37, 20, 5 and 64 tokens. The steps run as CUDA
    graphs, or eagerly where the model's forward cannot be captured (the MoE experts'
    token counts read on the host), and ``decode_graph_stats`` says which."""
    model = gpu_model(shape)
    inputs = gpu_batch(model)
    stock, tokens = forced_logits(model, inputs)
    with patched(model), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        paged, paged_tokens = forced_logits(model, inputs, target=tokens)
        graphs = nanoserve.decode_graph_stats(model)
    assert torch.equal(paged_tokens, tokens)
    scale = stock.abs().max().item()
    err = (paged - stock).abs().max().item()
    print(f"{shape}: max |paged - stock| {err:.3g} (logits up to {scale:.3g}); graphs {graphs}")
    assert err <= 1e-5 * scale
    assert graphs["captures"] > 0 or graphs["disabled"] is not None
