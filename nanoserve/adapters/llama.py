"""The Llama family: Llama (SmolLM2 is one), Mistral, Qwen2, Qwen3.

They share the attention module's contract: ``cache.update(k, v, layer_idx)`` then the
registered attention function with ``scaling`` and, for sliding layers, ``sliding_window``.
"""

from __future__ import annotations

from nanoserve.adapters.family import Family, KVLayout


def kv_layout(config) -> KVLayout:
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        head_dim = config.hidden_size // config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KVLayout(config.num_hidden_layers, num_kv_heads, head_dim)


def check(config) -> None:
    if getattr(config, "is_causal", True) is False:
        raise NotImplementedError("nanoserve: bidirectional (is_causal=False) models")


LLAMA = Family(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    kv_layout=kv_layout,
    decoder_layers=lambda model: model.base_model.layers,
    check=check,
    gated_mlp_classes=("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"),
    rms_norm_classes=("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"),
    rotary_attention_classes=(
        "LlamaAttention",
        "MistralAttention",
        "Qwen2Attention",
        "Qwen3Attention",
    ),
    rotary_embedding_classes=(
        "LlamaRotaryEmbedding",
        "MistralRotaryEmbedding",
        "Qwen2RotaryEmbedding",
        "Qwen3RotaryEmbedding",
    ),
    pre_norm_layer_classes=(
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
    ),
)
