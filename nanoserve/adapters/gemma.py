"""The Gemma family: Gemma 2 and Gemma 3's text models (``Gemma3ForCausalLM``), and Gemma
(1), whose attention is Llama's (head_dim 256, no softcap, no window).

What their attention modules hand the attention function, beyond Llama's contract: the
scale ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``), Gemma 2's logit softcap
(``softcap=``; Gemma 3 passes none), and ``sliding_window`` on the layers that
``config.layer_types`` marks "sliding_attention" (None on the global ones). ``paged_attention``
takes all three from the call, so a layer is computed as stock computes it. Gemma 3's q/k
norms and its separate rope base for local layers act on the query and key before
``cache.update``: the cache stores the K it is given and needs nothing of them. Like HF's
own cache, which keeps only the last window of a sliding layer, the sliding layers are
stored in a pool of their own whose blocks are released once they fall out of the window
(``window_groups``: a global and a sliding layer group); the window is applied when
attention reads the pool.
"""

from __future__ import annotations

from nanoserve.adapters.family import Family, window_groups
from nanoserve.adapters.llama import kv_layout

KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


def check(config) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError("nanoserve: bidirectional (use_bidirectional_attention) models")
    unknown = set(getattr(config, "layer_types", None) or ()) - set(KNOWN_LAYER_TYPES)
    if unknown:
        raise NotImplementedError(f"nanoserve: layer_types {sorted(unknown)} in a Gemma config")


GEMMA = Family(
    name="gemma",
    model_types=("gemma", "gemma2", "gemma3_text"),
    kv_layout=kv_layout,
    decoder_layers=lambda model: model.base_model.layers,
    check=check,
    cache_groups=window_groups,
    rotary_attention_classes=("GemmaAttention", "Gemma2Attention", "Gemma3Attention"),
    # (Gemma 3's module takes a layer type and holds a table of frequencies per type)
    rotary_embedding_classes=("GemmaRotaryEmbedding", "Gemma2RotaryEmbedding"),
)
