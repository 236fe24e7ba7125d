"""Paged extend attention: Triton (interpreter) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import (
    TOLERANCE,
    make_paged_kv,
    needs_interpreter,
    poison_hidden,
    rel_err,
    row_errors,
    spy_extend_runs,
)

from nanoserve.kernels import paged_extend_attention, paged_extend_attention_ref, triton_extend
from nanoserve.kernels.triton_extend import paged_extend_attention_triton

pytestmark = needs_interpreter

# (num_kv_heads, group, head_dim, block_size, history_lens, new_lens, window, softcap)
CASES = {
    "prefill-edges": (2, 4, 64, 16, [0, 0, 0, 0], [1, 15, 16, 17], None, None),
    "gqa7-d80-window": (1, 7, 80, 8, [30, 0], [5, 40], 12, None),
    "mha-d96-softcap": (2, 1, 96, 16, [50, 0, 17], [3, 2, 8], None, 20.0),
    "gqa8-d128-prefix": (1, 8, 128, 32, [31], [33], None, None),
    "empty-seq-between": (1, 4, 64, 8, [9, 4, 0], [4, 0, 6], 7, 5.0),
    "speculative-verify": (2, 2, 64, 16, [17, 40, 63, 1], [2, 8, 4, 3], None, None),
    # seq_len 0 rows (no token yet, no new token: all padding) have no output rows
    "empty-rows": (1, 4, 64, 8, [0, 9, 0, 0], [0, 4, 0, 5], 6, None),
    "d8-gqa4": (2, 4, 8, 16, [0, 15], [17, 2], None, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_extend_matches_reference(case, dtype, poison_outputs):
    num_kv_heads, group, head_dim, block_size, history, new, window, softcap = CASES[case]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        lens, num_kv_heads, head_dim, block_size, dtype
    )
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim).to(dtype)
    ref = paged_extend_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens, cu,
        sliding_window=window, softcap=softcap,
    )  # fmt: skip
    out = paged_extend_attention(
        query, key_cache, value_cache, tables, seq_lens, cu,
        sliding_window=window, softcap=softcap, backend="triton",
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == query.shape
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("window", [None, 5])
def test_extend_one_token_each_equals_decode(window, poison_outputs):
    """One new token per sequence: the extend kernel, the decode kernel (split and not) and
    the decode reference all agree."""
    from nanoserve.kernels import paged_decode_attention, paged_decode_attention_ref
    from nanoserve.kernels.triton_decode import paged_decode_attention_triton

    key_cache, value_cache, tables, seq_lens = make_paged_kv([3, 26, 1], 2, 64, 8, torch.float32)
    query = torch.randn(3, 4, 64)
    cu = torch.arange(4, dtype=torch.int32)
    extend = paged_extend_attention(
        query, key_cache, value_cache, tables, seq_lens, cu, sliding_window=window,
        backend="triton",
    )  # fmt: skip
    args = (query, key_cache, value_cache, tables, seq_lens)
    decode = paged_decode_attention(*args, sliding_window=window, backend="triton")
    decode_split = paged_decode_attention_triton(
        *args, scale=64**-0.5, sliding_window=window, softcap=None, num_splits=2
    )
    ref = paged_decode_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens,
        sliding_window=window,
    )  # fmt: skip
    for out in (extend, decode, decode_split):
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
    torch.testing.assert_close(extend, decode, rtol=1e-5, atol=1e-6)


# (BLOCK_M, BLOCK_N, num_warps, num_stages): tiles that the lengths below never line up with,
# so every program has an unmasked run (keys wholly below the diagonal), a masked diagonal run
# and, with a window, a masked run at the window's lower edge.
TILES = [(16, 16, 4, 1), (32, 16, 4, 1), (16, 64, 4, 1), (64, 32, 4, 1)]


@pytest.mark.parametrize("tiles", TILES, ids=[f"m{t[0]}n{t[1]}" for t in TILES])
@pytest.mark.parametrize(
    ("head_dim", "window", "softcap"),
    [(64, None, None), (80, None, None), (64, 37, None), (80, 37, 10.0)],
    ids=["d64", "d80-padded", "d64-window", "d80-window-softcap"],
)
def test_extend_masked_unmasked_split(tiles, head_dim, window, softcap, poison_outputs):
    history, new = [100, 0, 45, 7, 0], [70, 83, 1, 50, 16]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(lens, 2, head_dim, 16, torch.float32)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), 4, head_dim)
    ref = paged_extend_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens, cu,
        sliding_window=window, softcap=softcap,
    )  # fmt: skip
    out = paged_extend_attention_triton(
        query, key_cache, value_cache, tables, seq_lens, cu, scale=head_dim**-0.5,
        sliding_window=window, softcap=softcap, config=tiles,
    )  # fmt: skip
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("tile_major", [False, True], ids=["tile-head-grid", "tile-major"])
@pytest.mark.parametrize("num_seqs", [1, 2, 7, 8, 9])
def test_extend_finds_each_tiles_sequence(num_seqs, tile_major, poison_outputs, monkeypatch):
    """The grid's tiles map to their sequences and heads for batch sizes at and around powers
    of two, in either program order."""
    families = frozenset({"fp32"}) if tile_major else frozenset()
    monkeypatch.setattr(triton_extend, "TILE_MAJOR_FAMILIES", families)
    new = torch.randint(0, 40, (num_seqs,)).tolist()
    new[0] = max(new[0], 1)
    history = torch.randint(1, 30, (num_seqs,)).tolist()
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(lens, 1, 64, 16, torch.float32)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), 6, 64)
    ref = paged_extend_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens, cu
    )
    out = paged_extend_attention_triton(
        query, key_cache, value_cache, tables, seq_lens, cu, scale=64**-0.5,
        sliding_window=None, softcap=None,
    )  # fmt: skip
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_extend_and_decode_kernels_ignore_nan_outside_the_window(poison_outputs):
    """K/V that no new token's window reaches are never read: NaN there changes nothing."""
    from nanoserve.kernels import paged_decode_attention

    history, new, window = [60, 33, 5], [6, 1, 9], 17
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(lens, 1, 64, 8, torch.float32)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), 2, 64)
    decode_q = torch.randn(len(lens), 2, 64)
    for q_lens, attend in (
        (new, lambda k, v: paged_extend_attention(
            query, k, v, tables, seq_lens, cu, sliding_window=window, backend="triton")),
        ([1] * 3, lambda k, v: paged_decode_attention(
            decode_q, k, v, tables, seq_lens, sliding_window=window, backend="triton")),
    ):  # fmt: skip
        clean = attend(key_cache, value_cache)
        poisoned = attend(
            poison_hidden(key_cache, tables, lens, q_lens, window),
            poison_hidden(value_cache, tables, lens, q_lens, window),
        )
        assert torch.isfinite(clean).all()
        assert torch.equal(poisoned, clean)


