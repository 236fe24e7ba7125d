"""The attention and mask functions registered with transformers under ``ATTN_NAME``.

A patched model runs them for every forward. During a paged step (``step.current_step()``:
the patched forward opened one for a ``PagedCache``) attention reads the paged pools through
the step's block tables and the mask is skipped (the step metadata already knows which
columns are padding). Otherwise both run the attention the config had before patching, so a
patched model called without a paged cache, or an unpatched model sharing its config,
behaves as stock.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from nanoserve.adapters.fused_inputs import records_grad
from nanoserve.adapters.step import current_step, original_attn
from nanoserve.kernels import paged_decode_attention, paged_extend_attention

# No "sdpa", "flash" or "flex" in the name: transformers gives those substrings meaning.
ATTN_NAME = "nanoserve_paged"
# The name ``from_pretrained(attn_implementation=...)`` takes to patch the model it loads
# (``hf_native.py``); a model switched to it by hand is refused until patched again.
DOOR = "nanoserve"


def _original_attention(module: torch.nn.Module):
    name = original_attn(module.config)
    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return sys.modules[type(module).__module__].eager_attention_forward  # "eager"


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, Hq, q, D]; key/value are the layer's pools (from ``PagedCache.update``).

    Returns (out [B, q, Hq, D], None); pad rows of the output are zero.
    """
    if torch.compiler.is_compiling():  # compile_decode: the paged read stays Triton
        return _paged_attention_uncompiled(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    current = current_step()
    if current is None:
        return _original_attention(module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout > 0:
        raise ValueError(
            f"dropout: {type(module).__name__} asks for attention dropout {dropout} (the model "
            "is in training mode), which the paged kernels do not apply; call model.eval() "
            "before generate, or nanoserve.unpatch_model(model) to generate with dropout"
        )
    layer = getattr(module, "layer_idx", None)
    # the layer's pool, by address (compiled layers hand it on through their graph breaks)
    pool = current.cache.paged.layer_pools(layer)[0] if layer is not None else None
    if pool is None or key.data_ptr() != pool.data_ptr():
        raise RuntimeError(
            f"{type(module).__name__} (layer {layer}) attends over tensors other than its "
            "layer's paged pool while a paged forward runs: a forward of another model that "
            "shares this model's config, inside the patched one (from a hook, say): patch that "
            "model too (nanoserve.patch_model), or give it a config of its own; or layers "
            "called without the cache (transformers' gradient checkpointing drops it in "
            "training mode: call model.eval() or model.gradient_checkpointing_disable() "
            "before a forward over a PagedCache)"
        )
    meta = current.meta
    if meta.group_metas:
        if layer is None:
            raise RuntimeError(
                f"{type(module).__name__} has no layer_idx: the cache's layer groups need it "
                "to pick the layer's block tables"
            )
        meta = meta.group_metas[meta.layer_groups[layer]]
    step = meta.to(query.device)  # the step itself unless the layer lives elsewhere
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    paged = current.cache.paged
    kept = paged.layer_window(layer)
    if kept is not None and (window is None or window > kept):
        raise RuntimeError(
            f"layer {getattr(module, 'layer_idx', '?')} of {type(module).__name__} attends "
            f"{'to all positions' if window is None else f'within {window}'}, but the cache "
            f"releases blocks older than {kept} positions: a cache built for a shorter "
            "sliding window than this layer's (build it from the model's config, or let "
            "generate make one), or the family's cache_window wrong for this config"
        )
    batch, heads, q_len, head_dim = query.shape
    k_scale, v_scale = paged.scales_for(key)  # (None, None) unless FP8 pools
    opts = dict(
        scale=scaling,
        sliding_window=window,
        softcap=kwargs.get("softcap"),
        check=False,
        # the references where autograd records this layer (the kernels record nothing), as
        # for every layer of a step whose inputs or weights require grad
        backend="torch" if records_grad(query, key, value) else current.backend,
    )
    if k_scale is not None:
        opts.update(k_scale=k_scale, v_scale=v_scale)
    if step.all_single and q_len == 1:
        out = paged_decode_attention(
            query[:, :, 0].contiguous(), key, value, step.block_tables, step.seq_lens,
            equal_lengths=step.equal_lengths, shared_prefix=step.shared_prefix, **opts,
        )  # fmt: skip
        return out.unsqueeze(1), None
    # The padded width bounds every row's new tokens: few of them (verify steps of assisted
    # generation, short turns) take the memory-bound split-KV kernel.
    opts.update(max_query_len=q_len)
    flat = query.transpose(1, 2).reshape(batch * q_len, heads, head_dim)
    if step.token_index.shape[0] == flat.shape[0]:
        # No padding column (a shape fact: no device read): the real tokens are every row
        # of the padded layout, in order, so the packed query is the padded one.
        out = paged_extend_attention(
            flat, key, value, step.block_tables, step.seq_lens, step.cu_seqlens_q, **opts
        )
        return out.view(batch, q_len, heads, head_dim), None
    packed = flat.index_select(0, step.token_index)
    out = paged_extend_attention(
        packed, key, value, step.block_tables, step.seq_lens, step.cu_seqlens_q, **opts
    )
    full = torch.zeros_like(flat).index_copy_(0, step.token_index, out)
    return full.view(batch, q_len, heads, head_dim), None


_paged_attention_uncompiled = torch.compiler.disable(paged_attention)


def paged_mask(*args, **kwargs):
    """None during a paged step (attention needs no mask); else the original mask."""
    if current_step() is not None:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[original_attn(kwargs.get("config"))](*args, **kwargs)


def register() -> None:
    """Make ``ATTN_NAME`` known to transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, paged_mask)
