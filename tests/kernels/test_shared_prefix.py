"""Shared-prefix (cascade) decode attention: the planner, the plan's check, and the Triton
launch with a plan against the float64 reference (interpreter on CPU; CUDA under -m gpu)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from fp8_inputs import make_fp8_paged_kv
from int8_inputs import make_int8_paged_kv
from kernel_inputs import ON_GPU, TOLERANCE, make_paged_kv, rel_err, row_errors

from nanoserve.kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    shared_prefix,
    triton_decode,
)
from nanoserve.kernels.dispatch import sm_count
from nanoserve.kernels.shared_prefix import (
    TILE_ROWS,
    SharedPrefixPlan,
    check_shared_prefix,
    plan_shared_prefix,
    tile_capacity,
)
from nanoserve.kernels.triton_decode import paged_decode_attention_triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")
    ),
    *ON_GPU,
]


def shared_rows(groups, lens, num_kv_heads, head_dim, block_size, dtype, device="cpu"):
    """Paged K/V (``make_paged_kv``) whose rows share leading blocks: ``groups`` is a list of
    (rows, shared blocks); each group's rows point their first blocks at its first row's."""
    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        lens, num_kv_heads, head_dim, block_size, dtype, device
    )
    for rows, blocks in groups:
        for r in rows[1:]:
            assert lens[r] > blocks * block_size and lens[rows[0]] > blocks * block_size
            tables[r, :blocks] = tables[rows[0], :blocks]
    return key_cache, value_cache, tables, seq_lens


@pytest.fixture(autouse=True)
def any_grid_takes_the_plan(monkeypatch):
    """The launcher takes a plan only for grids that fill the GPU; these small shapes run
    the prefix pass too (``test_small_grids_read_every_row_whole`` checks the rule)."""
    monkeypatch.setattr(shared_prefix, "SHARED_PREFIX_PROGRAMS_PER_SM", 0)


def as_plan(plan: SharedPrefixPlan, device) -> SharedPrefixPlan:
    return SharedPrefixPlan(plan.prefix_lens.to(device), plan.tiles.to(device))


# -- the planner ---------------------------------------------------------------------------


def test_plan_groups_rows_by_their_common_blocks():
    """Rows 0, 2, 5 share 3 blocks, rows 1 and 4 share 1, row 3 shares none: two groups, each
    in its own tile, prefixes in tokens, and no row of one group in the other's tile."""
    tables = np.array(
        [[7, 8, 9, 10, 0], [20, 21, 22, 0, 0], [7, 8, 9, 11, 0],
         [30, 31, 0, 0, 0], [20, 23, 0, 0, 0], [7, 8, 9, 12, 13]],
        np.int32,
    )  # fmt: skip
    lens = np.array([60, 40, 55, 20, 30, 80], np.int32)
    plan = plan_shared_prefix(tables, lens, 16)
    assert plan.prefix_lens.tolist() == [48, 16, 48, 0, 16, 48]
    tiles = [sorted(t[t >= 0].tolist()) for t in plan.tiles.numpy()]
    assert sorted(tiles) == [[0, 2, 5], [1, 4]]
    assert plan.tiles.shape[1] == TILE_ROWS and plan.tiles.dtype == torch.int32


def test_plan_keeps_each_rows_newest_block_out():
    """Two rows on the same blocks: the shared prefix stops before the block that holds the
    shorter row's newest token (a block a row still writes is never shared), and rows whose
    only block is that one share nothing."""
    tables = np.array([[5, 6, 7], [5, 6, 7]], np.int32)

    def prefixes(lens):
        return plan_shared_prefix(tables, np.array(lens, np.int32), 16).prefix_lens.tolist()

    assert prefixes([33, 48]) == [32, 32]
    assert prefixes([32, 48]) == [16, 16]
    assert plan_shared_prefix(tables, np.array([16, 48], np.int32), 16) is None
    assert plan_shared_prefix(tables[:1], np.array([48], np.int32), 16) is None


