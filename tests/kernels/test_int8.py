"""INT8 pools: values and float16 scales per slot (keys per KV head and 16 channels, values
per KV head), quantized on write, dequantized in the attention kernels.

The torch references are tested everywhere; the Triton kernels under the interpreter with
float32 and float16 queries (the kernels dequantize into the query's dtype; bfloat16 lives in
test_gpu_int8.py).
"""

from __future__ import annotations

from fractions import Fraction

import numpy
import pytest
import torch
from int8_inputs import NEAR_TIE_AMAXES, make_int8_paged_kv, near_tie_group
from kernel_inputs import needs_interpreter, rel_err, row_errors

from nanoserve.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_extend_attention,
    paged_extend_attention_ref,
    slot_scatter,
    slot_scatter_ref,
)
from nanoserve.kernels.quant import (
    INT8_DTYPE,
    INT8_K_GROUP,
    dequantize_int8,
    int8_scale_shape,
    quantize_int8,
)
from nanoserve.kernels.triton_decode import paged_decode_attention_triton

# per-row relative error against float64 on the same dequantized values (the INT8 rounding
# itself is in both): float32 accumulation order, and float16 tile/output rounding
INT8_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _nearest_float16(exact: Fraction) -> float:
    """The float16 nearest to ``exact`` (no ties here: amax / 127 never ends in binary)."""
    guess = numpy.float16(float(exact))
    around = [numpy.nextafter(guess, numpy.float16(d)) for d in (-numpy.inf, numpy.inf)]
    return float(min([guess, *around], key=lambda c: abs(Fraction(float(c)) - exact)))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_int8_scale_is_the_quotient_rounded_once(device):
    """Each scale is the float16 nearest to amax / 127, on CPU and CUDA alike. Planted: the
    scale as amax * (1 / 127) in float32 (torch's CUDA division by a number): failed."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spread = 10 ** (torch.rand(2000, dtype=torch.float64) * 9 - 3)  # 1e-3 .. 1e6
    amax = torch.cat([torch.tensor(NEAR_TIE_AMAXES), spread.float()])
    amax = amax[(amax / 127 >= 2**-14) & (amax / 127 <= 65504)]  # (off the clamp)
    x = torch.zeros(len(amax), 16)
    x[:, 5] = -amax
    _, scale = quantize_int8(x.to(device))
    expected = [_nearest_float16(Fraction(float(a)) / 127) for a in amax.tolist()]
    assert scale.flatten().tolist() == expected


def _scatter_inputs(num_tokens, num_kv_heads, head_dim, block_size, dtype):
    num_blocks = num_tokens // block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, 55, dtype=INT8_DTYPE)  # untouched slots must keep 55
    value_cache = key_cache.clone()
    k_scale = torch.full(int8_scale_shape(shape, INT8_K_GROUP), 3.0, dtype=torch.float16)
    v_scale = torch.full(int8_scale_shape(shape, None), 3.0, dtype=torch.float16)
    # magnitudes from float16's scale floor to past its ceiling (8e6 / 127 > 65504)
    key = torch.randn(num_tokens, num_kv_heads, head_dim) * torch.logspace(-6, 7, head_dim)
    value = torch.randn(num_tokens, num_kv_heads, head_dim) * 20
    key[0, 0, :2] = torch.tensor([float("inf"), -float("inf")])
    value[-1, -1, -1] = float("nan")
    # exact ties (x.5 after scaling): amax 127 makes the scale 1
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.0])
    key[min(1, num_tokens - 1), 0] = ties.repeat(head_dim // 7 + 1)[:head_dim]
    # amaxes whose quotient by 127 a reciprocal product rounds onto a float16 tie
    for i, amax in enumerate(NEAR_TIE_AMAXES[: head_dim // 16]):
        key[-1, -1, 16 * i : 16 * i + 16] = near_tie_group(amax)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    skip = torch.rand(num_tokens) < 0.2
    skip[: min(2, num_tokens)] = False
    skip[-1] = False
    slots[skip] = -1
    return key.to(dtype), value.to(dtype), key_cache, value_cache, slots, k_scale, v_scale


def test_quantize_int8_rounds_to_its_group_scale():
    """Each group of 16 channels: scale = amax / 127 in float16 (at least 2^-14), values
    within half a step of x / scale, the amax at +-127 (ties to even), a group with inf or
    NaN reads back NaN, the others exact as int8 * scale."""
    x = torch.randn(6, 3, 80) * torch.logspace(-3, 3, 80)
    x[0, 0, 5] = float("nan")
    x[1, 2, 70] = -float("inf")
    q, scale = quantize_int8(x)
    assert q.dtype == INT8_DTYPE and q.shape == x.shape
    assert scale.dtype == torch.float16 and scale.shape == (6, 3, 5)
    back = dequantize_int8(q, scale, torch.float64)
    bad = torch.zeros(6, 3, 5, dtype=torch.bool)
    bad[0, 0, 0] = bad[1, 2, 4] = True
    assert torch.isnan(back.view(6, 3, 5, INT8_K_GROUP)[bad]).all()
    good = ~bad
    groups = x.double().view(6, 3, 5, INT8_K_GROUP)[good]
    step = scale.double()[good][:, None]
    assert ((back.view(6, 3, 5, INT8_K_GROUP)[good] - groups).abs() <= step / 2 * 1.001).all()
    # (a group under 127 * 2^-14 keeps the floor scale, and its amax may land below 126)
    above_floor = groups.abs().amax(-1) / 127 >= 2**-14 * 1.01
    assert above_floor.sum() > 20
    top = q.view(6, 3, 5, INT8_K_GROUP)[good].abs().amax(-1)
    assert (top[above_floor] >= 126).all()
    assert torch.equal(torch.tensor([0.5, 1.5, 2.5, 127.0]).round(), torch.tensor([0, 2, 2, 127.0]))
    q2, s2 = quantize_int8(torch.tensor([[0.5, 1.5, 2.5, -2.5, 127.0]]))
    assert s2.item() == 1.0 and q2.tolist() == [[0, 2, 2, -2, 127]]
    # one scale per row (values): the row's amax
    q3, s3 = quantize_int8(torch.tensor([[0.5, 254.0] + [1.0] * 30]), group=None)
    assert s3.shape == (1, 1) and s3.item() == 2.0 and q3[0, :3].tolist() == [0, 127, 0]


def test_reference_scatter_writes_values_and_scales_of_real_rows_only():
    key, value, key_cache, value_cache, slots, k_scale, v_scale = _scatter_inputs(
        40, 3, 64, 16, torch.float32
    )
    slot_scatter_ref(key, value, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale)
    keep = slots >= 0
    pairs = ((key_cache, k_scale, key, INT8_K_GROUP), (value_cache, v_scale, value, None))
    for cache, scales, x, group in pairs:
        stored = cache.view(-1, 3, 64)[slots[keep]]
        stored_scales = scales.view(-1, *scales.shape[2:])[slots[keep]]
        want_q, want_s = quantize_int8(x[keep], group)
        assert torch.equal(stored, want_q)
        assert torch.equal(stored_scales.nan_to_num(-1.0), want_s.nan_to_num(-1.0))
        untouched = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool)
        untouched[slots[keep]] = False
        assert (cache.view(-1, 3, 64)[untouched] == 55).all()
        assert (scales.view(-1, *scales.shape[2:])[untouched] == 3.0).all()
    # saturation: scales stop at float16's largest finite value
    assert (k_scale == 65504.0).any() and torch.isnan(k_scale).any()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("slots", [[-1, -1, -1], []], ids=["all-skipped", "no-token"])
def test_int8_scatter_of_no_stored_token_changes_nothing(slots, backend):
    """A step that stores no token (every row padding: each slot -1, or no token at all)
    leaves INT8 pools and scales as they were, as float pools are. Found by a sweep: the
    reference's group reshape could not infer its size from no row and raised."""
    key, value, key_cache, value_cache, _, k_scale, v_scale = _scatter_inputs(
        3, 2, 80, 4, torch.float32
    )
    mapping = torch.tensor(slots, dtype=torch.int64)
    key, value = key[: len(slots)], value[: len(slots)]
    before = [t.clone() for t in (key_cache, value_cache, k_scale, v_scale)]
    slot_scatter(
        key, value, key_cache, value_cache, mapping, k_scale=k_scale, v_scale=v_scale,
        backend=backend,
    )  # fmt: skip
    for after, was in zip((key_cache, value_cache, k_scale, v_scale), before, strict=True):
        assert torch.equal(after, was)
    assert quantize_int8(torch.zeros(0, 2, 80))[1].shape == (0, 2, 5)
    assert dequantize_int8(key_cache[:0], k_scale[:0], torch.float32).shape == (0, 4, 2, 80)


