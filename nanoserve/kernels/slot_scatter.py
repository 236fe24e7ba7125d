"""Slot scatter: write new K/V rows into the paged pools at their slots (-1 = not stored)."""

from __future__ import annotations

import torch

from nanoserve.kernels.dispatch import check_backend, use_triton
from nanoserve.kernels.validation import check_slot_scatter_args


def slot_scatter_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check: bool = True,
) -> None:
    """Write ``key``/``value`` [T, Hkv, D] into the pools [num_blocks, block_size, Hkv, D].

    ``slot_mapping`` int32/int64 [T]: token t goes to flat slot ``slot_mapping[t]``
    (block_id * block_size + offset); -1 skips the token. Pools are updated in place.
    """
    if check:
        check_slot_scatter_args(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep]
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep]


def slot_scatter(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check: bool = True,
    backend: str = "auto",
) -> None:
    """Same contract as ``slot_scatter_ref``; ``backend`` is "auto", "triton" or "torch".

    ``check=False`` skips every check (none of which then reads device memory), for callers
    that validated their metadata already and for CUDA-graph capture.
    """
    check_backend(backend)
    if check:
        check_slot_scatter_args(key, value, key_cache, value_cache, slot_mapping)
    if use_triton(backend, key_cache):
        from nanoserve.kernels.triton_scatter import slot_scatter_triton  # imports triton

        slot_scatter_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        slot_scatter_ref(key, value, key_cache, value_cache, slot_mapping, check=False)
