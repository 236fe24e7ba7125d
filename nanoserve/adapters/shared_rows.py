"""Copies of one prompt in a batch are prefilled once and stored once.

RL rollouts put each prompt G times into one ``generate`` batch, and ``num_return_sequences``
and beam search copy every prompt before the first forward. In the first forward of a call
(nothing cached yet), rows whose token ids, padding and positions are all equal compute the
same K/V and the same logits. That forward runs the first row of each group only; then every
row's block table becomes a fork of its group's (the blocks shared by reference count, the
partly filled last block copied when a row first writes to it) and every row gets its group's
logits.
"""

from __future__ import annotations

import torch

from nanoserve.adapters.step import CACHE_KWARGS, new_token_mask, paged_step

# Forward arguments whose rows can be taken from the group leaders alone.
_ROW_KWARGS = ("input_ids", "attention_mask", "position_ids")
_SHAREABLE = {*_ROW_KWARGS, "use_cache", "cache_position", "logits_to_keep", "return_dict",
              *CACHE_KWARGS}  # fmt: skip


def row_groups(cache, kwargs: dict) -> tuple[list[int], list[int]] | None:
    """(leaders, group of each row) for the first forward of a call whose batch holds equal
    rows: ``leaders[g]`` is the first row of group g, ``groups[i]`` the group of row i.
    None when every row differs, or the forward is not one this can share."""
    if cache.paged.num_seqs or not set(kwargs) <= _SHAREABLE:
        return None
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] < 2:
        return None
    parts = [ids]
    for name in _ROW_KWARGS[1:]:
        value = kwargs.get(name)
        if value is not None:
            if not isinstance(value, torch.Tensor) or value.shape != ids.shape:
                return None
            parts.append(value.to(ids.dtype))
    rows = torch.cat(parts, dim=1).cpu().numpy()
    first: dict[bytes, int] = {}
    leaders: list[int] = []
    groups: list[int] = []
    for i, row in enumerate(rows):
        group = first.setdefault(row.tobytes(), len(leaders))
        if group == len(leaders):
            leaders.append(i)
        groups.append(group)
    return (leaders, groups) if len(leaders) < len(groups) else None


def run_shared(stock_forward, backend: str, cache, kwargs: dict, leaders, groups):
    """The forward for the group leaders only, then every row forked from its group's;
    returns the model output with a logits row for every row of the batch."""
    ids = kwargs["input_ids"]
    index = torch.tensor(leaders, device=ids.device)
    sub = dict(kwargs)
    for name in _ROW_KWARGS:
        if sub.get(name) is not None:
            sub[name] = sub[name].index_select(0, index.to(sub[name].device))
    every_row = new_token_mask(kwargs, cache.paged.seq_lens)
    meta = cache.begin_step(new_token_mask(sub, cache.paged.seq_lens), ids.device)
    try:
        with paged_step(cache, meta, backend):
            output = stock_forward(**sub)
        cache.paged.reorder(groups)  # row i continues as a fork of its group's leader
    except BaseException:
        cache.abort_step()
        raise
    cache.end_step()
    computed = int(meta.cu_seqlens_q[-1])
    cache.note_shared_rows(len(groups) - len(leaders), int(every_row.sum()) - computed)
    logits = output["logits"]
    output["logits"] = logits.index_select(0, torch.tensor(groups, device=logits.device))
    return output