def _window_edge_tiles() -> list[tuple[int, int, int, int]]:
    """One tile for every BLOCK_N the launcher can pick (the CUDA autotune lists and the
    interpreter's tile), with the smallest BLOCK_M that goes with it: with at most 16 new
    tokens per sequence BLOCK_M does not move the window edge, BLOCK_N does. One warp count
    and one stage suffice under the interpreter."""
    from nanoserve.kernels.triton_extend import CUDA_CONFIGS, INTERPRETER_CONFIG

    tiles = [config[:2] for family in CUDA_CONFIGS.values() for config in family]
    tiles.append(INTERPRETER_CONFIG[:2])
    smallest_m = {n: min(m for m, n2 in tiles if n2 == n) for _, n in tiles}
    return [(m, n, 4, 1) for n, m in sorted(smallest_m.items())]


@pytest.mark.parametrize("tile", _window_edge_tiles(), ids=lambda t: f"m{t[0]}n{t[1]}")
def test_extend_window_edge_on_every_residue(tile, poison_outputs):
    """With a sliding window, keys from ``full_lo`` on are taken without a mask, so full_lo
    must not undershoot the last query row's window start ``ctx + q_end - window``. An
    off-by-one there errs only when that start falls on one residue modulo BLOCK_N, so one
    ragged batch puts it on every residue (history, new tokens and window all vary), with
    enough history below that the shifted tile lands in the unmasked run; rows are compared
    one by one, since one wrong key in one row vanishes in a norm over the batch.

    Planted bug: ``full_lo`` computed from ``ctx + q_end - window - 1`` (one token low) made
    this test fail for each BLOCK_N (edge residue 1, relative error 1e-2 to 5e-2 in one row)
    while every other extend test passed."""
    block_m, block_n = tile[:2]
    max_new = min(block_m, 16)
    history, new, windows = [], [], []
    for r in range(block_n):
        q_len = 1 + (5 * r) % max_new
        window = q_len + block_n + r % 3  # a whole tile between the edge and the diagonal
        edge = r + 1  # ctx + q_len - window: every residue modulo block_n once
        new.append(q_len)
        windows.append(window)
        history.append(edge + window - q_len)
    # one window for the launch: shift each sequence's history so its edge keeps its residue
    window = max(windows)
    history = [h + window - w for h, w in zip(history, windows, strict=True)]
    edges = [h + n - window for h, n in zip(history, new, strict=True)]
    assert sorted(e % block_n for e in edges) == list(range(block_n))
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(lens, 1, 16, 16, torch.float32)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), 1, 16)
    ref = paged_extend_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens, cu,
        sliding_window=window,
    )  # fmt: skip
    out = paged_extend_attention_triton(
        query, key_cache, value_cache, tables, seq_lens, cu, scale=16**-0.5,
        sliding_window=window, softcap=None, config=tile,
    )  # fmt: skip
    assert torch.isfinite(out).all()
    row_err = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)  # [tokens, heads]
    worst = int(row_err.amax(dim=1).argmax())
    seq = int(torch.searchsorted(cu, worst, right=True)) - 1
    assert row_err.max() < TOLERANCE[torch.float32], (
        f"token {worst} (sequence {seq}, edge residue {edges[seq] % block_n}): "
        f"relative error {row_err.max():.2e}"
    )


