"""GQA-packed split-KV extend attention (triton_verify.py): Triton (interpreter) against the
float64 reference, and the launcher's routing by ``max_query_len``."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import (
    TOLERANCE,
    make_paged_kv,
    needs_interpreter,
    poison_hidden,
    row_errors,
    spy_packed,
)

from nanoserve.kernels import paged_extend_attention, paged_extend_attention_ref
from nanoserve.kernels import triton_verify as verify
from nanoserve.kernels.triton_verify import paged_extend_attention_packed

pytestmark = needs_interpreter

# (num_kv_heads, group, head_dim, block_size, history_lens, new_lens, window, softcap,
#  (BLOCK_M, BLOCK_N, warps, stages) or None, splits or None)
CASES = {
    # lengths 1, bs - 1, bs, bs + 1 as history and as whole sequences; one row of 0 new tokens
    "edges-gqa8-d64": (1, 8, 64, 16, [0, 14, 16, 17, 15, 5], [1, 1, 1, 4, 2, 0], None, None,
                       None, 3),
    "verify-gqa4-d128": (2, 4, 128, 16, [17, 40, 63, 1], [2, 8, 4, 3], None, None, None, None),
    "mha-d96-softcap": (2, 1, 96, 16, [50, 0, 17], [3, 2, 8], None, 20.0, None, 2),
    # GQA 7: a 16-row tile holds 2 tokens x 7 heads and 2 padding rows
    "gqa7-d80-window": (1, 7, 80, 8, [30, 0, 5], [5, 9, 0], 12, None, (16, 16, 4, 1), 2),
    "d256-window-softcap": (2, 2, 256, 16, [100, 33], [5, 2], 37, 10.0, (16, 32, 4, 1), 4),
    # seq_len 0 rows (all padding): no output rows
    "empty-rows": (1, 4, 64, 8, [0, 9, 0, 0], [0, 4, 0, 5], 6, None, None, 2),
}  # fmt: skip


def _inputs(num_kv_heads, group, head_dim, block_size, history, new, dtype):
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        lens, num_kv_heads, head_dim, block_size, dtype
    )
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim).to(dtype)
    return query, key_cache, value_cache, tables, seq_lens, cu


def _reference(query, key_cache, value_cache, tables, seq_lens, cu, window, softcap):
    return paged_extend_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens, cu,
        sliding_window=window, softcap=softcap,
    )  # fmt: skip


def _assert_rows_close(out, ref, dtype):
    """Every (token, head) row on its own: one wrong row cannot hide in a norm."""
    err = row_errors(out, ref)
    assert out.dtype == dtype and out.shape == ref.shape
    token, head = divmod(int(err.argmax()), err.shape[1])
    assert err.max() < 5 * TOLERANCE[dtype], f"token {token}, head {head}: {err.max():.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_packed_matches_reference(case, dtype, poison_outputs):
    hkv, group, dim, bs, history, new, window, softcap, config, splits = CASES[case]
    args = _inputs(hkv, group, dim, bs, history, new, dtype)
    ref = _reference(*args, window, softcap)
    out = paged_extend_attention_packed(
        *args, scale=dim**-0.5, sliding_window=window, softcap=softcap,
        max_query_len=max(new), config=config, num_splits=splits,
    )  # fmt: skip
    _assert_rows_close(out, ref, dtype)


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("window", [None, 29])
def test_packed_many_tiles_per_sequence(splits, window, poison_outputs):
    """Sequences longer than a tile (4 tokens x 4 heads): several tiles per sequence, each
    with its own diagonal, unmasked run and window edge, cut into splits that do not line
    up with them; the last split of a short tile holds no key at all."""
    hkv, group, dim = 2, 4, 64
    history, new = [45, 0, 7, 70], [13, 21, 1, 6]
    args = _inputs(hkv, group, dim, 16, history, new, torch.float32)
    ref = _reference(*args, window, None)
    out = paged_extend_attention_packed(
        *args, scale=dim**-0.5, sliding_window=window, softcap=None,
        config=(16, 16, 4, 1), num_splits=splits,
    )  # fmt: skip
    _assert_rows_close(out, ref, torch.float32)


@pytest.mark.parametrize("splits", [2, 4])
def test_a_row_that_sees_no_key_gives_zeros_at_any_split_count(splits, poison_outputs):
    """Input the argument check refuses (seq_len 0 under a new token), reachable with
    ``check=False``: the row sees no key, and merged splits give the zeros one split gives,
    not NaN; the other rows keep the reference's values."""
    history, new = [20, 0, 9], [3, 1, 2]
    query, key_cache, value_cache, tables, seq_lens, cu = _inputs(
        1, 4, 64, 8, history, new, torch.float32
    )
    ref = _reference(query, key_cache, value_cache, tables, seq_lens, cu, None, None)
    seq_lens[1] = 0
    opts = dict(scale=64**-0.5, sliding_window=None, softcap=None, config=(16, 16, 4, 1))
    args = (query, key_cache, value_cache, tables, seq_lens, cu)
    one = paged_extend_attention_packed(*args, **opts, num_splits=1)
    split = paged_extend_attention_packed(*args, **opts, num_splits=splits)
    assert torch.equal(one[3], torch.zeros_like(one[3]))
    assert torch.equal(split[3], one[3])
    kept = torch.tensor([0, 1, 2, 4, 5])
    _assert_rows_close(split[kept], ref[kept], torch.float32)


