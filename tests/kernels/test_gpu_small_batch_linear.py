"""GPU tests (``pytest -m gpu``): the small-batch linear kernel in bfloat16 and float16 on
CUDA at the projections' real sizes, against the float32 reference. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels.small_batch_linear import small_batch_linear, small_batch_linear_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = [  # (K, output sizes, gated, bias)
    (2048, (2048, 512, 512), False, False),  # 1B q/k/v
    (896, (896, 128, 128), False, True),  # Qwen2-0.5B q/k/v, biases
    (2048, (8192, 8192), True, False),  # 1B gate/up
    (8192, (2048,), False, False),  # 1B down: K in four shares
    (576, (1536, 1536), True, False),  # SmolLM2 gate/up: K under one 256-tile multiple
    (1536, (576,), False, False),  # SmolLM2 down
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 33, 64])
@pytest.mark.parametrize(("k", "sizes", "gated", "bias"), CASES)
def test_within_one_rounding_of_the_reference(k, sizes, gated, bias, rows, dtype):
    gen = torch.Generator(device="cuda").manual_seed(rows * k)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype) for n in sizes]
    biases = None
    if bias:
        biases = [torch.randn(n, device="cuda", generator=gen).to(dtype) for n in sizes]
    out = small_batch_linear(x, weights, biases, gated=gated)
    ref = small_batch_linear_ref(x, weights, biases, gated=gated)
    assert torch.isfinite(out).all()
    assert (out == ref).float().mean() > 0.9  # mostly bit-equal
    if gated:
        # a last-bit difference in gate or up carries through silu and the product
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < (4e-3 if dtype == torch.bfloat16 else 5e-4)
        return
    # float32 accumulation (on the matrix unit) in another order than float64's: an output
    # is within one unit in its last place of the reference plus the accumulation's error,
    # a small part of the sum of |x_k w_k|; cuBLAS's F.linear meets the same bound
    magnitude = torch.cat([x.double().abs() @ w.double().abs().T for w in weights], dim=-1)
    bound = torch.finfo(dtype).eps * ref.double().abs() + 2**-14 * magnitude
    assert ((out.double() - ref.double()).abs() <= bound).all()
    if biases is None:
        stock = torch.cat([torch.nn.functional.linear(x, w) for w in weights], dim=-1)
        assert ((stock.double() - ref.double()).abs() <= bound).all()


ROTARY_CASES = [  # (K, q heads, KV heads, head dim, bias)
    (2048, 32, 8, 64, False),  # 1B
    (4096, 32, 8, 128, False),  # 8B
    (896, 14, 2, 64, True),  # Qwen2-0.5B, biases
    (576, 9, 3, 64, False),  # SmolLM2-135M
    (3072, 32, 32, 96, False),  # head dim 96 (Phi-3-mini)
    (2560, 32, 8, 80, False),  # head dim 80: halves not whole tiles
]


def _rotary_inputs(gen, rows, k, q_heads, kv_heads, dim, bias, dtype):
    """(x [rows, k], q/k/v weights, biases or None, cos, sin [rows, dim]) on CUDA: Llama
    3's frequencies at random positions up to 128k."""
    from nanoserve.kernels.rotary import rotary_cos_sin

    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    sizes = (q_heads * dim, kv_heads * dim, kv_heads * dim)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype) for n in sizes]
    biases = None
    if bias:
        biases = [torch.randn(n, device="cuda", generator=gen).to(dtype) for n in sizes]
    positions = torch.randint(0, 131072, (rows, 1), device="cuda", generator=gen)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, dim, 2, device="cuda").float() / dim)
    cos, sin = (t.view(rows, dim) for t in rotary_cos_sin(positions, inv_freq, 1.0, dtype))
    return x, weights, biases, cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
