"""Random paged inputs for kernel tests: scattered blocks, NaN in every unused slot."""

from __future__ import annotations

import os

import pytest
import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1"
)

# a ``device`` parameter for tests that also run on CUDA, under ``-m gpu``
ON_GPU = [
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    )
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out gives inf."""
    if not torch.isfinite(out).all():
        return float("inf")
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    spare_blocks: int = 3,
    extra_columns: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache, block_tables, seq_lens) with blocks in random order.

    Every slot that holds no token (free blocks, the tail of each last block) is NaN, and the
    table has ``extra_columns`` trailing entries pointing at NaN blocks, so any read past a
    sequence's end shows up as NaN in the result.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq) + extra_columns
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks).tolist()
    used, spare = perm[: sum(blocks_per_seq)], perm[sum(blocks_per_seq) :]
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids = torch.tensor([used.pop() for _ in range(nb)], dtype=torch.long)
        table[i, :nb] = ids.int()
        if width > nb:
            table[i, nb:] = spare[i % len(spare)] if spare else ids[0]
        flat_k = key_cache[ids.to(device)].view(-1, num_kv_heads, head_dim)
        flat_v = value_cache[ids.to(device)].view(-1, num_kv_heads, head_dim)
        flat_k[:n] = torch.randn(n, num_kv_heads, head_dim, device=device).to(dtype)
        flat_v[:n] = torch.randn(n, num_kv_heads, head_dim, device=device).to(dtype)
        key_cache[ids.to(device)] = flat_k.view(nb, block_size, num_kv_heads, head_dim)
        value_cache[ids.to(device)] = flat_v.view(nb, block_size, num_kv_heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return key_cache, value_cache, table.to(device), lens


def poison_hidden(pool: torch.Tensor, tables, lens, new, window) -> torch.Tensor:
    """A copy of ``pool`` with NaN at every position that no new token's window reaches."""
    pool = pool.clone()
    block_size = pool.shape[1]
    flat = pool.view(-1, *pool.shape[2:])
    for row, (n, q) in enumerate(zip(lens, new, strict=True)):
        for p in range(max(n - q - window + 1, 0)):  # p <= first query position - window
            flat[int(tables[row, p // block_size]) * block_size + p % block_size] = float("nan")
    return pool


@pytest.fixture
def forbid_triton(monkeypatch):
    """Make every Triton launcher raise inside the test (the ops look them up per call)."""
    import nanoserve.kernels.triton_decode as triton_decode
    import nanoserve.kernels.triton_extend as triton_extend
    import nanoserve.kernels.triton_scatter as triton_scatter

    def launched(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched")

    monkeypatch.setattr(triton_decode, "paged_decode_attention_triton", launched)
    monkeypatch.setattr(triton_extend, "paged_extend_attention_triton", launched)
    monkeypatch.setattr(triton_scatter, "slot_scatter_triton", launched)


@pytest.fixture
def poison_outputs(monkeypatch):
    """Make every float torch.empty / torch.empty_like inside the test come back NaN-filled."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(real_empty_like(*a, **k)))


def ulps(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in units of ref's dtype's epsilon times |ref| (float64), elementwise."""
    eps = torch.finfo(ref.dtype).eps
    return (out.double() - ref.double()).abs() / (eps * ref.double().abs().clamp(min=1e-30))


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error of every row (last dim) in float64: [..] without the last dim.
    Non-finite rows of ``out`` give inf."""
    err = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    return torch.where(torch.isfinite(out).all(dim=-1), err, float("inf"))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_split_bounds(seq_len: int, window: int | None, block_n: int, splits: int) -> list[int]:
    """First position of every non-empty split after the first, as the fixed-split decode
    launch cuts [first tile of the window, seq_len) (see ``_decode_kernel``)."""
    start = max(seq_len - window, 0) if window else 0
    base = start // block_n * block_n
    per_split = cdiv(cdiv(seq_len - base, splits), block_n) * block_n
    return [base + k * per_split for k in range(1, splits) if base + k * per_split < seq_len]


def balanced_chunk(lens: list[int], window: int | None, block_n: int, work_items: int) -> int:
    """Tokens per work item of the balanced decode launch for a batch of ``lens``, computed
    as the kernel's ``_row_items`` does: whole tiles, about total / work_items."""
    bases = [(max(n - window, 0) // block_n * block_n) if window else 0 for n in lens]
    total = sum(n - b for n, b in zip(lens, bases, strict=True))
    return max(cdiv(cdiv(total, work_items), block_n), 1) * block_n


def balanced_bounds(seq_len: int, window: int | None, block_n: int, chunk: int) -> list[int]:
    """First position of every work item of a row after its first (balanced launch): the
    row's ceil(work / chunk) items split its work evenly in whole tiles."""
    start = max(seq_len - window, 0) if window else 0
    base = start // block_n * block_n
    items = max(cdiv(seq_len - base, chunk), 1)
    per_item = cdiv(cdiv(seq_len - base, items), block_n) * block_n
    return [base + k * per_item for k in range(1, items) if base + k * per_item < seq_len]


def check_decode_planted(
    lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    device: str = "cpu",
    window: int | None = None,
    num_splits: int | None = None,
    work_items: int | None = None,
    max_bounds: int | None = None,
    row_tol: float,
) -> None:
    """Decode with one planted key per (sequence, KV head) whose score beats every other key
    by about 40 nats: that head group's output must be (close to) the planted value row, and
    every (sequence, head) row must match the float64 reference on its own (an error in one
    row cannot hide in a norm over all of them).

    For each length in ``lens`` the planted positions are: the newest key, the oldest
    visible key (the oldest in the window with one), the key just before the window (which
    must NOT dominate), and both sides of each boundary between the row's splits or work
    items (``max_bounds`` of them, spread out, or all); the batch holds as many sequences of
    that length as these need, one position per KV head. The query heads of a KV head share
    one vector, so the planted key dominates for each of them.
    """
    from nanoserve.kernels import paged_decode_attention_ref
    from nanoserve.kernels.triton_decode import decode_plan, paged_decode_attention_triton

    def bounds_of(seq_list: list[int]) -> dict[int, list[int]]:
        """Boundaries inside each length's rows for the launch the batch ``seq_list`` gets."""
        probe = torch.empty(len(seq_list), num_kv_heads * group, head_dim, dtype=dtype,
                            device=device)  # fmt: skip
        pool = torch.empty(1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        width = -(-max(lens) // block_size) + 1  # make_paged_kv adds one column
        table = torch.empty(len(seq_list), width, dtype=torch.int32, device=device)
        plan = decode_plan(probe, pool, table, num_splits=num_splits, work_items=work_items)
        if plan.work_items:
            chunk = balanced_chunk(seq_list, window, plan.block_n, plan.work_items)
            return {n: balanced_bounds(n, window, plan.block_n, chunk) for n in lens}
        return {n: decode_split_bounds(n, window, plan.block_n, plan.num_splits) for n in lens}

    def wishes_for(
        bounds_by_len: dict[int, list[int]], copies: dict[int, int]
    ) -> list[tuple[int, int, bool]]:
        """(seq_len, pos, must_dominate), one (sequence, KV head) each, by sequence; each
        length fills at least ``copies[n]`` sequences (repeating its newest key)."""
        wishes = []
        for n in lens:
            oldest = max(n - window, 0) if window else 0
            mine = [(n, n - 1, True), (n, oldest, True)]
            if oldest > 0:
                mine.append((n, oldest - 1, False))
            bounds = bounds_by_len[n]
            if max_bounds is not None and len(bounds) > max_bounds:
                bounds = [bounds[round(i * (len(bounds) - 1) / (max_bounds - 1))]
                          for i in range(max_bounds)]  # fmt: skip
            for b in bounds:
                mine += [(n, b - 1, b - 1 >= oldest), (n, b, True)]
            size = max(cdiv(len(mine), num_kv_heads), copies.get(n, 0)) * num_kv_heads
            wishes += mine + [mine[0]] * (size - len(mine))  # fill the last sequences
        return wishes

    # The boundaries depend on the batch (its size; for the balanced launch its lengths), and
    # the batch on the boundaries: grow the batch (never shrink it, so this settles) until it
    # gives the boundaries it was built for.
    seq_list, copies = list(lens), {}
    for _ in range(20):
        chosen = bounds_of(seq_list)
        wishes = wishes_for(chosen, copies)
        seq_list = [wishes[i][0] for i in range(0, len(wishes), num_kv_heads)]
        copies = {n: seq_list.count(n) for n in lens}
        if bounds_of(seq_list) == chosen:
            break
    else:
        raise AssertionError("the planted batch did not settle")
    planted = [(i // num_kv_heads, i % num_kv_heads, pos, dom)
               for i, (_, pos, dom) in enumerate(wishes)]  # fmt: skip

    key_cache, value_cache, tables, seq_lens = make_paged_kv(
        seq_list, num_kv_heads, head_dim, block_size, dtype, device=device
    )
    num_seqs = len(seq_list)
    shared = torch.randn(num_seqs, num_kv_heads, 1, head_dim, device=device)
    query = shared.expand(-1, -1, group, -1).reshape(num_seqs, num_kv_heads * group, head_dim)
    query = query.to(dtype).contiguous()
    for seq, kv_head, pos, _ in planted:
        q = shared[seq, kv_head, 0]
        key = q * (40.0 / (q.norm() ** 2 * head_dim**-0.5))  # scale * q.k = 40
        key_cache[int(tables[seq, pos // block_size]), pos % block_size, kv_head] = key.to(dtype)
    ref = paged_decode_attention_ref(
        query.double(), key_cache.double(), value_cache.double(), tables, seq_lens,
        sliding_window=window,
    )  # fmt: skip
    out = paged_decode_attention_triton(
        query, key_cache, value_cache, tables, seq_lens, scale=head_dim**-0.5,
        sliding_window=window, softcap=None, num_splits=num_splits, work_items=work_items,
    )  # fmt: skip
    err = row_errors(out, ref)  # [S, Hq]
    seq, head = divmod(int(err.argmax()), err.shape[1])
    assert err.max() < row_tol, (
        f"sequence {seq} (len {seq_list[seq]}), head {head}: relative error {err.max():.2e}"
    )
    for seq, kv_head, pos, dominate in planted:
        v_row = value_cache[int(tables[seq, pos // block_size]), pos % block_size, kv_head]
        heads = slice(kv_head * group, (kv_head + 1) * group)
        dist = row_errors(out[seq, heads], v_row.expand(group, -1))
        where = f"sequence {seq} (len {seq_list[seq]}), KV head {kv_head}, key at {pos}"
        if dominate:
            assert dist.max() < row_tol, f"{where} should dominate: distance {dist.max():.2e}"
        else:
            assert dist.min() > 0.1, f"{where} lies outside the window yet dominates"


def spy_packed(monkeypatch, *fields):
    """A list that records each packed-kernel launch's keyword ``fields`` (one value, or a
    tuple of several) while the launch still runs."""
    from nanoserve.kernels import triton_verify

    calls = []
    real = triton_verify.paged_extend_attention_packed

    def spy(*args, **kwargs):
        values = tuple(kwargs[f] for f in fields)
        calls.append(values[0] if len(values) == 1 else values)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_verify, "paged_extend_attention_packed", spy)
    return calls


def spy_extend_runs(monkeypatch):
    """A list that records each tiled extend launch's key runs (``NUM_SPLITS``, 1 when the
    launch passes none) while the launch still runs."""
    from nanoserve.kernels import triton_extend

    launched = []
    real = triton_extend._extend_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **meta):
                launched.append(meta.get("NUM_SPLITS", 1))
                return real[grid](*args, **meta)

            return run

    monkeypatch.setattr(triton_extend, "_extend_kernel", Spy())
    return launched
