"""One owner for a patched model's state and for the paged step of each forward.

- ``PatchState`` lives on the model instance (``state_of(model)``): the patch options, what
  patching replaced, the CUDA-graph runner, the pools kept between calls. A deep copy of a
  patched model gets a fresh state of its own (``PatchState.__deepcopy__``), so the copy runs
  its own weights and ``unpatch_model(copy)`` works.
- A paged forward opens exactly one step (``paged_step``), whether it runs eagerly or through
  the graph runner: the step's cache and metadata are the current ``Step`` (a context
  variable, so each thread and each nested call sees its own) that ``PagedCache.update`` and
  the attention and mask functions read.
- ``find_cache`` and ``new_token_mask`` are the one place that reads HF's forward arguments.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from nanoserve.adapters.compiled_layers import CompiledLayers
from nanoserve.adapters.decode_graphs import DecodeGraphs
from nanoserve.adapters.fused_decode import FusedDecode
from nanoserve.adapters.sizing import PoolOptions, call_inputs, generate_option
from nanoserve.cache import BlockAllocator, StepMetadata

# How forward and generate take the cache: 5.24 renamed past_key_values to cache.
CACHE_KWARGS = ("cache", "past_key_values")
STATE_ATTR = "_nanoserve_state"


@dataclass
class KeptPools:
    """A finished call's pool lists and allocator (with its cached prefix blocks), kept for
    the next calls that fit in them. A cache of layer groups keeps group 0's here and each
    further group's in ``others``."""

    dtype: torch.dtype
    pools: tuple[list, ...]  # (key_pools, value_pools, key_scales, value_scales)
    owner: Callable[[], object | None]  # weak reference to the PagedKVCache storing in them
    allocator: BlockAllocator
    others: tuple[KeptPools, ...] = ()

    @property
    def num_blocks(self) -> int:
        """The pool's blocks now (a continued cache may have grown it)."""
        return self.allocator.num_blocks

    @property
    def group_blocks(self) -> tuple[int, ...]:
        """Each group's blocks (empty when the cache had one group)."""
        if not self.others:
            return ()
        return (self.num_blocks, *(kept.num_blocks for kept in self.others))

    def made_for_inference(self) -> bool:
        """Whether the pool tensors were made under ``torch.inference_mode`` (outside it they
        take no in-place write)."""
        tensors = (p for kept in (self, *self.others) for pools in kept.pools for p in pools)
        return any(p is not None and p.is_inference() for p in tensors)

    def nbytes(self) -> int:
        """Bytes of the pool tensors (K and V, every layer allocated so far, every group)."""
        own = sum(
            p.numel() * p.element_size() for pools in self.pools for p in pools if p is not None
        )
        return own + sum(kept.nbytes() for kept in self.others)


def no_cache() -> None:
    return None


