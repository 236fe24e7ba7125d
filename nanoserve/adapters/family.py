"""Family: what nanoserve needs to know about one kind of HF model (a small record)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's K (or V) in one layer, and how many layers cache it.

    ``sliding_window``: the window every layer's attention is given (the cache may then
    release blocks that fell out of it); None when some layer sees the whole history.
    ``layer_groups``: for a model that mixes sliding and global layers, ((layer indices),
    window or None) per group of layers that attend alike, each stored in a pool of its own
    (``nanoserve.cache.GroupedKVCache``); None stores every layer in one pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    layer_groups: tuple[tuple[tuple[int, ...], int | None], ...] | None = None


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


def window_groups(config) -> tuple[tuple[tuple[int, ...], int | None], ...] | None:
    """The layers of ``config``'s model grouped by what they attend to: (global layers,
    None) and (sliding layers, window), from ``config.layer_types``; None unless both kinds
    are there (one group: ``uniform_window`` covers it)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or not layer_types:
        return None
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    full = tuple(i for i, t in enumerate(layer_types) if t != "sliding_attention")
    if not sliding or not full:
        return None
    return ((full, None), (sliding, int(window)))


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
    nanoserve's decode loop may skip it (None: never). ``cache_groups`` gives the layer
    groups (``KVLayout.layer_groups``) of a model mixing sliding and global layers, or None
    (the default: every layer in one pool). ``gated_mlp_classes``: the family's MLP classes
    whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (``fuse_decode``
    runs them as two launches when ``act_fn`` is SiLU); ``rms_norm_classes``: its norm classes
    computing ``weight * (x * rsqrt(mean(x**2) + eps)).to(dtype)`` as ``LlamaRMSNorm`` does
    (``fuse_decode`` runs them as one launch); ``rotary_attention_classes``: its attention
    classes whose forward calls its modeling module's ``apply_rotary_pos_emb(q, k, cos,
    sin)`` with Llama's formula (``fuse_decode`` runs it as one launch);
    ``rotary_embedding_classes``: its rotary embedding classes whose forward ``(x,
    position_ids)`` returns Llama's cos and sin tables (``fuse_decode`` computes them in one
    launch);
    ``pre_norm_layer_classes``: its decoder layer classes whose forward adds ``self_attn``'s
    output (its ``o_proj``'s) to the layer's input and normalizes the sum with
    ``post_attention_layernorm``, then adds ``mlp``'s output and hands the sum to the next
    layer (``fuse_decode`` runs each add with the norm after it as one launch).
    """

    name: str
    model_types: tuple[str, ...]
    kv_layout: Callable[[object], KVLayout]
    decoder_layers: Callable[[object], Sequence[object]]
    check: Callable[[object], None] | None = None
    cache_window: Callable[[object], int | None] = uniform_window
    plain_steps: Callable[[object, int], bool] | None = None
    cache_groups: Callable[[object], tuple | None] = lambda config: None
    gated_mlp_classes: tuple[str, ...] = ()
    rms_norm_classes: tuple[str, ...] = ()
    rotary_attention_classes: tuple[str, ...] = ()
    rotary_embedding_classes: tuple[str, ...] = ()
    pre_norm_layer_classes: tuple[str, ...] = ()

    def layout(self, config) -> KVLayout:
        """``kv_layout(config)`` with its ``sliding_window`` from ``cache_window`` and its
        ``layer_groups`` from ``cache_groups``."""
        return replace(
            self.kv_layout(config),
            sliding_window=self.cache_window(config),
            layer_groups=self.cache_groups(config),
        )
