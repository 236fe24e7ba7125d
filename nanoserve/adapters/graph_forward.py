"""Decode steps of a patched model through the CUDA-graph runner (``decode_graphs.py``).

A forward that is a decode step the captured graphs reproduce exactly (one new token in
every row, every row real, only the arguments generate passes, pools on the tokens' device)
opens its paged step on the host and runs through ``DecodeGraphs``; the caller runs every
other forward eagerly.
"""

from __future__ import annotations

import contextlib

import torch

from nanoserve.adapters.compiled_layers import CompiledLayers
from nanoserve.adapters.registry import family_for
from nanoserve.adapters.step import CACHE_KWARGS, PatchState, paged_step

# Forward arguments a captured decode step reproduces; any other one runs the step eagerly.
_GRAPH_KWARGS = {
    "input_ids", "attention_mask", "position_ids", "use_cache", "cache_position",
    "logits_to_keep", "return_dict", *CACHE_KWARGS,
}  # fmt: skip


def graph_step_possible(state: PatchState, cache, kwargs: dict, new: torch.Tensor) -> bool:
    """True when this forward (new-token mask ``new`` [B, q]) is a decode step a captured
    graph runs exactly."""
    graphs = state.graphs
    if graphs is None or graphs.disabled_reason is not None or cache.drops_out is not None:
        return False  # (a replay would not draw dropout as an eager step does)
    if not set(kwargs) <= _GRAPH_KWARGS or False in (
        kwargs.get("use_cache"),
        kwargs.get("return_dict"),
    ):
        return False
    ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
    if ids is None or positions is None or ids.dim() != 2 or ids.shape[1] != 1:
        return False
    if not (ids.is_cuda or not graphs.capture) or positions.shape != ids.shape:
        return False
    paged = cache.paged
    if paged.num_seqs != ids.shape[0] or any(
        pool is None or pool.device != ids.device for pool in paged.key_pools
    ):
        return False  # prefill has not run yet, or layers live on several devices
    return bool(new.all())


def graph_decode_step(model, state: PatchState, stock_forward, cache, kwargs, new):
    """Run one decode step through ``state.graphs``: blocks are allocated on the host by
    ``begin_step``, then the captured graph (or its first capture) runs on static buffers."""
    cache_name = next(k for k in CACHE_KWARGS if kwargs.get(k) is not None)
    extra = {k: kwargs[k] for k in ("logits_to_keep",) if k in kwargs}

    def run_forward(static):
        with paged_step(cache, static.meta, state.backend), _compiled(model, state):
            return stock_forward(
                input_ids=static.input_ids, position_ids=static.position_ids,
                attention_mask=None, use_cache=True, **{cache_name: cache}, **extra,
            )  # fmt: skip

    host = cache.begin_step(new, "cpu")
    try:
        output = state.graphs.step(
            cache,
            host,
            kwargs["input_ids"],
            kwargs["position_ids"],
            run_forward,
            signature=lambda c: memory_signature(model, c),
        )
    except BaseException:
        cache.abort_step()
        raise
    cache.end_step()
    return output


def _compiled(model, state: PatchState):
    if not state.compile_decode:
        return contextlib.nullcontext()
    if state.compiled_layers is None:
        state.compiled_layers = CompiledLayers(family_for(model.config).decoder_layers(model))
    return state.compiled_layers.active()


def memory_signature(model, cache) -> tuple:
    """Addresses, dtypes and shapes of what a captured decode step reads and writes in
    place: the cache's pools and the model's weights and buffers."""
    tensors = (*cache.paged.key_pools, *cache.paged.value_pools)
    tensors += (*model.parameters(), *model.buffers())
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors if t is not None)
