"""FP8 (e4m3) pools: quantize on write, dequantize in the attention kernels.

The torch references are tested everywhere; the Triton kernels under the interpreter with
float32 and float16 queries (bfloat16 lives in test_gpu.py). The interpreter reads fp8 NaN
as 480, so unused slots are poisoned with +-448 instead of NaN (see fp8_inputs.py).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from fp8_inputs import make_fp8_paged_kv
from kernel_inputs import needs_interpreter, rel_err, row_errors

from nanoserve.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_extend_attention,
    paged_extend_attention_ref,
    slot_scatter,
    slot_scatter_ref,
)
from nanoserve.kernels.quant import FP8_DTYPE, FP8_MAX
from nanoserve.kernels.triton_decode import paged_decode_attention_triton
from nanoserve.kernels.triton_scatter import encode_e4m3

# per-row relative error against float64 on the same dequantized values (the FP8 rounding
# itself is in both): float32 accumulation order, and float16 query/output rounding
FP8_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@triton.jit
def _encode(x, out, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out + i, encode_e4m3(tl.load(x + i)))


def _scatter_inputs(num_tokens, num_kv_heads, head_dim, block_size, dtype):
    num_blocks = num_tokens // block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # 0x7F is e4m3 NaN: untouched slots must keep it
    key_cache = torch.full(shape, 0x7F, dtype=torch.uint8).view(FP8_DTYPE)
    value_cache = key_cache.clone()
    k_scale = torch.rand(num_kv_heads) * 0.05 + 0.001
    v_scale = torch.rand(num_kv_heads) * 0.05 + 0.001
    # magnitudes from e4m3's subnormals to past its range (saturated), and +-inf
    key = torch.randn(num_tokens, num_kv_heads, head_dim) * torch.logspace(-4, 2, head_dim)
    value = torch.randn(num_tokens, num_kv_heads, head_dim) * 20
    key[0, 0, :2] = torch.tensor([float("inf"), -float("inf")])
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.rand(num_tokens) < 0.2] = -1
    return key.to(dtype), value.to(dtype), key_cache, value_cache, slots, k_scale, v_scale


def test_reference_scatter_quantizes_saturating():
    """The reference stores x / scale rounded to nearest e4m3, +-inf and out-of-range values
    saturated to +-448 (never NaN), per KV head's own scale."""
    key, value, key_cache, value_cache, slots, k_scale, v_scale = _scatter_inputs(
        40, 3, 64, 16, torch.float32
    )
    slot_scatter_ref(key, value, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale)
    keep = slots >= 0
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        stored = cache.view(-1, *cache.shape[2:])[slots[keep]].float()
        want = (x[keep].double() / scale.double()[:, None]).clamp(-FP8_MAX, FP8_MAX)
        assert torch.isfinite(stored).all()
        # e4m3 has 3 mantissa bits: round to nearest is within 2**-4 relative (normals),
        # and within half a subnormal step (2**-10) near zero
        assert ((stored - want).abs() <= want.abs() * 2**-4 + 2**-10).all()
        assert (stored.abs() == FP8_MAX).any()  # the inputs reached saturation
    untouched = torch.ones(key_cache.shape[0] * key_cache.shape[1], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.isnan(key_cache.view(-1, 3, 64)[untouched].float()).all()


@needs_interpreter
@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim", "block_size", "dtype"),
    [
        (1, 2, 64, 16, torch.float16),
        (37, 3, 80, 8, torch.float32),
        (100, 8, 128, 16, torch.float16),
        (17, 1, 96, 16, torch.float32),
    ],
)
def test_triton_scatter_fp8_matches_reference(
    num_tokens, num_kv_heads, head_dim, block_size, dtype
):
    """The Triton scatter stores the reference's e4m3 bytes exactly (rounding ties, the
    subnormals, saturation, inf), and leaves every other slot as it was."""
    key, value, key_cache, value_cache, slots, k_scale, v_scale = _scatter_inputs(
        num_tokens, num_kv_heads, head_dim, block_size, dtype
    )
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    slot_scatter_ref(key, value, ref_k, ref_v, slots, **scales)
    slot_scatter(key, value, key_cache, value_cache, slots, **scales, backend="triton")
    assert torch.equal(key_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), ref_v.view(torch.uint8))


