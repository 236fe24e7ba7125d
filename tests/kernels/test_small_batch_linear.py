"""Small-batch linear (a decode step's projections): Triton (interpreter) against the
float64 / float32 reference, fused groups, the gated MLP, K split in shares, bad input."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import needs_interpreter, rel_err

from nanoserve.kernels.small_batch_linear import (
    LinearConfig,
    choose_config,
    small_batch_linear,
    small_batch_linear_ref,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
SPLIT = LinearConfig(block_n=16, block_k=32, split=3, num_warps=4, num_stages=2)


def _inputs(rows, k, sizes, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for n in sizes]
    biases = [torch.randn(n, generator=gen).to(dtype) for n in sizes] if bias else None
    return x, weights, biases


def _exact(x, weights, biases, gated):
    """The float64 result, before any rounding to x's dtype."""
    f64 = [w.double() for w in weights]
    outs = [x.double() @ w.T for w in f64]
    if biases is not None:
        outs = [y + b.double() for y, b in zip(outs, biases, strict=True)]
    if gated:
        return torch.nn.functional.silu(outs[0]) * outs[1]
    return torch.cat(outs, dim=-1)


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("rows", "k", "sizes", "gated", "bias", "config"),
    [
        (1, 64, (48,), False, False, None),  # one weight, one row
        (3, 80, (32, 16, 16), False, True, None),  # q/k/v with biases (Qwen2)
        (16, 96, (64, 17, 17), False, False, None),  # the most rows, ragged tiles
        (5, 128, (40, 40), True, False, None),  # gated MLP
        (2, 128, (50, 20), False, True, SPLIT),  # K in three shares, summed after
        (16, 100, (33, 33), True, True, SPLIT),  # gated, split, K not a tile multiple
        (4, 15, (7,), False, False, None),  # K and N below one tile
        (17, 96, (64, 17, 17), False, True, None),  # a program of 32 rows, 15 padding
        (32, 128, (40, 40), True, False, None),  # gated, 32 rows
        (33, 128, (50, 20), False, False, SPLIT),  # 64 rows a program, K in shares
        (64, 100, (33, 33), True, True, SPLIT),  # the most rows, gated, split, ragged K
    ],
)
def test_matches_reference(rows, k, sizes, gated, bias, config, dtype):
    """Planted: the gated epilogue without silu, the second weight's column offset, the K
    share's upper bound one tile short and the bias on the wrong weight: each failed."""
    x, weights, biases = _inputs(rows, k, sizes, dtype, bias, seed=rows * k)
    out = small_batch_linear(x, weights, biases, gated=gated, backend="triton", config=config)
    ref = small_batch_linear_ref(x, weights, biases, gated=gated)
    width = sizes[0] if gated else sum(sizes)
    assert out.shape == (rows, width) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, _exact(x, weights, biases, gated)) < TOLERANCE[dtype]
    assert rel_err(out, ref) < TOLERANCE[dtype]
    if dtype == torch.float16:
        # one rounding per output, as the reference: any difference is in the last bit (of
        # gate or up when gated, which silu and the product can carry a few units further)
        ulp = torch.finfo(dtype).eps * ref.float().abs().clamp(min=2**-14)
        assert ((out.float() - ref.float()).abs() <= ulp * (4.01 if gated else 1.01)).all()


def test_reference_rounds_where_eager_torch_does():
    """The reference's gated result is eager PyTorch's MLP on the same float16 tensors
    (float32 on CPU: one rounding per op in both)."""
    x, (gate, up), _ = _inputs(3, 32, (24, 24), torch.float32, False, seed=7)
    eager = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
    torch.testing.assert_close(
        small_batch_linear_ref(x, [gate, up], gated=True), eager, rtol=1e-6, atol=1e-6
    )


