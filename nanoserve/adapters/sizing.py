"""How many blocks a generate call's pool gets."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import MaxLengthCriteria

from nanoserve.adapters.family import KVLayout
from nanoserve.adapters.read_back import READ_BACK_LAG
from nanoserve.cache.allocator import as_index
from nanoserve.kernels.quant import (
    FP8_DTYPE,
    INT8_DTYPE,
    INT8_K_GROUP,
    INT8_SCALE_DTYPE,
    KV_DTYPE_NAMES,
    QUANTIZED_DTYPES,
    int8_groups,
)
from nanoserve.kernels.validation import check_positive
from nanoserve.log import get_logger

_log = get_logger(__name__)


# FP8 pools' scale unless patch_model is given one (vLLM's default without calibrated scales).
DEFAULT_FP8_SCALE = 1.0


MAX_BLOCK_SIZE = 16384


@dataclass(frozen=True)
class PoolOptions:
    """patch_model's pool arguments; at most one of ``num_blocks`` / ``max_memory``.
    ``kv_dtype``: the pools' dtype (None: the model's); ``kv_scale``: FP8 pools' fixed scale
    (None: ``DEFAULT_FP8_SCALE`` for FP8 pools)."""

    layout: KVLayout
    block_size: int = 16
    num_blocks: int | None = None
    max_memory: int | None = None
    kv_dtype: torch.dtype | None = None
    kv_scale: float | None = None

    @property
    def fixed(self) -> bool:
        """True when the caller fixed the pool's size (``num_blocks`` or ``max_memory``)."""
        return self.num_blocks is not None or self.max_memory is not None

    def __post_init__(self):
        # frozen: normalised values (a numpy int is fine, a bool is not) go in through object
        object.__setattr__(self, "block_size", as_index(self.block_size, "block_size", 1))
        if self.block_size > MAX_BLOCK_SIZE:
            # (one block is the least a pool holds: such a block would be gigabytes)
            raise ValueError(
                f"block_size: must be at most {MAX_BLOCK_SIZE} tokens, got {self.block_size}"
            )
        if self.num_blocks is not None and self.max_memory is not None:
            raise ValueError("num_blocks, max_memory: give at most one of them")
        if self.num_blocks is not None:
            object.__setattr__(self, "num_blocks", as_index(self.num_blocks, "num_blocks", 1))
        if self.max_memory is not None:
            object.__setattr__(self, "max_memory", as_index(self.max_memory, "max_memory", 1))
        object.__setattr__(self, "kv_dtype", kv_dtype_of(self.kv_dtype))
        if self.kv_scale is not None:
            if self.kv_dtype != FP8_DTYPE:
                raise ValueError("kv_scale: only FP8 pools (kv_dtype='fp8_e4m3') take a scale")
            check_fp8_scale(self.kv_scale)
        elif self.kv_dtype == FP8_DTYPE:
            # A fixed scale: calibrating from a pool's first write would make a call's output
            # depend on the calls before it (kept pools keep their scales) and on how short
            # the first prompt was.
            object.__setattr__(self, "kv_scale", DEFAULT_FP8_SCALE)

    def pool_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the pools of a model computing in ``model_dtype``."""
        return self.kv_dtype or model_dtype

    def group_block_bytes(self, model_dtype: torch.dtype) -> list[int]:
        """Bytes of one block in each pool (layer group) of a model in ``model_dtype``."""
        dtype = self.pool_dtype(model_dtype)
        return [
            block_bytes(self.layout, self.block_size, dtype, layers)
            for layers, _ in group_windows(self.layout)
        ]

    def check_max_memory(self, model_dtype: torch.dtype) -> None:
        """ValueError naming ``max_memory`` when it holds less than one block of each pool."""
        if self.max_memory is None:
            return
        one_block = sum(self.group_block_bytes(model_dtype))
        if self.max_memory < one_block:
            raise ValueError(
                f"max_memory: {self.max_memory} bytes is less than one block ({one_block} "
                f"bytes: {self.block_size} tokens of K and V in every layer)"
            )


def check_fp8_scale(value) -> None:
    """``kv_scale`` must be a finite positive number that float32 holds as one."""
    check_positive("kv_scale", value)
    as_float32 = float(torch.tensor(float(value), dtype=torch.float32, device="cpu"))
    if not (math.isfinite(as_float32) and as_float32 > 0):
        raise ValueError(f"kv_scale: {value} is not a finite positive float32 value")


def kv_dtype_of(value) -> torch.dtype | None:
    """patch_model's ``kv_dtype`` as a pool dtype: None (the model's dtype), "fp8_e4m3" /
    torch.float8_e4m3fn, or "int8" / torch.int8."""
    if value is None or value in QUANTIZED_DTYPES:
        return value
    if isinstance(value, str) and value in KV_DTYPE_NAMES:
        return KV_DTYPE_NAMES[value]
    raise ValueError(
        "kv_dtype: expected None, 'fp8_e4m3' (torch.float8_e4m3fn) or 'int8' (torch.int8), "
        f"got {value!r}"
    )


def block_bytes(
    layout: KVLayout, block_size: int, dtype: torch.dtype, layers: int | None = None
) -> int:
    """Bytes one block takes over all layers (or ``layers`` of them), K and V (and the
    per-slot scales of INT8 pools)."""
    layers = layout.num_layers if layers is None else layers
    per_token = 2 * layers * layout.num_kv_heads * layout.head_dim * dtype.itemsize
    if dtype == INT8_DTYPE:
        scales = int8_groups(layout.head_dim, INT8_K_GROUP) + 1  # keys' groups, values' one
        per_token += layers * layout.num_kv_heads * scales * INT8_SCALE_DTYPE.itemsize
    return per_token * block_size


def group_windows(layout: KVLayout) -> list[tuple[int, int | None]]:
    """(layers, window) of each pool a cache of ``layout`` has: one per layer group, or one
    for every layer."""
    if layout.layer_groups is None:
        return [(layout.num_layers, layout.sliding_window)]
    return [(len(layers), window) for layers, window in layout.layer_groups]


def coarse_blocks(n: int) -> int:
    """``n`` rounded up to the next of 8, 9, ..., 15, 16, 18, ..., 30, 32, 36, ... (eight steps
    an octave): at most 12.5% more than asked, and few enough sizes that calls of varying
    length land on a pool already held."""
    if n <= 8:
        return 8
    shift = n.bit_length() - 4
    return -(-n // (1 << shift)) << shift


def coarse_width(n: int) -> int:
    """Block-table columns rounded up to a power of two: a CUDA graph is captured per table
    width, so calls of other lengths replay the same graphs."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class PoolSize:
    """A generate call's pool: ``num_blocks``, and ``table_width`` (block-table columns
    enough for the longest row, so every step's metadata has one shape). A layout of layer
    groups gives each group's blocks in ``group_blocks`` (``num_blocks`` is their sum) and,
    under ``max_memory``, what the call needs of each in ``group_needed`` (a kept pool split
    otherwise serves when it holds that much)."""

    num_blocks: int
    table_width: int
    group_blocks: tuple[int, ...] = ()
    group_needed: tuple[int, ...] = ()


