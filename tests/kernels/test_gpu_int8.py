"""GPU tests of INT8 pools (``pytest -m gpu``): bfloat16 (and float16, float32) queries over
int8 pools with per-slot scales at real shapes, the scatter's bytes, and a scatter + decode
step replayed as a CUDA graph. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from int8_inputs import NEAR_TIE_AMAXES, make_int8_paged_kv, near_tie_group
from kernel_inputs import row_errors

from nanoserve.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_extend_attention,
    paged_extend_attention_ref,
    slot_scatter,
    slot_scatter_ref,
)
from nanoserve.kernels.quant import INT8_DTYPE, INT8_K_GROUP, int8_scale_shape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# per (sequence, head) row against float64 on the same dequantized values: the tiles meet the
# query in its dtype, so bfloat16 rounds the dequantized K/V once more
ROW_TOL = {BF16: 2e-2, FP16: 3e-3, FP32: 1e-4}


def assert_rows_close(out, ref, unquantized, dtype):
    """Every row of ``out`` within ROW_TOL of float64, or (rows whose large scores turn the
    query dtype's rounding of K into a few percent, which the inputs' wide channel spread
    makes in a long prefill now and then) within twice the error of the same kernel on
    pools holding the dequantized values in the query's dtype; the mean row well inside."""
    err, base = row_errors(out, ref), row_errors(unquantized, ref)
    assert torch.isfinite(base).all()  # (an inf would lift the bound)
    bound = max(ROW_TOL[dtype], 2 * base.max().item())
    assert err.max().item() < bound, (err.max().item(), base.max().item())
    assert err.mean().item() < ROW_TOL[dtype] / 4, err.mean().item()


def _lens(num_seqs: int, max_len: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=g).tolist()
    lens[0] = max_len
    return lens


DECODE = {
    # (seq_lens, Hkv, group, D, block_size, dtype, window, softcap)
    "llama8b-b32-8k": ([8192] * 32, 8, 4, 128, 16, BF16, None, None),
    "qwen-28-4-b1-32k": ([32768], 4, 7, 128, 16, BF16, None, None),
    "ragged-b64-100-8000": (_lens(64, 8000, 3), 8, 4, 128, 16, BF16, None, None),
    "d64-fp16-window-softcap": (_lens(8, 3000, 1) + [1, 15, 16, 17], 2, 8, 64, 16, FP16, 256, 30.0),
    "d80-fp32-block8": (_lens(4, 1000, 2), 4, 1, 80, 8, FP32, None, None),
    "d96-bf16-mha": (_lens(6, 500, 4), 6, 1, 96, 16, BF16, None, None),
}


@pytest.mark.parametrize("case", list(DECODE), ids=list(DECODE))
def test_int8_decode_real_shapes(case, poison_outputs):
    lens, hkv, group, dim, bs, dtype, window, softcap = DECODE[case]
    kc, vc, ks, vs, k64, v64, bt, sl = make_int8_paged_kv(lens, hkv, dim, bs, device="cuda")
    q = (torch.randn(len(lens), hkv * group, dim, device="cuda") * 0.1).to(dtype)
    opts = dict(sliding_window=window, softcap=softcap)
    ref = paged_decode_attention_ref(q.double(), k64, v64, bt, sl, **opts)
    out = paged_decode_attention(q, kc, vc, bt, sl, **opts, k_scale=ks, v_scale=vs)
    base = paged_decode_attention(q, k64.to(dtype), v64.to(dtype), bt, sl, **opts)
    assert_rows_close(out, ref, base, dtype)


EXTEND = {
    # (history, new, Hkv, group, D, block_size, dtype, window)
    "prefill-4k-bf16": ([0], [4096], 8, 4, 128, 16, BF16, None),
    "chunks-bf16": ([3000, 0, 17], [512, 300, 1], 8, 4, 128, 16, BF16, None),
    "d64-fp16-window": ([2000, 5], [300, 40], 2, 8, 64, 16, FP16, 256),
    "d80-fp32": ([100, 0], [64, 33], 4, 7, 80, 16, FP32, None),
}


