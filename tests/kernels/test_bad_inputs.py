"""The public ops (Triton path) and their references reject bad input with a ValueError
naming the argument, before anything runs."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import needs_interpreter

from nanoserve.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_extend_attention,
    paged_extend_attention_ref,
    slot_scatter,
    slot_scatter_ref,
)

pytestmark = needs_interpreter


def _attention_args():
    pool = torch.randn(4, 8, 2, 64)
    return dict(
        query=torch.randn(2, 4, 64),
        key_cache=pool,
        value_cache=pool.clone(),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([9, 16], dtype=torch.int32),
    )


ATTENTION_BAD = [
    ("query", torch.randn(2, 3, 64)),  # 3 query heads over 2 KV heads
    ("query", torch.randn(2, 4, 32)),  # head_dim differs from the pool's
    ("query", torch.randn(2, 4, 64).half()),  # dtype differs from the pool's
    ("key_cache", torch.randn(4, 8, 2)),  # not 4-D
    ("key_cache", torch.randn(4, 8, 2, 128)[..., ::2]),  # not contiguous
    ("value_cache", torch.randn(4, 8, 2, 32)),
    ("block_tables", torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)),
    ("block_tables", torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)),  # id outside the pool
    ("seq_lens", torch.tensor([9, 17], dtype=torch.int32)),  # beyond the table
    ("seq_lens", torch.tensor([-1, 16], dtype=torch.int32)),  # 0 is allowed (an empty row)
    ("seq_lens", torch.tensor([9], dtype=torch.int32)),
]

CU_TWO_TOKENS = torch.tensor([0, 1, 2], dtype=torch.int32)
ATTENTION_OPS = {
    "decode": lambda **a: paged_decode_attention(**a, backend="triton"),
    "extend": lambda **a: paged_extend_attention(**a, cu_seqlens_q=CU_TWO_TOKENS, backend="triton"),
    "decode_ref": lambda **a: paged_decode_attention_ref(**a),
    "extend_ref": lambda **a: paged_extend_attention_ref(**a, cu_seqlens_q=CU_TWO_TOKENS),
}


@pytest.mark.parametrize(("name", "bad"), ATTENTION_BAD)
@pytest.mark.parametrize("op", list(ATTENTION_OPS))
def test_attention_bad_input(op, name, bad):
    args = _attention_args()
    args[name] = bad
    with pytest.raises(ValueError, match=f"^{name}"):
        ATTENTION_OPS[op](**args)


NAN, INF = float("nan"), float("inf")
BAD_KEYWORDS = [
    ("sliding_window", 0),
    ("sliding_window", 2.5),
    ("sliding_window", "8"),
    # Before the fix: True passed as a window of one token (Triton) and crashed the torch
    # path; NaN and inf raised raw int() errors that named nothing.
    ("sliding_window", True),
    ("sliding_window", NAN),
    ("sliding_window", INF),
    ("softcap", 0.0),
    # Before the fix: inf and True passed and gave non-finite or wrong output; NaN was caught
    # only because NaN > 0 is False.
    ("softcap", INF),
    ("softcap", NAN),
    ("softcap", True),
    ("scale", -1.0),
    ("scale", INF),
    ("scale", NAN),
    ("scale", True),
    ("scale", torch.tensor([0.1, 0.2])),
    # Before the fix: finite in float64 but inf or 0 in the kernels' float32 (NaN out), and
    # a window past 64 bits (an OverflowError naming nothing)
    ("scale", 1e39),
    ("softcap", 1e-46),
    ("sliding_window", 10**20),
]


@pytest.mark.parametrize(("kwarg", "value"), BAD_KEYWORDS)
@pytest.mark.parametrize("op", list(ATTENTION_OPS))
def test_attention_bad_keyword(op, kwarg, value):
    with pytest.raises(ValueError, match=f"^{kwarg}"):
        ATTENTION_OPS[op](**{**_attention_args(), kwarg: value})


def test_attention_bad_backend():
    with pytest.raises(ValueError, match="^backend"):
        paged_decode_attention(**_attention_args(), backend="cuda")


@pytest.mark.parametrize("op", list(ATTENTION_OPS))
def test_attention_whole_float_window_and_numpy_numbers_accepted(op):
    """Numbers that are not Python ints/floats but mean one still pass (and compute the
    same as their plain forms)."""
    import numpy as np

    args = _attention_args()
    plain = ATTENTION_OPS[op](**args, sliding_window=5, scale=0.125, softcap=30.0)
    other = ATTENTION_OPS[op](
        **args, sliding_window=5.0, scale=np.float32(0.125), softcap=np.int64(30)
    )
    torch.testing.assert_close(other, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("extend", [paged_extend_attention, paged_extend_attention_ref])
def test_extend_bad_cu_seqlens(extend):
    args = _attention_args()
    args["query"] = torch.randn(5, 4, 64)
    # wrong length, not ending at the query rows, not starting at 0
    for cu in ([0, 2, 4], [0, 3, 5, 5], [1, 2, 5], [0, 2, 3]):
        with pytest.raises(ValueError, match="^cu_seqlens_q"):
            extend(**args, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    args["seq_lens"] = torch.tensor([2, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="^cu_seqlens_q"):  # 3 new tokens, only 2 cached
        extend(**args, cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32))


@pytest.mark.parametrize("extend", [paged_extend_attention, paged_extend_attention_ref])
def test_extend_with_no_sequences_takes_no_query_rows(extend):
    """No sequences (a [0, W] table) with query rows left over: a ValueError naming query.
    Before the fix both paths returned the rows uninitialized."""
    args = _attention_args()
    args.update(
        query=torch.randn(5, 4, 64),
        block_tables=torch.zeros(0, 2, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32),
    )
    for cu in ([0], [3]):
        with pytest.raises(ValueError, match="^query: has 5 rows for 0 sequences"):
            extend(**args, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    args["query"] = torch.randn(0, 4, 64)
    out = extend(**args, cu_seqlens_q=torch.tensor([0], dtype=torch.int32))
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("op", ["scatter", *ATTENTION_OPS])
def test_one_pool_for_k_and_v_is_refused(op):
    """key_cache and value_cache sharing memory: V would overwrite K. Before the fix both
    paths ran, and the slots held V."""
    pool = torch.randn(4, 8, 2, 64)
    if op == "scatter":
        kv = torch.randn(2, 2, 64)
        with pytest.raises(ValueError, match="^value_cache: shares memory"):
            slot_scatter(kv, kv, pool, pool, torch.tensor([3, 7]), backend="triton")
        return
    args = dict(_attention_args(), key_cache=pool, value_cache=pool[:])
    with pytest.raises(ValueError, match="^value_cache: shares memory"):
        ATTENTION_OPS[op](**args)


def test_triton_refuses_float64():
    args = {k: v.double() if v.is_floating_point() else v for k, v in _attention_args().items()}
    with pytest.raises(ValueError, match="^backend"):
        paged_decode_attention(**args, backend="triton")
    out = paged_decode_attention(**args, backend="auto")  # auto falls back to the reference
    assert out.dtype == torch.float64
    assert torch.equal(out, paged_decode_attention_ref(**args))


@pytest.mark.parametrize("scatter", ["triton", "ref"])
@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("slot_mapping", torch.tensor([0, 64])),  # past the pool
        ("slot_mapping", torch.tensor([-2, 3])),
        ("slot_mapping", torch.tensor([5, 5])),  # the same slot twice
        ("slot_mapping", torch.tensor([1.0, 2.0])),
        ("slot_mapping", torch.tensor([1, 2, 3])),
        ("key", torch.randn(2, 3, 64)),
        ("value", torch.randn(3, 2, 64)),
        ("value", torch.randn(2, 2, 64).half()),
        ("backend", "gpu"),
    ],
)
def test_scatter_bad_input_writes_nothing(scatter, name, bad):
    if scatter == "ref" and name == "backend":
        pytest.skip("the reference has no backend argument")
    pool = torch.randn(4, 16, 2, 64)
    args = dict(
        key=torch.randn(2, 2, 64),
        value=torch.randn(2, 2, 64),
        key_cache=pool,
        value_cache=pool.clone(),
        slot_mapping=torch.tensor([3, 7]),
    )
    if scatter == "triton":
        args["backend"] = "triton"
    args[name] = bad
    before = pool.clone()
    with pytest.raises(ValueError, match=f"^{name}"):
        (slot_scatter if scatter == "triton" else slot_scatter_ref)(**args)
    assert torch.equal(pool, before)


def test_memory_overlap_is_measured_in_each_tensors_own_bytes():
    """Scales of another dtype carved from a pool's arena: refused where a byte is shared,
    taken where none is. Planted: both extents in the first tensor's element size (the
    check then missed an overlap at an offset and refused a neighbour): failed."""
    from nanoserve.kernels.validation import _overlap

    arena = torch.zeros(4096, dtype=torch.int8)
    pool = arena[1000:2024]  # bytes [1000, 2024)
    halves = arena.view(torch.float16)
    assert _overlap(halves[500:564], pool) and _overlap(pool, halves[500:564])  # [1000, 1128)
    assert _overlap(halves[1011:1020], pool)  # [2022, 2040): the pool's last two bytes
    assert not _overlap(halves[1012:1100], pool) and not _overlap(pool, halves[1012:1100])
    assert not _overlap(halves[:500], pool)  # [0, 1000)
    assert _overlap(arena.view(torch.float32)[250:252], pool)  # [1000, 1008)


def test_meta_tensors_are_named():
    """Meta tensors (a model built on the meta device, weights not loaded) hold no values:
    each launcher refuses them naming the argument. Found by a probe: two meta pools were
    "sharing memory" (both at address 0), and the norm, rotary and linear launchers raised
    NotImplementedError from a copy. Planted: the meta checks dropped: those errors again."""
    from nanoserve.kernels.rms_norm import rms_norm
    from nanoserve.kernels.rotary import apply_rotary
    from nanoserve.kernels.small_batch_linear import small_batch_linear

    meta = dict(device="meta")
    pool = torch.empty(4, 8, 2, 64, **meta)
    args = dict(_attention_args(), key_cache=pool, value_cache=torch.empty_like(pool))
    for op in ("decode", "extend"):
        with pytest.raises(ValueError, match="^key_cache: a meta tensor"):
            ATTENTION_OPS[op](**args)
    kv = torch.empty(2, 2, 64, **meta)
    with pytest.raises(ValueError, match="^key_cache: a meta tensor"):
        slot_scatter(kv, kv, pool, torch.empty_like(pool), torch.tensor([3, 7]), backend="triton")
    x = torch.empty(2, 64, **meta)
    with pytest.raises(ValueError, match="^x: a meta tensor"):
        rms_norm(x, torch.empty(64, **meta), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="^x: a meta tensor"):
        small_batch_linear(x, [torch.empty(8, 64, **meta)], backend="triton")
    q = torch.empty(1, 4, 3, 64, **meta)
    cos = torch.empty(1, 3, 64, **meta)
    with pytest.raises(ValueError, match="^q: a meta tensor"):
        apply_rotary(q, q.clone(), cos, cos.clone(), backend="triton")
