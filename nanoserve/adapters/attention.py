"""The attention and mask functions registered with transformers under ``ATTN_NAME``.

A patched model runs them for every forward. When the forward carries a ``PagedCache`` (the
hook in ``hf.py`` marks it active on the model's ``PatchState``) attention reads the paged
pools through the step's block tables and the mask is skipped (the step metadata already
knows which columns are padding). Otherwise both fall back to the model's original
implementation, so a patched model called without generate behaves as stock.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from nanoserve.kernels import paged_decode_attention, paged_extend_attention

# No "sdpa", "flash" or "flex" in the name: transformers gives those substrings meaning.
ATTN_NAME = "nanoserve_paged"


@dataclass
class PatchState:
    """What a patched model remembers: its original attention and the cache of the forward
    in flight (None outside a paged forward)."""

    original_attn: str
    cache: object | None = None
    # the latest generate call's PagedCache: weakly, or strongly after a call that raised
    last_cache: Callable[[], object | None] = lambda: None
    last_stats: dict = field(default_factory=dict)  # its figures as that call left them
    kept_pools: object | None = None  # hf.KeptPools of the latest call
    previous_generate: object | None = None
    previous_forward: object | None = None
    undo: list = field(default_factory=list)
    cuda_graphs: bool = False
    graphs: object | None = None  # DecodeGraphs when cuda_graphs
    in_graph_step: bool = False  # the graph runner owns the step: the hooks stand aside
    compiled_layers: object | None = None  # CompiledLayers when compile_decode


# id(config) -> PatchState. The attention and mask functions only see the module / config.
STATES: dict[int, PatchState] = {}


def _original_attention(module: torch.nn.Module, name: str):
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
    state = STATES.get(id(module.config))
    if state is None or state.cache is None:
        original = _original_attention(module, state.original_attn if state else "sdpa")
        return original(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    step = state.cache.step.to(query.device)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    softcap = kwargs.get("softcap")
    batch, heads, q_len, head_dim = query.shape
    opts = dict(scale=scaling, sliding_window=window, softcap=softcap, check=False)
    if step.all_single and q_len == 1:
        out = paged_decode_attention(
            query[:, :, 0].contiguous(), key, value, step.block_tables, step.seq_lens, **opts
        )
        return out.unsqueeze(1), None
    flat = query.transpose(1, 2).reshape(batch * q_len, heads, head_dim)
    packed = flat.index_select(0, step.token_index)
    out = paged_extend_attention(
        packed, key, value, step.block_tables, step.seq_lens, step.cu_seqlens_q, **opts
    )
    full = torch.zeros_like(flat).index_copy_(0, step.token_index, out)
    return full.view(batch, q_len, heads, head_dim), None


_paged_attention_uncompiled = torch.compiler.disable(paged_attention)


def paged_mask(*args, **kwargs):
    """None during a paged forward (attention needs no mask); else the original mask."""
    config = kwargs.get("config")
    state = STATES.get(id(config)) if config is not None else None
    if state is not None and state.cache is not None:
        return None
    original = state.original_attn if state is not None else "sdpa"
    return ALL_MASK_ATTENTION_FUNCTIONS[original](*args, **kwargs)


def register() -> None:
    """Make ``ATTN_NAME`` known to transformers (idempotent)."""
    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, paged_mask)
