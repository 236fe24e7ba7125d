"""Family: what nanoserve needs to know about one kind of HF model (a small record)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's K (or V) in one layer, and how many layers cache it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Family:
    """A model family: the ``config.model_type`` values it covers and its KV layout.

    ``check(config)`` raises NotImplementedError for a config feature the adapter does not
    handle (it may be None when every config of the family is fine). ``decoder_layers(model)``
    gives the model's decoder layers (what ``compile_decode`` compiles).
    """

    name: str
    model_types: tuple[str, ...]
    kv_layout: Callable[[object], KVLayout]
    decoder_layers: Callable[[object], Sequence[object]]
    check: Callable[[object], None] | None = None
