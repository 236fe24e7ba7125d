"""Random paged inputs for kernel tests: scattered blocks, NaN in every unused slot."""

from __future__ import annotations

import os

import pytest
import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1"
)


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
def poison_outputs(monkeypatch):
    """Make every float torch.empty / torch.empty_like inside the test come back NaN-filled."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(real_empty_like(*a, **k)))
