"""Tensor parallelism (transformers' ``tp_plan``): what the paged cache needs to know.

Under ``from_pretrained(..., tp_plan="auto")`` each rank's attention computes only its shard
of the heads, so the K/V reaching ``cache.update`` hold ``num_kv_heads / tp_size`` heads and
each rank's pools (allocated from the first K/V) hold only that shard. Every rank sees the
same inputs and makes the same allocation decisions, so the block tables agree with no
communication; nothing in the cache or the kernels talks across ranks.
"""

from __future__ import annotations

from dataclasses import replace

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