def test_plan_takes_the_deeper_split_when_it_saves_more():
    """Eight rows share block 1; two sets of four share 30 more blocks each: two groups of
    30 + 1 blocks (saving 6 x 31 reads) beat one group of one block (saving 7)."""
    tables = np.zeros((8, 40), np.int32)
    tables[:, 0] = 1
    tables[:4, 1:31] = np.arange(100, 130)
    tables[4:, 1:31] = np.arange(200, 230)
    tables[:, 31] = np.arange(300, 308)
    plan = plan_shared_prefix(tables, np.full(8, 31 * 16 + 5, np.int32), 16)
    assert plan.prefix_lens.tolist() == [31 * 16] * 8
    assert sorted(sorted(t[t >= 0].tolist()) for t in plan.tiles.numpy()) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    # only two rows agree past the first block: one group of eight over it (saving 7) beats
    # a pair over three blocks (saving 3)
    tables[:, 1:31] = np.arange(8)[:, None] * 100 + np.arange(30) + 1000
    tables[1, 1:3] = tables[0, 1:3]
    plan = plan_shared_prefix(tables, np.full(8, 31 * 16 + 5, np.int32), 16)
    assert plan.prefix_lens.tolist() == [16] * 8


def test_plan_of_prompts_each_one_block_longer_than_the_last():
    """1,200 rows where row k holds blocks 0..k of one document (a staircase of prefixes,
    nested 1,200 levels deep, past Python's recursion limit): one group of the rows
    599..1199 over 600 blocks saves the most reads (601 x 600 shared reads minus one row's,
    against (n - j - 1) x (j + 1) at any other level j). Planted: the walk as recursion
    raised RecursionError."""
    n = 1200
    tables = np.zeros((n, n + 1), np.int32)
    for k in range(n):
        tables[k, : k + 1] = np.arange(k + 1)
        tables[k, k + 1] = n + k  # the row's own block, holding its newest token
    seq_lens = np.arange(n, dtype=np.int32) + 2  # block size 1: row k has k + 1 shared blocks
    plan = plan_shared_prefix(tables, seq_lens, 1)
    expected = np.zeros(n, np.int32)
    expected[599:] = 600
    assert plan.prefix_lens.tolist() == expected.tolist()
    planned = np.sort(np.concatenate([t[t >= 0] for t in plan.tiles.numpy()]))
    assert planned.tolist() == list(range(599, n))
    check_shared_prefix(plan, torch.from_numpy(tables), torch.from_numpy(seq_lens), 1)


def test_plan_fits_its_tiles():
    """A group of 40 rows takes three tiles; with room for two it is left out (its rows read
    whole), and a smaller group still fits."""
    tables = np.zeros((44, 4), np.int32)
    tables[:40, :2] = [1, 2]
    tables[40:, :2] = [3, 4]
    tables[:, 2] = np.arange(10, 54)
    lens = np.full(44, 40, np.int32)
    plan = plan_shared_prefix(tables, lens, 16)
    assert plan.tiles.shape[0] == 4 <= tile_capacity(44)
    plan = plan_shared_prefix(tables, lens, 16, max_tiles=2)
    assert plan.prefix_lens.tolist() == [0] * 40 + [32] * 4 and plan.tiles.shape[0] == 1


# -- the check -----------------------------------------------------------------------------


def _bad_plans(plan: SharedPrefixPlan):
    lens, tiles = plan.prefix_lens, plan.tiles
    mixed = tiles.clone()
    mixed[0, 1] = 3  # row 3 shares nothing with row 0
    missing = tiles.clone()
    missing[0, 1] = -1  # row 1 keeps its prefix but no tile computes it
    twice = torch.cat([tiles, tiles])
    partial = lens.clone()
    partial[1] = 8  # not whole blocks
    too_long = lens.clone()
    too_long[:3] = 48  # reaches row 1's newest token (33 tokens)
    return {
        "mixed": SharedPrefixPlan(lens, mixed),
        "missing": SharedPrefixPlan(lens, missing),
        "twice": SharedPrefixPlan(lens, twice),
        "partial": SharedPrefixPlan(partial, tiles),
        "too_long": SharedPrefixPlan(too_long, tiles),
        "int64": SharedPrefixPlan(lens.long(), tiles),
        "wide_tiles": SharedPrefixPlan(lens, torch.cat([tiles, tiles], 1)),
    }