def test_auto_on_cpu_runs_the_reference(forbid_triton, monkeypatch):
    import nanoserve.kernels.triton_linear as triton_linear

    def launched(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched")

    monkeypatch.setattr(triton_linear, "_linear_kernel", launched)
    x, weights, _ = _inputs(2, 32, (16, 8), torch.float32, False, seed=3)
    out = small_batch_linear(x, weights)
    assert torch.equal(out, small_batch_linear_ref(x, weights))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(x=torch.zeros(65, 8)), "x: expected"),
        (dict(x=torch.zeros(8)), "x: expected"),
        (dict(x=torch.zeros(8, 2).T), "unit stride"),
        (  # an integer x came back truncated from the reference
            dict(x=torch.ones(2, 8, dtype=torch.int64), weights=[torch.ones(4, 8).long()]),
            "x: expected float16",
        ),
        (dict(weights=[]), "weights: expected 1 to 3"),
        (dict(weights=[torch.zeros(4, 8)] * 4), "weights: expected 1 to 3"),
        (dict(weights=[torch.zeros(4, 9)]), r"weights\[0\]"),
        (dict(weights=[torch.zeros(8, 4).T]), r"weights\[0\]"),
        (dict(weights=[torch.zeros(4, 8, dtype=torch.float16)]), r"weights\[0\]: dtype"),
        (dict(weights=[torch.zeros(4, 8)], gated=True), "gated=True"),
        (dict(weights=[torch.zeros(4, 8), torch.zeros(5, 8)], gated=True), "gated=True"),
        (dict(biases=[torch.zeros(4), None]), "every weight or for none"),
        (dict(biases=[torch.zeros(4)]), "biases: expected 2"),
        (dict(biases=[torch.zeros(5), torch.zeros(4)]), r"biases\[0\]"),
        (dict(biases=[torch.zeros(8)[::2], torch.zeros(4)]), r"biases\[0\]: expected a contig"),
        (  # every element offset is 32-bit in the kernel (meta tensors: nothing allocated)
            dict(
                x=torch.empty(1, 16384, device="meta"),
                weights=[torch.empty(131136, 16384, device="meta")],
            ),
            r"weights\[0\]: .* too large",
        ),
    ],
)
def test_bad_input_names_the_argument(kwargs, message):
    args = dict(x=torch.zeros(2, 8), weights=[torch.zeros(4, 8)] * 2, biases=None)
    args |= kwargs
    with pytest.raises(ValueError, match=message):
        small_batch_linear(args.pop("x"), args.pop("weights"), args.pop("biases"), **args)


def test_config_fills_the_machine_and_splits_only_few_tiles(monkeypatch):
    import nanoserve.kernels.small_batch_linear as module

    monkeypatch.setattr(module, "sm_count", lambda device: 132)  # an H200's
    cuda = torch.device("cuda", 0)
    qkv = choose_config(1, 2048, (2048, 512, 512), False, cuda)
    down = choose_config(1, 8192, (2048,), False, cuda)
    gate_up = choose_config(1, 4096, (14336, 14336), True, cuda)
    short_k = choose_config(1, 1024, (256,), False, cuda)
    assert qkv.split == 1 and qkv.block_n == 32  # 96 tiles: one wave, no split
    assert down.split == 4 and down.block_k == 128  # 64 tiles: four K shares of 2,048
    assert gate_up.split == 1 and gate_up.block_n == 64
    assert short_k.split == 1  # a share under 2,048 of K would not pay for the second pass


@needs_interpreter
@pytest.mark.parametrize("gated", [False, True])
def test_no_input_features_give_the_bias(gated):
    """K = 0 (an empty input): the reference's answer (zeros, the bias; gated: their
    activation's product). Found by a probe: the launcher divided by zero. Planted: K = 0
    launched: ZeroDivisionError."""
    x = torch.randn(3, 0)
    weights = [torch.randn(8, 0), torch.randn(8, 0)] if gated else [torch.randn(8, 0)]
    biases = None if gated else [torch.randn(8)]
    out = small_batch_linear(x, weights, biases, gated=gated, backend="triton")
    assert torch.equal(out, small_batch_linear_ref(x, weights, biases, gated=gated))