@needs_interpreter
@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim", "block_size", "dtype"),
    [
        (1, 2, 64, 16, torch.float16),
        (37, 3, 80, 8, torch.float32),
        (100, 8, 128, 16, torch.float16),
        (17, 1, 96, 1, torch.float32),
        (9, 2, 8, 16, torch.float32),
        (9, 2, 24, 4, torch.float16),
    ],
)
def test_triton_scatter_int8_matches_reference(
    num_tokens, num_kv_heads, head_dim, block_size, dtype
):
    """The Triton scatter stores the reference's int8 values and float16 scales exactly (ties,
    saturation, inf and NaN groups, head dims not a multiple of 16), and nothing else."""
    key, value, key_cache, value_cache, slots, k_scale, v_scale = _scatter_inputs(
        num_tokens, num_kv_heads, head_dim, block_size, dtype
    )
    ref = [t.clone() for t in (key_cache, value_cache, k_scale, v_scale)]
    slot_scatter_ref(key, value, ref[0], ref[1], slots, k_scale=ref[2], v_scale=ref[3])
    slot_scatter(
        key, value, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale,
        backend="triton",
    )  # fmt: skip
    assert torch.equal(key_cache, ref[0]) and torch.equal(value_cache, ref[1])
    for got, want in ((k_scale, ref[2]), (v_scale, ref[3])):
        assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0))


