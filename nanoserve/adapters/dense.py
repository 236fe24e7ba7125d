"""Dense decoders whose attention keeps Llama's contract: OLMo, OLMo 2, OLMo 3, Granite,
StarCoder2, Cohere (Command R), Cohere 2, SmolLM3, GLM, GLM-4, Helium, Ministral, EXAONE 4,
StableLM, GPT-NeoX (Pythia), Phi (1, 1.5, 2), Seed-OSS, Apertus, Arcee, ERNIE 4.5, Nemotron,
Hunyuan (dense) and BitNet.

Their attention modules call ``cache.update(k, v, layer_idx)`` and then the registered
attention function with ``scaling`` and, on sliding layers, ``sliding_window``; what else
sets them apart (q/k norms, partial or interleaved rotary, QKV clipping, Granite's
multipliers, Cohere's parallel block and logit scale, NoPE layers, Nemotron's 1p norm) acts
on the query and key before ``cache.update`` or outside attention, so the cache stores the
K/V it is given. Their model classes keep GenerationMixin's ``prepare_inputs_for_generation``.
Sliding layers mixed with global ones (``config.layer_types``: OLMo 3, Cohere 2, SmolLM3,
Ministral, EXAONE 4) are stored in a pool of their own, as Gemma's are.
"""

from __future__ import annotations

from nanoserve.adapters.family import Family, window_groups
from nanoserve.adapters.llama import kv_layout

KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


def check(config) -> None:
    """NotImplementedError for attention the paged kernels do not compute: bidirectional
    layers, or a layer type other than full and sliding attention (chunked, linear, ...)."""
    if getattr(config, "is_causal", True) is False or getattr(
        config, "use_bidirectional_attention", False
    ):
        raise NotImplementedError(f"nanoserve: bidirectional {config.model_type} models")
    unknown = set(getattr(config, "layer_types", None) or ()) - set(KNOWN_LAYER_TYPES)
    if unknown:
        raise NotImplementedError(
            f"nanoserve: layer_types {sorted(unknown)} in a {config.model_type} config"
        )


MODEL_TYPES = (
    "olmo", "olmo2", "olmo3", "granite", "starcoder2", "cohere", "cohere2", "smollm3",
    "glm", "glm4", "helium", "ministral", "exaone4", "stablelm", "gpt_neox", "phi",
    "seed_oss", "apertus", "arcee", "ernie4_5", "nemotron", "hunyuan_v1_dense", "bitnet",
)  # fmt: skip

DENSE = Family(
    name="dense",
    model_types=MODEL_TYPES,
    kv_layout=kv_layout,
    decoder_layers=lambda model: model.base_model.layers,
    check=check,
    cache_groups=window_groups,
)