@pytest.mark.parametrize("case", list(EXTEND), ids=list(EXTEND))
def test_int8_extend_real_shapes(case, poison_outputs):
    history, new, hkv, group, dim, bs, dtype, window = EXTEND[case]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    kc, vc, ks, vs, k64, v64, bt, sl = make_int8_paged_kv(lens, hkv, dim, bs, device="cuda")
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = (torch.randn(int(cu[-1]), hkv * group, dim, device="cuda") * 0.1).to(dtype)
    ref = paged_extend_attention_ref(q.double(), k64, v64, bt, sl, cu, sliding_window=window)
    out = paged_extend_attention(
        q, kc, vc, bt, sl, cu, sliding_window=window, k_scale=ks, v_scale=vs
    )
    base = paged_extend_attention(
        q, k64.to(dtype), v64.to(dtype), bt, sl, cu, sliding_window=window
    )
    assert_rows_close(out, ref, base, dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize(("num_tokens", "dim"), [(1, 128), (37, 80), (8192, 128), (300, 64)])
def test_int8_scatter_equals_reference(num_tokens, dim, dtype):
    """The hardware path stores the reference's int8 values and float16 scales: ties to even,
    the scale's floor and ceiling, inf and NaN groups."""
    shape = (num_tokens // 16 + 8, 16, 8, dim)
    kc = torch.full(shape, 55, dtype=INT8_DTYPE, device="cuda")
    vc = kc.clone()
    ks = torch.full(int8_scale_shape(shape, INT8_K_GROUP), 3.0, dtype=torch.float16, device="cuda")
    vs = torch.full(int8_scale_shape(shape, None), 3.0, dtype=torch.float16, device="cuda")
    k = torch.randn(num_tokens, 8, dim, device="cuda") * torch.logspace(-6, 7, dim, device="cuda")
    v = torch.randn(num_tokens, 8, dim, device="cuda") * 20
    k[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    v[-1, 0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.0, 3.5])
    for i, amax in enumerate(NEAR_TIE_AMAXES[: dim // 16]):
        k[0, 1, 16 * i : 16 * i + 16] = near_tie_group(amax)  # (token 0 is written)
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(shape[0] * 16, device="cuda")[:num_tokens]
    slots[1::7] = -1
    ref = [t.clone() for t in (kc, vc, ks, vs)]
    slot_scatter_ref(k, v, ref[0], ref[1], slots, k_scale=ref[2], v_scale=ref[3])
    slot_scatter(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    assert torch.equal(kc, ref[0]) and torch.equal(vc, ref[1])
    assert torch.equal(ks.nan_to_num(-1.0), ref[2].nan_to_num(-1.0))
    assert torch.equal(vs.nan_to_num(-1.0), ref[3].nan_to_num(-1.0))


def test_int8_scatter_and_decode_replay_as_a_cuda_graph():
    """scatter + decode over INT8 pools captured once and replayed with new rows: the replay
    writes the new values and scales and attends over them as an eager step does."""
    lens = [100, 37, 16]
    kc, vc, ks, vs, _, _, bt, sl = make_int8_paged_kv(lens, 8, 128, 16, device="cuda")
    new_k = torch.randn(3, 8, 128, device="cuda", dtype=BF16)
    new_v = torch.randn(3, 8, 128, device="cuda", dtype=BF16)
    q = torch.randn(3, 32, 128, device="cuda", dtype=BF16) * 0.1
    slots = torch.tensor(
        [int(bt[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(lens)]
    )
    slots = slots.cuda()
    pools = (kc, vc, ks, vs)
    eager = [t.clone() for t in pools]

    def step(k_cache, v_cache, k_scale, v_scale):
        slot_scatter(new_k, new_v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale,
                     check=False)  # fmt: skip
        return paged_decode_attention(q, k_cache, v_cache, bt, sl, k_scale=k_scale,
                                      v_scale=v_scale, check=False)  # fmt: skip

    step(*pools)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*pools)
    for _ in range(2):
        new_k.normal_()
        new_v.normal_()
        q.normal_().mul_(0.1)
        graph.replay()
        want = step(*eager)
        torch.cuda.synchronize()
        for got, ref in zip(pools, eager, strict=True):
            assert torch.equal(got.nan_to_num(-1.0), ref.nan_to_num(-1.0))
        assert torch.equal(out, want)
