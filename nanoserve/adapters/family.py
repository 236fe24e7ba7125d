"""Family: what nanoserve needs to know about one kind of HF model (a small record)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's K (or V) in one layer, and how many layers cache it.

    ``sliding_window``: the window every layer's attention is given (the cache may then
    release blocks that fell out of it); None when some layer sees the whole history."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None


def uniform_window(config) -> int | None:
    """The window every layer of ``config``'s model attends within, or None when a layer
    attends to all of the history. transformers marks the sliding layers in
    ``config.layer_types`` (Gemma, Qwen2/3); a config with ``sliding_window`` and no
    ``layer_types`` slides every layer (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "sliding_attention" for t in layer_types):
        return None
    return int(window)


@dataclass(frozen=True)
class Family:
    """A model family: the ``config.model_type`` values it covers and its KV layout.

    ``check(config)`` raises NotImplementedError for a config feature the adapter does not
    handle (it may be None when every config of the family is fine). ``decoder_layers(model)``
    gives the model's decoder layers (what ``compile_decode`` compiles). ``cache_window``
    gives the window every layer attends within (``KVLayout.sliding_window``).
    ``plain_steps(model, max_length)``: for a family whose model class overrides what HF's
    loop calls every step (``prepare_inputs_for_generation``), True when that override does
    nothing more than GenerationMixin's in a call that ends at ``max_length`` tokens, so
    nanoserve's decode loop may skip it (None: never).
    """

    name: str
    model_types: tuple[str, ...]
    kv_layout: Callable[[object], KVLayout]
    decoder_layers: Callable[[object], Sequence[object]]
    check: Callable[[object], None] | None = None
    cache_window: Callable[[object], int | None] = uniform_window
    plain_steps: Callable[[object, int], bool] | None = None

    def layout(self, config) -> KVLayout:
        """``kv_layout(config)`` with its ``sliding_window`` from ``cache_window``."""
        return replace(self.kv_layout(config), sliding_window=self.cache_window(config))