@dataclass(frozen=True)
class CallShape:
    """What a generate call stores: each row's real prompt tokens (padding is never
    stored), the columns of its prompt, the new tokens, how many copies of each row
    (beams, ``num_return_sequences``), the spare block a beam takes for copy-on-write, and
    how many rows hold each distinct prompt."""

    prompt_lens: list[int]
    width: int
    new_tokens: int
    copies: int
    spare: int
    groups: list[tuple[int, int]]  # (first row, rows) of each distinct prompt
    # Assisted generation and prompt lookup verify several tokens per step, as many as their
    # schedule grows to: a windowed pool is then sized as if it kept every token.
    multi_token_steps: bool = False
    window_slack: int = READ_BACK_LAG  # tokens a windowed pool keeps past the window


def window_slack(model, kwargs: dict) -> int:
    """Tokens past its window that a windowed pool keeps for a later crop: the decode steps
    nanoserve's loop runs past a stop before it reads the stop back, and on an assistant
    model's drafting call (transformers marks its generation config ``is_assistant`` and
    passes the drafts' ``max_new_tokens``) its drafts, which the main model may reject: the
    next drafting call crops them first."""
    if not generate_option(model, kwargs, "is_assistant"):
        return READ_BACK_LAG
    return READ_BACK_LAG + int(generate_option(model, kwargs, "max_new_tokens") or 0)


def generate_option(model, kwargs: dict, name: str):
    """Generate's option ``name``: from the call's keywords (where None too overrides the
    configs: transformers sets the call's keywords last, as given), else its generation
    config, else the model's (transformers fills what a passed config leaves unset from the
    model's, unless the call says ``use_model_defaults=False``); None when none sets it.
    ``kwargs`` are keywords only (a positional generation config moved into them)."""
    if name in kwargs:
        return kwargs[name]
    passed = kwargs.get("generation_config")
    if passed is not None:
        value = getattr(passed, name, None)
        if value is not None or kwargs.get("use_model_defaults") is False:
            return value
    return getattr(model.generation_config, name, None)


