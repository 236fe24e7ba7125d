"""The dense and MoE families on a CUDA GPU, in nanoserve's own decode loop (float32, greedy)
and in bfloat16 against stock's eager attention (dense shapes): three shapes each of
test_gpu_more_families.py's (a file of their own so that pytest-xdist runs them beside it)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import patched
from test_gpu_more_families import gpu_batch, gpu_model
from test_more_families import GREEDY
from test_new_families import NEEDS_GPU, forced_logits

import nanoserve


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("shape", ["mixtral-8x7b", "cohere2-8b", "phi-2"])
def test_gpu_own_loop_tokens_match_stock(shape):
    """Greedy, no logits processor: nanoserve's own decode loop (graph steps, the greedy
    choice on the device) gives stock's 64 tokens a row in float32."""
    model = gpu_model(shape)
    inputs = gpu_batch(model)
    opts = dict(max_new_tokens=64, **GREEDY)
    with torch.no_grad():
        stock = model.generate(**inputs, **opts)
        with patched(model), warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            paged = model.generate(**inputs, **opts)
            loop = nanoserve.decode_graph_stats(model)["decode_loop"]
    assert loop == "nanoserve"
    assert torch.equal(paged, stock)


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("shape", ["olmo2-7b", "exaone4-1.2b", "pythia-1b"])
def test_gpu_bfloat16_drift_within_stock_eager(shape):
    """In bfloat16 (the fused q/k/v projections in the graph steps), the patched model's
    logits are on average no further from stock's float32 logits than stock eager attention's
    in bfloat16 are, on the same forced tokens, and the largest error within twice eager's.
    Dense models only: an expert router near a tie may switch experts under any rounding, so
    a MoE model's bfloat16 error says little about attention."""
    model = gpu_model(shape, attn_implementation="eager")
    inputs = gpu_batch(model)
    exact, tokens = forced_logits(model, inputs)
    model.to(torch.bfloat16)
    eager, _ = forced_logits(model, inputs, target=tokens)
    with patched(model), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        paged, _ = forced_logits(model, inputs, target=tokens)
        fused = nanoserve.decode_graph_stats(model)["fused_decode"]
    eager_err, paged_err = (eager - exact).abs(), (paged - exact).abs()
    print(
        f"{shape} bfloat16 vs float32: paged max {paged_err.max():.3g} mean "
        f"{paged_err.mean():.3g}; eager max {eager_err.max():.3g} mean "
        f"{eager_err.mean():.3g}; fused {fused}"
    )
    assert paged_err.mean() <= eager_err.mean()
    assert paged_err.max() <= 2 * eager_err.max()
