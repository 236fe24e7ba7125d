"""Sliding windows changed after ``patch_model``: refused, since stock would follow them.

transformers reads ``config.sliding_window`` and ``config.layer_types`` at every forward to
build its masks (Qwen2/3, Gemma 2/3) or to pass the window (Mistral, Phi-3), while an
attention module keeps the window and layer type it was built with, and nanoserve laid out
its pools (which blocks a sliding layer may release, the layer groups) at patch time. A
change to either after patching would make the paged attention differ from stock.
"""

from __future__ import annotations

import sys

from nanoserve.adapters.family import KVLayout
from nanoserve.adapters.module_attrs import module_attr
from nanoserve.adapters.registry import family_for
from nanoserve.adapters.tensor_parallel import local_layout

_NONE = object()
# What transformers' modeling modules import when their forward builds sliding-window masks.
SLIDING_MASK = "create_sliding_window_causal_mask"


def stock_slides(model) -> bool:
    """Whether the transformers modeling module behind ``model``'s class (its own, or the
    nearest in its bases, for a user's subclass) builds sliding-window masks; True when no
    transformers module is found (the windows then stay as the config gives them)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.models."):
            module = sys.modules.get(cls.__module__)
            return module is None or hasattr(module, SLIDING_MASK)
    return True


def _sliding_layers(config) -> bool:
    """Whether ``config`` gives a window and marks a layer sliding in ``layer_types`` (where
    transformers' DynamicCache keeps a sliding layer for it, whatever the attention does)."""
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    return window is not None and "sliding_attention" in layer_types


def check_windows(model, layout: KVLayout) -> None:
    """ValueError naming ``config.sliding_window`` (or ``layer_types``) when the windows of
    ``model`` are not ones its paged pools were laid out for (``layout``, from
    ``patch_model``; a window every layer shares may narrow), when an attention module
    holds a window or layer type other than the config's, which stock's masks follow, or
    when the config gives a window that the model's attention ignores (``stock_slides``)."""
    config = model.config
    family = family_for(config)
    now = local_layout(family.layout(config), model)
    windowed = now.sliding_window is not None or now.layer_groups or _sliding_layers(config)
    if windowed and not stock_slides(model):
        raise ValueError(
            f"config.sliding_window: {config.sliding_window} on a {config.model_type} model, "
            "whose attention ignores it; transformers' DynamicCache then keeps only the last "
            "window of keys for the decode steps (of every layer config.layer_types marks "
            "sliding) while the prefill sees every position, which nanoserve does not "
            "reproduce; set model.config.sliding_window = None and config.layer_types to full "
            "attention (every step then attends to all positions, as the prefill does) and "
            "patch again"
        )
    if not _fits(now, layout):
        raise ValueError(
            "config.sliding_window / config.layer_types: changed after patch_model (the "
            f"paged pools were laid out for window {layout.sliding_window} and layer groups "
            f"{_groups(layout)}; the config now gives {now.sliding_window} and "
            f"{_groups(now)}); call nanoserve.patch_model(model) again to lay them out anew, "
            "or restore the config"
        )
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    for layer in family.decoder_layers(model):
        attention = module_attr(layer, "self_attn")
        index = module_attr(attention, "layer_idx") if attention is not None else None
        if not isinstance(index, int):
            continue
        kind = layer_types[index] if layer_types and index < len(layer_types) else None
        held_kind = module_attr(attention, "layer_type", _NONE)
        sliding = module_attr(attention, "is_sliding", _NONE)  # Exaone 4 marks it so
        if held_kind is _NONE and isinstance(sliding, bool):
            held_kind = "sliding_attention" if sliding else "full_attention"
        if held_kind is not _NONE and kind is not None and held_kind != kind:
            raise ValueError(
                f"config.layer_types: layer {index} is {kind!r} in the config but its "
                f"attention was built as {held_kind!r}; stock's masks follow the config, the "
                "attention module its own: rebuild the model, or restore the config"
            )
        held = module_attr(attention, "sliding_window", _NONE)
        if held is _NONE or kind is None:
            continue  # the attention reads the config's window itself (Mistral, Phi-3)
        if sliding is False:
            held = None  # it holds the window but passes it on sliding layers only
        expected = window if kind == "sliding_attention" else None
        if held != expected:
            raise ValueError(
                f"config.sliding_window: layer {index}'s attention holds sliding_window="
                f"{held}, but stock's masks use {expected} (config.sliding_window="
                f"{window}, layer type {kind!r}); set the attention modules' sliding_window "
                "to the config's, or restore the config"
            )


def _fits(now: KVLayout, laid_out: KVLayout) -> bool:
    """Whether pools laid out for ``laid_out`` hold what ``now`` attends to: the same windows,
    or one window for every layer, no wider than the pools keep (they then keep more)."""
    if (now.sliding_window, now.layer_groups) == (laid_out.sliding_window, laid_out.layer_groups):
        return True
    uniform = now.layer_groups is None and laid_out.layer_groups is None
    return (
        uniform
        and now.sliding_window is not None
        and laid_out.sliding_window is not None
        and now.sliding_window <= laid_out.sliding_window
    )


def _groups(layout: KVLayout) -> str:
    if layout.layer_groups is None:
        return "none"
    return ", ".join(f"{len(layers)} layers window {w}" for layers, w in layout.layer_groups)
