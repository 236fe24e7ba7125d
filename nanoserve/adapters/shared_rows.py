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

import hashlib
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.modules import module as _module_hooks

from nanoserve.adapters.module_attrs import module_attr
from nanoserve.adapters.step import CACHE_KWARGS, new_token_mask
from nanoserve.cache import block_digests
from nanoserve.kernels.content_hash import content_digest, kernel_runs_on
from nanoserve.log import get_logger

_log = get_logger(__name__)

# Forward arguments whose rows can be taken from the group leaders alone.
_ROW_KWARGS = ("input_ids", "attention_mask", "position_ids")
_NONE = object()
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
        output["logits"] = logits.index_select(0, torch.tensor(plan.groups, device=logits.device))
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


def prefix_salt(model, user_salt, state) -> bytes | None:
    """What names a call's cached prefixes beside their tokens (16 bytes), or None when K/V
    cannot be named across calls (``unnameable``: then only copies within the call share).

    The key: every parameter and buffer (address, in-place version, dtype, shape, and a
    fingerprint of its values, ``_fingerprint``, read once a call: fused optimizers and
    writes through ``.data`` change values without a new version), the forward hooks registered
    on any module (handle ids: adding or removing one changes the key; what a hook does
    from call to call cannot be seen), the adapters each tuner layer has on (peft), the
    model's dtype and the caller's ``cache_salt``. The digest of the last key is kept on
    ``state`` (a ``PatchState``); under tensor parallelism the caller joins the ranks'
    digests into one (``tensor_parallel.agreed_salt``)."""
    reason = unnameable(model)
    if reason is not None:
        if state.salt_key != reason:
            state.salt_key = reason
            _log.info("prefix cache: no prefix found across calls (%s)", reason)
        return None
    tensors, layout, switches = [], [], []
    seen, stack = set(), [model]
    while stack:  # every module once; parameters() and buffers() would walk them twice
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for tensors_of in (module._parameters, module._buffers):
            for t in tensors_of.values():
                if t is not None:
                    tensors.append(t)
                    layout.append((t.data_ptr(), _version(t), t.dtype, t.shape))
        hooks = (*module._forward_pre_hooks, *module._forward_hooks)
        if hooks or module_attr(module, "active_adapters", _NONE) is not _NONE:
            switches.append((len(seen), hooks, _adapters_on(module)))
        stack.extend(m for m in module._modules.values() if m is not None)
    global_hooks = (*_module_hooks._global_forward_pre_hooks, *_module_hooks._global_forward_hooks)
    values = _fingerprint(tensors, state.backend)
    key = (tuple(layout), values, tuple(switches), global_hooks, model.dtype, user_salt)
    if state.salt_key != key:
        state.salt_key = key
        state.salt = hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
    return state.salt


def unnameable(model) -> str | None:
    """Why K/V of this model cannot be named by tokens and weights alone (a phrase), or None:
    rotary frequencies that depend on the call's length (``dynamic``, ``longrope``: a later
    call of another length computes other K for the same prefix), or a module that drops
    out at random (training mode, ``drops_out``)."""
    for module in model.modules():
        kind = module_attr(module, "rope_type")
        kinds = kind.values() if isinstance(kind, dict) else [kind]
        for kind in kinds:
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
                return f"rope_type {kind!r}: its frequencies depend on the call's length"
    return drops_out(model)


def drops_out(model) -> str | None:
    """Which module of ``model`` drops out at random (training mode, a rate above 0), as a
    phrase, or None. Such a model computes other K/V and logits for each copy of a prompt,
    so no row may take another's."""
    for module in model.modules():
        rate = module.p if isinstance(module, torch.nn.Dropout) else _attention_dropout(module)
        if module.training and rate > 0:
            return f"{type(module).__name__} drops out at random in training mode"
    return None


def _attention_dropout(module) -> float:
    rate = module_attr(module, "attention_dropout", 0.0)
    return float(rate) if isinstance(rate, (int, float)) else 0.0


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version: their values are compared
        return None


