"""Plain-torch references: the definition every Triton kernel is held to.

They gather each sequence's history through its block table and run softmax attention in
float32 (float64 when the inputs are float64). Slow and obvious on purpose.
"""

from __future__ import annotations

import torch


def gather_history(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first ``seq_len`` cached rows, oldest first: [seq_len, num_kv_heads, D]."""
    block_size = cache.shape[1]
    num_used = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_used].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:seq_len]


def attend_sequence(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of the last ``q`` positions of one sequence over all of its ``s`` positions.

    query [q, Hq, D]; keys, values [s, Hkv, D]; returns [q, Hq, D] in the compute dtype.
    Query token i sits at position s - q + i and sees positions p with
    ``p <= pos`` and, with a window W, ``p > pos - W``.
    """
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    q_len, num_q_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_q_heads // num_kv_heads
    # Query head h reads KV head h // group: the group's queries share one K/V row set, so
    # K and V are never copied per query head (a 128k-token history stays a few GiB).
    q = query.to(compute).transpose(0, 1).reshape(num_kv_heads, group * q_len, -1)
    k = keys.to(compute).transpose(0, 1)  # [Hkv, s, D]
    v = values.to(compute).transpose(0, 1)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [Hkv, group * q, s]
    scores = scores.view(num_q_heads, q_len, seq_len)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))  # also drops NaN scores of hidden keys
    probs = torch.softmax(scores, dim=-1)
    # A hidden value row must not reach the output: its weight is 0, but 0 * NaN is NaN. So
    # non-finite value rows are zeroed for the product, and a query row that does see one
    # comes out NaN (what attention over a non-finite value gives).
    bad_v = ~torch.isfinite(v).all(dim=-1)  # [Hkv, s]
    weights = probs.view(num_kv_heads, group * q_len, seq_len)
    out = torch.matmul(weights, v.masked_fill(bad_v[..., None], 0.0))
    out = out.view(num_q_heads, q_len, -1)
    bad_v = bad_v.repeat_interleave(group, dim=0)  # [Hq, s]
    sees_bad = (visible & bad_v[:, None, :]).any(dim=-1)  # [Hq, q]
    out = out.masked_fill(sees_bad[..., None], float("nan"))
    return out.transpose(0, 1)  # [q, Hq, D]