def call_inputs(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The ids (or embeddings) of ``model.generate(*args, **kwargs)``: [B, columns, ...]."""
    inputs = args[0] if args else None
    for name in ("input_ids", "inputs", "inputs_embeds"):
        if inputs is None:
            inputs = kwargs.get(name)
    return inputs


def call_shape(model, args: tuple, kwargs: dict) -> CallShape:
    """The ``CallShape`` of ``model.generate(*args, **kwargs)``."""
    inputs = call_inputs(args, kwargs)
    batch, width = inputs.shape[:2] if inputs is not None else (1, 1)

    def get(name):
        return generate_option(model, kwargs, name)

    new_tokens = get("max_new_tokens")
    if new_tokens is None:
        new_tokens = max((get("max_length") or 20) - width, 0)
    # a MaxLengthCriteria of the caller's replaces generate's own (transformers >= 4.50)
    criteria = args[3] if len(args) > 3 else kwargs.get("stopping_criteria")
    custom = [c.max_length for c in criteria or () if type(c) is MaxLengthCriteria]
    if custom:
        new_tokens = max(new_tokens, min(custom) - width)
    # prompt lookup's verify step stores its candidate tokens before cropping them, up to
    # that many past max_length
    new_tokens += get("prompt_lookup_num_tokens") or 0
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        prompt_lens = [int(n) for n in mask.sum(dim=1).tolist()]
    else:
        prompt_lens = [width] * batch
    beams = get("num_beams") or 1
    copies = max(beams, get("num_return_sequences") or 1)
    groups = _groups(inputs, mask, len(prompt_lens))
    multi = any(
        get(name) is not None
        for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
    )
    spare = 1 if beams > 1 else 0
    slack = window_slack(model, kwargs)
    return CallShape(prompt_lens, width, new_tokens, copies, spare, groups, multi, slack)


def _groups(inputs, mask, batch: int) -> list[tuple[int, int]]:
    """(first row, rows) of each distinct (token ids, padding) row of ``inputs``; every row
    its own group when the inputs are not token ids."""
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2 or inputs.is_floating_point():
        return [(row, 1) for row in range(batch)]
    rows = inputs if not isinstance(mask, torch.Tensor) else torch.cat([inputs, mask], dim=1)
    groups: dict[bytes, list[int]] = {}
    for i, row in enumerate(rows.cpu().numpy()):
        groups.setdefault(row.tobytes(), [i, 0])[1] += 1
    return [(first, count) for first, count in groups.values()]


def pool_size(
    options: PoolOptions,
    model,
    args: tuple,
    kwargs: dict,
    share_rows: bool = False,
    quiet: bool = False,
) -> PoolSize:
    """``num_blocks``; else what fits in ``max_memory``; else what this call needs, rounded up
    by ``coarse_blocks``: for each row, blocks for its real prompt tokens plus the new
    tokens, and with beam search one spare block per beam for copy-on-write. With
    ``share_rows`` the copies of one prompt hold its blocks once, each with a block of its
    own for the partly filled last one. The table width fits the longest row, rounded up by
    ``coarse_width``. ``quiet``: no log line (a second sizing of the same call)."""
    shape = call_shape(model, args, kwargs)
    bs = options.block_size
    table_width = coarse_width(math.ceil((shape.width + shape.new_tokens) / bs) + 1)
    groups = group_windows(options.layout)
    grouped = options.layout.layer_groups is not None
    if options.num_blocks is not None:
        _log.info("pool: %d blocks of %d tokens (num_blocks)", options.num_blocks, bs)
        each = (options.num_blocks,) * len(groups) if grouped else ()
        width = min(table_width, coarse_width(options.num_blocks))  # no row holds more
        return PoolSize(options.num_blocks * max(1, len(each)), width, each)
    chunk = generate_option(model, kwargs, "prefill_chunk_size") or None
    needed = [_blocks_held(shape, bs, window, share_rows, chunk) for _, window in groups]
    if options.max_memory is not None:
        options.check_max_memory(model.dtype)  # again: the model's dtype may have changed
        sizes = options.group_block_bytes(model.dtype)
        # one block for each group, the rest split in proportion to what the call needs
        spare = options.max_memory - sum(sizes)
        wanted = [n * size for n, size in zip(needed, sizes, strict=True)]
        blocks = [
            1 + (spare * want // max(sum(wanted), 1)) // size
            for want, size in zip(wanted, sizes, strict=True)
        ]
        if not grouped:
            blocks = [options.max_memory // sizes[0]]
        _log.info(
            "pool: %s blocks of %d tokens, what fits in max_memory=%d bytes (%s bytes a block)",
            "+".join(map(str, blocks)),
            bs,
            options.max_memory,
            "+".join(map(str, sizes)),
        )
        table_width = min(table_width, coarse_width(max(blocks)))  # no row holds more
        if not grouped:
            return PoolSize(sum(blocks), table_width)
        return PoolSize(sum(blocks), table_width, tuple(blocks), tuple(needed))
    new, spare = shape.new_tokens, shape.spare
    blocks = [coarse_blocks(n) for n in needed]
    _log.log(
        logging.DEBUG if quiet else logging.INFO,
        "pool: %s blocks of %d tokens: %s needed (%d rows, %d prompt tokens, up to %d new "
        "tokens a row%s%s%s), rounded up to a coarse size",
        "+".join(map(str, blocks)),
        bs,
        "+".join(map(str, needed)),
        len(shape.prompt_lens) * shape.copies,
        sum(shape.prompt_lens),
        new,
        ", a spare block per beam" if spare else "",
        ", copies of a prompt stored once" if share_rows else "",
        f", {len(groups)} layer groups" if grouped else "",
    )
    return PoolSize(sum(blocks), table_width, tuple(blocks) if grouped else ())


def _blocks_held(
    shape: CallShape, bs: int, window: int | None, share_rows: bool, chunk: int | None = None
) -> int:
    """Blocks the call's rows hold at most in a pool whose layers attend within ``window``
    (None: the whole history); ``chunk``: the prefill's chunk size (None: one forward)."""
    new, spare = shape.new_tokens, shape.spare
    blocks = 0
    for first, rows in shape.groups:
        n, rows = shape.prompt_lens[first], rows * shape.copies
        held = math.ceil((n + new) / bs)
        if window is not None and not shape.multi_token_steps:
            # past its first forward a row holds its window's blocks
            slack = max(bs, shape.window_slack)  # as the cache keeps (hf.py's window_slack)
            decode = math.ceil((window + slack) / bs) + 1
            bound = max(math.ceil(n / bs), decode)  # the whole prompt, then a window
            if chunk and chunk < n:  # each chunk is stored past its window's blocks only
                bound = min(bound, max(math.ceil((window - 1 + slack + chunk) / bs) + 1, decode))
            held = min(held, bound)
        alone = rows * (held + spare)
        shared = math.ceil(n / bs) + rows * (math.ceil((n + new) / bs) - n // bs + spare)
        blocks += min(alone, shared) if share_rows else alone
    return blocks


def blocks_to_continue(paged, columns: int, model, args: tuple, kwargs: dict) -> list[int]:
    """Blocks a generate call that continues ``paged`` (a returned cache passed back, which
    has seen ``columns`` columns) may need beyond those its rows hold, in each of its layer
    groups (``paged.groups``): each row grows by at most the columns not cached yet (all of
    them for assisted and prompt-lookup calls) plus the new tokens, and may copy its last
    block. In a group that releases blocks past its window (``sliding_window``) a row holds
    at most that window's blocks, as ``_blocks_held`` bounds a new pool's; the blocks the rows
    hold now make no room meanwhile (the call holds them, to give them back should it fail:
    ``PagedCache.hold``). A cache that holds no rows (``reset()``) takes every row anew, as a
    new pool is sized (``_blocks_held``)."""
    shape = call_shape(model, args, kwargs)
    # assisted and prompt-lookup calls: transformers' first forward feeds every column again
    # on top of the cache (5.25 does), not only those it has not seen
    extend = shape.width if shape.multi_token_steps else max(shape.width - columns, 0)
    grow = extend + shape.new_tokens
    bs = paged.block_size
    need = []
    for group in paged.groups:
        if not group.tables:
            need.append(_blocks_held(shape, bs, group.sliding_window, share_rows=False))
            continue
        window = None if shape.multi_token_steps else group.sliding_window
        appended = 0  # blocks the rows add, none released
        at_most = 0  # blocks the rows hold at once, those they share counted for each
        for t in group.tables:
            appended += row_growth(t, grow, bs) + shape.spare
            if window is not None:
                # the window's blocks after each step, and the first forward's whole extension
                # past the window's first position
                blocks = math.ceil((t.num_tokens + grow) / bs)
                decode = math.ceil((window + group.window_slack) / bs) + 1
                first = math.ceil((window - 1 + group.window_slack + extend) / bs) + 1
                at_most += min(blocks - t.dropped, max(decode, first)) + 1 + shape.spare
        more = shape.copies * appended  # each copy of a row (beams, return sequences) grows
        if window is not None:
            more = min(more, shape.copies * at_most)
        need.append(more)
    return need


def row_growth(table, tokens: int, block_size: int) -> int:
    """Blocks a row (its ``BlockTable``) may take to append ``tokens``: those its tokens
    reach past the blocks it holds, and a copy of its last block (copy on write)."""
    return max(math.ceil((table.num_tokens + tokens) / block_size) - table.num_blocks, 0) + 1
