"""The split-KV merge (triton_split_merge.py) on its own: Triton (interpreter) against a
float64 weighting of the same partials, empty splits and rows no split saw included."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import TOLERANCE, needs_interpreter, row_errors

from nanoserve.kernels.dispatch import head_dim_pad
from nanoserve.kernels.triton_split_merge import merge_splits

pytestmark = needs_interpreter


def _merged_ref(mid_o: torch.Tensor, mid_lse: torch.Tensor) -> torch.Tensor:
    lse = mid_lse.double()
    top = lse.amax(-1, keepdim=True)
    w = torch.where(lse == float("-inf"), 0.0, torch.exp2(lse - top))
    total = w.sum(-1, keepdim=True)
    return (mid_o.double() * w[..., None]).sum(-2) / torch.where(total == 0, 1.0, total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_merge_weights_splits_and_skips_empty_ones(dtype, splits, head_dim, poison_outputs):
    """Random partials and log-sum-exps (some splits empty: lse -inf over zero outputs) merge
    to their 2^lse-weighted mean; a row whose every split is empty merges to zeros (as one
    split leaves it). Planted: the empty-split guard removed: the all-empty rows came back NaN."""
    tokens, heads, d_pad = 5, 3, head_dim_pad(head_dim)
    mid_o = torch.randn(tokens, heads, splits, d_pad).to(dtype)
    mid_lse = torch.randn(tokens, heads, splits) * 4
    empty = torch.rand(tokens, heads, splits) < 0.3
    empty[1, 2] = True  # a row no split saw
    mid_lse[empty] = float("-inf")
    mid_o[empty] = 0.0
    out = torch.empty(tokens, heads, head_dim, dtype=dtype)
    merge_splits(mid_o, mid_lse, out, head_dim, pdl=False)
    ref = _merged_ref(mid_o, mid_lse)[..., :head_dim]
    assert torch.equal(out[1, 2], torch.zeros(head_dim, dtype=dtype))
    seen = ~empty.all(-1)
    assert row_errors(out[seen], ref[seen]).max() < TOLERANCE[dtype]
