"""How many blocks a generate call's pool gets."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanoserve.adapters.family import KVLayout


@dataclass(frozen=True)
class PoolOptions:
    """patch_model's pool arguments; at most one of ``num_blocks`` / ``max_memory``."""

    layout: KVLayout
    block_size: int = 16
    num_blocks: int | None = None
    max_memory: int | None = None

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size: must be a positive int, got {self.block_size!r}")
        if self.num_blocks is not None and self.max_memory is not None:
            raise ValueError("num_blocks, max_memory: give at most one of them")
        if self.num_blocks is not None and (
            not isinstance(self.num_blocks, int) or self.num_blocks < 1
        ):
            raise ValueError(f"num_blocks: must be a positive int, got {self.num_blocks!r}")
        if self.max_memory is not None and (
            not isinstance(self.max_memory, int) or self.max_memory < 1
        ):
            raise ValueError(f"max_memory: must be a positive int (bytes), got {self.max_memory!r}")


def block_bytes(layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V."""
    per_token = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim
    return per_token * block_size * dtype.itemsize


def pool_blocks(options: PoolOptions, model, args: tuple, kwargs: dict) -> int:
    """``num_blocks``; else what fits in ``max_memory``; else what this call needs:
    rows x (blocks for prompt + new tokens, plus one spare for beam copy-on-write)."""
    if options.num_blocks is not None:
        return options.num_blocks
    if options.max_memory is not None:
        size = block_bytes(options.layout, options.block_size, model.dtype)
        if options.max_memory < size:
            raise ValueError(
                f"max_memory: {options.max_memory} bytes is less than one block ({size} bytes)"
            )
        return options.max_memory // size
    inputs = args[0] if args else None
    for name in ("input_ids", "inputs", "inputs_embeds"):
        if inputs is None:
            inputs = kwargs.get(name)
    batch, prompt = inputs.shape[:2] if inputs is not None else (1, 1)
    config = kwargs.get("generation_config") or model.generation_config

    def get(name):
        value = kwargs.get(name)
        return getattr(config, name, None) if value is None else value

    new_tokens = get("max_new_tokens")
    total = prompt + new_tokens if new_tokens is not None else max(get("max_length") or 20, prompt)
    rows = batch * max(get("num_beams") or 1, get("num_return_sequences") or 1)
    return rows * (math.ceil(total / options.block_size) + 1)