@dataclass
class PatchState:
    """What a patched model remembers. Options are fixed at patch time; the rest is the
    model's runtime (graphs, kept pools, the latest call's cache), reset in a deep copy."""

    config: object  # the model's config (its attention is switched while patched)
    pool: PoolOptions
    backend: str  # kernel backend for every paged step: "auto", "triton" or "torch"
    cuda_graphs: bool  # decode steps on CUDA replay captured graphs
    compile_decode: bool
    fuse_decode: bool  # 16-bit decode graph steps run norms and projections fused
    keep_pools: bool  # a finished call's pool (and its graphs) serve the next calls
    prefix_sharing: bool  # copies of one prompt in a batch are prefilled once
    original_attn: str
    previous_generate: Callable | None = None  # an instance attribute patching replaced
    previous_forward: Callable | None = None
    # the function of the forward patch_model installed (the decode loop calls the graph
    # runner straight only while the model's forward is still it)
    patched_forward: Callable | None = None
    decode_loop: bool = True  # greedy / sampling run nanoserve's loop (decode_loop.py)
    # which loop the latest _sample call ran: "nanoserve" or "stock: <why>" (None: none yet)
    last_loop: str | None = None
    # the latest loop call's decode steps run straight on the graph runner (no module call)
    # and token choices replayed as a graph (decode_loop.py)
    loop_steps: dict = field(default_factory=dict)
    # why the latest call's steps replayed no graph (a submodule's hook, dropout), or None
    eager_reason: str | None = None
    graphs: DecodeGraphs | None = None  # when cuda_graphs
    compiled_layers: CompiledLayers | None = None  # compile_decode's, built on first use
    fused_decode: FusedDecode | None = None  # built on first use
    # the latest generate call's PagedCache: weakly, or strongly after a call that raised
    last_cache: Callable[[], object | None] = no_cache
    # the PagedCache of the latest call, when it raised: held (last_cache) until the next
    # fresh call empties it and takes its pool, with the prefixes stored in it
    failed_cache: object | None = None
    # gives the config back if the model is collected while patched (detached by unpatch)
    finalizer: weakref.finalize | None = None
    last_stats: dict = field(default_factory=dict)  # its figures as that call left them
    kept_pools: KeptPools | None = None
    # the digest of the model's part of the latest prefix salt, and that part (prefix_salt.py)
    salt_key: tuple | str | None = None
    salt: bytes = b""
    # the weights' hash laid out per device, launched again while they lie where they did
    digest_plans: dict = field(default_factory=dict)
    # one paged call at a time per model: a second thread waits for the first to finish
    lock: threading.RLock = field(default_factory=threading.RLock)

    def __reduce__(self):
        raise TypeError(
            "pickle: a patched model holds nanoserve's runtime (pools, CUDA graphs, a lock) "
            "and cannot be pickled; nanoserve.unpatch_model(model) before pickle or "
            "torch.save and patch again after loading, or save model.state_dict() or "
            "save_pretrained()"
        )

    def __deepcopy__(self, memo) -> PatchState:
        config = copy.deepcopy(self.config, memo)  # the copy's own config (memo: same object)
        remember_original_attn(config, self.original_attn)
        fresh = PatchState(
            config=config,
            pool=self.pool,
            backend=self.backend,
            cuda_graphs=self.cuda_graphs,
            compile_decode=self.compile_decode,
            fuse_decode=self.fuse_decode,
            keep_pools=self.keep_pools,
            prefix_sharing=self.prefix_sharing,
            original_attn=self.original_attn,
            previous_generate=copy.deepcopy(self.previous_generate, memo),
            previous_forward=copy.deepcopy(self.previous_forward, memo),
            patched_forward=self.patched_forward,  # (a copied bound method keeps its function)
            decode_loop=self.decode_loop,
        )
        if self.graphs is not None:
            fresh.graphs = type(self.graphs)(capture=self.graphs.capture, agree=self.graphs.agree)
        return fresh


def stock_method(model, previous, name: str) -> Callable:
    """What ``model.<name>`` was before patching (``previous``, else the class's method),
    taking the rest of the arguments. The class's function is bound with
    ``functools.partial``, not ``__get__``: under ``torch.compile(model)`` Dynamo rebuilt such
    a bound method at a graph break as ``model.<name>``, the patched method, which then
    called itself until the recursion limit."""
    if previous is not None:
        return previous
    return functools.partial(getattr(type(model), name), model)


def state_of(model) -> PatchState | None:
    """The patch state of ``model`` (None when it is not patched)."""
    return model.__dict__.get(STATE_ATTR)


# -- the attention implementation a config had before patching -----------------------------
# Attention modules read ``config._attn_implementation``; models built from one config object
# share it, so patching one switches all of them. A model that shares the config but is not
# patched (or a patched one outside a paged forward) must still run what it ran before:
# the original name is kept per config object, with the patched models using it (weakly: a
# patched model dropped without unpatching leaves the set when it is collected).