def test_a_routed_tile_the_device_cannot_hold_falls_back(monkeypatch, poison_outputs):
    """A fixed ROUTES tile that the device cannot launch (Triton's OutOfResources before
    anything runs: a tile picked on an H200 needs more shared memory than another GPU has)
    gives the call to what an unrouted call takes, and is not tried again on that device.

    Planted bugs: without the fallback the call raised OutOfResources; without remembering
    the tile, each call tried it again (the launches below were [32, 16, 32, 16])."""
    from triton.runtime.errors import OutOfResources

    history, new = [0, 20], [33, 5]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(lens, 2, 64, 16, torch.float32)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), 4, 64)
    args = (query, key_cache, value_cache, tables, seq_lens, cu)
    ref = paged_extend_attention_ref(*(a.double() if a.is_floating_point() else a for a in args))
    routed = (32, 16, 4, 1)
    key = triton_extend.route_key(query, len(new), None, None)
    monkeypatch.setitem(triton_extend.ROUTES, key, ("tiles", routed))
    monkeypatch.setattr(triton_extend, "_UNFIT", set())
    real, launched = triton_extend._extend_kernel, []

    class TooBigForThisDevice:
        def __getitem__(self, grid):
            def run(*a, **meta):
                launched.append(meta["BLOCK_M"])
                if meta["BLOCK_M"] == routed[0]:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return real[grid](*a, **meta)

            return run

    monkeypatch.setattr(triton_extend, "_extend_kernel", TooBigForThisDevice())
    for _ in range(2):
        out = paged_extend_attention_triton(
            *args, scale=64**-0.5, sliding_window=None, softcap=None
        )
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
    fallback = triton_extend.INTERPRETER_CONFIG[0]
    assert launched == [routed[0], fallback, fallback]


def _chunk_inputs(history, new, num_kv_heads=1, group=2, head_dim=64, block_size=16):
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        lens, num_kv_heads, head_dim, block_size, torch.float16
    )
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim).half()
    return query, key_cache, value_cache, tables, seq_lens, cu


# (num_kv_heads, group, head_dim, block_size, history_lens, new_lens, window, softcap): every
# split run kind: empty runs (more splits than key tiles), a run ending inside the diagonal,
# a window's masked edge cut by a split, an empty sequence between others
SPLIT_CASES = {
    "chunks-over-history": (2, 4, 64, 16, [100, 45, 0], [70, 1, 33], None, None),
    "gqa7-d80-window-softcap": (1, 7, 80, 8, [90, 0], [21, 40], 37, 10.0),
    "mha-d128-empty-between": (2, 1, 128, 16, [60, 5, 30], [17, 0, 3], None, None),
}


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("tile_major", [False, True], ids=["tile-head-grid", "tile-major"])
@pytest.mark.parametrize("case", list(SPLIT_CASES), ids=list(SPLIT_CASES))
def test_extend_split_over_keys_matches_reference(
    case, tile_major, splits, poison_outputs, monkeypatch
):
    """num_splits runs of key tiles per tile, merged: every row against float64 (float16
    partials); a run with no visible key weighs nothing. Planted: the runs' bounds off by
    one key tile (a tile skipped between runs): failed every case."""
    num_kv_heads, group, head_dim, block_size, history, new, window, softcap = SPLIT_CASES[case]
    families = frozenset({"fp32", "16bit-d64", "16bit-d128"}) if tile_major else frozenset()
    monkeypatch.setattr(triton_extend, "TILE_MAJOR_FAMILIES", families)
    args = _chunk_inputs(history, new, num_kv_heads, group, head_dim, block_size)
    ref = paged_extend_attention_ref(
        *(a.double() if a.is_floating_point() else a for a in args),
        sliding_window=window, softcap=softcap,
    )  # fmt: skip
    out = paged_extend_attention_triton(
        *args, scale=head_dim**-0.5,
        sliding_window=window, softcap=softcap, config=(16, 16, 4, 1), num_splits=splits,
    )  # fmt: skip
    assert out.dtype == torch.float16
    assert row_errors(out, ref).max() < TOLERANCE[torch.float16]


