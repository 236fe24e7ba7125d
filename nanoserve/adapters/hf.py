"""patch_model / unpatch_model / cache_stats: put the paged cache under a stock HF model.

Patching (1) registers nanoserve's attention and mask functions and switches the model to
them, (2) hooks the base model's forward so each forward that carries a ``PagedCache`` opens
one step (``begin_step`` with the real-token mask of its columns) and closes it, and (3) wraps
``generate`` so that a call without a cache gets a fresh ``PagedCache``.
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref

import torch

from nanoserve.adapters.attention import ATTN_NAME, STATES, PatchState, register
from nanoserve.adapters.hf_cache import PagedCache
from nanoserve.adapters.registry import family_for
from nanoserve.adapters.sizing import PoolOptions, pool_size

_CACHE_KWARGS = ("cache", "past_key_values")  # 5.24 renamed past_key_values to cache


def patch_model(model, *, block_size: int = 16, num_blocks=None, max_memory=None):
    """Make ``model.generate`` run on the paged KV cache; returns ``model``.

    The pool holds ``num_blocks`` blocks of ``block_size`` tokens, or as many as fit in
    ``max_memory`` bytes, or by default what each generate call needs.
    """
    layout = family_for(model.config).kv_layout(model.config)  # NotImplementedError first
    options = PoolOptions(layout, block_size, num_blocks, max_memory)
    if id(model.config) in STATES:
        unpatch_model(model)
    register()
    state = PatchState(original_attn=model.config._attn_implementation)
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
    state.cache = state.last_cache = None
    return model


def cache_stats(model) -> dict[str, float]:
    """Pool figures of the patched model's latest paged cache (empty before any call):
    num_blocks, blocks_used, tokens, bytes_reserved, bytes_holding_tokens, unused_share."""
    cache = last_cache(model)
    return {} if cache is None else cache.stats()


def last_cache(model) -> PagedCache | None:
    """The ``PagedCache`` of the patched model's latest generate call (None before any)."""
    state = STATES.get(id(model.config))
    if state is None:
        raise ValueError("model: not patched (call nanoserve.patch_model first)")
    return state.last_cache


# -- the step boundary: hooks on the base model's forward -------------------------------------


def _open_step(state: PatchState, module, args, kwargs):
    state.cache = None
    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
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
    if state.cache is not None:
        state.cache.end_step()
        state.cache = None
    return None


# -- generate ----------------------------------------------------------------------------------


def _paged_generate(model_class, state: PatchState, options: PoolOptions):
    stock = model_class.generate
    forward = inspect.signature(model_class.forward).parameters
    cache_kwarg = "cache" if "cache" in forward else "past_key_values"

    @functools.wraps(stock)
    def generate(self, *args, **kwargs):
        user_cache = any(kwargs.get(k) is not None for k in _CACHE_KWARGS)
        config = kwargs.get("generation_config") or self.generation_config
        use_cache = kwargs.get("use_cache", getattr(config, "use_cache", True))
        if not user_cache and use_cache is not False:
            for k in _CACHE_KWARGS:
                kwargs.pop(k, None)
            size = pool_size(options, self, args, kwargs)
            cache = PagedCache(
                options.layout.num_layers, size.num_blocks, options.block_size, size.table_width
            )
            state.last_cache = cache
            kwargs[cache_kwarg] = cache
        return stock(self, *args, **kwargs)

    return generate
