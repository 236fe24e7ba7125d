"""The first forward of a generate call, shared: what is already known is not prefilled.

Two things are known before a call's first forward (nothing of the call cached yet):
- **Copies of one prompt.** RL rollouts put each prompt G times into one batch, and
  ``num_return_sequences`` and beam search copy every prompt before the first forward. Rows
  whose token ids, padding and positions are all equal compute the same K/V and logits: the
  forward runs the first row of each group only, then every row's block table becomes a fork
  of its group's (blocks shared by reference count, the partly filled last block copied when
  a row first writes to it) and every row gets its group's logits.
- **Prefixes an earlier call stored, or that several prompts share.** With a salt
  (``PagedCache.prefix_salt``: the weights, dtype and a caller's isolation salt), each row's
  full blocks are named by chained digests (``nanoserve.cache.prefix``); the leading ones
  found in the pool's cache are attached to the row instead of prefilled, and the forward
  runs only each row's remaining tokens (as a ragged extend over the attached history).
  Leading blocks that several different prompts of the batch share, and that no call stored
  yet, are first computed once, as rows of their own, and published, so that the rows' own
  lookups find them. Afterwards the rows' full blocks are published for later calls. The
  last token of a prompt is always computed: its logits are needed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.adapters.step import CACHE_KWARGS, host_to_device, new_token_mask
from nanoserve.cache import block_digests
from nanoserve.log import get_logger

_log = get_logger(__name__)

# Forward arguments whose rows can be taken from the group leaders alone.
_ROW_KWARGS = ("input_ids", "attention_mask", "position_ids")
_SHAREABLE = {*_ROW_KWARGS, "use_cache", "cache_position", "logits_to_keep", "return_dict",
              *CACHE_KWARGS}  # fmt: skip


@dataclass
class _Plan:
    leaders: list[int]  # the first row of each group
    groups: list[int]  # the group of each row
    columns: list[np.ndarray]  # each leader's real-token columns
    digests: list[list[bytes]]  # each leader's full-block digests (none without a salt)
    mask: np.ndarray | None = None  # the attention mask [B, columns] on the host


def first_forward(run_step, cache, kwargs: dict):
    """Run a call's first forward sharing what is known (module docstring); returns the
    model output with a logits row for every row, or None when there is nothing to share
    (the caller then runs the forward as usual). ``run_step(kwargs, new)`` runs one paged
    forward of ``kwargs`` whose new-token mask is ``new`` (its step begun, not ended)."""
    plan = _plan(cache, kwargs)
    if plan is None:
        return None
    paged, ids = cache.paged, kwargs["input_ids"]
    given = kwargs.get("attention_mask")
    if given is None or given.shape == ids.shape:  # the host copy _plan made: no sync
        rows = {"input_ids": ids, "attention_mask": torch.from_numpy(plan.mask)}
    else:
        rows = kwargs  # (a mask of other rows: new_token_mask says what is wrong)
    every_row = new_token_mask(rows, paged.seq_lens)  # refuses right padding first
    trim = kwargs.get("logits_to_keep") == 1  # else every column's logits are wanted
    computed = _prefill_common_prefixes(run_step, cache, kwargs, plan) if trim else 0
    paged.add_sequences(len(plan.leaders))
    try:
        cached = [
            paged.attach_prefix(u, digests[: (len(cols) - 1) // paged.block_size]) if trim else 0
            for u, (cols, digests) in enumerate(zip(plan.columns, plan.digests, strict=True))
        ]
        sub, new = _leader_inputs(kwargs, plan, cached, paged.seq_lens)
        output = run_step(sub, new)
        for u, digests in enumerate(plan.digests):
            paged.publish(u, digests, first=cached[u] // paged.block_size)
        if len(plan.leaders) < len(plan.groups):
            paged.reorder(plan.groups)  # row i continues as a fork of its group's leader
    except BaseException:
        cache.abort_step()
        paged.reset()  # the call's first forward: nothing of it stays
        raise
    cache.end_step(columns=ids.shape[1])
    shared = dict(
        rows=len(plan.groups) - len(plan.leaders),
        hits=sum(1 for n in cached if n),
        tokens=int(every_row.sum()) - int(new.sum()) - computed,  # host values: no sync
    )
    cache.note_shared(**shared)
    _log.info(
        "first forward: %d rows copy another, %d rows found %d cached prefix tokens, "
        "%d prompt tokens not recomputed",
        shared["rows"],
        shared["hits"],
        sum(cached),
        shared["tokens"],
    )
    if len(plan.leaders) < len(plan.groups):
        logits = output["logits"]
        output["logits"] = logits.index_select(0, host_to_device(plan.groups, logits.device))
    return output


def _prefill_common_prefixes(run_step, cache, kwargs: dict, plan: _Plan) -> int:
    """Compute once, and publish, the leading full blocks that several different prompts of
    the batch share (the longest such run of each prompt, its last token never included);
    returns the tokens computed. Those rows are dropped afterwards: HF never sees them."""
    bs = cache.paged.block_size
    counts = Counter(d for digests in plan.digests for d in digests)
    shared: dict[bytes, tuple[int, int]] = {}  # last digest -> (leader, blocks)
    for u, (cols, digests) in enumerate(zip(plan.columns, plan.digests, strict=True)):
        limit = min(len(digests), (len(cols) - 1) // bs)
        blocks = max((i + 1 for i in range(limit) if counts[digests[i]] > 1), default=0)
        if blocks:
            shared.setdefault(digests[blocks - 1], (u, blocks))
    if not shared:
        return 0
    reps = list(shared.values())
    prefixes = _Plan(
        leaders=[plan.leaders[u] for u, _ in reps],
        groups=list(range(len(reps))),
        columns=[plan.columns[u][: n * bs] for u, n in reps],
        digests=[plan.digests[u][:n] for u, n in reps],
    )
    paged = cache.paged
    paged.add_sequences(len(reps))
    try:
        cached = [paged.attach_prefix(i, d) for i, d in enumerate(prefixes.digests)]
        if all(n == len(c) for n, c in zip(cached, prefixes.columns, strict=True)):
            return 0  # an earlier call stored them all
        sub, new = _leader_inputs(kwargs, prefixes, cached, paged.seq_lens, trim=True)
        computed = int(new.sum())
        run_step(sub, new)
        for i, digests in enumerate(prefixes.digests):
            paged.publish(i, digests)
    except BaseException:
        cache.abort_step()
        raise
    finally:
        cache.discard_step()  # the prefix rows go; their published blocks stay findable
    return computed


def _plan(cache, kwargs: dict) -> _Plan | None:
    if cache.drops_out is not None or cache.row_hooks is not None or cache.paged.num_seqs:
        return None
    if not set(kwargs) <= _SHAREABLE or kwargs.get("return_dict") is False:
        return None  # (a tuple output has no logits field to give every row)
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] < 1:
        return None
    batch, width = ids.shape
    host = {"input_ids": ids.cpu().numpy()}
    for name in _ROW_KWARGS[1:]:
        value = kwargs.get(name)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] != width:
            return None
        host[name] = np.broadcast_to(value.cpu().numpy(), (batch, width))
    mask = host.get("attention_mask", np.ones((batch, width), np.int64))
    positions = host.get("position_ids", np.broadcast_to(np.arange(width), (batch, width)))
    first: dict[bytes, int] = {}
    leaders, groups = [], []
    for i in range(batch):
        parts = (host["input_ids"], mask, positions)
        key = b"".join(part[i].astype(np.int64).tobytes() for part in parts)
        group = first.setdefault(key, len(leaders))
        if group == len(leaders):
            leaders.append(i)
        groups.append(group)
    salt = cache.prefix_salt
    columns, digests = [], []
    done: list[tuple[bytes, np.ndarray, list[bytes]]] = []  # (row salt, tokens, digests)
    for row in leaders:
        cols = np.flatnonzero(mask[row])
        columns.append(cols)
        pos = positions[row, cols].astype(np.int64)
        contiguous = len(pos) and bool((pos == pos[0] + np.arange(len(pos))).all())
        if salt is None or not contiguous:
            digests.append([])
            continue
        row_salt = salt + pos[:1].tobytes()  # K/V depend on the positions too
        tokens = host["input_ids"][row, cols]
        known = _known_digests(done, row_salt, tokens, cache.paged.block_size)
        digests.append(block_digests(tokens, cache.paged.block_size, row_salt, known))
        done.append((row_salt, tokens, digests[-1]))
    if len(leaders) == batch and not any(digests):
        return None
    return _Plan(leaders, groups, columns, digests, mask.copy())


def _known_digests(done, row_salt: bytes, tokens: np.ndarray, block_size: int) -> list[bytes]:
    """The digests of ``tokens``' leading full blocks that an earlier row of ``done`` (row
    salt, tokens, digests) already computed: the longest run of whole blocks in which its
    salt and tokens equal these (a shared system prompt is hashed once, not once a row)."""
    best: list[bytes] = []
    for salt, other, other_digests in done:
        n = min(len(tokens), len(other)) // block_size * block_size
        if salt != row_salt or n // block_size <= len(best):
            continue
        differ = np.flatnonzero(tokens[:n] != other[:n])
        same = (differ[0] if len(differ) else n) // block_size
        if same > len(best):
            best = other_digests[:same]
    return best


def _leader_inputs(kwargs: dict, plan: _Plan, cached: list[int], seq_lens, trim: bool = False):
    """(the leaders' forward arguments, each row without its first ``cached`` real tokens
    and left padded to the longest rest; their new-token mask [U, columns] on the CPU).
    Without ``trim`` and with nothing cached, the rows keep every column."""
    ids = kwargs["input_ids"]
    rows = host_to_device(plan.leaders, ids.device)
    if not trim and not any(cached):
        sub = dict(kwargs)
        for name in _ROW_KWARGS:
            value = sub.get(name)
            if value is not None and value.shape[0] == ids.shape[0]:
                sub[name] = value.index_select(0, rows.to(value.device))
        return sub, new_token_mask(sub, seq_lens)
    rest = [cols[n:] for cols, n in zip(plan.columns, cached, strict=True)]
    width = max(1, *(len(cols) for cols in rest))
    take = np.zeros((len(rest), width), np.int64)
    new = np.zeros((len(rest), width), bool)
    for u, cols in enumerate(rest):
        if not len(cols):  # an empty prompt: its last column, as the untrimmed forward runs it
            take[u, -1] = ids.shape[1] - 1
            continue
        take[u, width - len(cols) :] = cols
        new[u, width - len(cols) :] = True
    take_t = torch.from_numpy(take).to(ids.device)
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
    positions = positions.expand(ids.shape[0], -1).index_select(0, rows.to(positions.device))
    sub = dict(
        kwargs,
        input_ids=ids.index_select(0, rows).gather(1, take_t),
        attention_mask=torch.from_numpy(new.astype(np.int64)).to(ids.device),
        position_ids=positions.gather(1, take_t.to(positions.device)),
    )
    if kwargs.get("cache_position") is not None:
        sub["cache_position"] = kwargs["cache_position"][-width:]
    return sub, torch.from_numpy(new)
