"""On a CUDA GPU: FP8 pools kept between calls (the patched model's fixed ``kv_scale``) are
taken by the next call, whose cached prompt prefix is read at the scales it was stored at;
a cache given those pools with another fixed scale refuses."""

from __future__ import annotations

import pytest
import torch
from helpers import patched
from test_gpu_parity import make_model, padded_batch

import nanoserve
from nanoserve import PagedKVCache
from nanoserve.kernels.quant import FP8_DTYPE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_fp8_pools_are_kept_between_calls_and_a_new_scale_is_refused():
    model = make_model("llama-3.2-1b", torch.bfloat16)
    inputs = padded_batch(model.config.vocab_size)
    with patched(model, kv_dtype="fp8_e4m3"), torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        kept = nanoserve.cache_stats(model)["kept_pool_bytes"]
        second = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        stats = nanoserve.cache_stats(model)
    print(f"kept pool bytes {kept}; after the second call {stats}")
    assert kept > 0 and first.shape == second.shape == (4, 64 + 8)
    assert stats["tokens_not_recomputed"] > 0  # the second call read the first's FP8 K/V
    # the cache level, on device tensors: kept pools' scales against a new fixed scale
    rows = torch.randn(5, 2, 64, device="cuda", dtype=torch.bfloat16)
    for scale, other in ((None, 2.0), (0.5, 0.25)):
        cache = PagedKVCache(1, num_blocks=8, block_size=4, kv_dtype=FP8_DTYPE, kv_scale=scale)
        cache.begin_step(torch.ones(1, 5, dtype=torch.bool), "cuda")
        cache.write(0, rows, rows)
        lists = cache.pool_lists
        with pytest.raises(ValueError, match="^kv_scale: the pools given come with FP8"):
            PagedKVCache(1, 8, 4, pools=lists, kv_dtype=FP8_DTYPE, kv_scale=other)
        again = PagedKVCache(1, 8, 4, pools=lists, kv_dtype=FP8_DTYPE, kv_scale=scale)
        assert again.scales(0)[0] is cache.scales(0)[0]