@dataclass
class _Original:
    """A config's attention before patching, and the patched models using the config."""

    config: weakref.ref
    name: str
    models: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    copies: int = 0  # patch states' deep copies (their models are not known to them)

    def in_use(self) -> bool:
        return self.copies > 0 or any(True for _ in self.models)  # (skips collected models)


_ORIGINAL_ATTN: dict[int, _Original] = {}


def remember_original_attn(config, name: str, model=None) -> str:
    """Record ``config``'s attention before the first patch of a model using it, and
    ``model`` as one of its patched models (None: a patch state's deep copy, counted
    instead); returns the original name (the recorded one when another patched model
    shares this config)."""
    entry = _ORIGINAL_ATTN.get(id(config))
    if entry is None or entry.config() is not config:
        key = id(config)
        entry = _Original(weakref.ref(config, lambda _: _ORIGINAL_ATTN.pop(key, None)), name)
    if model is not None:
        entry.models.add(model)
    else:
        entry.copies += 1
    # (set after the add: a collection during it may have run a finalizer that dropped it)
    _ORIGINAL_ATTN[id(config)] = entry
    return entry.name


def forget_original_attn(config, model=None, collected: bool = False) -> str | None:
    """``model`` is no longer patched (``collected``: a patched model was collected, and
    the set has let it go); the name to switch ``config`` back to when no patched model
    uses it any more, else None."""
    entry = _ORIGINAL_ATTN.get(id(config))
    if entry is None or entry.config() is not config:
        return None if collected else "sdpa"
    if model is not None and model in entry.models:
        entry.models.discard(model)
    elif not collected and entry.copies > 0:  # (a deep copy's model, counted)
        entry.copies -= 1
    if entry.in_use():
        return None
    del _ORIGINAL_ATTN[id(config)]
    return entry.name


def original_attn(config) -> str:
    """The attention ``config`` used before it was patched ("sdpa" when unknown)."""
    entry = _ORIGINAL_ATTN.get(id(config)) if config is not None else None
    if entry is not None and entry.config() is config:
        return entry.name
    return "sdpa"


# -- the step of the forward in flight ---------------------------------------------------


@dataclass
class Step:
    """The paged forward in flight: its cache (a ``PagedCache``), the step metadata every
    layer reads, and the kernel backend ("torch" where autograd records the forward: the
    Triton kernels record no graph, the torch references do)."""

    cache: object
    meta: StepMetadata
    backend: str
    # layer index -> rows its q/k/v launch already stored in the pools (``qkv_rotary.Stored``)
    stored_rows: dict = field(default_factory=dict)


_CURRENT: ContextVar[Step | None] = ContextVar("nanoserve_step", default=None)