def test_checked_decode_refuses_a_plan_that_does_not_hold():
    key_cache, value_cache, tables, seq_lens = shared_rows(
        [([0, 1, 2], 2)], [40, 33, 50, 20], 2, 16, 16, torch.float32
    )
    plan = plan_shared_prefix(tables.numpy(), seq_lens.numpy(), 16)
    assert plan.prefix_lens.tolist() == [32, 32, 32, 0]
    query = torch.randn(4, 4, 16)
    args = (query, key_cache, value_cache, tables, seq_lens)
    good = paged_decode_attention(*args, shared_prefix=plan, backend="torch")
    assert torch.equal(good, paged_decode_attention(*args, backend="torch"))
    for name, bad in _bad_plans(plan).items():
        with pytest.raises(ValueError, match="shared_prefix"):
            paged_decode_attention(*args, shared_prefix=bad, backend="torch")
        assert name


# -- the kernels against the reference ------------------------------------------------------

# (num_kv_heads, group, head_dim, block_size, lens, groups [(rows, blocks)], softcap)
CASES = {
    # prefix + 1 (the newest token only), + block_size - 1, + block_size, + block_size + 1
    "gqa4-edges": (2, 4, 64, 16, [33, 47, 48, 49, 80], [([0, 1, 2, 3, 4], 2)], None),
    "mha-d80-two-groups": (
        2,
        1,
        80,
        8,
        [30, 17, 25, 60, 61, 9],
        [([0, 2, 3], 2), ([4, 1], 2)],
        None,
    ),
    "gqa7-d96-softcap": (1, 7, 96, 16, [70, 65, 90, 5], [([0, 1, 2], 4)], 20.0),
    "gqa8-d128-tile-overflow": (1, 8, 128, 16, [40] * 18 + [7], [(list(range(18)), 2)], None),
    "bs32-long-prefix": (2, 4, 64, 32, [700, 650, 641, 100], [([0, 1, 2], 20)], None),
}


