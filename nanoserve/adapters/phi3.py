"""The Phi-3 family: Phi-3 / Phi-3.5-mini (and Phi-4-mini, which shares ``model_type`` "phi3").

The fused qkv projection, partial rotary and long-rope scaling all act before
``cache.update``; the attention function sees Llama's contract: ``scaling = head_dim**-0.5``
and ``sliding_window = config.sliding_window`` on every layer (2047 in the 4k-context
checkpoints). Long-rope models re-run the whole sequence once, without a cache, when it first
grows past ``original_max_position_embeddings`` (``Phi3ForCausalLM.prepare_inputs_for_
generation`` passes no cache to that forward): that forward and the rest of the call then run
on stock's cache, as stock does, and give stock's tokens.
"""

from __future__ import annotations

from transformers import GenerationMixin, Phi3ForCausalLM

from nanoserve.adapters.family import Family
from nanoserve.adapters.llama import kv_layout


def plain_steps(model, max_length: int) -> bool:
    """Whether Phi-3's own ``prepare_inputs_for_generation`` acts as GenerationMixin's in a
    call ending at ``max_length`` tokens: it drops the cache only when the sequence grows past
    ``original_max_position_embeddings``. (A subclass's own override is not vouched for.)"""
    cls = type(model)
    if cls.prepare_inputs_for_generation is not Phi3ForCausalLM.prepare_inputs_for_generation:
        return False
    own_update = cls._update_model_kwargs_for_generation
    if own_update is not GenerationMixin._update_model_kwargs_for_generation:
        return False
    original = getattr(model.config, "original_max_position_embeddings", None)
    return original is None or max_length <= original


PHI3 = Family(
    name="phi3",
    model_types=("phi3",),
    kv_layout=kv_layout,
    decoder_layers=lambda model: model.base_model.layers,
    plain_steps=plain_steps,
)