@pytest.mark.parametrize(("k", "q_heads", "kv_heads", "dim", "bias"), ROTARY_CASES)
def test_rotary_epilogue_is_the_rotary_kernel_bit_for_bit(k, q_heads, kv_heads, dim, bias,
                                                         rows, dtype):  # fmt: skip
    """q, k and v with the rotation written beside them: the projections bit-equal to
    ``small_batch_linear``'s, the rotated q and k bit-equal to ``apply_rotary`` of them (and
    so to eager's rotary embedding), with ``torch.empty`` poisoned."""
    from nanoserve.kernels.rotary import apply_rotary
    from nanoserve.kernels.small_batch_linear import small_batch_linear_rotary

    gen = torch.Generator(device="cuda").manual_seed(rows * k + dim)
    x, weights, biases, cos, sin = _rotary_inputs(gen, rows, k, q_heads, kv_heads, dim, bias,
                                                  dtype)  # fmt: skip
    sizes = [w.shape[0] for w in weights]
    real_empty = torch.empty
    torch.empty = lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan"))
    try:
        out, rotated_q, rotated_k = small_batch_linear_rotary(x, weights, biases, cos, sin)
    finally:
        torch.empty = real_empty
    assert torch.equal(out, small_batch_linear(x, weights, biases))
    n_q, n_k = sizes[:2]
    q = out[:, :n_q].view(rows, 1, q_heads, dim).transpose(1, 2)
    k_ = out[:, n_q : n_q + n_k].view(rows, 1, kv_heads, dim).transpose(1, 2)
    ref_q, ref_k = apply_rotary(q, k_, cos.view(rows, 1, dim), sin.view(rows, 1, dim))
    assert torch.equal(rotated_q, ref_q.reshape(rows, n_q))
    assert torch.equal(rotated_k, ref_k.reshape(rows, n_k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize(("k", "q_heads", "kv_heads", "dim", "bias"), ROTARY_CASES)
def test_kv_store_is_slot_scatter_bit_for_bit(k, q_heads, kv_heads, dim, bias, rows, dtype):
    """k rotated and v stored by the q/k/v launch: the pools bit-equal to ``slot_scatter``
    of the launch's own outputs into pools of NaN (other slots untouched, slot -1 rows
    unstored), the outputs those of the launch without the store; then the same launch
    captured in a CUDA graph (``check=False``) and replayed on new x and slots."""
    from nanoserve.kernels.slot_scatter import KVStore, slot_scatter
    from nanoserve.kernels.small_batch_linear import small_batch_linear_rotary

    gen = torch.Generator(device="cuda").manual_seed(rows * k + dim + 1)
    x, weights, biases, cos, sin = _rotary_inputs(gen, rows, k, q_heads, kv_heads, dim, bias,
                                                  dtype)  # fmt: skip
    pool_shape = (rows // 16 + 4, 16, kv_heads, dim)
    # each pool a view into a buffer of NaN one block longer on either side: a write past
    # the pools lands there
    buffer_shape = (pool_shape[0] + 2, *pool_shape[1:])
    buffers = [torch.empty(buffer_shape, dtype=dtype, device="cuda") for _ in "kv"]

    def fresh_store(seed):
        slots = torch.randperm(pool_shape[0] * 16, generator=torch.Generator().manual_seed(seed))
        slots = slots[:rows].cuda()
        if rows > 1:
            slots[rows // 2] = -1
        for buffer in buffers:
            buffer.fill_(float("nan"))
        return KVStore(buffers[0][1:-1], buffers[1][1:-1], slots)

    def check(store, x):
        out, q_rot, k_rot = small_batch_linear_rotary(x, weights, biases, cos, sin)
        want = [torch.full(pool_shape, float("nan"), dtype=dtype, device="cuda") for _ in "kv"]
        value = out[:, -kv_heads * dim :].reshape(rows, kv_heads, dim)
        slot_scatter(k_rot.view(rows, kv_heads, dim), value, *want, store.slot_mapping)
        for got, ref in zip((store.key_pool, store.value_pool), want, strict=True):
            assert torch.equal(got.nan_to_num(3.0), ref.nan_to_num(3.0))
        for buffer in buffers:
            assert buffer[0].isnan().all() and buffer[-1].isnan().all()
        return out, q_rot, k_rot

    store = fresh_store(rows)
    got = small_batch_linear_rotary(x, weights, biases, cos, sin, kv_store=store)
    for a, b in zip(got, check(store, x), strict=True):
        assert torch.equal(a, b)
    if rows not in (1, 16):
        return
    store = fresh_store(rows + 1)
    small_batch_linear_rotary(x, weights, biases, cos, sin, kv_store=store, check=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small_batch_linear_rotary(x, weights, biases, cos, sin, kv_store=store, check=False)
    x.copy_(torch.randn(rows, k, device="cuda", generator=gen).to(dtype))
    store.slot_mapping.copy_(fresh_store(rows + 2).slot_mapping)  # (the pools NaN again)
    graph.replay()
    check(store, x)