def _case_inputs(case, dtype, device):
    num_kv_heads, group, head_dim, block_size, lens, groups, softcap = CASES[case]
    key_cache, value_cache, tables, seq_lens = shared_rows(
        groups, lens, num_kv_heads, head_dim, block_size, dtype, device
    )
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, device=device).to(dtype)
    plan = plan_shared_prefix(tables.cpu().numpy(), seq_lens.cpu().numpy(), block_size)
    for rows, blocks in groups:
        assert (plan.prefix_lens[rows] >= blocks * block_size).all()
    ref = paged_decode_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens,
        softcap=softcap,
    )  # fmt: skip
    args = (query, key_cache, value_cache, tables, seq_lens)
    return args, as_plan(plan, device), ref, softcap


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("launch", ["auto", "splits1", "splits4", "balanced"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])  # fmt: skip
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_decode_with_a_shared_prefix_matches_reference(case, dtype, launch, device,
                                                       poison_outputs):  # fmt: skip
    """Every launch (fixed splits, one split, the balanced plan) with the prefix pass: each
    (row, head) against the float64 reference, rows outside every group included."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter's tl.dot is wrong on bfloat16")
    args, plan, ref, softcap = _case_inputs(case, dtype, device)
    head_dim = args[0].shape[-1]
    if launch == "auto":
        out = paged_decode_attention(*args, softcap=softcap, shared_prefix=plan, backend="triton")
    else:
        extra = {"splits1": dict(num_splits=1), "splits4": dict(num_splits=4),
                 "balanced": dict(work_items=5)}[launch]  # fmt: skip
        out = paged_decode_attention_triton(
            *args, scale=head_dim**-0.5, sliding_window=None, softcap=softcap,
            shared_prefix=plan, **extra,
        )  # fmt: skip
    assert out.dtype == dtype and out.shape == args[0].shape
    tolerance = TOLERANCE[dtype]
    errors = row_errors(out.float().cpu(), ref.cpu())
    assert errors.max() < 10 * tolerance, errors
    assert rel_err(out, ref) < tolerance


def spy_prefix_pass(monkeypatch) -> list[int]:
    """A list receiving one entry per prefix-pass launch."""
    passes, launcher = [], triton_decode.shared_prefix_partials

    def recording(*args, **kwargs):
        passes.append(1)
        return launcher(*args, **kwargs)

    monkeypatch.setattr(triton_decode, "shared_prefix_partials", recording)
    return passes


# Quantized pools: row errors against float64 on the same dequantized values (FP8 meets
# 16-bit queries in float16; INT8 meets the query in its dtype, so bfloat16 rounds once more)
QUANTIZED_TOLERANCE = {
    "fp8": {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2},
    "int8": {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("launch", ["auto", "splits1", "splits4", "balanced"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])  # fmt: skip
@pytest.mark.parametrize("pools", ["fp8", "int8"])
@pytest.mark.parametrize("case", ["gqa4-edges", "mha-d80-two-groups", "gqa7-d96-softcap",
                                  "bs32-long-prefix", "gqa8-d128-tile-overflow"])  # fmt: skip
def test_quantized_pools_with_a_shared_prefix_match_reference(
    case, pools, dtype, launch, device, poison_outputs, monkeypatch
):
    """FP8 pools (per-KV-head scales 10x apart) and INT8 pools (per-slot scales, K's per 16
    channels): the prefix pass runs and dequantizes as the decode kernel does (FP8: K's
    scale in the scores, V's at the decode kernel's end; INT8: a product per channel group
    times its keys' scales, V's scales in the softmax weights); each (row, head) against
    float64 on the dequantized pools (INT8's smaller matrix splits a tile of 18 rows of 8
    query heads into more programs). A bfloat16 query of magnitude 1e5 (past float16's
    range; K's scale shrunk to match) meets FP8 tiles in float16 through its power of two,
    so it runs under the interpreter too. Planted: the pass without FP8's K scale, its
    output scaled by a stray factor, and INT8's V scales left out: each failed."""
    if pools == "int8" and dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter's tl.dot is wrong on bfloat16")
    num_kv_heads, group, head_dim, block_size, lens, groups, softcap = CASES[case]
    make = make_fp8_paged_kv if pools == "fp8" else make_int8_paged_kv
    kc, vc, ks, vs, k64, v64, tables, seq_lens = make(
        lens, num_kv_heads, head_dim, block_size, device=device
    )
    for rows, blocks in groups:
        tables[rows[1:], :blocks] = tables[rows[0], :blocks]
    magnitude = 0.1  # INT8's channels span three decades: scores of order one
    if pools == "fp8":
        magnitude = {torch.float32: 1.0, torch.float16: 1e2, torch.bfloat16: 1e5}[dtype]
        ks, k64 = ks / magnitude, k64 / magnitude
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, device=device) * magnitude
    query = query.to(dtype)
    plan = as_plan(plan_shared_prefix(tables.cpu().numpy(), seq_lens.cpu().numpy(), block_size),
                   device)  # fmt: skip
    ref = paged_decode_attention_ref(query.double(), k64, v64, tables, seq_lens, softcap=softcap)
    passes = spy_prefix_pass(monkeypatch)
    args = (query, kc, vc, tables, seq_lens)
    scales = dict(k_scale=ks, v_scale=vs, softcap=softcap, shared_prefix=plan)
    if launch == "auto":
        out = paged_decode_attention(*args, **scales, backend="triton")
    else:
        extra = {"splits1": dict(num_splits=1), "splits4": dict(num_splits=4),
                 "balanced": dict(work_items=5)}[launch]  # fmt: skip
        out = paged_decode_attention_triton(
            *args, scale=head_dim**-0.5, sliding_window=None, **scales, **extra
        )
    assert passes, "the prefix pass did not run"
    assert out.dtype == dtype and out.shape == query.shape
    errors = row_errors(out.float().cpu(), ref.cpu())
    assert errors.max() < QUANTIZED_TOLERANCE[pools][dtype], errors.max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("inf"), 1e30], ids=["inf", "1e30"])