def test_packed_ignores_nan_outside_the_window(poison_outputs):
    """K/V that no new token's window reaches are never read: NaN there changes nothing."""
    history, new, window = [60, 33, 5], [6, 1, 9], 17
    args = _inputs(1, 4, 64, 8, history, new, torch.float32)
    query, key_cache, value_cache, tables, seq_lens, cu = args
    lens = [h + n for h, n in zip(history, new, strict=True)]
    opts = dict(scale=64**-0.5, sliding_window=window, softcap=None, num_splits=3)
    clean = paged_extend_attention_packed(*args, **opts)
    poisoned = paged_extend_attention_packed(
        query,
        poison_hidden(key_cache, tables, lens, new, window),
        poison_hidden(value_cache, tables, lens, new, window),
        tables, seq_lens, cu, **opts,
    )  # fmt: skip
    assert torch.isfinite(clean).all()
    assert torch.equal(poisoned, clean)


def test_max_query_len_routes_to_the_packed_kernel(monkeypatch, poison_outputs):
    """A small max_query_len takes the packed kernel, None keeps the extend tiles; a bound
    below the true maximum only changes the kernel, never the result."""
    calls = spy_packed(monkeypatch, "max_query_len")
    args = _inputs(2, 4, 64, 16, [17, 40, 3], [2, 5, 20], torch.float32)
    ref = _reference(*args, None, None)
    for max_query_len, packed in ((None, False), (20, False), (5, True), (1, True)):
        calls.clear()
        out = paged_extend_attention(*args, backend="triton", max_query_len=max_query_len)
        assert calls == ([max_query_len] if packed else [])
        _assert_rows_close(out, ref, torch.float32)


def test_routes_table_picks_kernel_and_config(monkeypatch, poison_outputs):
    """An entry of ROUTES for a call's route_key sends it to the packed kernel (its config
    and splits) or to the extend tiles at a fixed config, without max_query_len."""
    from nanoserve.kernels import triton_extend

    calls = spy_packed(monkeypatch, "config", "num_splits")
    args = _inputs(2, 4, 64, 16, [17, 0], [30, 20], torch.float32)
    ref = _reference(*args, 9, None)
    key = triton_extend.route_key(args[0], 2, 9, None)
    assert key == triton_extend.route_key(args[0], 2, 10, None)  # no window size in the key
    assert key != triton_extend.route_key(args[0], 2, None, None)
    monkeypatch.setitem(triton_extend.ROUTES, key, ("packed", (16, 16, 4, 1), 2))
    out = paged_extend_attention(*args, sliding_window=9, backend="triton")
    assert calls == [((16, 16, 4, 1), 2)]
    _assert_rows_close(out, ref, torch.float32)
    monkeypatch.setitem(triton_extend.ROUTES, key, ("tiles", (32, 16, 4, 1)))
    out = paged_extend_attention(*args, sliding_window=9, backend="triton")
    assert len(calls) == 1
    _assert_rows_close(out, ref, torch.float32)
    # few new tokens have their own key: its entry sets the packed config and splits
    few = triton_extend.route_key(args[0], 2, 9, None, max_query_len=30)
    assert few == key  # 30 new tokens are not few
    few = triton_extend.route_key(args[0], 2, 9, None, max_query_len=1)
    assert few != key
    monkeypatch.setitem(triton_extend.ROUTES, few, ("packed", (32, 16, 4, 1), 3))
    calls.clear()
    out = paged_extend_attention(*args, sliding_window=9, backend="triton", max_query_len=1)
    assert calls == [((32, 16, 4, 1), 3)]
    _assert_rows_close(out, ref, torch.float32)  # a bound below the truth: still right


