"""Decode and extend steps of a patched model through the CUDA-graph runner
(``decode_graphs.py``).

A forward that is a step the captured graphs reproduce exactly (only the arguments generate
passes, pools already made on the tokens' device, and either one new token in every row,
every row real, or an extend of ``column_bucket`` columns over the rows' cached tokens, none
included: a prompt's prefill, a later chat turn; left padded, the last column's logits
only, one pool group of the model's dtype) opens its paged step on the host and runs
through ``DecodeGraphs``; the caller runs every other forward eagerly.
"""

from __future__ import annotations

import contextlib

import torch

from nanoserve.adapters.attention import ATTN_NAME
from nanoserve.adapters.compiled_layers import CompiledLayers
from nanoserve.adapters.decode_graphs import bucket_for
from nanoserve.adapters.extend_static import MAX_TOKENS, column_bucket, fits_tables
from nanoserve.adapters.fused_decode import FusedDecode
from nanoserve.adapters.fused_inputs import FUSED_DTYPES
from nanoserve.adapters.model_walk import ModelWalk
from nanoserve.adapters.numeric_modes import numeric_modes
from nanoserve.adapters.prefix_salt import tensor_place
from nanoserve.adapters.registry import family_for
from nanoserve.adapters.step import (
    CACHE_KWARGS,
    PatchState,
    paged_step,
    state_of,
    stock_method,
)
from nanoserve.adapters.tensor_parallel import tp_size
from nanoserve.adapters.user_hooks import HookScan, plain_call

# config flags under which transformers' output capturing is active in every forward
_CAPTURE_FLAGS = ("output_hidden_states", "output_attentions", "output_router_logits")

# fuse_decode's forwards in steps of several columns too (prefills, extends), captured or
# eager; off, only decode graph steps run them (the switch the benchmarks' A/B turns).
FUSE_PREFILL = True

# Forward arguments a captured decode step reproduces; any other one runs the step eagerly.
_GRAPH_KWARGS = {
    "input_ids", "attention_mask", "position_ids", "use_cache", "cache_position",
    "logits_to_keep", "return_dict", *CACHE_KWARGS,
}  # fmt: skip


def graph_step_kind(state: PatchState, cache, kwargs: dict, new: torch.Tensor) -> str | None:
    """ "decode" or "extend" when this forward (new-token mask ``new`` [B, q]) is a step a
    captured graph runs exactly, else None."""
    graphs = state.graphs
    if graphs is None or cache.drops_out is not None or cache.hooked is not None:
        return None  # (a replay would not draw dropout, nor call a hook, as an eager step does)
    if not set(kwargs) <= _GRAPH_KWARGS or False in (
        kwargs.get("use_cache"),
        kwargs.get("return_dict"),
    ):
        return None
    ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
    if ids is None or positions is None or ids.dim() != 2 or positions.shape != ids.shape:
        return None
    if not (ids.is_cuda or not graphs.capture):
        return None
    paged, (rows, columns) = cache.paged, ids.shape
    if any(pool is None or pool.device != ids.device for pool in paged.key_pools):
        return None  # the pools are made by this step, or layers live on several devices
    if paged.num_seqs != rows and (columns == 1 or paged.num_seqs):
        return None  # (an extend step may start the sequences: a prompt's own prefill)
    if columns == 1:
        return "decode" if graphs.disabled_reason is None and bool(new.all()) else None
    bucket = column_bucket(columns)
    if (
        bucket is None
        or graphs.extend_disabled_reason is not None
        or kwargs.get("logits_to_keep") != 1  # the graph keeps the last column's logits
        or len(paged.groups) > 1
        or paged.kv_dtype is not None  # (FP8 scales are set by a call's first write)
        or bucket_for(rows) * bucket > MAX_TOKENS
        # (the step's tables are at least table_width wide; a pool capped below the
        # columns, with rows padded far past their tokens, stays eager)
        or not fits_tables(bucket, paged.block_size, paged.table_width)
    ):
        return None
    return "extend"


def replay_skips(model, hooks: HookScan) -> str | None:
    """What a replayed step of ``model`` would skip (a phrase), or None. A replay runs the
    captured kernels and no Python, so transformers' output capturing (config flags) and a
    forward hook or wrapped forward on a submodule (``hooks``, from ``scan_hooks``), which
    stock runs at every step, would run only while its step is captured."""
    config = getattr(model, "config", None)
    for flag in _CAPTURE_FLAGS:
        if getattr(config, flag, False):
            return f"config.{flag} (transformers' output capturing runs in every forward)"
    return hooks.replay


def graph_step(model, state: PatchState, stock_forward, cache, kwargs, new, borrow=False):
    """Run one decode or extend step (``graph_step_kind``) through ``state.graphs``: blocks
    are allocated on the host by ``begin_step``, then the captured graph (or its first
    capture) runs on static buffers. The caller ends the step (``cache.end_step``).
    ``borrow``: return only the logits, as ``DecodeGraphs.step`` lends them."""
    cache_name = next(k for k in CACHE_KWARGS if kwargs.get(k) is not None)
    extra = {k: kwargs[k] for k in ("logits_to_keep",) if k in kwargs}
    # compile_decode compiles the layers for decode steps; an extend step's shapes would
    # compile them again for each bucket
    decode = kwargs["input_ids"].shape[1] == 1

    def run_forward(static):
        none = contextlib.nullcontext()
        layers = _compiled(model, state) if decode else none
        # (the step's token rows)
        fused = _fused(model, state, static.input_ids.numel()) if decode or FUSE_PREFILL else none
        with paged_step(cache, static.meta, state.backend), layers, fused:
            return stock_forward(
                input_ids=static.input_ids, position_ids=static.position_ids,
                attention_mask=None, use_cache=True, **{cache_name: cache}, **extra,
            )  # fmt: skip

    host = cache.begin_step(new, "cpu")
    try:
        return state.graphs.step(
            cache,
            host,
            kwargs["input_ids"],
            kwargs["position_ids"],
            run_forward,
            signature=lambda c: memory_signature(model, c),
            borrow=borrow,
            # a forward of the caller's own: autocast or TF32 may change between forwards
            modes=None if cache.generating else replay_modes(),
        )
    except BaseException:
        cache.abort_step()
        raise