def test_reference_attention_equals_dequantized_pools():
    """The FP8 references give what the float references give on the dequantized pools."""
    kc, vc, ks, vs, k64, v64, tables, lens = make_fp8_paged_kv([5, 33], 2, 64, 16)
    query = torch.randn(2, 8, 64)
    out = paged_decode_attention_ref(query, kc, vc, tables, lens, k_scale=ks, v_scale=vs)
    ref = paged_decode_attention_ref(query.double(), k64, v64, tables, lens)
    assert rel_err(out, ref) < 1e-6
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    query = torch.randn(10, 8, 64)
    out = paged_extend_attention_ref(query, kc, vc, tables, lens, cu, k_scale=ks, v_scale=vs)
    ref = paged_extend_attention_ref(query.double(), k64, v64, tables, lens, cu)
    assert rel_err(out, ref) < 1e-6


# (num_kv_heads, group, head_dim, block_size, seq_lens, window, softcap, num_splits)
DECODE_CASES = {
    "gqa4-edges": (2, 4, 64, 16, [1, 15, 16, 17], None, None, None),
    "gqa8-d80-window": (1, 8, 80, 8, [7, 9, 130], 20, None, None),
    "mha-d96-softcap-3splits": (3, 1, 96, 16, [200, 33], None, 30.0, 3),
    "gqa4-d128-nosplit": (4, 4, 128, 32, [31, 33], None, None, 1),
    # many splits: the merge cuts head-dim lanes across programs
    "gqa4-d128-128splits": (1, 4, 128, 16, [1500, 9000], None, None, 128),
}


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_fp8_matches_reference(case, dtype, poison_outputs):
    num_kv_heads, group, head_dim, block_size, lens, window, softcap, splits = DECODE_CASES[case]
    kc, vc, ks, vs, k64, v64, tables, seq_lens = make_fp8_paged_kv(
        lens, num_kv_heads, head_dim, block_size
    )
    query = torch.randn(len(lens), num_kv_heads * group, head_dim).to(dtype)
    opts = dict(sliding_window=window, softcap=softcap)
    ref = paged_decode_attention_ref(query.double(), k64, v64, tables, seq_lens, **opts)
    if splits is None:
        out = paged_decode_attention(
            query, kc, vc, tables, seq_lens, **opts, k_scale=ks, v_scale=vs, backend="triton"
        )
    else:
        out = paged_decode_attention_triton(
            query, kc, vc, tables, seq_lens, scale=head_dim**-0.5, **opts,
            num_splits=splits, k_scale=ks, v_scale=vs,
        )  # fmt: skip
    assert out.dtype == dtype and out.shape == query.shape
    # per (sequence, head) row: an error in one KV head's scale cannot hide in a norm
    assert row_errors(out, ref).max() < FP8_TOL[dtype]


@needs_interpreter
@pytest.mark.parametrize("magnitude", [1e5, 1e-6, 1.0])
def test_decode_fp8_bfloat16_query_of_any_magnitude(magnitude, poison_outputs):
    """FP8 tiles meet a 16-bit query in float16 (so bfloat16 runs here: the interpreter's
    float16 dot is right): a query far past float16's range (1e5) or deep in its subnormals
    (1e-6) still gives the reference's rows, the K scale keeping the scores of order one.
    Planted bug, reverted: the query converted to float16 without its power-of-two
    (``q_pow = 1.0``) failed 1e5 (inf scores: NaN rows) and 1e-6 (row errors 0.06)."""
    kc, vc, ks, vs, k64, v64, tables, seq_lens = make_fp8_paged_kv([1, 17, 70], 2, 64, 16)
    query = (torch.randn(3, 8, 64) * magnitude).to(torch.bfloat16)
    key_mul = 1.0 / magnitude
    ref = paged_decode_attention_ref(query.double(), k64 * key_mul, v64, tables, seq_lens)
    out = paged_decode_attention(
        query, kc, vc, tables, seq_lens, k_scale=ks * key_mul, v_scale=vs, backend="triton"
    )
    assert out.dtype == torch.bfloat16
    assert row_errors(out, ref).max() < 1e-2