def _rotary_inputs(rows, k, q_heads, kv_heads, dim, dtype, bias, seed):
    from nanoserve.kernels.rotary import rotary_cos_sin

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    sizes = (q_heads * dim, kv_heads * dim, kv_heads * dim)
    weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for n in sizes]
    biases = [torch.randn(n, generator=gen).to(dtype) for n in sizes] if bias else None
    positions = torch.randint(0, 40000, (rows, 1), generator=gen)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, dim, 2).float() / dim)
    cos, sin = rotary_cos_sin(positions, inv_freq, 1.0, dtype, backend="torch")
    return x, weights, biases, cos.view(rows, dim), sin.view(rows, dim)


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("rows", "k", "q_heads", "kv_heads", "dim", "bias", "config"),
    [
        (1, 64, 4, 4, 64, False, None),  # GQA 1
        (3, 96, 8, 2, 80, True, None),  # GQA 4, half-heads not whole tiles, biases
        (5, 128, 8, 1, 96, False, None),  # GQA 8
        (2, 64, 2, 1, 128, False, None),
        (17, 64, 2, 2, 2, False, None),  # the narrowest head; 32-row program
        (2, 512, 2, 1, 64, False, LinearConfig(32, 64, 4, 4, 2)),  # K in shares: rotated apart
        (1, 64, 4, 2, 64, False, LinearConfig(16, 64, 1, 4, 2)),  # 8-column halves
    ],
)
def test_rotary_epilogue_matches_reference(rows, k, q_heads, kv_heads, dim, bias, config, dtype):
    """The projections as ``small_batch_linear`` computes them, and q and k rotated as
    ``apply_rotary`` rotates those outputs (eager's bits; float16 bit for bit), within the
    rounding of the float64 reference. Planted: the second half's columns taken from the
    first (HALF dropped in ``_rotary_cols``), the sine's sign flipped, and the tail of a
    head half not masked: each failed."""
    from nanoserve.kernels.small_batch_linear import (
        _rotated,
        small_batch_linear_rotary,
        small_batch_linear_rotary_ref,
    )

    x, weights, biases, cos, sin = _rotary_inputs(rows, k, q_heads, kv_heads, dim, dtype,
                                                  bias, seed=rows * dim + k)  # fmt: skip
    out, q_rot, k_rot = small_batch_linear_rotary(
        x, weights, biases, cos, sin, backend="triton", config=config
    )
    assert torch.equal(out, small_batch_linear(x, weights, biases, backend="triton", config=config))
    eager_q, eager_k = _rotated(out, weights, cos, sin)
    assert torch.equal(q_rot, eager_q) and torch.equal(k_rot, eager_k)
    _, ref_q, ref_k = small_batch_linear_rotary_ref(x, weights, biases, cos, sin)
    for got, ref in ((q_rot, ref_q), (k_rot, ref_k)):
        assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weights": 2}, "weights: expected q, k and v"),
        ({"cos": torch.zeros(3, 16)}, "cos: expected"),
        ({"sin": torch.zeros(2, 16, dtype=torch.float16)}, "sin: expected unit stride"),
        ({"cos": torch.zeros(2, 15), "sin": torch.zeros(2, 15)}, "cos: expected an even D"),
        ({"cos": torch.zeros(2, 12), "sin": torch.zeros(2, 12)}, "weights\\[0\\]: 32 outputs"),
    ],
)
def test_rotary_bad_input_names_the_argument(change, message):
    from nanoserve.kernels.small_batch_linear import small_batch_linear_rotary

    x = torch.zeros(2, 8)
    weights = [torch.zeros(32, 8), torch.zeros(16, 8), torch.zeros(16, 8)][
        : change.get("weights", 3)
    ]
    cos = change.get("cos", torch.zeros(2, 16))
    sin = change.get("sin", torch.zeros(2, 16))
    with pytest.raises(ValueError, match=message):
        small_batch_linear_rotary(x, weights, None, cos, sin)


def _kv_store(rows, kv_heads, dim, dtype, seed, block_size=16):
    """(KVStore, the memory around its pools): pools of NaN (every slot the launch must not
    write keeps its NaN), each a view into a buffer one block longer on either side (a
    write past the pools lands there), and a slot for each row: distinct, random, the last
    row's -1 where there are several rows."""
    from nanoserve.kernels.slot_scatter import KVStore

    gen = torch.Generator().manual_seed(seed)
    blocks = rows // block_size + 3
    shape = (blocks + 2, block_size, kv_heads, dim)
    buffers = [torch.full(shape, float("nan"), dtype=dtype) for _ in "kv"]
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows]
    if rows > 1:
        slots[-1] = -1
    return KVStore(buffers[0][1:-1], buffers[1][1:-1], slots), buffers


