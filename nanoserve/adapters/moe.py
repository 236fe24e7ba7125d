"""Mixture-of-experts decoders whose attention keeps Llama's contract: Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, GraniteMoE (and its shared-expert variant), GLM-4.5 (``glm4_moe``), ERNIE
4.5 MoE and Hunyuan MoE.

Attention is as in ``dense.py``; the experts act between the layers' attentions and are the
model's own code (``config._experts_implementation``: transformers' default "grouped_mm"
keeps the routing on the device, and the decode steps are captured as CUDA graphs). An
implementation that reads the routing on the host cannot be captured: the first capture
fails, a warning says so, and the steps run eagerly (``decode_graph_stats(model)
["disabled"]`` gives the reason), with stock's tokens.
"""

from __future__ import annotations

from nanoserve.adapters.dense import check
from nanoserve.adapters.family import Family, window_groups
from nanoserve.adapters.llama import kv_layout

MODEL_TYPES = (
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared",
    "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe",
)  # fmt: skip

MOE = Family(
    name="moe",
    model_types=MODEL_TYPES,
    kv_layout=kv_layout,
    decoder_layers=lambda model: model.base_model.layers,
    check=check,
    cache_groups=window_groups,
)
