"""GPU tests of FP8 pools (``pytest -m gpu``): bfloat16 (and float16) queries over
float8_e4m3fn pools at real shapes, the scatter's bytes, a CUDA graph whose scales change in
place, and the error against float32 K/V as the context grows. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from fp8_inputs import make_fp8_paged_kv
from kernel_inputs import rel_err, row_errors

from nanoserve.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_extend_attention,
    paged_extend_attention_ref,
    slot_scatter,
    slot_scatter_ref,
)
from nanoserve.kernels.quant import FP8_DTYPE, FP8_MAX, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# per (sequence, head) row against float64 on the same dequantized values
ROW_TOL = {BF16: 2e-2, FP16: 3e-3, FP32: 1e-4}


def _lens(num_seqs: int, max_len: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=g).tolist()
    lens[0] = max_len
    return lens


DECODE = {
    # (seq_lens, Hkv, group, D, block_size, dtype, window, softcap)
    "llama8b-b32-8k": ([8192] * 32, 8, 4, 128, 16, BF16, None, None),
    "llama8b-b1-32k": ([32768], 8, 4, 128, 16, BF16, None, None),
    "qwen-28-4-b1-32k": ([32768], 4, 7, 128, 16, BF16, None, None),
    "ragged-b128-2k": (_lens(128, 2048, 0), 8, 4, 128, 16, BF16, None, None),
    "d64-fp16-window-softcap": (_lens(8, 3000, 1) + [1, 15, 16, 17], 2, 8, 64, 16, FP16, 256, 30.0),
    "d80-d96-fp32": (_lens(4, 1000, 2), 4, 1, 96, 8, FP32, None, None),
}


@pytest.mark.parametrize("case", list(DECODE), ids=list(DECODE))
def test_fp8_decode_real_shapes(case, poison_outputs):
    lens, hkv, group, dim, bs, dtype, window, softcap = DECODE[case]
    kc, vc, ks, vs, k64, v64, bt, sl = make_fp8_paged_kv(lens, hkv, dim, bs, device="cuda")
    q = torch.randn(len(lens), hkv * group, dim, device="cuda").to(dtype)
    opts = dict(sliding_window=window, softcap=softcap)
    ref = paged_decode_attention_ref(q.double(), k64, v64, bt, sl, **opts)
    out = paged_decode_attention(q, kc, vc, bt, sl, **opts, k_scale=ks, v_scale=vs)
    err = row_errors(out, ref).max().item()
    assert err < ROW_TOL[dtype], err


EXTEND = {
    # (history, new, Hkv, group, D, block_size, dtype, window)
    "prefill-4k-bf16": ([0], [4096], 8, 4, 128, 16, BF16, None),
    "chunks-bf16": ([3000, 0, 17], [512, 300, 1], 8, 4, 128, 16, BF16, None),
    "d64-fp16-window": ([2000, 5], [300, 40], 2, 8, 64, 16, FP16, 256),
    "d80-fp32": ([100, 0], [64, 33], 4, 7, 80, 16, FP32, None),
}


@pytest.mark.parametrize("case", list(EXTEND), ids=list(EXTEND))
def test_fp8_extend_real_shapes(case, poison_outputs):
    history, new, hkv, group, dim, bs, dtype, window = EXTEND[case]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    kc, vc, ks, vs, k64, v64, bt, sl = make_fp8_paged_kv(lens, hkv, dim, bs, device="cuda")
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = torch.randn(int(cu[-1]), hkv * group, dim, device="cuda").to(dtype)
    ref = paged_extend_attention_ref(q.double(), k64, v64, bt, sl, cu, sliding_window=window)
    out = paged_extend_attention(
        q, kc, vc, bt, sl, cu, sliding_window=window, k_scale=ks, v_scale=vs
    )
    err = row_errors(out, ref).max().item()
    assert err < ROW_TOL[dtype], err


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("num_tokens", [1, 37, 8192])
def test_fp8_scatter_bytes_equal_reference(num_tokens, dtype):
    """The hardware path stores the reference's e4m3 bytes: ties to even, subnormals,
    saturation, +-inf to +-448 and NaN kept."""
    shape = (num_tokens // 16 + 8, 16, 8, 128)
    kc = torch.full(shape, 0x7F, dtype=torch.uint8, device="cuda").view(FP8_DTYPE)
    vc = kc.clone()
    k = torch.randn(num_tokens, 8, 128, device="cuda") * torch.logspace(-4, 2, 128, device="cuda")
    v = torch.randn(num_tokens, 8, 128, device="cuda") * 20
    k[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    k, v = k.to(dtype), v.to(dtype)
    ks = torch.rand(8, device="cuda") * 0.05 + 0.001
    vs = torch.rand(8, device="cuda") * 0.05 + 0.001
    slots = torch.randperm(shape[0] * 16, device="cuda")[:num_tokens]
    slots[1::7] = -1
    rk, rv = kc.clone(), vc.clone()
    slot_scatter_ref(k, v, rk, rv, slots, k_scale=ks, v_scale=vs)
    slot_scatter(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


def test_fp8_decode_step_cuda_graph_reads_scales_in_place():
    """scatter + decode over FP8 pools captured once; scales changed in place (copy_) before
    the replay are the ones the replay uses."""
    hkv, group, dim, bs = 8, 4, 128, 16
    lens = _lens(8, 1000, 10)
    kc, vc, ks, vs, _, _, bt, _ = make_fp8_paged_kv([n + 1 for n in lens], hkv, dim, bs,
                                                    device="cuda")  # fmt: skip
    pos = torch.tensor(lens, device="cuda")
    slots = bt[torch.arange(len(lens), device="cuda"), pos // bs].long() * bs + pos % bs
    seq_lens = (pos + 1).int()
    q = torch.randn(len(lens), hkv * group, dim, device="cuda").to(BF16)
    k_new = torch.randn(len(lens), hkv, dim, device="cuda").to(BF16)
    v_new = torch.randn_like(k_new)

    def step() -> torch.Tensor:
        slot_scatter(k_new, v_new, kc, vc, slots, k_scale=ks, v_scale=vs, check=False)
        return paged_decode_attention(q, kc, vc, bt, seq_lens, k_scale=ks, v_scale=vs,
                                      check=False)  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    ks.mul_(1.5)
    vs.mul_(0.5)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert torch.equal(static_out, eager)
    ref = paged_decode_attention_ref(q.float(), kc, vc, bt, seq_lens, k_scale=ks, v_scale=vs)
    assert rel_err(static_out, ref) < ROW_TOL[BF16]


def test_fp8_error_flat_from_1k_to_32k():
    """bf16 queries over FP8 K/V against float32 K/V and queries: the error does not grow
    with the context (float32 accumulation)."""
    hkv, group, dim = 8, 4, 128
    errors = []
    for length in (1024, 4096, 32768):
        key = torch.randn(length, hkv, dim, device="cuda")
        value = torch.randn(length, hkv, dim, device="cuda")
        q = torch.randn(1, hkv * group, dim, device="cuda") * 2
        bt = torch.arange(length // 16, dtype=torch.int32, device="cuda")[None]
        sl = torch.tensor([length], dtype=torch.int32, device="cuda")
        pool_shape = (-1, 16, hkv, dim)
        ref = paged_decode_attention_ref(q, key.view(pool_shape), value.view(pool_shape), bt, sl)
        ks = key.abs().amax(dim=(0, 2)) / FP8_MAX
        vs = value.abs().amax(dim=(0, 2)) / FP8_MAX
        kc = quantize(key, ks).view(-1, 16, hkv, dim)
        vc = quantize(value, vs).view(-1, 16, hkv, dim)
        out = paged_decode_attention(q.to(BF16), kc, vc, bt, sl, k_scale=ks, v_scale=vs)
        errors.append(rel_err(out, ref))
    assert max(errors) < 0.1, errors
    assert errors[-1] < 2 * errors[0], errors
