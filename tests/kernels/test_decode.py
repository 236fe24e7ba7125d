"""Paged decode attention: Triton (interpreter) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import (
    TOLERANCE,
    balanced_chunk,
    cdiv,
    check_decode_planted,
    make_paged_kv,
    needs_interpreter,
    rel_err,
    row_errors,
)

from nanoserve.kernels import paged_decode_attention, paged_decode_attention_ref
from nanoserve.kernels.dispatch import next_pow2
from nanoserve.kernels.triton_decode import paged_decode_attention_triton

pytestmark = needs_interpreter

# (num_kv_heads, group, head_dim, block_size, seq_lens, window, softcap, num_splits)
# num_splits None takes the launcher's own choice (4 nominal SMs off GPU).
CASES = {
    "gqa4-edges": (2, 4, 64, 16, [1, 15, 16, 17], None, None, None),
    "gqa7-d80-window": (1, 7, 80, 8, [7, 8, 9, 130], 20, None, None),
    "mha-d96-softcap-3splits": (2, 1, 96, 16, [200, 33], None, 30.0, 3),
    "gqa8-d128-nosplit": (1, 8, 128, 32, [31, 32, 33], None, None, 1),
    "window-softcap-4splits": (1, 4, 64, 8, [150, 5], 50, 10.0, 4),
    "bs128": (2, 2, 64, 128, [129, 300], None, None, None),
    "many-splits": (1, 4, 64, 16, [513], None, None, None),
    # the most splits a few long rows take (MAX_SPLITS_LONG), many of them empty on the short row
    "128-splits": (1, 4, 64, 16, [1500, 9000], None, None, 128),
    # many splits: the merge cuts the head-dim lanes across programs (the last chunks of
    # head_dim 80 padded to 128 partly and wholly masked)
    "d80-64-splits": (2, 2, 80, 16, [700, 1100], None, None, 64),
    "window-longer-than-seq": (2, 2, 64, 16, [40, 3], 64, None, 2),
    # head_dim under tl.dot's least reduction of 16: the kernels pad it with masked lanes
    "d8-gqa4": (2, 4, 8, 16, [1, 17], None, None, 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_decode_matches_reference(case, dtype, poison_outputs):
    num_kv_heads, group, head_dim, block_size, lens, window, softcap, splits = CASES[case]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        lens, num_kv_heads, head_dim, block_size, dtype
    )
    query = torch.randn(len(lens), num_kv_heads * group, head_dim).to(dtype)
    ref = paged_decode_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens,
        sliding_window=window, softcap=softcap,
    )  # fmt: skip
    if splits is None:
        out = paged_decode_attention(
            query, key_cache, value_cache, tables, seq_lens,
            sliding_window=window, softcap=softcap, backend="triton",
        )  # fmt: skip
    else:
        out = paged_decode_attention_triton(
            query, key_cache, value_cache, tables, seq_lens, scale=head_dim**-0.5,
            sliding_window=window, softcap=softcap, num_splits=splits,
        )  # fmt: skip
    assert out.dtype == dtype and out.shape == query.shape
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("splits", [1, 4, None])
def test_decode_empty_rows_are_zero(splits, window, poison_outputs):
    """A row with seq_len 0 (no token yet: all padding, as the cache builds it) passes
    check=True and comes out exactly zero in the reference and the kernel, split or not; the
    other rows are unaffected. (check=True refused seq_len 0 before.)"""
    lens = [0, 20, 0, 33]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(lens, 2, 64, 8, torch.float32)
    query = torch.randn(len(lens), 4, 64)
    ref = paged_decode_attention_ref(query, key_cache, value_cache, tables, seq_lens,
                                     sliding_window=window)  # fmt: skip
    if splits is None:
        out = paged_decode_attention(query, key_cache, value_cache, tables, seq_lens,
                                     sliding_window=window, backend="triton")  # fmt: skip
    else:
        out = paged_decode_attention_triton(
            query, key_cache, value_cache, tables, seq_lens, scale=64**-0.5,
            sliding_window=window, softcap=None, num_splits=splits,
        )  # fmt: skip
    for row in (0, 2):
        assert torch.equal(ref[row], torch.zeros(4, 64)), row
        assert torch.equal(out[row], torch.zeros(4, 64)), row
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    ("window", "splits", "items"),
    [(None, 1, None), (None, 3, None), (None, 4, None), (90, 3, None), (150, 4, None),
     (None, 128, None), (90, 128, None),
     (None, None, None), (None, None, 10**6), (None, None, 3), (90, None, 10**6),
     (150, None, 5)],
    ids=["nowin-1split", "nowin-3splits", "nowin-4splits", "win90-3splits", "win150-4splits",
         "nowin-128splits", "win90-128splits",
         "balanced-auto", "balanced-every-tile", "balanced-3items", "win90-balanced-every-tile",
         "win150-balanced-5items"],
)  # fmt: skip
def test_decode_planted_key_dominates(window, splits, items, poison_outputs):
    """One key per (sequence, KV head) scores ~40 nats above the rest, at the newest
    position, the oldest (in-window) one, just before the window, and on both sides of
    every boundary between splits (fixed-split launch) or work items (balanced launch: a
    huge target makes every tile an item): each row must come out as that key's value row,
    compared per (sequence, head), not in a norm over the batch.

    Planted bugs, each reverted: ``hi = tl.minimum(lo + per_split, seq_len - 1)`` (the
    newest key dropped) failed every case here with relative error ~1 in the planted rows
    (on the GPU at 32k the same bug gave 4.9e-3 over all rows against a 1e-2 tolerance);
    ``hi = tl.minimum(lo + per_split - 1, seq_len)`` (each split's last key dropped) failed
    every split case here; in the balanced launch ``hi = ...(lo + per_item - 1, seq_len)``
    failed every balanced case but "balanced-3items" (one item per row there, whose end lies
    past seq_len), and ``first = ... - row_items + 1`` (items shifted by one) failed every
    balanced case; both also failed test_decode_balanced_ragged_rows."""
    check_decode_planted(
        [200, 77, 130], 2, 2, 64, 16, torch.float32,
        window=window, num_splits=splits, work_items=items, row_tol=1e-4,
    )  # fmt: skip


def _launch(lens, num_kv_heads, group, dtype=torch.float32, extra_columns=1, **launch):
    """The Triton decode launch (``launch``: its options) over fresh rows of ``lens`` (head
    dim 64, pages of 16) and the float64 reference: (out, ref)."""
    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        lens, num_kv_heads, 64, 16, dtype, extra_columns=extra_columns
    )
    query = torch.randn(len(lens), num_kv_heads * group, 64).to(dtype)
    ref = paged_decode_attention_ref(query.double(), key_cache.double(), value_cache.double(),
                                     tables, seq_lens)  # fmt: skip
    out = paged_decode_attention_triton(
        query, key_cache, value_cache, tables, seq_lens, scale=64**-0.5,
        sliding_window=None, softcap=None, **launch,
    )  # fmt: skip
    return out, ref


def _balanced_launch(lens, num_kv_heads, group, work_items):
    """The balanced decode launch over float32 rows of ``lens``: (out, ref)."""
    return _launch(lens, num_kv_heads, group, work_items=work_items)


@pytest.mark.parametrize("items", [1, 2, 7, 64, None])
def test_decode_balanced_ragged_rows(items, poison_outputs):
    """Rows of very different lengths (0, 1, block edges, long) in one balanced launch, with
    the work cut into 1 .. 64 target items: every (row, head) matches the reference alone."""
    out, ref = _balanced_launch([0, 1, 15, 16, 17, 700, 3, 260], 2, 4, items)
    assert torch.equal(out[0], torch.zeros(8, 64))
    errors = row_errors(out[1:], ref[1:])
    assert errors.max() < 1e-5, errors


def test_decode_balanced_merge_over_many_items(poison_outputs):
    """A row cut into more items than the merge kernel reads in one step (every tile its own
    item: 71 here, against a step of at most 64) merges over several steps, beside rows of
    one and two items. Planted bug, reverted: merging only the first step's items
    (``range(0, tl.minimum(to_merge, ITEMS_STEP), ITEMS_STEP)``) failed the long row here."""
    out, ref = _balanced_launch([64 * 70 + 5, 3, 65], 1, 2, 10**6)
    errors = row_errors(out, ref)
    assert errors.max() < 1e-5, errors


def test_decode_balanced_few_items_merge_over_many_steps(poison_outputs):
    """Eight rows under a target of 40 items take the merge's few-items launch (8 items a
    step, one warp); the long row's ~40 items still merge over several steps. Planted bug,
    reverted: merging only the first step's items failed the long row here."""
    from nanoserve.kernels.triton_decode import MERGE_FEW_ITEMS, merge_items_launch

    assert merge_items_launch(40, 8, 41) == (MERGE_FEW_ITEMS, 1)
    out, ref = _balanced_launch([64 * 40 + 5, 3, 65, 1, 17, 130, 16, 64], 1, 2, 40)
    errors = row_errors(out, ref)
    assert errors.max() < 1e-5, errors