def test_reference_attention_equals_dequantized_pools():
    kc, vc, ks, vs, k64, v64, tables, lens = make_int8_paged_kv([5, 33], 2, 64, 16)
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
    "gqa2-d24-block1": (2, 2, 24, 1, [1, 5], None, None, None),
    # several tiles a split: fixed splits load the next tile's block ids a step ahead
    "gqa4-long-2splits": (2, 4, 64, 4, [300, 250, 64], None, None, 2),
    # many splits: the merge cuts head-dim lanes across programs
    "gqa4-64splits": (1, 4, 64, 16, [700, 1100], None, None, 64),
}


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_int8_matches_reference(case, dtype, poison_outputs):
    num_kv_heads, group, head_dim, block_size, lens, window, softcap, splits = DECODE_CASES[case]
    kc, vc, ks, vs, k64, v64, tables, seq_lens = make_int8_paged_kv(
        lens, num_kv_heads, head_dim, block_size
    )
    query = (torch.randn(len(lens), num_kv_heads * group, head_dim) * 0.1).to(dtype)
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
    assert row_errors(out, ref).max() < INT8_TOL[dtype]


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
def test_extend_int8_matches_reference(case, dtype, poison_outputs):
    num_kv_heads, group, head_dim, block_size, history, new, window, softcap = EXTEND_CASES[case]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    kc, vc, ks, vs, k64, v64, tables, seq_lens = make_int8_paged_kv(
        lens, num_kv_heads, head_dim, block_size
    )
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = (torch.randn(int(cu[-1]), num_kv_heads * group, head_dim) * 0.1).to(dtype)
    opts = dict(sliding_window=window, softcap=softcap)
    ref = paged_extend_attention_ref(query.double(), k64, v64, tables, seq_lens, cu, **opts)
    out = paged_extend_attention(
        query, kc, vc, tables, seq_lens, cu, **opts, k_scale=ks, v_scale=vs, backend="triton"
    )
    assert out.dtype == dtype and out.shape == query.shape
    assert row_errors(out, ref).max() < INT8_TOL[dtype]


