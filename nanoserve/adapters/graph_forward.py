"""The patched model's ``forward`` on CUDA: decode steps go through the graph runner.

A forward that is a decode step the captured graphs reproduce exactly (one new token in
every row, every row real, only the arguments generate passes) opens the paged step on the
host and runs through ``DecodeGraphs``; every other forward goes to the stock one unchanged.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from nanoserve.adapters.attention import PatchState
from nanoserve.adapters.hf_cache import CACHE_KWARGS, PagedCache

# Forward arguments a captured decode step reproduces; any other one runs the step eagerly.
_GRAPH_KWARGS = {
    "input_ids", "attention_mask", "position_ids", "use_cache", "cache_position",
    "logits_to_keep", "return_dict", *CACHE_KWARGS,
}  # fmt: skip


def graph_forward(stock_forward, state: PatchState, cache_name: str):
    """``forward`` that runs decode steps through ``state.graphs``; everything else (and any
    step it cannot reproduce exactly) goes to ``stock_forward`` unchanged."""

    @functools.wraps(stock_forward)
    def forward(*args, **kwargs):
        new_tokens = _graph_step_mask(state, args, kwargs)
        if new_tokens is None:
            return stock_forward(*args, **kwargs)
        cache = next(kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None)
        extra = {k: kwargs[k] for k in ("logits_to_keep",) if k in kwargs}

        def run_forward(static):
            cache.paged.step = static.meta
            state.cache = cache
            compiled = state.compiled_layers
            with compiled.active() if compiled is not None else contextlib.nullcontext():
                return stock_forward(
                    input_ids=static.input_ids, position_ids=static.position_ids,
                    attention_mask=None, use_cache=True, **{cache_name: cache}, **extra,
                )  # fmt: skip

        host = cache.begin_step(new_tokens, "cpu")  # blocks are allocated here, on the host
        state.in_graph_step = True
        try:
            output = state.graphs.step(
                cache, host, kwargs["input_ids"], kwargs["position_ids"], run_forward
            )
        finally:
            state.in_graph_step = False
            state.cache = None
        cache.end_step()
        return output

    return forward


def memory_signature(model_ref, cache: PagedCache) -> tuple:
    """Addresses, dtypes and shapes of what a captured decode step reads and writes in
    place: the cache's pools and the model's weights and buffers."""
    tensors = (*cache.paged.key_pools, *cache.paged.value_pools)
    model = model_ref()
    if model is not None:
        tensors += (*model.parameters(), *model.buffers())
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors if t is not None)


def _graph_step_mask(state: PatchState, args, kwargs) -> torch.Tensor | None:
    """The step's new-token mask [B, 1] (all True) when this forward is a decode step a
    graph can run; else None."""
    graphs = state.graphs
    if graphs is None or graphs.disabled_reason is not None or args:
        return None
    if not set(kwargs) <= _GRAPH_KWARGS or False in (
        kwargs.get("use_cache"),
        kwargs.get("return_dict"),
    ):
        return None
    cache = next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)
    ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
    if not isinstance(cache, PagedCache) or ids is None or positions is None:
        return None
    if (
        not (ids.is_cuda or not graphs.capture)
        or ids.dim() != 2
        or ids.shape[1] != 1
        or positions.shape != ids.shape
    ):
        return None
    paged = cache.paged
    if paged.num_seqs != ids.shape[0] or any(
        pool is None or pool.device != ids.device for pool in paged.key_pools
    ):
        return None  # prefill has not run yet, or layers live on several devices
    mask = kwargs.get("attention_mask")
    if mask is None:
        return torch.ones(ids.shape[0], 1, dtype=torch.bool)
    if mask.dim() != 2:
        return None
    new = mask[:, -1:].to("cpu", torch.bool)
    return new if bool(new.all()) else None
