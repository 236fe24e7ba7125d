"""The references against torch SDPA on the same K/V laid out contiguously (their
bad-input errors are tested with the ops' in test_bad_inputs.py)."""

import pytest
import torch
import torch.nn.functional as F
from kernel_inputs import poison_hidden

from nanoserve.kernels import (
    paged_decode_attention_ref,
    paged_extend_attention_ref,
    slot_scatter_ref,
)


def paged_copy(keys: list[torch.Tensor], block_size: int, num_blocks: int, gen: torch.Generator):
    """Put each sequence's [len, H, D] rows into a NaN pool at shuffled blocks."""
    heads, dim = keys[0].shape[1:]
    pool = torch.full((num_blocks, block_size, heads, dim), float("nan"), dtype=keys[0].dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-k.shape[0] // block_size) for k in keys)
    tables = torch.zeros(len(keys), width, dtype=torch.int32)
    for row, k in enumerate(keys):
        n_blocks = -(-k.shape[0] // block_size)
        ids = [order.pop() for _ in range(n_blocks)]
        tables[row, :n_blocks] = torch.tensor(ids, dtype=torch.int32)
        slots = torch.tensor(
            [ids[p // block_size] * block_size + p % block_size for p in range(k.shape[0])]
        )
        pool.view(-1, heads, dim)[slots] = k
    return pool, tables


def sdpa_last_rows(q, k, v, *, scale, window, softcap):
    """SDPA (with an explicit mask) of the last q rows of one contiguous sequence."""
    q_len, s_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    q_pos = torch.arange(s_len - q_len, s_len)[:, None]
    k_pos = torch.arange(s_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    if softcap is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale)
    else:  # SDPA has no softcap: apply it on explicit logits
        logits = softcap * torch.tanh(qh @ kh.transpose(-1, -2) * scale / softcap)
        out = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1) @ vh
    return out[0].transpose(0, 1)


CASES = [
    # (q_heads, kv_heads, head_dim, window, softcap)
    (4, 4, 64, None, None),
    (8, 2, 80, None, None),
    (7, 1, 96, 5, None),
    (16, 2, 128, None, 30.0),
    (8, 1, 64, 9, 20.0),
]


# Two fixed seeds and one drawn per session (fresh inputs each run); every assertion
# message names the seed, so a failure can be rerun with it.
SEEDS = [0, 1, int(torch.randint(2, 2**31, (1,), generator=torch.Generator().manual_seed(
    torch.seed())))]  # fmt: skip


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,window,softcap", CASES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_extend_and_decode_refs_match_sdpa(
    q_heads, kv_heads, head_dim, window, softcap, block_size, seed
):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2]
    new = [1, 3, block_size, 2, 7]
    keys = [torch.randn(n, kv_heads, head_dim, dtype=torch.float64) for n in lens]
    values = [torch.randn(n, kv_heads, head_dim, dtype=torch.float64) for n in lens]
    k_pool, tables = paged_copy(keys, block_size, 16, gen)
    v_pool = torch.full_like(k_pool, float("nan"))
    # same blocks for V: scatter through the K table's slots
    for row, v in enumerate(values):
        ids = tables[row].tolist()
        slots = torch.tensor(
            [ids[p // block_size] * block_size + p % block_size for p in range(v.shape[0])]
        )
        v_pool.view(-1, kv_heads, head_dim)[slots] = v
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5

    cu = torch.tensor([0] + new, dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), q_heads, head_dim, dtype=torch.float64)
    out = paged_extend_attention_ref(
        query, k_pool, v_pool, tables, seq_lens, cu, sliding_window=window, softcap=softcap
    )
    for row in range(len(lens)):
        rows = slice(int(cu[row]), int(cu[row + 1]))
        expected = sdpa_last_rows(
            query[rows], keys[row], values[row], scale=scale, window=window, softcap=softcap
        )
        torch.testing.assert_close(
            out[rows], expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"seed {seed}: {m}"
        )

    decode_q = torch.randn(len(lens), q_heads, head_dim, dtype=torch.float64)
    out = paged_decode_attention_ref(
        decode_q, k_pool, v_pool, tables, seq_lens, sliding_window=window, softcap=softcap
    )
    for row in range(len(lens)):
        expected = sdpa_last_rows(
            decode_q[row : row + 1],
            keys[row],
            values[row],
            scale=scale,
            window=window,
            softcap=softcap,
        )
        torch.testing.assert_close(
            out[row : row + 1], expected, rtol=1e-10, atol=1e-10,
            msg=lambda m: f"seed {seed}: {m}",
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_ref_output_dtype_follows_query(dtype):
    k_pool = torch.randn(4, 8, 2, 64).to(dtype)
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    out = paged_decode_attention_ref(
        torch.randn(1, 4, 64).to(dtype),
        k_pool,
        k_pool.clone(),
        tables,
        torch.tensor([11], dtype=torch.int32),
    )
    assert out.dtype == dtype and out.shape == (1, 4, 64) and torch.isfinite(out).all()


def test_scatter_skips_padding_slots():
    pool = torch.zeros(2, 4, 1, 8)
    key = torch.randn(3, 1, 8)
    slot_scatter_ref(key, key.clone(), pool, pool.clone(), torch.tensor([5, -1, 0]))
    flat = pool.view(-1, 1, 8)
    assert torch.equal(flat[5], key[0]) and torch.equal(flat[0], key[2])
    untouched = [i for i in range(8) if i not in (0, 5)]
    assert torch.equal(flat[untouched], torch.zeros(6, 1, 8))


def test_refs_ignore_nan_outside_the_window():
    """NaN in K and V where no query row looks leaves the output finite and unchanged; NaN in
    a value row a query row does see makes that row non-finite. (The old reference let the
    hidden NaN through: 0 * NaN in probs @ v made every row NaN.)"""
    gen = torch.Generator().manual_seed(1)
    lens, new, window, block_size = [40, 23, 9], [5, 3, 1], 7, 8
    keys = [torch.randn(n, 2, 16, dtype=torch.float64, generator=gen) for n in lens]
    values = [torch.randn(n, 2, 16, dtype=torch.float64, generator=gen) for n in lens]
    k_pool, tables = paged_copy(keys, block_size, 16, torch.Generator().manual_seed(2))
    v_pool, tables_v = paged_copy(values, block_size, 16, torch.Generator().manual_seed(2))
    assert torch.equal(tables, tables_v)  # same draw of blocks: V sits where K sits
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), 4, 16, dtype=torch.float64, generator=gen)
    decode_q = torch.randn(len(lens), 4, 16, dtype=torch.float64, generator=gen)
    runs = {
        "extend": (
            lambda k, v: paged_extend_attention_ref(
                query, k, v, tables, seq_lens, cu, sliding_window=window
            ),
            new,
        ),
        "decode": (
            lambda k, v: paged_decode_attention_ref(
                decode_q, k, v, tables, seq_lens, sliding_window=window
            ),
            [1] * len(lens),
        ),
    }
    for name, (attend, q_lens) in runs.items():
        clean = attend(k_pool, v_pool)
        poisoned = attend(
            poison_hidden(k_pool, tables, lens, q_lens, window),
            poison_hidden(v_pool, tables, lens, q_lens, window),
        )
        assert torch.isfinite(poisoned).all(), name
        torch.testing.assert_close(poisoned, clean, rtol=0, atol=0, msg=name)
    # the newest key of sequence 0 is visible to its decode row: NaN there must show
    v_seen = v_pool.clone()
    last = lens[0] - 1
    v_seen[int(tables[0, last // block_size]), last % block_size, 0, 3] = float("nan")
    out = runs["decode"][0](k_pool, v_seen)
    assert not torch.isfinite(out[0, :2]).any() and torch.isfinite(out[0, 2:]).all()
    assert torch.equal(out[1:], runs["decode"][0](k_pool, v_pool)[1:])
