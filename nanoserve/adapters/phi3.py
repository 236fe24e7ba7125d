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

from nanoserve.adapters.family import Family
from nanoserve.adapters.llama import kv_layout

PHI3 = Family(
    name="phi3",
    model_types=("phi3",),
    kv_layout=kv_layout,
    decoder_layers=lambda model: model.base_model.layers,
)