def test_turns_over_history_route_to_the_packed_kernel_split(monkeypatch, poison_outputs):
    """17..TURN_MAX_QUERY_LEN new tokens over a history long enough to split (here 16 keys a
    split) take the packed kernel with turn_plan's count, in 16-bit dtypes; no bound, a
    longer one, float32, or a history too short to split keep the extend tiles."""
    from nanoserve.kernels import triton_extend

    calls = spy_packed(monkeypatch, "num_splits")
    monkeypatch.setattr(verify, "TURN_SPLIT_KEYS", 16)
    history, new = [50, 9], [20, 18]
    for dtype in (torch.float16, torch.float32):
        args = _inputs(1, 4, 64, 16, history, new, dtype)
        ref = _reference(*args, None, None)
        for max_query_len in (None, 20, 17, 40, triton_extend.TURN_MAX_QUERY_LEN + 1):
            calls.clear()
            out = paged_extend_attention(*args, backend="triton", max_query_len=max_query_len)
            turn = dtype == torch.float16 and max_query_len in (20, 17, 40)
            splits = verify.turn_plan(args[0], args[1], args[3], 20, None)[1]
            assert splits > 1
            assert calls == ([splits] if turn else []), (dtype, max_query_len)
            _assert_rows_close(out, ref, dtype)
    monkeypatch.setattr(verify, "TURN_SPLIT_KEYS", 512)  # 80 keys: too few to split
    calls.clear()
    args = _inputs(1, 4, 64, 16, history, new, torch.float16)
    paged_extend_attention(*args, backend="triton", max_query_len=20)
    assert calls == []


# (num_kv_heads, group, head_dim, history_lens, new_lens, window, softcap): turns the CPU
# routes once it counts a GPU's SMs
TURNS = {
    "window-narrower-than-a-tile": (2, 4, 64, [40, 3], [20, 19], 5, None),
    "gqa7-d80-softcap": (1, 7, 80, [30, 60], [17, 25], None, 20.0),
    "gqa32-d128": (1, 32, 128, [45], [18], None, None),
    "mha-d96-window": (3, 1, 96, [70, 0], [33, 21], 40, None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TURNS), ids=list(TURNS))
def test_routed_turns_match_reference(case, monkeypatch, poison_outputs):
    """Turns the route splits (132 SMs counted, 8 keys a split): GQA 1/4/7/32, head dims
    64-128, windows narrower than a tile, soft-cap; every row against float64."""
    hkv, group, dim, history, new, window, softcap = TURNS[case]
    monkeypatch.setattr(verify, "sm_count", lambda device: 132)
    monkeypatch.setattr(verify, "TURN_SPLIT_KEYS", 8)
    calls = spy_packed(monkeypatch, "num_splits")
    args = _inputs(hkv, group, dim, 16, history, new, torch.float16)
    ref = _reference(*args, window, softcap)
    out = paged_extend_attention(
        *args, sliding_window=window, softcap=softcap, backend="triton", max_query_len=max(new)
    )
    assert calls == [verify.turn_plan(args[0], args[1], args[3], max(new), window)[1]]
    assert calls[0] > 1
    _assert_rows_close(out, ref, torch.float16)


def test_a_packed_tile_the_device_cannot_launch_falls_back_to_the_tiles(
    monkeypatch, poison_outputs
):
    """OutOfResources from the packed launch (a tile too large for another GPU's shared
    memory) leaves the turn to the extend tiles, and later calls of that tile skip it."""
    from triton.runtime.errors import OutOfResources

    from nanoserve.kernels import triton_extend

    launches = []

    def too_large(*args, **kwargs):
        launches.append(kwargs["config"])
        raise OutOfResources(232448, 101376, "shared memory")

    monkeypatch.setattr(verify, "paged_extend_attention_packed", too_large)
    monkeypatch.setattr(verify, "TURN_SPLIT_KEYS", 16)
    monkeypatch.setattr(triton_extend, "_UNFIT", set())
    args = _inputs(1, 4, 64, 16, [50, 9], [20, 18], torch.float16)
    ref = _reference(*args, None, None)
    for _ in range(2):
        out = paged_extend_attention(*args, backend="triton", max_query_len=20)
        _assert_rows_close(out, ref, torch.float16)
    unfit = triton_extend._UNFIT
    assert len(launches) == 1 and unfit == {(args[0].device, ("packed", *launches[0]))}