@needs_interpreter
def test_int8_error_is_small_and_does_not_grow_with_length():
    """Attention over INT8 K/V against float32 K/V: each stored value is rounded once (to a
    256th of its group's range), so the error is small and flat as the context grows."""
    errors = []
    for length in (256, 1024, 4096):
        key = torch.randn(length, 2, 64) * torch.logspace(-1, 1, 64)
        value = torch.randn(length, 2, 64)
        tables = torch.arange(length // 16, dtype=torch.int32)[None]
        lens = torch.tensor([length], dtype=torch.int32)
        query = torch.randn(1, 32, 64) * 0.3  # peaked enough that attention is not a mean
        pools = [x.view(-1, 16, 2, 64) for x in (key, value)]
        ref = paged_decode_attention_ref(query, *pools, tables, lens)
        (kc, ks), (vc, vs) = quantize_int8(pools[0]), quantize_int8(pools[1], group=None)
        out = paged_decode_attention(
            query, kc, vc, tables, lens, k_scale=ks, v_scale=vs, backend="triton"
        )
        errors.append(rel_err(out, ref))
    assert max(errors) < 0.02, errors
    assert errors[-1] < 2 * errors[0], errors


@pytest.mark.parametrize(
    ("name", "bad", "match"),
    [
        ("k_scale", None, "required"),
        ("v_scale", None, "required"),
        ("k_scale", torch.ones(4, 16, 2, 3, dtype=torch.float16), r"\[4, 16, 2, 4\]"),
        ("v_scale", torch.ones(4, 16, 2, 4, dtype=torch.float16), r"\[4, 16, 2, 1\]"),
        ("v_scale", torch.ones(4, 16, 2, 1), "dtype"),
        ("k_scale", torch.ones(2, dtype=torch.float16), "dims"),
        ("v_scale", "strided", "contiguous"),
        ("v_scale", "same", "shares memory"),
        ("k_scale", "in_key_pool", "shares memory with the pools"),
        ("v_scale", "in_value_pool", "shares memory with the pools"),
    ],
)
@pytest.mark.parametrize("op", ["scatter", "decode", "extend", "scatter_ref", "decode_ref"])
def test_bad_int8_scales_raise_naming_the_argument(op, name, bad, match):
    kc = torch.zeros(4, 16, 2, 64, dtype=INT8_DTYPE)
    args = dict(
        key_cache=kc, value_cache=kc.clone(), k_scale=torch.ones(4, 16, 2, 4, dtype=torch.float16),
        v_scale=torch.ones(4, 16, 2, 1, dtype=torch.float16),
    )  # fmt: skip
    if bad == "strided":
        bad = torch.ones(4, 16, 2, 2, dtype=torch.float16)[..., :1]
    elif bad == "same":  # the first entries of the key scales
        bad = args["k_scale"].view(-1)[: 4 * 16 * 2].view(4, 16, 2, 1)
    elif bad in ("in_key_pool", "in_value_pool"):  # float16 views of a pool's last bytes
        pool = args["key_cache" if bad == "in_key_pool" else "value_cache"].view(-1)
        want = args[name].numel() * 2
        bad = pool[-want:].view(torch.float16).view(args[name].shape)
    args[name] = bad
    before = [args["key_cache"].clone(), args["value_cache"].clone()]
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
    assert torch.equal(args["key_cache"], before[0])
    assert torch.equal(args["value_cache"], before[1])


@needs_interpreter
def test_interpreted_bfloat16_query_over_int8_pools_is_refused():
    """INT8 tiles meet the query in its own dtype, and the interpreter's bfloat16 dot is wrong:
    refused rather than answered wrongly."""
    kc, vc, ks, vs, _, _, tables, lens = make_int8_paged_kv([5], 2, 64, 16)
    query = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^backend: .*bfloat16"):
        paged_decode_attention(query, kc, vc, tables, lens, k_scale=ks, v_scale=vs,
                               backend="triton")  # fmt: skip
