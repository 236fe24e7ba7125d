"""Tensor parallelism (transformers' ``tp_plan``): what the paged cache needs to know.

Under ``from_pretrained(..., tp_plan="auto")`` each rank's attention computes only its shard
of the heads, so the K/V reaching ``cache.update`` hold ``num_kv_heads / tp_size`` heads and
each rank's pools (allocated from the first K/V) hold only that shard. Every rank sees the
same inputs and makes the same allocation decisions, so the block tables agree with no
communication; nothing in the cache or the kernels talks across ranks. Decode steps replay
CUDA graphs that hold the step's all-reduces; the decisions that could differ between ranks,
whether a capture worked and whether a new cache keeps the graphs (their pools' addresses
are each rank's own), are settled across them (``capture_agreement``).
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
        on_nccl = torch.distributed.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_nccl else "cpu"
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree


def agreed_salt(model, salt: bytes) -> bytes:
    """One prefix salt for every rank from each rank's own (16 bytes each: one all-gather).
    Each rank salts its own weight shards: a change to one rank's shard alone must make every
    rank miss, or the ranks would run forwards of different lengths. The model on one device
    gets ``salt`` back."""
    if tp_size(model) == 1:
        return salt
    group = process_group(model)
    on_nccl = torch.distributed.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_nccl else "cpu"
    mine = torch.frombuffer(bytearray(salt), dtype=torch.uint8).to(device)
    every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(every, mine, group=group)
    joined = b"".join(bytes(t.cpu().tolist()) for t in every)
    return hashlib.blake2b(joined, digest_size=len(salt)).digest()