def test_one_rows_huge_query_leaves_the_other_rows_of_a_tile(bad, device, poison_outputs,
                                                             monkeypatch):  # fmt: skip
    """FP8 pools, bfloat16 queries: the prefix pass's matrix holds rows of several sequences,
    and each row meets the tiles in float16 through its own power of two, so row 0's query
    entry of 1e30 (or inf) leaves rows 1-4 at the reference. Planted: one power of two for
    the whole matrix (the first version): rows 1-4 off by 1 to 10."""
    num_kv_heads, group, head_dim, block_size, lens, groups, _ = CASES["gqa4-edges"]
    kc, vc, ks, vs, k64, v64, tables, seq_lens = make_fp8_paged_kv(
        lens, num_kv_heads, head_dim, block_size, device=device
    )
    for rows, blocks in groups:
        tables[rows[1:], :blocks] = tables[rows[0], :blocks]
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, device=device)
    query = query.to(torch.bfloat16)
    query[0, :, 0] = bad
    plan = as_plan(plan_shared_prefix(tables.cpu().numpy(), seq_lens.cpu().numpy(), block_size),
                   device)  # fmt: skip
    assert (plan.prefix_lens.cpu() > 0).all()  # row 0 shares its tiles with rows 1-4
    passes = spy_prefix_pass(monkeypatch)
    out = paged_decode_attention(
        query, kc, vc, tables, seq_lens, k_scale=ks, v_scale=vs, shared_prefix=plan,
        backend="triton",
    )  # fmt: skip
    ref = paged_decode_attention_ref(query[1:].double(), k64, v64, tables[1:], seq_lens[1:])
    assert passes
    assert row_errors(out[1:].float().cpu(), ref.cpu()).max() < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_is_ignored_under_a_window(device, poison_outputs):
    """A sliding window reads each row whole (the prefix pass has no window): the plan is
    ignored and the output is the windowed reference."""
    args, plan, _, _ = _case_inputs("gqa4-edges", torch.float32, device)
    query, key_cache, value_cache, tables, seq_lens = args
    ref = paged_decode_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens,
        sliding_window=20,
    )  # fmt: skip
    out = paged_decode_attention(*args, sliding_window=20, shared_prefix=plan, backend="triton")
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_small_grids_read_every_row_whole(device, monkeypatch):
    """With fewer (row, KV head) programs than SHARED_PREFIX_PROGRAMS_PER_SM per SM the plan
    is not taken (no prefix pass); with as many it is; the answer is the reference's both
    ways. Planted: the rule's comparison reversed: failed."""
    monkeypatch.undo()
    args, plan, ref, softcap = _case_inputs("gqa4-edges", torch.float32, device)
    programs = args[0].shape[0] * args[1].shape[2]  # 5 rows x 2 KV heads
    passes = spy_prefix_pass(monkeypatch)
    sms = sm_count(args[0].device)
    for per_sm, taken in ((programs / sms + 1, False), (programs / sms, True)):
        monkeypatch.setattr(shared_prefix, "SHARED_PREFIX_PROGRAMS_PER_SM", per_sm)
        passes.clear()
        out = paged_decode_attention(*args, shared_prefix=plan, backend="triton")
        assert bool(passes) == taken
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
