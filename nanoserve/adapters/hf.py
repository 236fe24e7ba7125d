"""patch_model / unpatch_model / cache_stats: put the paged cache under a stock HF model.

Patching (1) registers nanoserve's attention and mask functions and switches the model to
them, (2) replaces the model's ``forward`` so that each forward that carries a ``PagedCache``
opens one paged step (``step.paged_step``; decode steps on CUDA through the CUDA-graph runner)
and (3) replaces ``generate`` so that a call without a cache gets a fresh ``PagedCache``. The
state all of that needs lives on the model instance (``step.PatchState``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import types
import weakref

import torch
from transformers import GenerationMixin

from nanoserve.adapters.attention import ATTN_NAME, DOOR, register
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.family import KVLayout
from nanoserve.adapters.fused_decode import FUSED_KINDS
from nanoserve.adapters.graph_forward import (
    eager_fused,
    graph_step,
    graph_step_kind,
    records_grad,
    replay_skips,
)
from nanoserve.adapters.hf_cache import PagedCache, cache_kwarg
from nanoserve.adapters.model_walk import ModelWalk, config_of_its_own, layer_past
from nanoserve.adapters.pool_memory import check_pool_fits
from nanoserve.adapters.prefix_salt import begin_prefix_salt, finish_prefix_salt
from nanoserve.adapters.registry import family_for
from nanoserve.adapters.sample_hook import hook, unhook
from nanoserve.adapters.shared_rows import first_forward
from nanoserve.adapters.sizing import (
    PoolOptions,
    PoolSize,
    blocks_to_continue,
    call_inputs,
    generate_option,
    pool_size,
    row_growth,
    window_slack,
)
from nanoserve.adapters.step import (
    CACHE_KWARGS,
    STATE_ATTR,
    KeptPools,
    PatchState,
    check_left_padded,
    check_whole_mask,
    find_cache,
    forget_original_attn,
    inferred_mask,
    new_token_mask,
    no_cache,
    no_paged_step,
    padding_after_a_token,
    padding_inside,
    paged_step,
    remember_original_attn,
    state_of,
    stock_method,
)
from nanoserve.adapters.tensor_parallel import (
    agree_options,
    agreed_salt,
    capture_agreement,
    local_layout,
)
from nanoserve.adapters.user_hooks import HookScan, is_accelerate_wrapper, own_forward, scan_hooks
from nanoserve.adapters.versions import check_transformers_version, transformers_before
from nanoserve.adapters.windows import check_windows
from nanoserve.cache import GroupedKVCache, PagedKVCache
from nanoserve.kernels.dispatch import check_backend
from nanoserve.log import get_logger

_log = get_logger(__name__)


def patch_model(
    model,
    *,
    block_size: int = 16,
    num_blocks=None,
    max_memory=None,
    cuda_graphs: bool = True,
    compile_decode: bool = False,
    fuse_decode: bool = True,
    backend: str = "auto",
    keep_pools: bool = True,
    prefix_sharing: bool = True,
    decode_loop: bool = True,
    kv_dtype=None,
    kv_scale: float | None = None,
):
    """Make ``model.generate`` run on the paged KV cache; returns ``model``.

    The pool holds ``num_blocks`` blocks of ``block_size`` (1 to 16384) tokens, or as many as fit in
    ``max_memory`` bytes, or by default what each generate call needs. A model that mixes
    sliding and global layers (Gemma 2, Gemma 3) has a pool per layer group, the sliding
    one releasing the blocks that fell out of the window: ``num_blocks`` is then each
    pool's, and ``max_memory`` is shared between them in proportion to what a call needs
    of each. With
    ``cuda_graphs`` (the default) decode steps on CUDA replay captured CUDA graphs; on CPU,
    or with ``cuda_graphs=False``, every step runs eagerly. ``compile_decode`` also runs the
    decoder layers of those graph steps through ``torch.compile`` (fewer, fused kernels;
    close to but not bit-equal with stock eager; see ``compiled_layers.py``).
    ``fuse_decode`` (the default): in the decode graph steps of a float16 / bfloat16 model
    every RMSNorm runs as one Triton launch, the rotary embedding as one for q and k
    (bit-equal to stock's; not with ``compile_decode``) and, at up to 64 rows, each layer's
    q/k/v projections as one and a SiLU-gated MLP as two (``fused_decode.py``; float32
    accumulation as eager, another summation order, so the last bit can differ from
    stock's); its prefill and extend steps run them too where the Triton kernels run (past
    64 token rows the MLP as cuBLAS's products and one ``silu_mul``), but not the eager
    steps of a model with submodule hooks; ``False`` keeps transformers' modules there. ``backend``
    picks the kernels of every paged step: "auto" (Triton on CUDA, the torch references on
    CPU), "triton" (on CPU under ``TRITON_INTERPRET=1``) or "torch". ``keep_pools`` (the
    default) keeps a finished call's pool, and the decode graphs captured over it, for the
    next calls that fit in it; ``release_memory(model)`` frees them on request, and
    ``keep_pools=False`` after every call. ``prefix_sharing`` (the default): copies of one
    prompt in a batch (``num_return_sequences``, beams, a prompt repeated G times) are
    prefilled once and share their blocks, and so are leading blocks several prompts share
    or an earlier call stored (``shared_rows.py``; ``generate(..., cache_salt=...)`` keeps
    callers apart). ``decode_loop`` (the default): greedy and multinomial sampling run
    nanoserve's decode loop (``decode_loop.py``: token choice on the device, no host sync
    per token); ``False`` runs HF's loop. Either way the tokens are stock's. ``kv_dtype``:
    None (the default) stores K/V in the model's dtype; "fp8_e4m3" (or
    torch.float8_e4m3fn) stores them in FP8 with a float32 scale per (layer, KV head), half
    the bytes of 16-bit pools (``max_memory`` holds twice the tokens); attention still
    computes in the model's dtype with float32 accumulation. Every scale is ``kv_scale``
    (default 1.0: e4m3 is floating point, so the scale matters only past +-448 * scale,
    where values saturate, and in subnormals); a fixed scale keeps a call's tokens
    independent of the calls before it. "int8" (or torch.int8) stores int8 values with
    float16 scales per slot (keys one per 16 channels of a head, values one per head),
    computed as each token is written: 1.86-1.88x the tokens of 16-bit pools and much
    closer to them than FP8 (README, "INT8 KV").

    Every argument is checked before anything changes: a failed call leaves the model as it
    was. Patching a patched model again replaces its options.
    """
    check_transformers_version()
    if not isinstance(model, GenerationMixin):
        inner = getattr(model, "get_base_model", None)
        wrapped = getattr(model, "module", None)
        if isinstance(model, torch.nn.Module) and isinstance(wrapped, GenerationMixin):
            raise ValueError(
                f"model: {type(model).__name__} wraps a transformers model in .module "
                "(DataParallel, say), which has no generate(); patch that model, "
                "nanoserve.patch_model(model.module), and call model.module.generate"
            )
        if callable(getattr(model, "generate", None)) and callable(inner):
            raise ValueError(
                f"model: {type(model).__name__} wraps a transformers model (peft, say); patch "
                "the model inside it, nanoserve.patch_model(model.get_base_model()), and keep "
                "calling the wrapper's generate"
            )
        raise ValueError(
            f"model: {type(model).__name__} has no generate(); patch the model with the "
            "language-model head (e.g. AutoModelForCausalLM), not its base model"
        )
    family = family_for(model.config)  # NotImplementedError names the supported families
    named = list(model.named_modules())
    _check_layer_config(config_of_its_own(named, model.config))
    layout = local_layout(family.layout(model.config), model)  # this rank's KV heads
    _check_layer_count(layer_past(named, layout.num_layers), layout)
    check_windows(model, layout)
    options = PoolOptions(layout, block_size, num_blocks, max_memory, kv_dtype, kv_scale)
    options.check_max_memory(model.dtype)
    for name, value in (
        ("cuda_graphs", cuda_graphs),
        ("compile_decode", compile_decode),
        ("fuse_decode", fuse_decode),
        ("keep_pools", keep_pools),
        ("prefix_sharing", prefix_sharing),
        ("decode_loop", decode_loop),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{name}: must be True or False, got {value!r}")
    if compile_decode and not cuda_graphs:
        raise ValueError("compile_decode: needs cuda_graphs=True (it compiles the graph steps)")
    check_backend(backend)

    unpatch_model(model)
    register()
    current = model.config._attn_implementation
    state = PatchState(
        config=model.config,
        pool=options,
        backend=backend,
        cuda_graphs=cuda_graphs,
        compile_decode=compile_decode,
        fuse_decode=fuse_decode,
        keep_pools=keep_pools,
        prefix_sharing=prefix_sharing,
        decode_loop=decode_loop,
        original_attn=remember_original_attn(model.config, current, model),
        previous_generate=model.__dict__.get("generate"),
        previous_forward=model.__dict__.get("forward"),
    )
    model.__dict__[STATE_ATTR] = state
    state.finalizer = weakref.finalize(model, _collected_unpatched, weakref.ref(model.config))
    try:
        if state.cuda_graphs:
            state.graphs = DecodeGraphs(agree=capture_agreement(model))
        model.set_attn_implementation(ATTN_NAME)
        model.generate = _method(model, "generate", _paged_generate)
        model.forward = _method(model, "forward", _paged_forward)
        state.patched_forward = model.forward.__func__
    except BaseException:
        unpatch_model(model)
        raise
    return model


def unpatch_model(model):
    """Undo ``patch_model``: attention implementation, generate and forward as they were
    (accelerate's hooks added since stay, around that forward; a wrapper of the caller's
    set around the patched forward since is dropped with it). A model that is not patched
    is returned unchanged."""
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        return model
    with state.lock:  # a generate call in flight in another thread finishes first
        model.__dict__.pop(STATE_ATTR, None)
        _restore(model, state)
    return model


def _restore(model, state: PatchState) -> None:
    _put_back(model, "generate", state.previous_generate)
    _restore_forward(model, state)
    if state.graphs is not None:
        state.graphs.reset()
    if state.finalizer is not None:
        state.finalizer.detach()
    unhook(model)
    # a config shared with another patched model stays switched until that one is unpatched;
    # the door's name (set by hand on a patched model) refuses to run unpatched: back too
    original = forget_original_attn(model.config, model)
    if original is not None and model.config._attn_implementation in (ATTN_NAME, DOOR):
        model.set_attn_implementation(original)


def _put_back(model, name: str, previous) -> None:
    if previous is not None:
        model.__dict__[name] = previous
    else:
        model.__dict__.pop(name, None)


def _restore_forward(model, state: PatchState) -> None:
    """The forward as it was before ``patch_model``. Where it was replaced after patching:
    inside accelerate's wrapper (hooks added since, which stay) the forward it wraps; the
    class's own forward put back (accelerate's ``remove_hook_from_module``) stays; any other
    wrapper (one holding the patched forward) is dropped, as the patched forward is."""
    current = model.__dict__.get("forward")
    previous = state.previous_forward
    inner = model.__dict__.get("_old_forward")
    if (
        is_accelerate_wrapper(current, model)
        and getattr(inner, "__func__", None) is state.patched_forward
    ):
        model._old_forward = (
            previous if previous is not None else type(model).forward.__get__(model)
        )
    elif not own_forward(current, model):
        _put_back(model, "forward", previous)


def _collected_unpatched(config_ref) -> None:
    """A patched model was collected without ``unpatch_model``: its config (shared with
    another model, or saved with one) goes back to its attention when no patched model uses
    it any more, as an unpatch would have left it."""
    config = config_ref()
    if config is None:
        return
    original = forget_original_attn(config, collected=True)
    if original is not None and config._attn_implementation in (ATTN_NAME, DOOR):
        config._attn_implementation = original


def _state(model) -> PatchState:
    state = state_of(model)
    if state is None:
        raise ValueError("model: not patched (call nanoserve.patch_model first)")
    return state


def _unset_dynamic(model, kwargs: dict) -> None:
    """Generate's ``cache_implementation="dynamic"`` (stock's default cache, named) unset for
    the call, which passes its own cache (stock refuses both). A passed generation config is
    copied, not changed; the keyword is passed only where the value would come back from
    the call's keywords or the model's config (transformers fills a passed config's unset
    fields from the model's)."""
    passed = kwargs.get("generation_config")
    if passed is not None and getattr(passed, "cache_implementation", None) is not None:
        passed = copy.deepcopy(passed)
        passed.cache_implementation = None
        kwargs["generation_config"] = passed
    model_default = getattr(model.generation_config, "cache_implementation", None)
    fills = model_default is not None and kwargs.get("use_model_defaults") is not False
    if passed is None or fills or "cache_implementation" in kwargs:
        kwargs["cache_implementation"] = None


def cache_stats(model) -> dict[str, float]:
    """Pool figures of the patched model's latest paged cache (num_blocks, blocks_used,
    tokens, bytes_reserved, bytes_holding_tokens, unused_share; taken from the cache while
    the caller still holds it, else as the call left it; absent before any call), and what
    the model holds between calls: ``kept_pool_blocks`` / ``kept_pool_bytes`` (the pool the
    next call reuses) and ``graphs_held`` (captured decode graphs). With layer groups the
    figures are summed over them, ``layer_groups`` counts them and ``group{g}_<figure>``
    gives each one's (``group{g}_window``: 0 for the global layers)."""
    state = _state(model)
    cache = state.last_cache()
    stats = cache.stats() if cache is not None else dict(state.last_stats)
    kept = state.kept_pools
    stats["kept_pool_blocks"] = 0 if kept is None else sum(kept.group_blocks) or kept.num_blocks
    stats["kept_pool_bytes"] = kept.nbytes() if kept is not None else 0
    stats["graphs_held"] = len(state.graphs.graphs) if state.graphs is not None else 0
    return stats


def _forget_cached(state: PatchState) -> None:
    """The stored prefixes went with the kept pool: ``cache_stats`` counts none (the last
    call's own figures stay)."""
    for name in ("cached_blocks", "evictable_blocks"):
        if name in state.last_stats:
            state.last_stats[name] = 0


def release_memory(model) -> None:
    """Free what the patched model holds between generate calls: the kept pool and the
    captured decode graphs (and, on CUDA, cuBLAS's per-stream workspaces and the cached
    blocks of PyTorch's allocator). A cache the caller still holds
    (``return_dict_in_generate=True``) stays the caller's. The next call allocates a pool
    and captures its graphs again."""
    state = _state(model)
    with state.lock:
        state.kept_pools = None
        state.last_cache = no_cache
        state.failed_cache = None
        _forget_cached(state)
        if state.graphs is not None:
            state.graphs.reset()
    if torch.cuda.is_available():
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:  # cuBLAS allocates them again when it needs them
            clear_workspaces()
        torch.cuda.empty_cache()


def last_cache(model) -> PagedCache | None:
    """The ``PagedCache`` of the patched model's latest generate call while something still
    holds it (``return_dict_in_generate=True`` hands it back as the output's cache) or when
    that call raised (say ``OutOfBlocks``); else None, and the next call that fits in its pool
    reuses its memory. A failed call's cache is emptied and retired by the next call that
    takes its pool, unless it was passed back to continue it first; raised in nanoserve's
    decode loop, it holds the loop's state (steps issued past the failing one, finished rows
    compacted away), HF's loop (``decode_loop=False``) leaves stock's."""
    return _state(model).last_cache()


def decode_graph_stats(model) -> dict:
    """The patched model's CUDA-graph figures: graphs held, captures, replays (of them,
    ``extend_replays``: extend steps), why decode graphs (``disabled``) or extend
    graphs (``extend_disabled``) were turned off (None while they are on), and which loop
    the latest call ran for greedy or sampled decoding (``decode_loop``: "nanoserve",
    "stock: <why>", or None before any call and after one that decoded otherwise: beam
    search, assisted or prompt-lookup decoding run transformers' own loops),
    ``eager_reason``: why the latest call's steps replayed no graph (a forward hook on a
    submodule, which a replay would skip; a module dropping out), or None,
    ``fused_decode``: how many modules have run fused in graph steps
    (``fuse_decode``: {"attention": q/k/v groups, "mlp": gated MLPs, "norm": RMSNorms,
    "rotary": rotary calls in a step}), and ``loop_steps``: of nanoserve's latest loop,
    the decode steps run straight on the graph runner (``direct``), the token choices
    replayed as a graph (``choice_replays``), the choice's captures (``choice_captures``: one
    per batch size the call decoded at) and why a capture failed, after which its choices ran
    eagerly (``choice_failed``, None if none did)."""
    state = _state(model)
    fused = state.fused_decode
    loop = {
        "decode_loop": state.last_loop,
        "eager_reason": state.eager_reason,
        "fused_decode": fused.counts() if fused else dict.fromkeys(FUSED_KINDS, 0),
        "loop_steps": dict(state.loop_steps),
    }
    graphs = state.graphs
    if graphs is None:
        off = dict(enabled=False, graphs=0, captures=0, replays=0, extend_replays=0)
        return off | {"disabled": None, "extend_disabled": None} | loop
    return {
        **loop,
        "enabled": graphs.disabled_reason is None,
        "graphs": len(graphs.graphs),
        "captures": graphs.captures,
        "replays": graphs.replays,
        "extend_replays": graphs.extend_replays,
        "disabled": graphs.disabled_reason,
        "extend_disabled": graphs.extend_disabled_reason,
    }


# -- forward: one paged step per forward that carries a PagedCache --------------------------


def _method(model, name: str, body):
    """``body`` bound to ``model`` under the name and signature of the class's ``name``
    (generate inspects ``forward``'s parameters to choose what it passes)."""

    @functools.wraps(getattr(type(model), name))
    def method(self, *args, **kwargs):
        return body(self, *args, **kwargs)

    return types.MethodType(method, model)


def _paged_forward(self, *args, **kwargs):
    state = _state(self)
    stock = stock_method(self, state.previous_forward, "forward")
    if args:
        kwargs = _keywords(stock, args, kwargs)
        args = ()
    cache = find_cache(kwargs)
    if not isinstance(cache, PagedCache):
        with no_paged_step():  # (called inside another paged forward, that one's step)
            return stock(**kwargs)  # attention and mask run as before patching
    _check_attention(self)
    if kwargs.get("output_attentions"):
        raise ValueError(
            "output_attentions: the paged kernels compute no attention weights; generate "
            "without a PagedCache (a patched model's generate does that for this option)"
        )
    with state.lock:
        if state_of(self) is not state:  # unpatched (or patched again) by another thread
            return self.forward(**kwargs)
        _check_retired(cache, type(self))
        if not cache.generating:
            _taken_back(state, cache)
        if not cache.mask_checked or not cache.generating:  # (a caller's forward: each one)
            check_whole_mask(kwargs, cache.paged.seq_lens(), cache.columns)
        if not cache.mask_checked:
            if not cache.generating:  # (generate checked the windows itself)
                check_windows(self, state.pool.layout)
            cache.mask_checked = True
        new = None  # the forward's new-token mask, once its rows are known to stay as they are
        if not cache.generating:  # a forward of the caller's own: hooks may change between
            _note_hooks(state, cache, scan_hooks(self), self)
            cache.paged.leave_inference_mode()  # (a cache returned under inference mode)
            new = new_token_mask(kwargs, cache.paged.seq_lens)
            _room_for_forward(state, cache, self, new)
        run_step = functools.partial(_run_step, self, state, stock, cache)
        if state.prefix_sharing:
            output = first_forward(run_step, cache, kwargs)
            if output is not None:
                return output
        if cache.unshared_blocks is not None and not cache.paged.num_seqs:
            # the pool was sized for shared copies that this first forward does not share
            have = [group.allocator.num_blocks for group in cache.paged.groups]
            _grow(
                cache.paged,
                [max(0, n - h) for n, h in zip(cache.unshared_blocks, have, strict=True)],
            )
            cache.unshared_blocks = None
        if new is None:  # (first_forward, sharing nothing, left the rows as they were)
            new = new_token_mask(kwargs, cache.paged.seq_lens)
        output = run_step(kwargs, new)
        cache.end_step()
        return output


def _run_step(model, state: PatchState, stock, cache: PagedCache, kwargs: dict, new):
    """One paged forward of ``kwargs`` whose new-token mask is ``new`` [B, q]: a captured
    graph's replay where ``graph_step_kind`` allows, else eagerly. The step is begun here
    (OutOfBlocks leaves everything as it was) and forgotten if the forward fails; the
    caller ends it."""
    autograd = records_grad(model, kwargs)
    if not autograd and graph_step_kind(state, cache, kwargs, new) is not None:
        return graph_step(model, state, stock, cache, kwargs, new)
    tokens = kwargs.get("input_ids")
    device = (tokens if tokens is not None else kwargs["inputs_embeds"]).device
    meta = cache.begin_step(new, device)
    try:
        # the Triton kernels (and a replay) record no autograd graph; the references do
        with (
            paged_step(cache, meta, "torch" if autograd else state.backend),
            eager_fused(model, state, cache, kwargs, autograd),
        ):
            return stock(**kwargs)
    except BaseException:
        cache.abort_step()  # the step's tokens were never all written: forget them
        raise


def _generate_again(model, args: tuple, kwargs: dict, user_salt):
    """The call as the model stands now: another thread unpatched it (or patched it again)
    while this call waited for the lock. ``cache_salt`` goes only to a patched model."""
    if user_salt is not None and state_of(model) is not None:
        kwargs = dict(kwargs, cache_salt=user_salt)
    return model.generate(*args, **kwargs)


def _grow(paged, more: list[int]) -> None:
    """Give each layer group of ``paged`` ``more[g]`` more blocks."""
    if len(paged.groups) == 1:
        paged.grow(more[0])
    else:
        paged.grow(more)


def _keywords(forward, args: tuple, kwargs: dict) -> dict:
    """``forward``'s positional ``args`` and ``kwargs`` as keywords only."""
    signature = inspect.signature(forward)
    bound = signature.bind_partial(*args, **kwargs).arguments
    out = {}
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            raise ValueError(f"{name}: extra positional arguments to a paged forward")
        else:
            out[name] = value
    return out


# -- generate -----------------------------------------------------------------------------


def _pools_for(state: PatchState, size: PoolSize, dtype: torch.dtype, failed=None):
    """(num_blocks, pool lists, allocators) of this call's cache, one entry per layer group:
    the kept ones (the allocators carry the cached prefixes) or (size's blocks, None, None).
    The kept pool of an earlier call serves when nothing can reach the store that used it
    (its ``PagedCache``, or the store inside, both let go), its dtype matches and it has at
    least the blocks this call needs in every group (exactly as many under ``num_blocks``;
    under ``max_memory``, a split between layer groups serves every call whose needs it
    holds): the same memory keeps the captured decode graphs valid. Otherwise the kept
    pool is let go before a new one is made. (A pool tensor taken out of a cache by hand is the
    caller's to copy.) ``failed``: the cache of the latest call when it raised (held for
    ``last_cache`` since): when the kept pool serves but for it, it is emptied and retired
    (``_retire``) and this call takes the pool, with the prefixes stored in it."""
    kept, state.kept_pools = state.kept_pools, None
    wanted = list(size.group_blocks) or [size.num_blocks]
    fresh = wanted, [None] * len(wanted), [None] * len(wanted)
    inference = kept is not None and not torch.is_inference_mode_enabled()
    inference = inference and kept.made_for_inference()
    failed_store = failed.paged if failed is not None else None
    owned = kept is not None and kept.owner() not in (None, failed_store)
    if kept is None or owned or kept.dtype != dtype or inference:
        if kept is not None:
            why = "a returned cache holds it" if owned else f"{kept.dtype}"
            why = "made under torch.inference_mode" if inference else why
            _log.info("pool: the kept pool is not reused (%s)", why)
        return fresh
    held = list(kept.group_blocks) or [kept.num_blocks]
    if len(held) != len(wanted):
        fits = False
    elif size.group_needed:
        # max_memory split between layer groups: a kept split that holds what this call needs
        # in every group serves, rather than a new split for each call's proportions
        fits = all(h >= n for h, n in zip(held, size.group_needed, strict=True))
    elif state.pool.fixed:
        fits = held == wanted
    else:
        fits = all(h >= w for h, w in zip(held, wanted, strict=True))
    _log.info(
        "pool: the kept pool of %s blocks %s (%s asked for)",
        "+".join(map(str, held)),
        "serves this call" if fits else "is let go",
        "+".join(map(str, wanted)),
    )
    if not fits:
        if not state.pool.fixed and len(held) == len(wanted):
            # Each group as large as either call needs: calls whose groups grow in turn (a
            # long prompt, then many new tokens) then share one pool instead of each making
            # its own (and recapturing the decode graphs).
            wanted = [max(h, w) for h, w in zip(held, wanted, strict=True)]
            fresh = wanted, [None] * len(wanted), [None] * len(wanted)
        return fresh
    if failed is not None and kept.owner() is failed_store:
        _retire(failed)
    each = (kept, *kept.others)
    return held, [k.pools for k in each], [k.allocator for k in each]


def _retire(failed: PagedCache) -> None:
    """Empty a failed call's cache (its rows' blocks go back to the pool; the prefixes
    stored stay) and mark it retired (``_check_retired``): a later call takes its pool."""
    failed.reset()
    failed.retired = True


def _taken_back(state: PatchState, cache: PagedCache) -> None:
    """``cache``, passed back by the caller, is theirs again: a failed call's cache that
    the caller continues is no longer retired by the next call."""
    if state.failed_cache is cache:
        state.failed_cache = None


def _check_retired(cache: PagedCache, model_class) -> None:
    """ValueError naming the cache argument when ``cache`` is a failed call's cache whose
    pool a later call took (``_retire``)."""
    if cache.retired:
        raise ValueError(
            f"{cache_kwarg(model_class)}: the cache of a generate call that raised, whose pool "
            "a later call has taken (it holds nothing now); start a new call without it"
        )


def _may_share(kwargs: dict, option) -> bool:
    """Whether the call's first forward can prefill copies of a prompt once (what the pool
    is sized for): token ids, no chunked prefill, no per-row inputs or outputs beyond the
    ones ``shared_rows.py`` takes. (Should the forward not share after all, the patched
    forward grows the pool to the unshared size before anything is stored.)"""
    if kwargs.get("inputs_embeds") is not None or option("prefill_chunk_size"):
        return False
    if option("output_hidden_states") or option("output_attentions"):
        return False
    rows = ("inputs", "input_ids", "attention_mask", "position_ids")
    return not any(isinstance(v, torch.Tensor) and k not in rows for k, v in kwargs.items())


def _note_hooks(state: PatchState, cache: PagedCache, hooks: HookScan, model) -> None:
    """Put on ``cache`` what the model's hooks (``scan_hooks``) rule out for its forwards."""
    cache.submodule_hooks = replay_skips(model, hooks)
    cache.hooked = cache.submodule_hooks if state.graphs is not None else None
    cache.row_hooks, cache.batch_hooks = hooks.rows, hooks.batch
    state.eager_reason = cache.drops_out or cache.hooked


@contextlib.contextmanager
def _generating(state: PatchState, cache: PagedCache, hooks: HookScan, model, walk: ModelWalk):
    """``cache`` inside a generate call: what the model's hooks rule out was found at the
    call's start (``hooks``), and its forwards do not look again (their steps stay cheap);
    the rest of what that start read off the modules is ``walk``."""
    _note_hooks(state, cache, hooks, model)
    cache.generating = True
    cache.walk = walk
    if cache.hooked is not None:
        _log.info("decode graphs: this call's steps run eagerly (%s)", cache.hooked)
    if hooks.rows is not None and state.prefix_sharing:
        _log.info("prefix sharing: off for this call (%s may compute rows apart)", hooks.rows)
    # transformers' early-exit drafting (assistant_early_exit) lowers config.num_hidden_layers
    # around each draft and puts it back only when the draft returns: a refusal raised in a
    # draft would leave every later call running fewer layers
    layers = getattr(model.config, "num_hidden_layers", None)
    try:
        yield
    except BaseException:
        if getattr(model.config, "num_hidden_layers", None) != layers:
            model.config.num_hidden_layers = layers
        raise
    finally:
        cache.generating = False
        cache.walk = None  # (modules may change before the next call)


def _options(model, state: PatchState, dropout: str | None, hooks: HookScan) -> dict:
    """What every tensor-parallel rank must run a call with (``agree_options``): the patch
    options, the attention implementation, whether the model drops out and what its hooks
    rule out (one rank replaying, sharing rows or running its own loop while another does
    not would pair the collectives wrongly)."""
    return dict(
        pool=state.pool, backend=state.backend, cuda_graphs=state.cuda_graphs,
        compile_decode=state.compile_decode, fuse_decode=state.fuse_decode,
        keep_pools=state.keep_pools,
        prefix_sharing=state.prefix_sharing, decode_loop=state.decode_loop,
        attn_implementation=model.config._attn_implementation, dropout=dropout,
        replay_skips=replay_skips(model, hooks) is not None and state.graphs is not None,
        row_hooks=hooks.rows is not None, batch_hooks=hooks.batch is not None,
    )  # fmt: skip


def _broadcast_mask(args: tuple, kwargs: dict) -> None:
    """ValueError naming ``input_ids`` when they are not 2-D (stock's IndexError comes from
    deep inside its preparation); an ``attention_mask`` of one row for several rows of
    inputs broadcast over them in ``kwargs``, as stock's attention broadcasts it."""
    inputs = call_inputs(args, kwargs)
    if not isinstance(inputs, torch.Tensor):
        return
    if inputs.dim() < 2:
        raise ValueError(
            f"input_ids: expected a 2-D tensor [batch, length], got shape {tuple(inputs.shape)}"
            "; one prompt is input_ids[None]"
        )
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == 1 < len(inputs):
        kwargs["attention_mask"] = mask.expand(len(inputs), -1)


def _check_attention(model) -> None:
    """ValueError when the attention implementation was switched after patching
    (``set_attn_implementation``): stock attention would read the paged pools as its cache."""
    current = model.config._attn_implementation
    if current != ATTN_NAME:
        raise ValueError(
            f"attn_implementation: {current!r} was set after patch_model, but the paged cache "
            "needs nanoserve's attention; call nanoserve.patch_model(model) again, or "
            "nanoserve.unpatch_model(model) to run stock"
        )


def _check_layer_config(name: str | None) -> None:
    """ValueError naming the module ``config_of_its_own`` found (None: nothing to say)."""
    if name is not None:
        raise ValueError(
            f"{name}.config: a config object of its own, not the model's (peft's "
            "layer_replication copies one into each layer): patch_model switches the "
            "attention of model.config only, and this module would run stock attention on "
            "the paged cache; build the model with one config shared by its layers"
        )


def _check_layer_count(module: str | None, layout: KVLayout) -> None:
    """ValueError naming the module ``layer_past`` found (None: nothing to say)."""
    if module is not None:
        raise ValueError(
            f"{module}: a layer index past the {layout.num_layers} layers the paged pools are "
            "laid out for (config.num_hidden_layers when patch_model ran); set "
            "config.num_hidden_layers to the model's layers and call "
            "nanoserve.patch_model(model) again"
        )


def _check_forward(model, state: PatchState) -> None:
    """ValueError naming ``model.forward`` when the patched forward was taken off the model
    after patching (accelerate's ``remove_hook_from_module``, or a second dispatch, puts
    back the forward it found first): the paged cache would reach stock's forward."""
    forward = model.__dict__.get("forward")
    if is_accelerate_wrapper(forward, model):  # accelerate's hooks around what it found
        forward = model.__dict__.get("_old_forward")
    if forward is None or own_forward(forward, model):
        raise ValueError(
            "model.forward: nanoserve's patched forward was replaced by the class's own after "
            "patch_model (as accelerate's remove_hook_from_module or a new dispatch does); "
            "call nanoserve.patch_model(model) again"
        )


# transformers from which continuing a returned cache with chunked prefill or prompt lookup
# gives stock's tokens on a patched model (5.17 measured otherwise; none between tested)
CHUNKED_CONTINUATION_FROM = "5.24"


def _check_continuation(model, cache: PagedCache, args: tuple, kwargs: dict) -> None:
    """ValueError naming ``input_ids`` when a returned cache passed back to generate does not
    fit the call's inputs: other rows than it holds (after generate's copies for beams or
    ``num_return_sequences``), or every column already in it: there is no token it has not
    seen to start from (stock then feeds and stores every column a second time)."""
    embeds = kwargs.get("inputs_embeds")  # (generate counts positions by these when given)
    inputs = embeds if embeds is not None else call_inputs(args, kwargs)
    cached = cache.get_seq_length()
    held = cache.paged.num_seqs
    copies = max(
        generate_option(model, kwargs, "num_beams") or 1,
        generate_option(model, kwargs, "num_return_sequences") or 1,
    )
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 and held:
        rows = inputs.shape[0] * copies
        if rows != held:
            copied = f" ({inputs.shape[0]} x {copies} copies)" if copies > 1 else ""
            raise ValueError(
                f"input_ids: {rows} rows{copied}, and the cache passed back holds {held} "
                "sequences; continue with the sequences it returned, one row each, without "
                "new beams or num_return_sequences copies"
            )
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 and inputs.shape[1] <= cached:
        raise ValueError(
            f"input_ids: {inputs.shape[1]} columns, and the cache passed back already holds "
            f"{cached}; pass the sequences it returned (they end with a token it has not "
            "seen), or generate without the cache"
        )
    if transformers_before(CHUNKED_CONTINUATION_FROM):
        for name in ("prefill_chunk_size", "prompt_lookup_num_tokens"):
            if generate_option(model, kwargs, name):
                raise ValueError(
                    f"{name}: continuing a returned cache with it needs transformers >= "
                    f"{CHUNKED_CONTINUATION_FROM} (5.17's generate feeds such a call's prompt "
                    "otherwise than without the cache, and nanoserve's tokens then differ from "
                    "stock's); continue without it, or upgrade transformers"
                )


def _room_to_continue(state: PatchState, cache: PagedCache, model, args, kwargs) -> None:
    """A returned cache passed back to generate grows its pool to fit the call, as stock's
    cache would, unless the patch that made the pool fixed its size (``num_blocks`` /
    ``max_memory``: then ``OutOfBlocks`` says so)."""
    if cache.pool_fixed:
        return
    paged = cache.paged
    _grow_to(
        state, paged, blocks_to_continue(paged, cache.get_seq_length(), model, args, kwargs), model
    )


def _room_for_forward(state: PatchState, cache, model, new: torch.Tensor) -> None:
    """A forward of the caller's own on a returned cache grows its pool to fit the forward's
    new tokens (``new`` bool [B, q]), as stock's cache would, unless the pool size was fixed:
    each row may take the blocks its tokens reach plus a copy of its last one (every row
    anew on a cache that holds none, after ``reset()``)."""
    counts = new.sum(dim=1).tolist()
    paged = cache.paged
    if cache.pool_fixed:
        return
    if not paged.num_seqs:  # a reset cache: every row is new
        bs = paged.block_size
        _grow_to(state, paged, [sum(-(-n // bs) + 1 for n in counts)] * len(paged.groups), model)
        return
    if len(counts) != paged.num_seqs:
        return  # (a row count the step refuses itself)
    need = [
        sum(
            row_growth(t, n, paged.block_size)
            for t, n in zip(group.tables, counts, strict=True)
            if n
        )
        for group in paged.groups
    ]
    _grow_to(state, paged, need, model)


def _grow_to(state: PatchState, paged, need: list[int], model) -> None:
    """Grow each layer group of ``paged`` so that ``need[g]`` blocks are free, refused first
    (``check_pool_fits``) if the devices cannot hold the larger pool."""
    free = [group.allocator.num_free for group in paged.groups]
    if any(n > f for n, f in zip(need, free, strict=True)):
        more = [max(0, n - f) for n, f in zip(need, free, strict=True)]
        grown = [g.allocator.num_blocks + m for g, m in zip(paged.groups, more, strict=True)]
        each = tuple(grown) if len(grown) > 1 else ()
        # (the memory check of an unfixed size, whatever the current patch fixed)
        unfixed = dataclasses.replace(state.pool, num_blocks=None, max_memory=None)
        check_pool_fits(PoolSize(sum(grown), paged.table_width, each), unfixed, model)
        _grow(paged, more)


def _new_store(state: PatchState, size: PoolSize, num_blocks, pools, allocators, slack: int):
    """This call's store: a ``PagedKVCache``, or a ``GroupedKVCache`` for a layout of layer
    groups; ``num_blocks``, ``pools`` and ``allocators`` give one entry per group; ``slack``:
    the tokens a windowed layer keeps past its window (``sizing.window_slack``)."""
    layout = state.pool.layout
    if layout.layer_groups is not None:
        return GroupedKVCache(
            layout.layer_groups,
            num_blocks,
            state.pool.block_size,
            size.table_width,
            pools=pools,
            backend=state.backend,
            allocators=allocators,
            window_slack=slack,
            kv_dtype=state.pool.kv_dtype,
            kv_scale=state.pool.kv_scale,
        )
    return PagedKVCache(
        layout.num_layers,
        num_blocks[0],
        state.pool.block_size,
        size.table_width,
        pools=pools[0],
        backend=state.backend,
        allocator=allocators[0],
        sliding_window=layout.sliding_window,
        window_slack=slack,
        kv_dtype=state.pool.kv_dtype,
        kv_scale=state.pool.kv_scale,
    )


def _paged_generate(self, *args, **kwargs):
    state = _state(self)
    # One call on a model at a time, from here: what the call reads off the model (its
    # modules, hooks, training mode, the weights' salt) is read once its turn has come, so
    # a call that waited does not look prefixes up under weights another thread has changed.
    with state.lock:
        if state_of(self) is not state:  # unpatched or patched again while this call waited
            user_salt = kwargs.pop("cache_salt", None)
            return _generate_again(self, args, kwargs, user_salt)
        return _generate_in_turn(self, state, args, kwargs)


def _checked_model(model, state: PatchState, walk: ModelWalk, hooks: HookScan) -> str | None:
    """The checks of the model as it stands that a paged call runs (the patch options agreed
    with its dropout and hooks, its attention, layer configs, forward and windows); returns
    ``walk.dropout``."""
    dropout = walk.dropout
    agree_options(model, _options(model, state, dropout, hooks))
    _check_attention(model)
    _check_layer_config(walk.layer_config)
    _check_layer_count(layer_past(walk.named, state.pool.layout.num_layers), state.pool.layout)
    _check_forward(model, state)
    check_windows(model, state.pool.layout)
    return dropout


def _generate_in_turn(self, state: PatchState, args: tuple, kwargs: dict):
    """``_paged_generate`` under ``state.lock``."""
    stock = stock_method(self, state.previous_generate, "generate")
    if len(args) > 1:  # a generation config (or more) passed by position: read as keywords
        with contextlib.suppress(TypeError, ValueError):
            args, kwargs = (), _keywords(stock, args, kwargs)
    hook(self)  # generate looks _sample up on the class (sample_hook.py)
    option = functools.partial(generate_option, self, kwargs)

    if state.graphs is not None:
        state.graphs.recheck = True  # the weights may have moved since the last call
    state.eager_reason = None
    state.last_loop = None  # (set again by a greedy or sampling loop this call runs)
    walk = ModelWalk(self)  # what the checks below read off every module, listed once
    # what the hooks rule out: graph replays, prefix sharing, nanoserve's decode loop
    hooks = scan_hooks(self, walk.named)
    user_salt = kwargs.pop("cache_salt", None)
    if user_salt is not None and not isinstance(user_salt, (str, bytes)):
        raise ValueError(f"cache_salt: expected a str or bytes, got {type(user_salt).__name__}")
    _broadcast_mask(args, kwargs)
    passed = find_cache(kwargs)
    if isinstance(passed, PagedCache):
        if option("use_cache") is False:
            raise ValueError(
                "use_cache: False, with a PagedCache passed back to continue; stock would "
                "store every column again in it: pass use_cache=True, or no cache"
            )
        if walk.stock_only is not None:
            name, why = cache_kwarg(type(self)), walk.stock_only
            raise ValueError(
                f"{name}: a PagedCache passed back, but {why}: nanoserve runs such a model as "
                "stock does, on stock's cache; start a new call without the cache"
            )
        _check_retired(passed, type(self))
        _taken_back(state, passed)
        dropout = _checked_model(self, state, walk, hooks)
        _check_continuation(self, passed, args, kwargs)
        # (before the growth below, which counts the blocks a window keeps)
        passed.paged.keep_past_window(window_slack(self, kwargs))
        _room_to_continue(state, passed, self, args, kwargs)
        passed.mask_checked = False
        passed.drops_out = dropout  # (training mode may have changed since)
        passed.paged.leave_inference_mode()  # (returned by a call under inference mode)
        # a failed call (OutOfBlocks, say) leaves the cache as given: its rows' blocks are
        # held through the call, which beam reorders and windows would otherwise free
        held = passed.hold()
        try:
            with _generating(state, passed, hooks, self, walk):
                out = stock(*args, **kwargs)
        except BaseException:
            passed.restore(held)
            raise
        passed.release(held)
        return out
    if passed is not None or option("use_cache") is False:
        why = "the caller's own cache" if passed is not None else "use_cache=False"
        _log.info("fallback: stock generate (%s)", why)
        return stock(*args, **kwargs)  # the caller's own transformers cache
    if option("output_attentions"):
        _log.info("fallback: stock generate (output_attentions: paged kernels compute no weights)")
        return stock(*args, **kwargs)  # stock's cache and attention, which return the weights
    if walk.stock_only is not None:
        _log.info("fallback: stock generate (%s)", walk.stock_only)
        return stock(*args, **kwargs)  # stock's cache, forwards and loop: stock's tokens
    implementation = option("cache_implementation")
    # stock drops "hybrid" (Gemma's hub default) and runs "dynamic" as its default cache
    if implementation not in (None, "hybrid", "dynamic"):
        paged = implementation == "paged"
        batch = "; model.generate_batch(...) runs on its pool too" if paged else ""
        raise ValueError(
            f"cache_implementation: {implementation!r} asks for a transformers cache, but this "
            "model is patched by nanoserve and generates on its paged cache; leave "
            f"cache_implementation unset, or call nanoserve.unpatch_model(model) first{batch}"
        )
    # a model that drops out at random computes each copy of a prompt differently
    dropout = _checked_model(self, state, walk, hooks)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        raise ValueError(  # stock's check too, which the pool sizing below would pre-empt
            f"attention_mask: passed to generate must be 2-D [batch, length], got shape "
            f"{tuple(mask.shape)}"
        )
    if isinstance(mask, torch.Tensor):
        mask = mask.to("cpu", torch.bool)  # (read on the host once, by both checks)
        if padding_inside(mask):
            # (a row's last column padding stays refused below: right padding, a caller's bug)
            _log.info("fallback: stock generate (attention_mask: padding between real tokens)")
            return stock(*args, **kwargs)  # stock's cache: the paged one holds no such holes
    inferred = inferred_mask(self, args, kwargs) if mask is None else None
    if inferred is not None and padding_after_a_token(inferred):
        # a token equal to pad_token_id after a prompt's first real one: generate attends
        # around the hole (or the right padding) the mask it infers has
        _log.info("fallback: stock generate (the mask generate infers from pad_token_id)")
        return stock(*args, **kwargs)
    empty_row = isinstance(mask, torch.Tensor) and not check_left_padded(mask).any(dim=1).all()
    if empty_row and state.original_attn != "sdpa":
        # eager attention gives a row of nothing but padding even weights over every column,
        # flash attention none; the paged kernels answer it as sdpa does
        _log.info("fallback: stock generate (attention_mask: a row of padding only)")
        return stock(*args, **kwargs)
    pending_salt = None
    if state.prefix_sharing and hooks.rows is None and not option("prefill_chunk_size"):
        # the weights' hash runs on the device while the host sizes the pool below
        pending_salt = begin_prefix_salt(self, state, walk)
    for name in CACHE_KWARGS:
        kwargs.pop(name, None)
    share = (
        state.prefix_sharing
        and dropout is None
        and hooks.rows is None
        and _may_share(kwargs, option)
    )
    size = pool_size(state.pool, self, args, kwargs, share)
    kept = state.kept_pools
    reclaimable = kept.nbytes() if kept is not None else 0
    check_pool_fits(size, state.pool, self, reclaimable, walk.parameters)
    pool_dtype = state.pool.pool_dtype(self.dtype)
    failed, state.failed_cache = state.failed_cache, None
    num_blocks, pools, allocators = _pools_for(state, size, pool_dtype, failed)
    slack = window_slack(self, kwargs)
    paged = _new_store(state, size, num_blocks, pools, allocators, slack)
    cache = PagedCache(paged)
    cache.pool_fixed = state.pool.fixed
    cache.drops_out = dropout
    salt = None
    if pending_salt is not None:
        salt = finish_prefix_salt(pending_salt, self, user_salt, state, walk)
    stores = [group.allocator.store_id for group in paged.groups]
    cache.prefix_salt = agreed_salt(self, salt, stores)
    if share and not state.pool.fixed:
        unshared = pool_size(state.pool, self, args, kwargs, quiet=True)
        unshared = list(unshared.group_blocks) or [unshared.num_blocks]
        grows = any(u > n for u, n in zip(unshared, num_blocks, strict=True))
        cache.unshared_blocks = unshared if grows else None
    # weakly: a cache the caller drops is gone, and its memory can serve the next call
    state.last_cache = weakref.ref(cache)
    kept = [
        KeptPools(pool_dtype, g.pool_lists, weakref.ref(paged), g.allocator) for g in paged.groups
    ]
    kept[0].others = tuple(kept[1:])
    state.kept_pools = kept[0]
    kwargs[cache_kwarg(type(self))] = cache
    if implementation == "dynamic":
        _unset_dynamic(self, kwargs)
    try:
        with _generating(state, cache, hooks, self, walk):
            return stock(*args, **kwargs)
    except BaseException:
        state.last_cache = lambda: cache  # held, so the caller can see what was kept
        state.failed_cache = cache
        raise
    finally:
        state.last_stats = cache.stats()
        if not state.keep_pools:
            state.kept_pools = None
            _forget_cached(state)
            if state.graphs is not None:
                state.graphs.reset()