def test_decode_plan_for_fp8_pools():
    """FP8 pools (16-bit query) step 128 tokens two stages deep, the bytes of a 16-bit tile of
    64 tokens, with registers capped at FP8_TILE_REGISTERS; pages of 256 tokens make
    256-token tiles, which keep the compiler's registers (capped they spill); so do head dims
    past 128, float32 queries and a given config.
    Planted, reverted: three stages (the earlier plan): failed; the cap on 256-token tiles:
    failed."""
    from nanoserve.kernels.triton_decode import FP8_TILE_REGISTERS, decode_plan

    cap = FP8_TILE_REGISTERS
    for block_size, dim, expected in (
        (16, 128, (128, 4, 2, cap)),
        (128, 128, (128, 4, 2, cap)),
        (16, 64, (128, 4, 2, cap)),
        (256, 128, (256, 4, 2, 0)),
        (16, 256, (64, 4, 2, 0)),
    ):
        kc = torch.zeros(4, block_size, 2, dim, dtype=FP8_DTYPE)
        tables = torch.zeros(1, 4, dtype=torch.int32)
        query = torch.zeros(1, 8, dim, dtype=torch.float16)
        plan = decode_plan(query, kc, tables)
        assert (*plan[:3], plan.max_registers) == expected, (block_size, dim)
        assert decode_plan(query.float(), kc, tables).max_registers == 0
        given = decode_plan(query, kc, tables, config=(64, 4, 2))
        assert given[:3] == (64, 4, 2) and given.max_registers == 0


# (num_kv_heads, group, head_dim, block_size, history_lens, new_lens, window, softcap)
EXTEND_CASES = {
    "prefill-edges": (2, 4, 64, 16, [0, 0, 0, 0], [1, 15, 16, 17], None, None),
    "gqa8-d80-window": (1, 8, 80, 8, [30, 0], [5, 40], 12, None),
    "mha-d96-softcap-prefix": (3, 1, 96, 16, [50, 17], [3, 8], None, 20.0),
    "gqa4-d128-prefix": (2, 4, 128, 32, [31], [33], None, None),
}


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(EXTEND_CASES), ids=list(EXTEND_CASES))
def test_extend_fp8_matches_reference(case, dtype, poison_outputs):
    num_kv_heads, group, head_dim, block_size, history, new, window, softcap = EXTEND_CASES[case]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    kc, vc, ks, vs, k64, v64, tables, seq_lens = make_fp8_paged_kv(
        lens, num_kv_heads, head_dim, block_size
    )
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim).to(dtype)
    opts = dict(sliding_window=window, softcap=softcap)
    ref = paged_extend_attention_ref(query.double(), k64, v64, tables, seq_lens, cu, **opts)
    out = paged_extend_attention(
        query, kc, vc, tables, seq_lens, cu, **opts, k_scale=ks, v_scale=vs, backend="triton"
    )
    assert out.dtype == dtype and out.shape == query.shape
    assert row_errors(out, ref).max() < FP8_TOL[dtype]