def _compiled(model, state: PatchState):
    if not state.compile_decode:
        return contextlib.nullcontext()
    if state.compiled_layers is None:
        state.compiled_layers = CompiledLayers(family_for(model.config).decoder_layers(model))
    return state.compiled_layers.active()


def eager_fused(model, state: PatchState, cache, kwargs: dict, autograd: bool):
    """The fused forwards (``fuse_decode``) for a step of ``cache`` run eagerly (a prefill
    the graphs do not take, a step of a patch without graphs), or a null context: not while
    autograd records the step, not where a submodule's hook or a wrapped forward would see
    them (``cache.submodule_hooks``: as in graph steps, which such models do not replay),
    nor where the kernels would not run (the CPU with backend "auto"). The residual adds
    stay stock's here (``FusedDecode.active``)."""
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if not FUSE_PREFILL or tokens is None or autograd or cache.submodule_hooks is not None:
        return contextlib.nullcontext()
    if not (tokens.is_cuda or state.backend == "triton"):
        return contextlib.nullcontext()
    rows = tokens.numel() if tokens.dim() <= 2 else tokens.shape[:-1].numel()
    return _fused(model, state, rows, residual=False)


def _fused(model, state: PatchState, rows: int, residual: bool = True):
    if (
        not state.fuse_decode
        or state.backend == "torch"
        or model.dtype not in FUSED_DTYPES  # (float32: stock's modules, no graph breaks)
        or tp_size(model) > 1  # (tensor-parallel layers reduce in their hooks)
    ):
        return contextlib.nullcontext()
    if state.fused_decode is None:
        family = family_for(model.config)
        state.fused_decode = FusedDecode(
            model.base_model,
            family.decoder_layers(model),
            family,
            state.backend,
            # (the compiler fuses these itself; a swap would break its graph)
            rotary=not state.compile_decode,
            residual=not state.compile_decode,
            compiled=state.compile_decode,
        )
    return state.fused_decode.active(rows, residual=residual)


def memory_signature(model, cache) -> tuple:
    """What a captured decode step depends on besides the values it reads: the addresses,
    dtypes and shapes of what it reads and writes in place (the cache's pools and their
    FP8 or INT8 scales, the model's weights and buffers), the model's structure
    (``prefix_salt.structure_key``: a swapped activation, a changed eps or scaling, an
    adapter switched, none of which moves a tensor) and torch's numeric settings
    (``numeric_modes``: autocast, matmul precision), all of which a replay would run as
    captured."""
    paged = cache.paged
    tensors = (*paged.key_pools, *paged.value_pools, *paged.key_scales, *paged.value_scales)
    walk = cache.walk if cache.walk is not None else ModelWalk(model)
    tensors += (*walk.parameters, *walk.buffers)
    addresses = tuple(tensor_place(t) for t in tensors if t is not None)
    return addresses, walk.structure, replay_modes()


def replay_modes() -> tuple:
    """torch's settings a captured step replays as captured: ``numeric_modes``, and whether
    inference mode is on (a graph's buffers made under it take no write outside it)."""
    return numeric_modes(), torch.is_inference_mode_enabled()


def records_grad(model, kwargs: dict) -> bool:
    """Whether autograd records this forward: grad mode on, and a parameter or a tensor
    argument (``inputs_embeds``, say) that requires grad. generate runs without grad."""
    if not torch.is_grad_enabled():
        return False
    tensors = (v for v in kwargs.values() if isinstance(v, torch.Tensor))
    return any(t.requires_grad for t in tensors) or any(p.requires_grad for p in model.parameters())


def loop_decode_step(model, cache, fixed: dict, input_ids, position_ids):
    """One decode step of nanoserve's loop (``decode_loop.py``) on its ``PagedCache``;
    ``fixed``: its forward arguments but the tokens [B, 1] and positions [B, 1]. When the
    patched forward (``hf.py``) would run this step as a captured graph, it runs here
    without the module call and the model output: returns the logits [B, 1, V], lent by
    the graph runner (valid until the next step). Otherwise returns None before anything
    changed, and the caller calls the model."""
    state = state_of(model)
    if (
        state is None
        or model.config._attn_implementation != ATTN_NAME
        # the model call would run something besides the patched forward: a hook on the
        # model, a forward wrapped after patching, a compiled call
        or not plain_call(model)
        or getattr(model.__dict__.get("forward"), "__func__", None) is not state.patched_forward
    ):
        return None  # (the model call raises or runs it, as for any forward)
    kwargs = {"input_ids": input_ids, "position_ids": position_ids, **fixed}
    # (no mask: every column is new)
    new = torch.ones(input_ids.shape, dtype=torch.bool, device="cpu")
    with state.lock:
        if (
            state_of(model) is not state
            or not (cache.generating and cache.mask_checked)
            or (cache.unshared_blocks is not None and not cache.paged.num_seqs)
            or "attention_mask" in kwargs
            or records_grad(model, kwargs)
            or graph_step_kind(state, cache, kwargs, new) != "decode"
        ):
            return None
        stock = stock_method(model, state.previous_forward, "forward")
        logits = graph_step(model, state, stock, cache, kwargs, new, borrow=True)
        cache.end_step()
        return logits