def _adapters_on(module) -> tuple:
    """A tuner layer's (peft) switches: adapters disabled, active and merged."""
    active = getattr(module, "active_adapters", ())
    merged = getattr(module, "merged_adapters", ())
    return (
        bool(getattr(module, "disable_adapters", False)),
        tuple(active) if isinstance(active, (list, tuple)) else (active,),
        tuple(merged) if isinstance(merged, (list, tuple)) else (merged,),
    )


def _fingerprint(tensors: list[torch.Tensor], backend: str = "auto") -> tuple:
    """What the values of ``tensors`` are, per device. Where the Triton kernels run (CUDA, or
    the interpreter with ``backend="triton"``): ``content_digest``, a hash of every byte at
    its place (any changed byte changes it). Elsewhere (CPU): ``_float_fingerprint``."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        if t.device.type != "meta" and t.numel():
            per_device.setdefault(t.device, []).append(t.detach())
    prints = []
    for device, group in per_device.items():
        if kernel_runs_on(backend, device):
            prints.append(content_digest(group, backend=backend))
        else:
            prints.append(_float_fingerprint(device, group))
    return tuple(prints)


def _float_fingerprint(device: torch.device, tensors: list[torch.Tensor]) -> tuple:
    """Two position-weighted sums over every tensor's row sums and column sums (a tensor of
    more dimensions read as [first dim, the rest]; complex values as pairs of reals;
    one-byte and non-float dtypes by their raw values), read back with one copy. A changed
    value changes them beyond float rounding, and so does a write that keeps each tensor's
    total and norm, such as reordered rows, heads or columns (the weights differ by
    position). Each row or column sum enters squashed to a signed logarithm, with NaN and
    infinities as fixed values, so that a mask of -inf or a huge buffer cannot drown the
    rest. Not a hash: changes made to cancel can pass, and so can a change below float
    rounding of a large sum."""
    sums = []
    for t in tensors:
        if t.is_complex():
            t = torch.view_as_real(t.resolve_conj())  # (rotary tables kept as complex)
        if t.element_size() == 1:
            t = t.view(torch.uint8)
        # a reduction widens its input to the accumulation dtype first, except 16-bit floats
        # into float32 on CUDA: a float64 sum would copy every weight to float64
        wide = t.dtype == torch.float64 or not t.is_floating_point()
        dtype = torch.float64 if wide else torch.float32
        grid = t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(1, -1)
        sums += [grid.sum(dim=1, dtype=dtype).double(), grid.sum(dim=0, dtype=dtype).double()]
    flat = torch.nan_to_num(torch.cat(sums), nan=0.5, posinf=1e300, neginf=-1e300)
    flat = torch.sign(flat) * torch.log1p(flat.abs())
    position = torch.arange(flat.numel(), dtype=torch.float64, device=device)
    first = (flat * (torch.sin(position * 0.6180339887498949) + 1.5)).sum()
    second = (flat * (torch.cos(position * 1.4142135623730951) + 1.5)).sum()
    return tuple(torch.stack([first, second]).cpu().tolist())


def _plan(cache, kwargs: dict) -> _Plan | None:
    if cache.drops_out is not None or cache.paged.num_seqs:
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
    rows = torch.tensor(plan.leaders, device=ids.device)
    if not trim and not any(cached):
        sub = dict(kwargs)
        for name in _ROW_KWARGS:
            value = sub.get(name)
            if value is not None and value.shape[0] == ids.shape[0]:
                sub[name] = value.index_select(0, rows.to(value.device))
        return sub, new_token_mask(sub, seq_lens)
    rest = [cols[n:] for cols, n in zip(plan.columns, cached, strict=True)]
    width = max(len(cols) for cols in rest)
    take = np.zeros((len(rest), width), np.int64)
    new = np.zeros((len(rest), width), bool)
    for u, cols in enumerate(rest):
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