@needs_interpreter
@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("rows", "k", "q_heads", "kv_heads", "dim", "config", "backend"),
    [
        (1, 64, 4, 4, 64, None, "triton"),  # GQA 1, one row
        (3, 96, 8, 2, 80, None, "triton"),  # GQA 4, half-heads not whole tiles
        (5, 128, 8, 1, 96, None, "triton"),  # GQA 8
        (17, 64, 2, 2, 2, None, "triton"),  # the narrowest head; 32-row program
        (1, 64, 4, 2, 64, LinearConfig(16, 64, 1, 4, 2), "triton"),  # 8-column halves
        (2, 512, 2, 1, 64, LinearConfig(32, 64, 4, 4, 2), "triton"),  # shares: stored apart
        (3, 64, 4, 2, 64, None, "torch"),  # the reference backend stores too
    ],
)
def test_kv_store_writes_what_slot_scatter_writes(
    rows, k, q_heads, kv_heads, dim, config, backend, dtype
):
    """With a ``KVStore`` the launch also writes k rotated and v (its own outputs) to the
    rows' slots, bit for bit what ``slot_scatter`` writes from them, leaves every other slot
    as it was (NaN), and a row of slot -1 unstored; the outputs are those of the launch
    without it. Planted: the value tile stored into the key pool, the slot -1 check
    dropped, k stored unrotated: each failed."""
    from nanoserve.kernels.slot_scatter import slot_scatter_ref
    from nanoserve.kernels.small_batch_linear import (
        small_batch_linear_rotary,
        small_batch_linear_rotary_ref,
    )

    x, weights, biases, cos, sin = _rotary_inputs(rows, k, q_heads, kv_heads, dim, dtype,
                                                  False, seed=rows * dim + k + 1)  # fmt: skip
    store, buffers = _kv_store(rows, kv_heads, dim, dtype, seed=rows + dim)
    expected = [store.key_pool.clone(), store.value_pool.clone()]
    out, q_rot, k_rot = small_batch_linear_rotary(
        x, weights, biases, cos, sin, backend=backend, config=config, kv_store=store
    )
    plain = small_batch_linear_rotary(x, weights, biases, cos, sin, backend=backend, config=config)
    for got, want in zip((out, q_rot, k_rot), plain, strict=True):
        assert torch.equal(got, want)
    value = out[:, -kv_heads * dim :].reshape(rows, kv_heads, dim)
    slot_scatter_ref(k_rot.view(rows, kv_heads, dim), value, *expected, store.slot_mapping)
    for got, want in zip((store.key_pool, store.value_pool), expected, strict=True):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    stored = (rows - (rows > 1)) * kv_heads * dim  # (a row of slot -1 is not stored)
    for buffer in buffers:  # nothing written outside the slots, before or past the pools
        assert int(buffer.isnan().logical_not().sum()) == stored
    # the reference stores its own rows the same way
    ref_store, _ = _kv_store(rows, kv_heads, dim, dtype, seed=rows + dim)
    _, _, ref_k = small_batch_linear_rotary_ref(x, weights, biases, cos, sin, ref_store)
    kept = store.slot_mapping[store.slot_mapping >= 0]
    ref_rows = ref_store.key_pool.view(-1, kv_heads, dim)[kept]
    assert torch.equal(ref_rows.reshape(len(kept), -1), ref_k[: len(kept)])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("kv_store", "kv_store: expected a KVStore"),
        ("dtype", "kv_store: pools of torch.float16 on cpu; the rows are stored unconverted"),
        ("heads", "kv_store: pools of \\[.., 1, 16\\] do not hold k and v's 16 / 16 outputs"),
        ("value_pool", "kv_store: value_cache: shape"),
        ("length", "kv_store: slot_mapping: has 3 entries for 2 tokens"),
        ("range", "kv_store: slot_mapping: values in \\[0, 64\\] outside \\[-1, 63\\]"),
        ("twice", "kv_store: slot_mapping: writes the same slot twice"),
        ("unchecked", "kv_store: slot_mapping: dtype float32 not in"),
    ],
)
def test_kv_store_bad_input_names_the_argument(change, message):
    """Each bad ``KVStore`` is refused before anything is written (the pools stay zero)."""
    from nanoserve.kernels.slot_scatter import KVStore
    from nanoserve.kernels.small_batch_linear import small_batch_linear_rotary

    x = torch.zeros(2, 8)
    weights = [torch.zeros(32, 8), torch.zeros(16, 8), torch.zeros(16, 8)]
    cos, sin = torch.zeros(2, 16), torch.zeros(2, 16)
    key_pool, value_pool = torch.zeros(4, 16, 1, 16), torch.zeros(4, 16, 1, 16)
    slots = torch.tensor([3, 5])
    check = True
    if change == "dtype":
        key_pool, value_pool = key_pool.half(), value_pool.half()
    elif change == "heads":  # heads of 8 for the pools' 16
        cos = sin = torch.zeros(2, 8)
    elif change == "value_pool":
        value_pool = torch.zeros(4, 16, 2, 8)
    elif change == "length":
        slots = torch.tensor([3, 5, 7])
    elif change == "range":
        slots = torch.tensor([0, 64])
    elif change == "twice":
        slots = torch.tensor([9, 9])
    elif change == "unchecked":
        slots, check = torch.tensor([1.0, 2.0]), False
    store = KVStore(key_pool, value_pool, slots)
    with pytest.raises(ValueError, match=message):
        small_batch_linear_rotary(x, weights, None, cos, sin,
                                  kv_store=store if change != "kv_store" else (1, 2, 3),
                                  check=check)  # fmt: skip
    assert not key_pool.any() and not value_pool.any()