def test_merge_items_launch_rule():
    """Rows of a few items each: one-warp programs of MERGE_FEW_ITEMS items a step; rows of
    more: one step of up to MERGE_ITEMS_STEP items (at least 16), four warps."""
    from nanoserve.kernels.triton_decode import (
        MERGE_FEW_ITEMS,
        MERGE_ITEMS_STEP,
        merge_items_launch,
    )

    assert merge_items_launch(132, 32, 133) == (MERGE_FEW_ITEMS, 1)  # ~4 items a row
    assert merge_items_launch(264, 64, 265) == (MERGE_FEW_ITEMS, 1)
    assert merge_items_launch(8 * 16, 16, 129) == (MERGE_FEW_ITEMS, 1)  # exactly 8 a row
    assert merge_items_launch(8 * 16 + 1, 16, 130) == (MERGE_ITEMS_STEP, 4)
    assert merge_items_launch(124, 4, 125) == (MERGE_ITEMS_STEP, 4)  # ~31 items a row
    assert merge_items_launch(10**6, 3, 71) == (MERGE_ITEMS_STEP, 4)
    assert merge_items_launch(100, 2, 9) == (16, 4)  # no row holds more than its 9 tiles


def test_decode_custom_scale_and_strided_query(poison_outputs):
    key_cache, value_cache, tables, seq_lens = make_paged_kv([37, 5], 2, 64, 16, torch.float32)
    query = torch.randn(4, 2, 64).transpose(0, 1)  # [2 seqs, 4 heads, 64], not contiguous
    ref = paged_decode_attention_ref(query, key_cache, value_cache, tables, seq_lens, scale=0.3)
    out = paged_decode_attention(
        query, key_cache, value_cache, tables, seq_lens, scale=0.3, backend="triton"
    )
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def _plain_decode(query, key_cache, value_cache, tables, seq_lens, scale):
    """Softmax attention of each sequence's one query over its K/V gathered contiguously by
    block id (written out here, not the reference)."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query, dtype=torch.float64)
    for i, n in enumerate(seq_lens.tolist()):
        slots = [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n)]
        k = key_cache.reshape(-1, num_kv_heads, key_cache.shape[3])[slots].double()
        v = value_cache.reshape(-1, num_kv_heads, value_cache.shape[3])[slots].double()
        for h in range(query.shape[1]):
            w = torch.softmax(k[:, h // group] @ query[i, h].double() * scale, dim=0)
            out[i, h] = w @ v[:, h // group]
    return out


def test_decode_auto_on_cpu_is_the_reference(forbid_triton):
    """backend="auto" on CPU tensors launches no Triton kernel (even under the interpreter)
    and computes attention: against softmax written out on the gathered K/V."""
    key_cache, value_cache, tables, seq_lens = make_paged_kv([9, 20], 1, 64, 8, torch.float32)
    query = torch.randn(2, 2, 64)
    out = paged_decode_attention(query, key_cache, value_cache, tables, seq_lens)
    expected = _plain_decode(query, key_cache, value_cache, tables, seq_lens, 64**-0.5)
    assert out.dtype == torch.float32
    assert rel_err(out, expected) < TOLERANCE[torch.float32]


def test_decode_many_long_narrow_path(poison_outputs):
    """Head dim 64, fp16, >= 4 programs per (nominal) SM and an 8k-token table: the launcher
    takes 64-token steps (balanced over work items); the result still matches the reference."""
    from nanoserve.kernels.triton_decode import decode_plan

    lens = [1, 15, 16, 17, 300]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        lens, 4, 64, 16, torch.float16, extra_columns=512
    )
    query = torch.randn(len(lens), 4 * 4, 64).to(torch.float16)
    plan = decode_plan(query, key_cache, tables)
    assert plan[:3] == (64, 4, 2) and plan.work_items > 0
    # a short table, or a split count given by the caller, keeps the usual choice
    assert decode_plan(query, key_cache, tables[:, :40]).block_n == 128
    assert decode_plan(query, key_cache, tables, num_splits=1) == (128, 4, 2, 1, 0, 0, False)
    ref = paged_decode_attention_ref(query.double(), key_cache.double(), value_cache.double(),
                                     tables, seq_lens)  # fmt: skip
    out = paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, backend="triton")
    assert rel_err(out, ref) < TOLERANCE[torch.float16]


def test_decode_plan_split_launch_takes_two_stages():
    """Head dim 128, 16-bit: three pipeline stages without splits, two once the launch splits
    (a caller's config is kept as given). Rows in a table of more than BALANCE_ABOVE_TOKENS
    tokens take the balanced launch; in a table of at most that many, fixed splits.
    Planted, reverted: the table bound left out of ``balances``: failed."""
    from nanoserve.kernels.triton_decode import BALANCE_ABOVE_TOKENS, decode_plan

    wide = BALANCE_ABOVE_TOKENS // 16 + 1 - 7  # columns past the longest row's 7 blocks
    key_cache, _, tables, _ = make_paged_kv([100, 3], 2, 128, 16, torch.float16, extra_columns=wide)
    query = torch.randn(2, 8, 128).to(torch.float16)
    assert decode_plan(query, key_cache, tables, num_splits=1) == (64, 4, 3, 1, 0, 0, False)
    assert decode_plan(query, key_cache, tables, num_splits=2) == (64, 4, 2, 2, 0, 0, False)
    plan = decode_plan(query, key_cache, tables)  # balanced: may split any row
    assert plan.work_items > 0 and plan[:4] == (64, 4, 2, 0)
    short = decode_plan(query, key_cache, tables[:, : BALANCE_ABOVE_TOKENS // 16])
    assert short.work_items == 0 and short.num_splits > 1 and short[:3] == (64, 4, 2)
    alone = decode_plan(query[:1], key_cache, tables[:1])  # one row: fixed splits
    assert alone.work_items == 0 and alone.num_splits > 1 and alone[:3] == (64, 4, 2)
    config = (64, 4, 3)
    given = decode_plan(query, key_cache, tables, config=config, num_splits=4)
    assert given == (64, 4, 3, 4, 0, 0, False)


def test_decode_plan_int8_fixed_splits_load_block_ids_ahead():
    """INT8 pools under 16-bit queries in fixed splits: block ids a step ahead and three
    stages (a second K/V buffer); the balanced launch, float32 queries, 16-bit and FP8 pools
    and a caller's config keep the ids in the loop. Planted, reverted: the rule on for the
    balanced launch too: failed."""
    from nanoserve.kernels.quant import FP8_DTYPE, INT8_DTYPE
    from nanoserve.kernels.triton_decode import BALANCE_ABOVE_TOKENS, decode_plan

    wide = BALANCE_ABOVE_TOKENS // 16 + 1 - 7
    pool, _, tables, _ = make_paged_kv([100, 3], 2, 128, 16, torch.float16, extra_columns=wide)
    int8_pool = pool.to(INT8_DTYPE)
    query = torch.randn(2, 8, 128).to(torch.float16)
    for splits in (1, 2, 4):
        plan = decode_plan(query, int8_pool, tables, num_splits=splits)
        assert plan.table_ahead and plan.num_stages == 3 and plan.num_splits == splits
    short = decode_plan(query, int8_pool, tables[:, : BALANCE_ABOVE_TOKENS // 16])
    assert short.work_items == 0 and short.table_ahead and short.num_stages == 3
    balanced = decode_plan(query, int8_pool, tables)
    assert balanced.work_items > 0 and not balanced.table_ahead and balanced.num_stages == 2
    assert not decode_plan(query.float(), int8_pool, tables, num_splits=2).table_ahead
    assert not decode_plan(query, pool, tables, num_splits=2).table_ahead
    assert not decode_plan(query, pool.to(FP8_DTYPE), tables, num_splits=2).table_ahead
    given = decode_plan(query, int8_pool, tables, config=(64, 4, 2), num_splits=2)
    assert given == (64, 4, 2, 2, 0, 0, False)


def test_decode_plan_rows_of_one_length_take_the_fixed_splits():
    """Where the balanced launch would run, rows the caller says are of one length take the
    fixed splits with ``choose_num_splits``' count; a given ``work_items`` or ``num_splits``
    is still kept. Planted, reverted: the hint left out of ``decode_plan``: failed."""
    from nanoserve.kernels.triton_decode import (
        BALANCE_ABOVE_TOKENS,
        choose_num_splits,
        decode_plan,
    )

    wide = BALANCE_ABOVE_TOKENS // 16 + 1 - 7
    key_cache, _, tables, _ = make_paged_kv(
        [100, 100], 2, 128, 16, torch.float16, extra_columns=wide
    )
    query = torch.randn(2, 8, 128).to(torch.float16)
    assert decode_plan(query, key_cache, tables).work_items > 0
    told = decode_plan(query, key_cache, tables, equal_lengths=True)
    splits = choose_num_splits(2, 2, tables.shape[1] * 16, told.block_n, query.device)
    assert told.work_items == 0 and told.num_splits == splits > 1, told
    assert decode_plan(query, key_cache, tables, work_items=5, equal_lengths=True).work_items == 5
    given = decode_plan(query, key_cache, tables, num_splits=3, equal_lengths=True)
    assert given.num_splits == 3 and given.work_items == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_splits_past_the_tiles_are_empty_and_exact(dtype, poison_outputs, monkeypatch):
    """A table of 768 tokens (6 or 12 tiles, not a power of two) takes the power of two of
    splits at or above its tiles: the splits past the last tile see no key and weigh
    nothing in the merge; rows of 600, 1 and 767 tokens match the reference (an H100's
    SM count; planted, reverted: the merge weighing the empty splits' zeros as keys)."""
    from nanoserve.kernels import triton_decode as decode
    from nanoserve.kernels.triton_decode import decode_plan

    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    lens = [600, 1, 767]
    key_cache, _, tables, _ = make_paged_kv(lens, 2, 64, 16, dtype, extra_columns=0)
    assert tables.shape[1] * 16 == 768
    query = torch.randn(len(lens), 8, 64).to(dtype)
    plan = decode_plan(query, key_cache, tables)
    tiles = cdiv(768, plan.block_n)
    assert plan.work_items == 0 and plan.num_splits == next_pow2(tiles) > tiles, plan
    out, ref = _launch(lens, 2, 4, dtype, extra_columns=0)
    assert row_errors(out.float(), ref.float()).max() < TOLERANCE[dtype]


@pytest.mark.parametrize("lens", [[300, 300, 300], [300, 1, 2000]], ids=["equal", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_told_rows_of_one_length_is_exact_even_when_wrong(lens, dtype, poison_outputs):
    """The fixed-split launch the hint picks, over a table wide enough for the balanced
    one, matches the reference on rows of one length and, told wrongly, on ragged rows (a
    hint costs time, never exactness): every row's own length bounds its splits."""
    from nanoserve.kernels.triton_decode import BALANCE_ABOVE_TOKENS

    columns = BALANCE_ABOVE_TOKENS // 16 + 1 - cdiv(max(lens), 16)
    out, ref = _launch(lens, 2, 4, dtype, extra_columns=columns, equal_lengths=True)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert row_errors(out.float(), ref.float()).max() < TOLERANCE[dtype]


def test_checked_decode_reads_whether_the_rows_are_of_one_length(monkeypatch):
    """``paged_decode_attention`` with its check (which copies the lengths to the host)
    tells the launch whether they are all equal; without the check only a caller's hint
    does; a caller's hint is kept. Planted, reverted: the check's lengths not passed on
    (always False): failed."""
    from nanoserve.kernels import triton_decode

    told = []

    def record(*args, equal_lengths, **kwargs):
        told.append(equal_lengths)
        return args[0].clone()

    monkeypatch.setattr(triton_decode, "paged_decode_attention_triton", record)
    for lens in ([5, 5, 5], [5, 6, 5], [9]):
        args = make_paged_kv(lens, 1, 16, 4, torch.float32)
        query = torch.randn(len(lens), 2, 16)
        paged_decode_attention(query, *args, backend="triton")
        paged_decode_attention(query, *args, backend="triton", check=False)
        paged_decode_attention(query, *args, backend="triton", equal_lengths=False)
    assert told == [True, False, False, False, False, False, True, False, False]


@pytest.mark.parametrize("num_kv_heads", [1, 4, 8])
@pytest.mark.parametrize("kind", ["equal", "near-equal", "ragged"])
def test_decode_balanced_few_rows_keep_to_their_programs(kind, num_kv_heads, monkeypatch):
    """Up to MANY_ROWS rows: whatever their lengths, the balanced plan's items (each row
    rounded up to whole items, as the kernel cuts them) stay within the programs per SM it
    targets, so equal rows never spill into a second wave. Planted bug, reverted: the target
    without the rows taken off (``return max(1, target)``) failed 7 of these 9 cases, among
    them equal rows with 4 and 8 KV heads (9 items a row where 8 fill the target)."""
    from nanoserve.kernels import triton_decode as decode

    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    gen = torch.Generator().manual_seed(num_kv_heads)
    for rows in (2, 3, 8, 13, decode.MANY_ROWS):
        if kind == "equal":
            lens = [32768] * rows
        elif kind == "near-equal":
            lens = (32000 + torch.randint(0, 769, (rows,), generator=gen)).tolist()
        else:
            lens = torch.randint(1, 40000, (rows,), generator=gen).tolist()
        target = decode.choose_work_items(rows, num_kv_heads, torch.device("cpu"))
        chunk = balanced_chunk(lens, None, 64, target)
        items = sum(max(cdiv(n, chunk), 1) for n in lens)
        per_sm = decode.WORK_ITEMS_PER_SM_MANY_ROWS if rows >= decode.MANY_ROWS else 4
        assert items <= cdiv(per_sm * 132, num_kv_heads), (rows, lens, target, items)


def test_decode_split_count_rule(monkeypatch):
    """Fixed splits from shapes: about four programs per SM below one wave, never more
    splits than the power of two at or above the tiles, and past MAX_SPLITS only while each
    split keeps LONG_SPLIT_TOKENS tokens (a row of 8k tokens or more with four KV heads
    takes 128, if it has that many tiles; with eight KV heads, or at 4k, 64). Planted bugs,
    reverted: the cap at MAX_SPLITS alone failed (32k tokens, four KV heads: 64); the
    twenty-ninth session's four tiles a split failed (8k and 16k tokens of 64-token tiles,
    32k of 128-token tiles: 64); the tiles rounded down, as before, failed (768 tokens: 4)."""
    from nanoserve.kernels import triton_decode as decode

    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    cases = [  # (rows, KV heads, table tokens, BLOCK_N) -> splits
        ((1, 4, 32768, 64), 128),
        ((1, 8, 32768, 64), 64),
        ((1, 4, 16384, 64), 128),
        ((1, 4, 8192, 64), 128),
        ((1, 4, 4096, 64), 64),
        ((1, 2, 131072, 64), 128),
        ((1, 4, 32768, 128), 128),
        ((1, 2, 16384, 128), 128),
        ((1, 4, 8192, 128), 64),
        ((1, 1, 8192, 32), 128),
        ((1, 1, 4096, 32), 64),
        ((1, 1, 1024, 64), 16),
        ((1, 8, 768, 128), 8),  # 6 tiles: a tile a split (two empty), not 4 of two tiles
        ((1, 8, 1536, 128), 16),
        ((4, 8, 640, 128), 8),
        ((16, 8, 768, 128), 4),  # the target (5) binds first
        ((2, 2, 65536, 64), 128),
        ((8, 8, 32768, 64), 8),
        ((200, 8, 4096, 64), 1),
    ]
    for (rows, heads, tokens, block_n), splits in cases:
        got = decode.choose_num_splits(rows, heads, tokens, block_n, cpu)
        assert got == splits, (rows, heads, tokens, block_n, got)


def test_merge_lanes_per_program():
    """The fixed-split merge reads at most REDUCE_TILE_ELEMENTS partial values a program
    (whole head dims for few splits, lanes cut across programs for many), never fewer than
    REDUCE_MIN_LANES lanes, and the lanes divide the padded head dim."""
    from nanoserve.kernels.triton_decode import REDUCE_TILE_ELEMENTS, reduce_lanes

    cases = [((128, 128), 16), ((64, 128), 32), ((8, 64), 64), ((3, 128), 128), ((256, 256), 16),
             ((16, 128), 128), ((32, 128), 64), ((2, 16), 16)]  # fmt: skip
    for (splits, d_pad), lanes in cases:
        got = reduce_lanes(splits, d_pad)
        assert got == lanes and d_pad % got == 0, (splits, d_pad, got)
        assert got == 16 or got == d_pad or got * splits <= REDUCE_TILE_ELEMENTS


def test_programmatic_dependent_launch_only_on_nvidia(monkeypatch):
    from nanoserve.kernels.dispatch import supports_pdl

    assert supports_pdl(torch.device("cpu")) is False
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter, even with CUDA tensors
    assert supports_pdl(torch.device("cuda", 0)) is False
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert supports_pdl(torch.device("cuda", 0)) is False


def test_split_decode_launches_its_merge_with_pdl_where_supported(monkeypatch):
    """With PDL supported, the split kernel signals its dependents and the merge launch
    carries launch_pdl (the merge then waits on the device), for fixed splits and for the
    balanced launch; a row in one run is launched with PDL too (``test_pdl.py``)."""
    import nanoserve.kernels.dispatch as dispatch
    import nanoserve.kernels.triton_decode as triton_decode

    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, kwargs))

    monkeypatch.setattr(dispatch, "supports_pdl", lambda device: True)
    monkeypatch.setattr(triton_decode, "_decode_kernel", Recorder("split"))
    monkeypatch.setattr(triton_decode, "_reduce_kernel", Recorder("merge"))
    monkeypatch.setattr(triton_decode, "_merge_items_kernel", Recorder("merge items"))
    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        [100, 7], 2, 64, 16, torch.float16, extra_columns=triton_decode.BALANCE_ABOVE_TOKENS // 16
    )  # a table long enough for the balanced launch
    query = torch.randn(2, 8, 64).to(torch.float16)
    for splits in (4, 1, None):
        triton_decode.paged_decode_attention_triton(
            query, key_cache, value_cache, tables, seq_lens, scale=0.125,
            sliding_window=None, softcap=None, num_splits=splits,
        )  # fmt: skip
    names = [name for name, _ in launches]
    assert names == ["split", "merge", "split", "split", "merge items"]
    (_, split_kw), (_, merge_kw), (_, alone_kw), (_, items_kw), (_, merge_items_kw) = launches
    assert split_kw["PDL"] and merge_kw["PDL"] and merge_kw["launch_pdl"] is True
    assert alone_kw["PDL"] and alone_kw["launch_pdl"] is True  # (after the step's scatter)
    assert items_kw["PDL"] and items_kw["BALANCED"] and merge_items_kw["launch_pdl"] is True
