"""Slot scatter: write new K/V rows into the paged pools at their slots (-1 = not stored)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from nanoserve.kernels.dispatch import check_backend, use_triton
from nanoserve.kernels.quant import INT8_DTYPE, quantize, quantize_int8
from nanoserve.kernels.validation import check_slot_scatter_args


class KVStore(NamedTuple):
    """Where a kernel that makes new K/V rows stores them itself, as ``slot_scatter`` would:
    a layer's pools [num_blocks, block_size, Hkv, D] (contiguous) and each row's flat slot,
    int32/int64 [T] (-1: the row is not stored)."""

    key_pool: torch.Tensor
    value_pool: torch.Tensor
    slot_mapping: torch.Tensor


def slot_scatter_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check: bool = True,
) -> None:
    """Write ``key``/``value`` [T, Hkv, D] into the pools [num_blocks, block_size, Hkv, D].

    ``slot_mapping`` int32/int64 [T]: token t goes to flat slot ``slot_mapping[t]``
    (block_id * block_size + offset); -1 skips the token. Pools are updated in place.
    FP8 pools (float8_e4m3fn) take float32 ``k_scale``/``v_scale`` [Hkv]: each row is
    stored as ``x / scale`` saturated to +-448. INT8 pools take float16 per-slot scales
    (keys [num_blocks, block_size, Hkv, groups], values [..., 1]), written here beside the
    values (see ``quant.py``).
    """
    if check:
        check_slot_scatter_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key, value = key[keep], value[keep]
    if key_cache.dtype == INT8_DTYPE:
        key, key_scales = quantize_int8(key)
        value, value_scales = quantize_int8(value, group=None)
        k_scale.view(-1, *k_scale.shape[2:])[slots] = key_scales
        v_scale.view(-1, *v_scale.shape[2:])[slots] = value_scales
    elif k_scale is not None:
        key, value = quantize(key, k_scale), quantize(value, v_scale)
    # (rows of another float dtype are stored converted, as the kernel's store does)
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key.to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value.to(value_cache.dtype)


def slot_scatter(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check: bool = True,
    backend: str = "auto",
) -> None:
    """Same contract as ``slot_scatter_ref``; ``backend`` is "auto", "triton" or "torch".

    ``check=False`` skips every check (none of which then reads device memory), for callers
    that validated their metadata already and for CUDA-graph capture.
    """
    check_backend(backend)
    if check:
        check_slot_scatter_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if use_triton(backend, key_cache):
        from nanoserve.kernels.triton_scatter import slot_scatter_triton  # imports triton

        slot_scatter_triton(key, value, key_cache, value_cache, slot_mapping, **scales)
    else:
        slot_scatter_ref(key, value, key_cache, value_cache, slot_mapping, **scales, check=False)
