"""Tensor parallelism (transformers' ``tp_plan``): what the paged cache needs to know.

Under ``from_pretrained(..., tp_plan="auto")`` each rank's attention computes only its shard
of the heads, so the K/V reaching ``cache.update`` hold ``num_kv_heads / tp_size`` heads and
each rank's pools (allocated from the first K/V) hold only that shard. Every rank sees the
same inputs and makes the same allocation decisions, so the block tables agree with no
communication; nothing in the cache or the kernels talks across ranks. Decode steps replay
CUDA graphs that hold the step's all-reduces; the decisions that could differ between ranks,
whether a capture worked and whether a new cache keeps the graphs (their pools' addresses
are each rank's own), are settled across them (``capture_agreement``), and so, once a
generate call, are the options every rank must share (``agree_options``) and the salt of
the call's cached prefixes (``agreed_salt``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace

import torch

from nanoserve.adapters.family import KVLayout


def tp_size(model) -> int:
    """Tensor-parallel ranks the model is sharded over (1 when it is not)."""
    return int(getattr(model, "_tp_size", None) or 1)


def local_layout(layout: KVLayout, model) -> KVLayout:
    """This rank's share of ``layout``; ValueError when the KV heads do not divide evenly."""
    ranks = tp_size(model)
    if layout.num_kv_heads % ranks:
        raise ValueError(
            f"model: its {layout.num_kv_heads} KV heads do not divide among {ranks} "
            "tensor-parallel ranks; use a tp_size that divides num_key_value_heads"
        )
    return replace(layout, num_kv_heads=layout.num_kv_heads // ranks)


def process_group(model):
    """The process group of the model's tensor-parallel ranks (transformers' device mesh)."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None  # the default group
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")


def capture_agreement(model) -> Callable[[bool], bool] | None:
    """``agree(ok) -> bool``: True on every rank when every rank's ``ok`` is True (one small
    all-reduce, at each graph capture and once a generate call, when its first decode step
    decides whether the graphs fit its cache); None for a model on one device."""
    if tp_size(model) == 1:
        return None
    group = process_group(model)

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_collective_device(group))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree


def agree_options(model, options: dict) -> None:
    """Every tensor-parallel rank must run a call alike: a rank that shares prefixes, runs
    another decode loop or drops out runs forwards of other lengths into the collectives,
    and the ranks hang. ``options`` (name -> value) are compared with one all-gather, before
    the call changes anything; ValueError naming those that differ, on every rank. Nothing
    for a model on one device."""
    if tp_size(model) == 1:
        return
    names = sorted(options)
    records = _all_gather(model, b"".join(_digest(repr(options[n]), 8) for n in names))
    differ = [
        name for i, name in enumerate(names) if len({r[8 * i : 8 * i + 8] for r in records}) > 1
    ]
    if differ:
        raise ValueError(
            f"{', '.join(differ)}: the tensor-parallel ranks differ (patch_model's options, "
            "the attention implementation, training mode); make every rank alike"
        )


def agreed_salt(model, salt: bytes | None, stores: list[int]) -> bytes | None:
    """One prefix salt for every rank (one all-gather; a model on one device gets ``salt``
    back), from each rank's own, which salts its own weight shards, and from the identity
    of the prefix stores its call uses (``stores``: the allocators' ``store_id``; a rank
    that released its memory or was patched again holds none of the blocks the others
    cached): a change on one rank alone makes every rank miss. None when any rank has no
    salt."""
    if tp_size(model) == 1:
        return salt
    record = (b"\x01" + salt if salt is not None else b"\x00" + bytes(16)) + _digest(
        repr(stores), 8
    )
    records = _all_gather(model, record)
    if any(r[0] == 0 for r in records):
        return None
    return _digest(b"".join(records), 16)


def _all_gather(model, record: bytes) -> list[bytes]:
    """Every rank's ``record`` (the same length on each), in rank order."""
    group = process_group(model)
    mine = torch.frombuffer(bytearray(record), dtype=torch.uint8).to(_collective_device(group))
    every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(every, mine, group=group)
    joined = torch.cat(every).cpu().tolist()
    return [bytes(joined[i : i + len(record)]) for i in range(0, len(joined), len(record))]


def _collective_device(group):
    """Where a collective of ``group`` takes its tensors: this rank's GPU under NCCL, else
    the CPU (gloo)."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _digest(data, size: int) -> bytes:
    data = data.encode() if isinstance(data, str) else data
    return hashlib.blake2b(data, digest_size=size).digest()