def test_extend_splits_fill_the_sms_while_runs_keep_their_keys(monkeypatch):
    """Fewer programs, or more keys in the tables, give more runs; a window caps the keys;
    a grid filling half the SMs gets 1; powers of two within [1, EXTEND_MAX_SPLITS]."""
    monkeypatch.setattr(triton_extend, "sm_count", lambda device: 132)
    monkeypatch.setattr(triton_extend, "EXTEND_SPLIT_KEYS", 64)

    def splits(new, width, heads=8, window=None, bound=True, block_m=64):
        query = torch.zeros(sum(new), heads, 64, dtype=torch.float16)
        tables = torch.zeros(len(new), width, dtype=torch.int32)
        max_query_len = max(new) if bound else None
        return triton_extend.extend_splits(query, tables, 16, block_m, window, max_query_len)

    assert splits([512], 256) == 2  # 8 tiles x 8 heads = 64 programs
    assert splits([512], 256, heads=4) == 4
    assert splits([512], 256, heads=2) == 8  # capped at EXTEND_MAX_SPLITS
    assert splits([512], 8) == 2 and splits([512], 4) == 1  # 128 / 64 keys a run
    assert splits([128], 256, heads=4) == 8
    assert splits([128], 256, heads=4, window=64) == 2  # 64 + 128 keys in reach
    assert splits([512], 256, heads=16) == 1  # 128 programs: the grid fills half the SMs
    # with no bound every sequence counts a tile more (the grid's idle tiles): 9 x 8 = 72
    assert splits([512], 256, bound=False) == 1
    assert splits([64] * 8, 256, heads=2, bound=False) == 4  # 16 tiles, 8 of them idle
    assert splits([64] * 8, 256, heads=2) == 8
    for count in (splits([100], w, heads=h) for w in (1, 9, 300) for h in (1, 3, 8, 40)):
        assert 1 <= count <= triton_extend.EXTEND_MAX_SPLITS and count & (count - 1) == 0


def test_a_routed_chunk_on_a_short_grid_splits_its_keys(monkeypatch, poison_outputs):
    """A routed (fixed-tile) call whose grid leaves SMs idle launches extend_splits' runs
    and matches float64 row by row; the same call with the grid full launches one.
    Planted: the route's count not passed to the launch: one run, the assert below failed."""
    monkeypatch.setattr(triton_extend, "sm_count", lambda device: 132)
    monkeypatch.setattr(triton_extend, "EXTEND_SPLIT_KEYS", 32)
    args = _chunk_inputs([150, 70], [40, 18])
    ref = paged_extend_attention_ref(*(a.double() if a.is_floating_point() else a for a in args))
    key = triton_extend.route_key(args[0], 2, None, None, 40)
    monkeypatch.setitem(triton_extend.ROUTES, key, ("tiles", (16, 16, 4, 1)))
    launched = spy_extend_runs(monkeypatch)
    out = paged_extend_attention(*args, backend="triton", max_query_len=40)
    expected = triton_extend.extend_splits(args[0], args[3], 16, 16, None, 40)
    assert expected > 1 and launched == [expected]
    assert row_errors(out, ref).max() < TOLERANCE[torch.float16]
    monkeypatch.setattr(triton_extend, "sm_count", lambda device: 4)
    launched.clear()
    out = paged_extend_attention(*args, backend="triton", max_query_len=40)
    assert launched == [1] and row_errors(out, ref).max() < TOLERANCE[torch.float16]
