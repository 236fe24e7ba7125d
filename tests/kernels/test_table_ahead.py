"""The extend and decode kernels with their block ids loaded a step ahead (extend's
``TABLE_AHEAD`` and the "tiles-ahead" routes that turn it on; decode's
``DecodePlan.table_ahead``): Triton (interpreter) against the float64 reference.
The flag moves each tile's table load one step earlier in the loop, so what these guard is
the tile whose ids are used: the first one (loaded before the loop), each next one, and the
last one (whose look-ahead reaches past the run and must be masked)."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import (
    TOLERANCE,
    check_decode_planted,
    make_paged_kv,
    needs_interpreter,
    rel_err,
)

from nanoserve.kernels import (
    paged_decode_attention_ref,
    paged_extend_attention_ref,
    triton_decode,
    triton_extend,
)
from nanoserve.kernels.triton_extend import paged_extend_attention_triton

pytestmark = needs_interpreter


@pytest.fixture
def table_ahead(monkeypatch):
    monkeypatch.setattr(triton_extend, "TABLE_AHEAD", True)


@pytest.fixture
def decode_ahead(monkeypatch):
    """Every decode launch plans its block ids a step ahead (the launcher's own tile, stages
    and splits otherwise)."""
    planned = triton_decode.decode_plan

    def ahead(*args, **kwargs):
        return planned(*args, **kwargs)._replace(table_ahead=True)

    monkeypatch.setattr(triton_decode, "decode_plan", ahead)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    ("window", "splits", "items"),
    [(None, 1, None), (None, 4, None), (300, 3, None), (None, None, 10**6), (150, None, 5)],
    ids=["nowin-1split", "nowin-4splits", "win300-3splits", "balanced-every-tile",
         "win150-balanced-5items"],
)  # fmt: skip
def test_decode_planted_key_dominates_with_ids_ahead(
    window, splits, items, block_size, decode_ahead, poison_outputs
):
    """One key per (sequence, KV head) dominates, at the newest and oldest visible
    positions and on both sides of every split or item boundary (``check_decode_planted``),
    with pages of 4 tokens (several pages a tile) and 16; the rows' splits run over several
    tiles, except the balanced launch's items of one tile each, where only the load before
    the loop is used.

    Planted bug: the look-ahead reading the tile after next (``pos + 2 * BLOCK_N``) failed
    every case but "balanced-every-tile"."""
    check_decode_planted(
        [700, 77, 300], 2, 2, 64, block_size, torch.float32,
        window=window, num_splits=splits, work_items=items, row_tol=1e-4,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_decode_with_ids_ahead_matches_reference(splits, dtype, decode_ahead, poison_outputs):
    """Rows of 1, a page - 1, a page, a page + 1 and several tiles, a window and a soft-cap,
    with the fixed-split and balanced launches.

    Planted bug: the look-ahead reading the tile after next: every case failed."""
    lens = [1, 15, 16, 17, 300]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(lens, 2, 80, 16, dtype)
    query = torch.randn(len(lens), 8, 80).to(dtype)
    for window, softcap in ((None, None), (40, 30.0)):
        ref = paged_decode_attention_ref(
            query.double(), key_cache.double(), value_cache.double(), tables, seq_lens,
            sliding_window=window, softcap=softcap,
        )  # fmt: skip
        out = triton_decode.paged_decode_attention_triton(
            query, key_cache, value_cache, tables, seq_lens, scale=80**-0.5,
            sliding_window=window, softcap=softcap, num_splits=splits,
        )  # fmt: skip
        assert rel_err(out, ref) < TOLERANCE[dtype]


# (BLOCK_M, BLOCK_N, num_warps, num_stages): the lengths below never line up with them, so
# programs have unmasked runs of one and of several tiles before their diagonal.
TILES = [(16, 16, 4, 1), (32, 16, 4, 1), (16, 64, 4, 1)]


@pytest.mark.parametrize("tiles", TILES, ids=[f"m{t[0]}n{t[1]}" for t in TILES])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    ("window", "softcap"), [(None, None), (200, 10.0)], ids=["causal", "window-softcap"]
)
def test_extend_with_table_ahead_matches_reference(
    tiles, block_size, window, softcap, table_ahead, poison_outputs
):
    """Every row against the float64 reference, one by one (one wrong tile of keys shows in
    its rows, not only in a norm over the batch).

    Planted bug: the look-ahead reading the tile after next (``pos + 2 * BLOCK_N``) failed
    every case here."""
    history, new = [300, 0, 45, 7, 0], [70, 83, 1, 50, 16]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(lens, 2, 64, block_size, torch.float32)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), 4, 64)
    ref = paged_extend_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens, cu,
        sliding_window=window, softcap=softcap,
    )  # fmt: skip
    out = triton_extend.paged_extend_attention_triton(
        query, key_cache, value_cache, tables, seq_lens, cu, scale=64**-0.5,
        sliding_window=window, softcap=softcap, config=tiles,
    )  # fmt: skip
    err = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    assert err.max() < TOLERANCE[torch.float32], f"worst row {int(err.max(1).values.argmax())}"


def _chunk_inputs(dtype):
    history, new = [0, 40], [33, 5]
    lens = [h + n for h, n in zip(history, new, strict=True)]
    key_cache, value_cache, tables, seq_lens = make_paged_kv(lens, 2, 64, 4, dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), 4, 64).to(dtype)
    return query, key_cache, value_cache, tables, seq_lens, cu


class _SpyKernel:
    """Stands for ``_extend_kernel``: records each launch's (BLOCK_M, TABLE_AHEAD), and
    raises Triton's OutOfResources for the tile in ``too_big`` (a device too small for it)."""

    def __init__(self, real, too_big=None):
        self.real, self.too_big, self.launches = real, too_big, []

    def __getitem__(self, grid):
        def run(*args, **meta):
            from triton.runtime.errors import OutOfResources

            self.launches.append((meta["BLOCK_M"], meta["TABLE_AHEAD"]))
            if meta["BLOCK_M"] == self.too_big:
                raise OutOfResources(300_000, 232_448, "shared memory")
            return self.real[grid](*args, **meta)

        return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_tiles_ahead_route_launches_with_the_ids_ahead(dtype, monkeypatch, poison_outputs):
    """A "tiles-ahead" route runs its tile with TABLE_AHEAD on, a "tiles" route and an
    unrouted call with it off; each gives the reference's rows. If the device cannot hold
    the routed tile, the fallback (what an unrouted call takes) runs with it off too.

    Planted bugs: the route's kind ignored (TABLE_AHEAD off on the tiles-ahead route) failed
    the first check; the fallback keeping the route's TABLE_AHEAD failed the last."""
    args = _chunk_inputs(dtype)
    ref = paged_extend_attention_ref(*(a.double() if a.is_floating_point() else a for a in args))
    key = triton_extend.route_key(args[0], 2, None, None)
    monkeypatch.setattr(triton_extend, "_UNFIT", set())
    spy = _SpyKernel(triton_extend._extend_kernel)
    monkeypatch.setattr(triton_extend, "_extend_kernel", spy)

    def call():
        out = paged_extend_attention_triton(*args, scale=64**-0.5, sliding_window=None,
                                            softcap=None)  # fmt: skip
        assert rel_err(out, ref) < TOLERANCE[dtype]

    monkeypatch.setitem(triton_extend.ROUTES, key, ("tiles-ahead", (32, 16, 4, 1)))
    call()
    assert spy.launches == [(32, True)]
    monkeypatch.setitem(triton_extend.ROUTES, key, ("tiles", (32, 16, 4, 1)))
    call()
    monkeypatch.delitem(triton_extend.ROUTES, key)
    call()
    fallback = triton_extend.INTERPRETER_CONFIG[0]
    assert spy.launches[1:] == [(32, False), (fallback, False)]
    spy.launches.clear()
    spy.too_big = 64
    monkeypatch.setitem(triton_extend.ROUTES, key, ("tiles-ahead", (64, 16, 4, 1)))
    call()
    assert spy.launches == [(64, True), (fallback, False)]