@needs_interpreter
def test_fp8_error_does_not_grow_with_length():
    """Attention over FP8 K/V against float32 K/V: the error comes from rounding each stored
    value once, so it stays flat as the context grows (float32 accumulation); summing in a
    narrow type would make it grow."""
    from nanoserve.kernels.quant import quantize

    errors = []
    for length in (256, 1024, 4096):
        key = torch.randn(length, 2, 64)
        value = torch.randn(length, 2, 64)
        tables = torch.arange(length // 16, dtype=torch.int32)[None]
        lens = torch.tensor([length], dtype=torch.int32)
        # 32 query rows; peaked enough that attention is not a plain mean
        query = torch.randn(1, 32, 64) * 3
        ref = paged_decode_attention_ref(
            query, key.view(-1, 16, 2, 64), value.view(-1, 16, 2, 64), tables, lens
        )
        scale = (key.abs().amax(dim=(0, 2)) / FP8_MAX).float()
        kc, vc = (
            quantize(key, scale).view(-1, 16, 2, 64),
            quantize(value, scale).view(-1, 16, 2, 64),
        )
        out = paged_decode_attention(
            query, kc, vc, tables, lens, k_scale=scale, v_scale=scale, backend="triton"
        )
        errors.append(rel_err(out, ref))
    # (30 draws through the reference: 0.06-0.10, so the earlier bound of 0.1 failed about
    # one run in twenty; the growth check is the point)
    assert max(errors) < 0.15, errors
    assert errors[-1] < 2 * errors[0], errors


@pytest.mark.parametrize(
    ("name", "bad", "match"),
    [
        ("k_scale", None, "required"),
        ("v_scale", None, "required"),
        ("k_scale", torch.ones(3), "entries"),
        ("v_scale", torch.ones(2, dtype=torch.float16), "dtype"),
        ("k_scale", torch.ones(2, 1), "dims"),
        ("v_scale", torch.tensor([1.0, 0.0]), "positive"),
        ("k_scale", torch.tensor([1.0, float("nan")]), "positive"),
        ("k_scale", "meta", "a meta tensor"),
        ("v_scale", "strided", "contiguous"),
        ("v_scale", "in_value_pool", "shares memory with the pools"),
    ],
)
@pytest.mark.parametrize("op", ["scatter", "decode", "extend", "scatter_ref", "decode_ref"])
def test_bad_scales_raise_naming_the_argument(op, name, bad, match):
    kc = torch.zeros(4, 16, 2, 64, dtype=FP8_DTYPE)
    args = dict(key_cache=kc, value_cache=kc.clone(), k_scale=torch.ones(2), v_scale=torch.ones(2))
    if bad == "meta":
        bad = torch.ones(2, device="meta")
    elif bad == "strided":  # a column of a [Hkv, layers] table: the kernels read scale + head
        bad = torch.ones(2, 3)[:, 0]
    elif bad == "in_value_pool":  # two float32 ones in the value pool's last bytes
        tail = args["value_cache"].view(torch.uint8).view(-1)[-8:]
        tail.copy_(torch.ones(2).view(torch.uint8))
        bad = tail.view(torch.float32)
    args[name] = bad
    before = args["key_cache"].view(torch.uint8).clone()
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"^{name}: .*{match}"):
        if op.startswith("scatter"):
            fn = slot_scatter if op == "scatter" else slot_scatter_ref
            rows = torch.randn(2, 2, 64)
            fn(rows, rows, slot_mapping=torch.tensor([0, 5]), **args)
        elif op.startswith("decode"):
            fn = paged_decode_attention if op == "decode" else paged_decode_attention_ref
            fn(torch.randn(1, 4, 64), block_tables=tables, seq_lens=lens, **args)
        else:
            cu = torch.tensor([0, 3], dtype=torch.int32)
            paged_extend_attention(torch.randn(3, 4, 64), block_tables=tables, seq_lens=lens,
                                   cu_seqlens_q=cu, **args)  # fmt: skip
    assert torch.equal(args["key_cache"].view(torch.uint8), before)


def test_scales_for_unquantized_pools_and_fp8_queries_are_refused():
    kc = torch.zeros(4, 16, 2, 64)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="^k_scale: .*only FP8/INT8 pools"):
        query = torch.randn(1, 4, 64)
        paged_decode_attention(query, kc, kc.clone(), tables, lens, k_scale=torch.ones(2))
    fp8 = kc.to(FP8_DTYPE)
    scales = dict(k_scale=torch.ones(2), v_scale=torch.ones(2))
    with pytest.raises(ValueError, match="^query: dtype"):
        query = torch.zeros(1, 4, 64, dtype=FP8_DTYPE)
        paged_decode_attention(query, fp8, fp8.clone(), tables, lens, **scales)
    with pytest.raises(ValueError, match="^key: dtype"):
        rows = torch.randn(2, 2, 64).double()
        slot_scatter(rows, rows, fp8, fp8.clone(), torch.tensor([0, 1]), **scales)


@needs_interpreter
def test_e4m3_encoder_rounds_like_torch():
    """The scatter's integer e4m3 encoder against torch's cast on the cases random data
    never hits: every midpoint between codes (ties to even) and its neighbours, the
    subnormals, zero, +-inf, NaN and values past 448."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()
    mids = (codes[1:] + codes[:-1]) / 2
    up, down = torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)
    special = torch.tensor([float("nan"), float("inf"), 0.0, -0.0, 1e-30, 2**-10, 464.0, 465.0])
    x = torch.cat([codes, mids, up, down, special, torch.randn(300) * 0.01])
    x = torch.cat([x, -x])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    out = torch.empty(n, dtype=torch.uint8)
    _encode[(1,)](x, out, N=n)
    want = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    assert torch.equal(out, want), x[out != want][:8]