def test_turn_plan_splits_follow_the_history_and_the_programs(monkeypatch):
    """More keys in the tables mean more splits, more programs (rows, KV heads) fewer; a
    window caps the history; a power of two, within [1, MAX_SPLITS]."""
    monkeypatch.setattr(verify, "TURN_SPLIT_KEYS", 16)

    def splits(rows, width, hkv=1, dim=64, window=None, new=20):
        query = torch.zeros(rows * new, hkv * 4, dim, dtype=torch.float16)
        pools = torch.zeros(1, 16, hkv, dim, dtype=torch.float16)
        tables = torch.zeros(rows, width, dtype=torch.int32)
        return verify.turn_plan(query, pools, tables, new, window)[1]

    by_width = [splits(1, w) for w in (1, 2, 4, 8, 64)]
    assert by_width == sorted(by_width) and by_width[0] == 1 and by_width[-1] > 2
    by_rows = [splits(r, 64) for r in (1, 2, 4, 8)]
    assert by_rows == sorted(by_rows, reverse=True) and by_rows[-1] == 1
    assert splits(1, 64, hkv=4) < splits(1, 64)
    assert splits(1, 64, window=10) < splits(1, 64)
    for count in by_width + by_rows:
        assert 1 <= count <= verify.MAX_SPLITS and count & (count - 1) == 0


# (rows, new tokens, history, head_dim) -> (tile rows, splits) on 132 SMs, 32 query / 8 KV
# heads, block 16: the turn classes of benchmarks/bench_extend_classes.py
TURN_PLANS = {
    (1, 64, 2048, 64): (64, 4),  # 128-row tiles: 16 programs x 5 key splits < 132
    (1, 32, 2048, 64): (64, 4),
    (4, 64, 2048, 64): (128, 4),  # 64 programs x 5 >= 132: the default tile
    (2, 128, 2048, 64): (128, 4),
    (1, 64, 8192, 64): (128, 16),
    (1, 64, 2048, 128): (64, 4),  # past head dim 64 always the narrow tile
    (4, 64, 2048, 128): (64, 2),  # 128 programs, two resident an SM
    (1, 64, 2048, 96): (64, 4),
}


@pytest.mark.parametrize("shape", list(TURN_PLANS), ids=[str(k) for k in TURN_PLANS])
def test_turn_plan_narrows_the_tile_where_the_default_leaves_sms_idle(shape, monkeypatch):
    """The 64-row tile past head dim 64 and where 128-row tiles split by the keys give
    fewer programs than SMs; its splits fill the programs an SM holds (``resident_programs``)."""
    monkeypatch.setattr(verify, "sm_count", lambda device: 132)
    rows, new, history, dim = shape
    query = torch.zeros(rows * new, 32, dim, dtype=torch.float16)
    pools = torch.zeros(1, 16, 8, dim, dtype=torch.float16)
    tables = torch.zeros(rows, -(-(history + new) // 16), dtype=torch.int32)
    config, splits = verify.turn_plan(query, pools, tables, new, None)
    assert (config[0], splits) == TURN_PLANS[shape]


def test_turn_plan_keeps_the_default_tile_for_groups_past_its_rows(monkeypatch):
    """A GQA group wider than the narrow tile's rows (one token's heads must fit a tile)."""
    monkeypatch.setattr(verify, "sm_count", lambda device: 132)
    query = torch.zeros(20, 128, 128, dtype=torch.float16)
    pools = torch.zeros(1, 16, 1, 128, dtype=torch.float16)
    tables = torch.zeros(1, 200, dtype=torch.int32)
    config, splits = verify.turn_plan(query, pools, tables, 20, None)
    assert config[0] >= 128 and splits > 1


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "5"])
def test_bad_max_query_len(bad):
    args = _inputs(1, 2, 64, 16, [3], [2], torch.float32)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_extend_attention(*args, backend="triton", max_query_len=bad)


