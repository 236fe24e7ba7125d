"""patch_model / unpatch_model / cache_stats: put the paged cache under a stock HF model.

Patching (1) registers nanoserve's attention and mask functions and switches the model to
them, (2) hooks the base model's forward so each forward that carries a ``PagedCache`` opens
one step (``begin_step`` with the real-token mask of its columns) and closes it, (3) wraps
``generate`` so that a call without a cache gets a fresh ``PagedCache``, and (4) on CUDA,
wraps ``forward`` so that decode steps replay CUDA graphs (``graph_forward.py``,
``decode_graphs.py``).
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.adapters.attention import ATTN_NAME, STATES, PatchState, register
from nanoserve.adapters.compiled_layers import CompiledLayers
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.graph_forward import graph_forward, memory_signature
from nanoserve.adapters.hf_cache import CACHE_KWARGS, PagedCache, cache_kwarg
from nanoserve.adapters.registry import family_for
from nanoserve.adapters.sizing import PoolOptions, pool_size
from nanoserve.adapters.tensor_parallel import local_layout, tp_size


def patch_model(
    model,
    *,
    block_size: int = 16,
    num_blocks=None,
    max_memory=None,
    cuda_graphs: bool = True,
    compile_decode: bool = False,
):
    """Make ``model.generate`` run on the paged KV cache; returns ``model``.

    The pool holds ``num_blocks`` blocks of ``block_size`` tokens, or as many as fit in
    ``max_memory`` bytes, or by default what each generate call needs. With
    ``cuda_graphs`` (the default) decode steps on CUDA replay captured CUDA graphs; on CPU,
    or with ``cuda_graphs=False``, every step runs eagerly. ``compile_decode`` also runs the
    decoder layers of those graph steps through ``torch.compile`` (fewer, fused kernels;
    close to but not bit-equal with stock eager; see ``compiled_layers.py``).
    """
    family = family_for(model.config)  # NotImplementedError first
    layout = local_layout(family.kv_layout(model.config), model)  # this rank's KV heads
    options = PoolOptions(layout, block_size, num_blocks, max_memory)
    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs: must be True or False, got {cuda_graphs!r}")
    if not isinstance(compile_decode, bool):
        raise ValueError(f"compile_decode: must be True or False, got {compile_decode!r}")
    if compile_decode and not cuda_graphs:
        raise ValueError("compile_decode: needs cuda_graphs=True (it compiles the graph steps)")
    if id(model.config) in STATES:
        unpatch_model(model)
    register()
    state = PatchState(original_attn=model.config._attn_implementation, cuda_graphs=cuda_graphs)
    base = model.base_model
    state.undo.append(
        base.register_forward_pre_hook(functools.partial(_open_step, state), with_kwargs=True)
    )
    state.undo.append(
        base.register_forward_hook(functools.partial(_close_step, state), with_kwargs=True)
    )
    key = id(model.config)
    state.undo.append(weakref.finalize(model, STATES.pop, key, None))
    STATES[key] = state
    model.set_attn_implementation(ATTN_NAME)
    state.previous_generate = model.__dict__.get("generate")
    model.generate = types.MethodType(_paged_generate(type(model), state, options), model)
    # Under tensor parallelism every rank would capture the step's collectives; one rank
    # falling back to eager while another replays would hang them, and no multi-GPU run has
    # checked capture there yet: such models decode eagerly.
    if cuda_graphs and tp_size(model) == 1:
        state.graphs = DecodeGraphs(
            signature=functools.partial(memory_signature, weakref.ref(model))
        )
        if compile_decode:
            state.compiled_layers = CompiledLayers(family.decoder_layers(model))
        state.previous_forward = model.__dict__.get("forward")
        model.forward = graph_forward(model.forward, state, cache_kwarg(type(model)))
    return model


def unpatch_model(model):
    """Undo ``patch_model``: attention implementation, generate and hooks as they were."""
    state = STATES.pop(id(model.config), None)
    if state is None:
        return model
    for handle in state.undo:
        if isinstance(handle, weakref.finalize):
            handle.detach()
        else:
            handle.remove()
    model.set_attn_implementation(state.original_attn)
    if state.previous_generate is not None:
        model.generate = state.previous_generate
    else:
        model.__dict__.pop("generate", None)
    if state.graphs is not None:
        state.graphs.reset()
        if state.previous_forward is not None:
            model.forward = state.previous_forward
        else:
            model.__dict__.pop("forward", None)
    state.cache = state.compiled_layers = state.kept_pools = None
    state.last_cache = lambda: None
    return model


def cache_stats(model) -> dict[str, float]:
    """Pool figures of the patched model's latest paged cache (empty before any call):
    num_blocks, blocks_used, tokens, bytes_reserved, bytes_holding_tokens, unused_share.
    Taken from the cache itself while the caller still holds it, else as the call left it."""
    cache = last_cache(model)
    return cache.stats() if cache is not None else dict(_state(model).last_stats)


def last_cache(model) -> PagedCache | None:
    """The ``PagedCache`` of the patched model's latest generate call while something still
    holds it (``return_dict_in_generate=True`` hands it back as the output's cache) or when
    that call raised (say ``OutOfBlocks``); else None, and the next call of the same pool
    size reuses its memory."""
    return _state(model).last_cache()


def _state(model) -> PatchState:
    state = STATES.get(id(model.config))
    if state is None:
        raise ValueError("model: not patched (call nanoserve.patch_model first)")
    return state


def decode_graph_stats(model) -> dict:
    """The patched model's CUDA-graph figures: graphs held, captures, replays, and why
    graphs were turned off (None while they are on)."""
    graphs = _state(model).graphs
    if graphs is None:
        return {"enabled": False, "graphs": 0, "captures": 0, "replays": 0, "disabled": None}
    return {
        "enabled": graphs.disabled_reason is None,
        "graphs": len(graphs.graphs),
        "captures": graphs.captures,
        "replays": graphs.replays,
        "disabled": graphs.disabled_reason,
    }


# -- the step boundary: hooks on the base model's forward -------------------------------------


def _open_step(state: PatchState, module, args, kwargs):
    if state.in_graph_step:
        return None
    state.cache = None
    cache = next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)
    if not isinstance(cache, PagedCache):
        return None
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs["inputs_embeds"]
    batch, q_len = tokens.shape[:2]
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if mask is None:
        new = torch.ones(batch, q_len, dtype=torch.bool)
    elif mask.dim() == 2:
        new = mask[:, -q_len:].bool()
    else:
        raise NotImplementedError("nanoserve: a 4D attention_mask with the paged cache")
    cache.begin_step(new, tokens.device)
    state.cache = cache
    return None


def _close_step(state: PatchState, module, args, kwargs, output):
    if state.cache is not None and not state.in_graph_step:
        state.cache.end_step()
        state.cache = None
    return None


# -- generate ----------------------------------------------------------------------------------


@dataclass
class KeptPools:
    """A finished call's pool lists, kept for the next call of the same pool size."""

    num_blocks: int
    dtype: torch.dtype
    pools: tuple[list, list]  # (key_pools, value_pools)
    owner: Callable[[], object | None]  # weak reference to the PagedKVCache storing in them


def _pools_for(state: PatchState, num_blocks: int, dtype: torch.dtype):
    """The previous call's pool lists when nothing can reach the store that used them (its
    ``PagedCache``, or the ``PagedKVCache`` inside, both let go) and this call's pool has as
    many blocks of the same dtype: the same memory keeps the captured decode graphs valid.
    Otherwise None, and the old pools are let go before new ones are made. (A pool tensor
    taken out of a cache by hand is the caller's to copy.)"""
    kept, state.kept_pools = state.kept_pools, None
    if kept is None or kept.owner() is not None:
        return None
    return kept.pools if (kept.num_blocks, kept.dtype) == (num_blocks, dtype) else None


def _paged_generate(model_class, state: PatchState, options: PoolOptions):
    stock = model_class.generate
    cache_name = cache_kwarg(model_class)

    @functools.wraps(stock)
    def generate(self, *args, **kwargs):
        if state.graphs is not None:
            state.graphs.recheck = True
        user_cache = any(kwargs.get(k) is not None for k in CACHE_KWARGS)
        config = kwargs.get("generation_config") or self.generation_config
        use_cache = kwargs.get("use_cache", getattr(config, "use_cache", True))
        if user_cache or use_cache is False:
            return stock(self, *args, **kwargs)
        for k in CACHE_KWARGS:
            kwargs.pop(k, None)
        size = pool_size(options, self, args, kwargs)
        pools = _pools_for(state, size.num_blocks, self.dtype)
        cache = PagedCache(
            options.layout.num_layers,
            size.num_blocks,
            options.block_size,
            size.table_width,
            pools=pools,
        )
        # weakly: a cache the caller drops is gone, and its memory can serve the next call
        state.last_cache = weakref.ref(cache)
        paged = cache.paged
        state.kept_pools = KeptPools(
            size.num_blocks, self.dtype, (paged.key_pools, paged.value_pools), weakref.ref(paged)
        )
        kwargs[cache_name] = cache
        try:
            return stock(self, *args, **kwargs)
        except BaseException:
            state.last_cache = lambda: cache  # held, so the caller can see what was kept
            raise
        finally:
            state.last_stats = cache.stats()

    return generate
