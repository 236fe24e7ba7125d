"""fuse_projections: a graph step's q/k/v in one launch and a SiLU-gated MLP in two.

On CPU the graph runner executes its static buffers eagerly (``DecodeGraphs(capture=False)``)
and the kernel runs under the Triton interpreter (``backend="triton"``) on float16 models;
the GPU test (test_gpu_parity) captures real graphs in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from helpers import NEEDS_INTERPRETER
from test_decode_graphs import generate_patched
from test_families import padded_batch, tiny_model

import nanoserve
from nanoserve.adapters.decode_graphs import DecodeGraphs

GREEDY = dict(do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def run(model, inputs, fuse=True, backend="triton", steps=6):
    patch = {"block_size": 4, "backend": backend, "fuse_projections": fuse}
    return generate_patched(
        model, inputs, patch, DecodeGraphs(capture=False), max_new_tokens=steps, **GREEDY
    )


def fp16_model(name="llama"):
    return tiny_model(name).to(torch.float16)


@NEEDS_INTERPRETER
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases
def test_fused_steps_match_unfused(name):
    """Planted: k and v handed each other's outputs: every case failed."""
    model = fp16_model(name)
    inputs = padded_batch([9, 4, 7], 9)
    plain, plain_stats = run(model, inputs, fuse=False)
    fused, stats = run(model, inputs, fuse=True)
    assert plain_stats["fused_projections"] == (0, 0)
    assert stats["fused_projections"] == (2, 2)  # both layers' attention and MLP
    assert stats["replays"] == plain_stats["replays"] == 5
    assert torch.equal(plain.sequences, fused.sequences)
    for a, b in zip(plain.logits, fused.logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    for layer in model.model.layers:  # nothing of the fused forwards is left behind
        modules = [getattr(layer.self_attn, n) for n in PROJECTIONS] + [layer.mlp]
        assert not any("forward" in m.__dict__ for m in modules)


def test_float32_and_torch_backend_are_not_fused():
    inputs = padded_batch([5, 3], 5)
    _, stats = run(tiny_model("llama"), inputs, backend="auto")
    assert stats["fused_projections"] == (0, 0)  # float32: torch's projections, exact
    _, stats = run(fp16_model(), inputs, backend="torch")
    assert stats["fused_projections"] == (0, 0)


@NEEDS_INTERPRETER
def test_more_rows_than_the_kernel_takes_run_stock():
    """Planted: the row limit dropped from ``fits``: failed (the kernel refused 32 rows)."""
    inputs = padded_batch([5] * 17, 5)  # bucket of 32 rows
    _, stats = run(fp16_model(), inputs, steps=3)
    assert stats["fused_projections"] == (0, 0)
    assert stats["replays"] == 2


class _Scaled(torch.nn.Linear):
    """A Linear subclass that computes more (as LoRA or a quantized layer would)."""

    def forward(self, x):
        return super().forward(x) * 2


@NEEDS_INTERPRETER
def test_subclassed_or_hooked_projections_keep_their_forwards():
    """Planted: the MLP fused despite its down projection's hook: failed."""
    model = fp16_model()
    layer = model.model.layers[0]
    k = layer.self_attn.k_proj
    scaled = _Scaled(k.in_features, k.out_features, bias=False, dtype=torch.float16)
    scaled.weight.data.copy_(k.weight.data)
    layer.self_attn.k_proj = scaled
    calls = []
    layer.mlp.down_proj.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    inputs = padded_batch([6, 2], 6)
    plain, _ = run(model, inputs, fuse=False)
    hook_calls = len(calls)
    fused, stats = run(model, inputs)
    # layer 0: neither its attention (k is a subclass) nor its MLP (down is hooked)
    assert stats["fused_projections"] == (1, 1)
    assert len(calls) == 2 * hook_calls  # the hook ran in every step of both calls
    assert torch.equal(plain.sequences, fused.sequences)
    for a, b in zip(plain.logits, fused.logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_the_switch_is_checked():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="fuse_projections"):
        nanoserve.patch_model(model, fuse_projections="yes")
    with pytest.raises(ValueError, match="fuse_projections"):
        nanoserve.PagedConfig(fuse_projections=1)