def current_step() -> Step | None:
    """The paged step of the forward running in this context, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def paged_step(cache, meta: StepMetadata, backend: str) -> Iterator[Step]:
    """Make ``meta`` the step every layer of ``cache`` reads for the duration of a forward.

    Both the eager path and the graph runner open steps through this one function."""
    cache.paged.step = meta
    token = _CURRENT.set(Step(cache, meta, backend))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def no_paged_step() -> Iterator[None]:
    """No paged step for the duration of a forward that runs without a paged cache (one
    called from inside another model's paged forward, by a hook, say): its attention and
    mask run as before patching."""
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def find_cache(kwargs: dict):
    """The cache object HF passes to ``forward`` or ``generate`` (either name), or None."""
    for name in CACHE_KWARGS:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None


def new_token_mask(kwargs: dict, cached_lens: Callable[[], list[int]]) -> torch.Tensor:
    """bool [B, q] on the CPU: which columns of this forward are real tokens to store.

    From ``attention_mask`` (its last q columns), else all True. Raises ValueError for what
    the paged cache cannot store as stock computes it: a 4-D mask, and a real token followed
    by padding (right padding), within the step or after tokens a row already cached
    (``cached_lens()``: each row's cached token count)."""
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        raise ValueError("input_ids: a paged forward needs input_ids or inputs_embeds")
    batch, q_len = tokens.shape[:2]
    mask = kwargs.get("attention_mask")
    if mask is None:
        return torch.ones(batch, q_len, dtype=torch.bool, device="cpu")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(
            "attention_mask: nanoserve's paged cache takes a 2-D [batch, columns] padding mask; "
            "a custom 4-D mask needs the stock cache (nanoserve.unpatch_model(model))"
        )
    new = mask[:, -q_len:].to("cpu", torch.bool)
    if new.shape != (batch, q_len):
        raise ValueError(
            f"attention_mask: {tuple(mask.shape)} does not cover the {q_len} new columns"
        )
    if not bool(new.all()):
        check_left_padded(new, cached_lens())
    return new


def host_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor of ``values`` on ``device``, copied without waiting for the device's
    queued work (``torch.tensor(values, device=...)`` synchronizes the stream first, which
    would drain the decode steps issued ahead)."""
    return torch.tensor(values, dtype=torch.int64, device="cpu").to(device, non_blocking=True)


def check_whole_mask(kwargs: dict, cached_lens: list[int] | None = None, columns: int = 0) -> None:
    """``check_left_padded`` over every column of a forward's 2-D ``attention_mask``, the
    cached ones too, and ``check_cached_columns``: run on the first forward of each generate
    call and on every forward outside one. (Given no mask, generate infers one from pad ids;
    a generated token equal to ``pad_token_id`` then reads as padding inside the sequence
    when its cache is continued. Stock masks that key; the paged cache holds it and would
    attend it.) ``cached_lens``: each row's tokens in the cache; ``columns``: the columns
    it has seen, left padding included (0: nothing cached)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        mask = mask.to("cpu", torch.bool)  # (read back once for both checks)
        check_left_padded(mask)
    rows_match = mask is None or (mask.dim() == 2 and mask.shape[0] == len(cached_lens or ()))
    if columns and cached_lens is not None and rows_match:  # (other rows: the step refuses)
        check_cached_columns(mask, cached_lens, columns)


def check_cached_columns(mask: torch.Tensor | None, cached_lens: list[int], columns: int) -> None:
    """ValueError naming ``attention_mask`` when a forward's mask [B, columns + new] (None:
    every column real) marks the columns a cache holds otherwise than it holds them: row r's
    first ``columns - cached_lens[r]`` as padding (stored as none), the rest as its tokens.
    Stock's cache keeps padding K/V, and a mask marking them real makes it attend them; one
    marking a cached token as padding makes it skip it. The paged cache can do neither."""
    lens = torch.tensor(cached_lens, dtype=torch.long, device="cpu")
    if mask is None:
        if bool((lens < columns).any()):
            raise ValueError(
                "attention_mask: none (or all ones), so every column is real to stock, but "
                f"the cache holds left padding (rows {_rows(lens < columns)}) that it did not "
                "store; pass the mask the cache was filled with, extended by ones for the new "
                "columns"
            )
        return
    if mask.shape[1] < columns:
        raise ValueError(
            f"attention_mask: {mask.shape[1]} columns, fewer than the {columns} the cache "
            "holds; pass a mask over every column (the cached ones, then the new ones)"
        )
    held = torch.arange(columns, device="cpu")[None, :] >= (columns - lens)[:, None]
    differs = (mask[:, :columns].to("cpu", torch.bool) != held).any(dim=1)
    if bool(differs.any()):
        raise ValueError(
            f"attention_mask: over the {columns} columns the cache holds, rows "
            f"{_rows(differs)} mark real tokens and padding otherwise than the calls that "
            "filled it (the paged cache stores no padding, so it cannot attend padding nor "
            "skip a cached token as stock would); pass the mask those calls had, extended "
            "by ones for the tokens generated and the new columns"
        )


def _rows(flags: torch.Tensor) -> str:
    rows = flags.nonzero().flatten().tolist()
    return ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")


def padding_inside(mask: torch.Tensor) -> bool:
    """True when a row of ``mask`` [B, n] has padding between real tokens while every row
    ends with a real one (a caller masking tokens out of a prompt): stock attends around
    such holes, which the paged cache cannot hold."""
    mask = mask.to("cpu", torch.bool)
    if mask.shape[1] < 2 or not bool(mask[:, -1].all()):
        return False
    return padding_after_a_token(mask)


def padding_after_a_token(mask: torch.Tensor) -> bool:
    """True when a row of ``mask`` [B, n] (bool) has a padding column after a real token: a
    hole, or right padding."""
    return bool((mask[:, 1:] < mask[:, :-1]).any())


def inferred_mask(model, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The attention mask [B, n] (bool, on the host) that generate infers for a call passing
    none, as transformers' ``_prepare_attention_mask_for_generation`` does: the ids that are
    not ``pad_token_id``, where the ids hold it and it is no EOS id. None where generate
    infers all ones (or the call passes a mask)."""
    if kwargs.get("attention_mask") is not None:
        return None
    ids = kwargs.get("input_ids")
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 0):
        ids = call_inputs(args, kwargs)
    pad = generate_option(model, kwargs, "pad_token_id")
    if pad is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None  # (without a pad id generate pads with the first EOS id: no inference)
    if ids.dtype not in (torch.int32, torch.int64):
        return None
    pads = torch.as_tensor(pad).flatten().cpu()
    eos = generate_option(model, kwargs, "eos_token_id")
    if eos is not None and bool(torch.isin(torch.as_tensor(eos).flatten().cpu(), pads).any()):
        return None
    padding = torch.isin(ids.cpu(), pads)
    return ~padding if bool(padding.any()) else None


def check_left_padded(mask: torch.Tensor, cached_lens: list[int] | None = None) -> torch.Tensor:
    """ValueError naming ``attention_mask`` when a row of ``mask`` [B, n] has padding after a
    real token, or any padding after tokens it already cached (``cached_lens``). Returns the
    mask as bool on the CPU."""
    mask = mask.to("cpu", torch.bool)
    within = (mask[:, 1:] < mask[:, :-1]).any(dim=1)  # padding after a real token of the mask
    holes = within
    if cached_lens:
        cached = torch.tensor([n > 0 for n in cached_lens], device="cpu")
        holes = within | (cached & ~mask.all(dim=1))
    if bool(holes.any()):
        fed_again = ""
        if not bool(within.any()):  # (then the padding comes after cached tokens)
            fed_again = (
                "; here the padding columns come after tokens the cache holds: transformers "
                "feeds a left-padded row's whole input again over its cache (a continuation "
                "with prompt_lookup_num_tokens or assistant_model), which the paged cache "
                "cannot store, so continue such a cache without them"
            )
        raise ValueError(
            "attention_mask: padding after a real token (right padding, a later chat turn "
            "padded inside a continued sequence, or a token equal to pad_token_id inside a "
            "sequence whose mask generate inferred) is not supported by nanoserve's paged "
            'cache; tokenize with padding_side="left" (each turn unpadded when continuing a '
            "cache) and pass the mask" + fed_again
        )
    return mask


def pad_to_feed(model, pad: int) -> int | None:
    """A token id to feed the model in place of ``pad`` when its input embedding has no row
    ``pad`` (a tokenizer's added pad token, -1), else None: finished rows in the decode loop
    (steps issued before the loop reads back that every row stopped feed pads that stock
    never feeds: its loop stops first; none of their values is returned; where stock feeds
    one, a row finished while others go on with its scores or logits kept, it raises an
    IndexError, and here that row's values past its EOS are those of this id) and the
    padding columns of a batch of prompts (masked out, but looked up all the same)."""
    try:
        size = getattr(model.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(size, int) or 0 <= pad < size:
        return None
    return 0