def test_packed_config_too_small_for_the_group():
    """A tile of fewer rows than 16 or than the GQA group cannot hold one token's heads."""
    args = _inputs(1, 8, 64, 16, [3], [2], torch.float32)
    for config in ((4, 16, 4, 1), (16, 16, 4, 1)):
        small = _inputs(1, 32, 64, 16, [3], [2], torch.float32) if config[0] == 16 else args
        with pytest.raises(ValueError, match="config"):
            paged_extend_attention_packed(
                *small, scale=0.125, sliding_window=None, softcap=None, config=config
            )


def test_packed_splits_fill_whole_waves(monkeypatch):
    """The rule's picks on five verify shapes of the H100 sweep (132 SMs, 1-16 splits;
    benchmarks/RESULTS.md, forty-sixth session), each within 1% of the sweep's fastest: a
    count whose programs leave a last wave part-filled loses to fewer splits, and of equal
    costs the fewest splits win. Planted: the old rule (four programs an SM) gave 5, 3, 3, 17
    and 9; ties to the most splits failed the tie's assertion."""
    monkeypatch.setattr(verify, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    # (busy programs, key tiles of 64, resident programs an SM) -> splits
    assert verify.packed_splits(128, 63, 2, cpu) == 2  # 32 x 5 over 4,000, 28 / 4, d128
    assert verify.packed_splits(256, 32, 2, cpu) == 1  # 64 x 3 over 2,000
    assert verify.packed_splits(256, 63, 3, cpu) == 3  # 32 x 5 over 4,000, 32 / 8, d64
    assert verify.packed_splits(32, 47, 2, cpu) == 8  # 16 x 8 over 3,000, 12 / 2
    assert verify.packed_splits(64, 126, 3, cpu) == 6  # 8 x 4 over 8,000, 32 / 8
    assert verify.packed_splits(1, 500, 2, cpu) == verify.MAX_SPLITS
    assert verify.packed_splits(1, 3, 2, cpu) == 3  # 3 to 32 splits all cost 1 + 2 tiles
    assert verify.packed_splits(5000, 500, 2, cpu) == 1
    for programs in (1, 3, 100, 264, 265, 1000):
        for tiles in (1, 2, 63, 1000):
            assert 1 <= verify.packed_splits(programs, tiles, 2, cpu) <= verify.MAX_SPLITS


@pytest.mark.parametrize("window", [None, 12])
def test_the_launcher_hands_the_split_rule_its_shapes(window, monkeypatch, poison_outputs):
    """A launch with no split count asks ``packed_splits`` with the busy programs (tiles that
    hold tokens x KV heads), the key tiles the block tables hold (of BLOCK_N keys, not of the
    pool's blocks; a window caps them at the window plus the turn) and the tile's residency,
    and runs what it answers. Planted: key tiles counted in pool blocks, and the window's cap
    dropped: each failed its case."""
    asked = []
    real = verify.packed_splits

    def spy(programs, key_tiles, resident, device):
        asked.append((programs, key_tiles, resident))
        return real(programs, key_tiles, resident, device)

    monkeypatch.setattr(verify, "packed_splits", spy)
    history, new = [40, 7, 100], [3, 5, 2]
    args = _inputs(2, 4, 64, 8, history, new, torch.float32)
    width = args[3].shape[1]
    out = paged_extend_attention_packed(
        *args, scale=0.125, sliding_window=window, softcap=None, max_query_len=5,
        config=(16, 32, 4, 1),
    )  # fmt: skip
    # 16-row tiles hold 4 tokens of a 4-head group: the grid's 10 // 4 + 3 = 5 tiles are
    # fewer than the bound's 3 x 2, so 5 count as busy
    history_keys = width * 8 if window is None else 12 + 5
    assert asked == [(5 * 2, -(-history_keys // 32), 3)]
    _assert_rows_close(out, _reference(*args, window, None), torch.float32)


def test_resident_programs_of_the_compiled_tiles():
    """Programs an SM holds: the 16-, 32- and 64-row tiles' counts were read off their sm_90
    compiles (registers, shared memory); the 128-row ones are the turn rule's measured
    figures, head dim 80 pads to 128."""
    assert verify.resident_programs(16, 128) == 3 and verify.resident_programs(32, 64) == 3
    assert verify.resident_programs(32, 128) == 2 and verify.resident_programs(64, 128) == 2
    assert verify.resident_programs(64, 80) == 2 and verify.resident_programs(128, 64) == 2
    assert verify.resident_programs(128, 128) == 1
