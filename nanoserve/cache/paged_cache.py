"""PagedKVCache: per-layer K/V pools over one shared set of block tables.

The model step is explicit: ``begin_step`` grows every sequence's table once for the tokens
of this forward and builds the step's metadata (slot mapping, block tables, lengths); each
layer then calls ``write`` with the same metadata. A table per layer, or growing the table
per layer, would be wrong: every layer stores the same tokens at the same positions, so one
block id names a slot in every layer's pool.

Pools are allocated lazily by the first ``write`` of each layer, with that K/V's dtype and
device, so layers spread over several devices (accelerate's ``device_map``) keep their pool
beside them.

When every layer attends only to the last ``sliding_window`` positions, ``begin_step`` first
releases each sequence's leading blocks that no query of this step or a later one can see
(all of their positions before ``num_tokens - sliding_window + 1``), less a slack of
``max(block_size, window_slack)`` tokens: a later ``drop_last`` of up to that many tokens (a
speculative step's rejected tokens, a decode loop's steps issued past a stop) leaves
sequences that can continue. A long sequence then holds at most
``ceil((sliding_window + slack) / block_size) + 1`` blocks. The
kernels never read the released entries of the block table (their window starts past them;
the entries read as block 0).

A model whose layers attend differently (sliding and global layers) stores each group of
layers in a ``PagedKVCache`` of its own (``grouped_cache.py``): there a block id names a
slot in every layer of its group only.

With ``kv_dtype=torch.float8_e4m3fn`` the pools hold FP8 values and each layer has float32
scales per KV head (``key_scales`` / ``value_scales``, [Hkv]) beside its pools: the scatter
quantizes on write (saturating) and the attention kernels dequantize on read. A layer's
scales are set once, when its pool takes its first write (calibrated from that write's
per-head amax times ``CALIBRATION_HEADROOM``, or a fixed ``kv_scale``), and never change
while the pool lives: later writes saturate instead, since a new scale would misread every
token already stored (and the cached prefixes and the decode graphs, which read the scales
in place, go on with the pools).

With ``kv_dtype=torch.int8`` the pools hold int8 values and every slot its own float16
scales (``key_scales`` [num_blocks, block_size, Hkv, groups] and ``value_scales`` [..., 1]
per layer, allocated with the pools): the scatter writes both, so nothing is calibrated and
a token's stored values depend on that token alone (see ``kernels/quant.py``). A block copy
copies its scales too.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.cache.allocator import BlockAllocator, as_index
from nanoserve.cache.block_table import DROPPED, BlockTable
from nanoserve.kernels.dispatch import check_backend
from nanoserve.kernels.quant import (
    FP8_DTYPE,
    FP8_MAX,
    INT8_DTYPE,
    INT8_K_GROUP,
    INT8_SCALE_DTYPE,
    QUANTIZED_DTYPES,
    int8_scale_shape,
)
from nanoserve.kernels.shared_prefix import (
    SharedPrefixPlan,
    plan_shared_prefix,
    takes_shared_prefix,
)
from nanoserve.kernels.slot_scatter import KVStore, slot_scatter
from nanoserve.kernels.validation import FLOAT_DTYPES, check_positive

# Calibrated FP8 scales map this many times the first write's per-head amax to e4m3's
# largest value (448): room for later tokens larger than the prompt's (see
# benchmarks/fp8_accuracy.py for the measurement behind the choice).
CALIBRATION_HEADROOM = 2.0


@dataclass
class StepMetadata:
    """What every layer of one forward needs, built once per step.

    ``new_token_mask`` bool [S, q] marks the real (stored) tokens of the step's padded batch.
    Tensors (on ``device``): ``slot_mapping`` int64 [S * q] (-1 for padding),
    ``token_index`` int64 [T] flat indices of the real tokens in the padded [S * q] layout,
    ``block_tables`` int32 [S, max_blocks], ``seq_lens`` int32 [S], ``cu_seqlens_q`` int32
    [S + 1] over the real tokens. ``all_single`` (every row takes one token) and
    ``equal_lengths`` (every row holds as many tokens as the others after the step) are host
    values. ``shared_prefix``: in a decode step, the ``SharedPrefixPlan`` of rows whose tables
    begin with the same blocks (decode attention reads those once for all of them), or None.

    A cache of several layer groups (``GroupedKVCache``) gives each group its own
    ``slot_mapping`` and ``block_tables``: ``group_metas`` holds one metadata per group (the
    other fields are the same in all) and ``layer_groups`` the group of each layer; this
    object's own fields are group 0's. Both are empty for a cache of one group.
    """

    slot_mapping: torch.Tensor
    token_index: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    all_single: bool
    equal_lengths: bool = False
    _mirrors: dict[torch.device, StepMetadata] = field(default_factory=dict, repr=False)
    group_metas: tuple[StepMetadata, ...] = ()
    layer_groups: tuple[int, ...] = ()
    shared_prefix: SharedPrefixPlan | None = None

    def for_layer(self, layer_idx: int) -> StepMetadata:
        """The metadata layer ``layer_idx`` reads (its group's; this one with one group)."""
        if not self.group_metas:
            return self
        return self.group_metas[self.layer_groups[layer_idx]]

    def to(self, device: torch.device) -> StepMetadata:
        """The same metadata on ``device`` (copied once per device per step)."""
        device = torch.device(device)
        if self.slot_mapping.device == device:
            return self
        if device not in self._mirrors:
            groups = tuple(meta.to(device) for meta in self.group_metas)
            if groups:
                self._mirrors[device] = grouped_metadata(groups, self.layer_groups)
            else:
                plan = self.shared_prefix
                if plan is not None:
                    plan = SharedPrefixPlan(*(t.to(device, non_blocking=True) for t in plan))
                self._mirrors[device] = StepMetadata(
                    *(t.to(device, non_blocking=True) for t in self._tensors()),
                    all_single=self.all_single,
                    equal_lengths=self.equal_lengths,
                    shared_prefix=plan,
                )
        return self._mirrors[device]

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.slot_mapping,
            self.token_index,
            self.block_tables,
            self.seq_lens,
            self.cu_seqlens_q,
        )


def grouped_metadata(
    group_metas: tuple[StepMetadata, ...], layer_groups: tuple[int, ...]
) -> StepMetadata:
    """One step's metadata over several layer groups (``StepMetadata``): group 0's fields,
    with every group's metadata and each layer's group."""
    first = group_metas[0]
    return StepMetadata(
        *first._tensors(),
        all_single=first.all_single,
        equal_lengths=first.equal_lengths,
        group_metas=group_metas,
        layer_groups=layer_groups,
        shared_prefix=first.shared_prefix,
    )


def _misfit(
    layer_idx: int, pool: torch.Tensor, like: torch.Tensor, num_blocks: int, dtype: torch.dtype
) -> str:
    """Why ``like`` [tokens, kv_heads, head_dim] cannot be stored in layer ``layer_idx``'s
    ``pool`` [num_blocks, block_size, kv_heads, head_dim] of ``dtype``."""
    figures = [
        ("blocks", pool.shape[0], num_blocks),
        ("dtype", pool.dtype, dtype),
        ("heads", pool.shape[2], like.shape[1]),
        ("head_dim", pool.shape[3], like.shape[2]),
        ("device", pool.device, like.device),
    ]
    differs = ", ".join(f"{name} {old} -> {new}" for name, old, new in figures if old != new)
    return (
        f"layer {layer_idx} already holds this cache's K/V and cannot take this write "
        f"({differs}); replacing the pool would lose the cached tokens. Start a new cache "
        "after changing the model's dtype or device."
    )


def check_given_scales(pools: tuple[list, ...] | None, kv_scale: float | None) -> None:
    """A fixed ``kv_scale`` must agree with the FP8 scales given with ``pools`` (four lists:
    key pools, value pools, key scales [Hkv] float32, value scales): a layer that comes with
    its scales keeps them (its K/V were stored at them), so a different ``kv_scale`` would go
    unused. One device read per device, and only when both are given."""
    if kv_scale is None or pools is None or len(pools) != 4:
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for scales in (*pools[2], *pools[3]):
        if scales is not None:
            by_device.setdefault(scales.device, []).append(scales.reshape(-1))
    for parts in by_device.values():
        if bool(torch.cat(parts).ne(kv_scale).any()):
            raise ValueError(
                f"kv_scale: the pools given come with FP8 scales other than {kv_scale}, and "
                "keep them (their K/V were stored at those); pass kv_scale=None to keep "
                "them, or new pools to store at kv_scale"
            )


class PagedKVCache:
    """K/V pools ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, one block
    table per sequence, shared by all layers."""

    # Decode steps plan shared-prefix reads (``StepMetadata.shared_prefix``); False reads
    # every row whole, as before (A/B timings).
    share_prefix_reads = True

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int = 16,
        table_width: int = 1,
        pools: tuple[list, list] | None = None,
        backend: str = "auto",
        allocator: BlockAllocator | None = None,
        sliding_window: int | None = None,
        window_slack: int = 0,
        kv_dtype: torch.dtype | None = None,
        kv_scale: float | None = None,
    ):
        """``table_width``: the least number of columns of every step's ``block_tables``.
        A fixed width keeps shapes (and so the kernels' launch choices) the same from step
        to step, which CUDA-graph replay needs and which makes eager and replayed steps
        compute exactly the same thing.

        ``pools``: (key_pools, value_pools) lists, one entry per layer, to store into
        instead of allocating new ones (a finished cache's pools, reused so that memory
        addresses, and graphs captured over them, stay the same). The lists are shared, not
        copied; a pool whose shape, dtype or device does not fit is replaced in them, until
        this cache has written into it: from then on a write that does not fit the layer's
        pool raises ``ValueError`` (replacing it would zero the cached history).

        ``backend``: the slot-scatter kernel ``write`` uses ("auto", "triton" or "torch").

        ``allocator``: the allocator of the store that last used ``pools`` (its cached
        prefixes come with it); it must have ``num_blocks`` blocks and no owner left: every
        reference it held is dropped.

        ``sliding_window``: every layer's attention sees only the last this many positions
        (a query at position p sees p - sliding_window < q <= p); blocks wholly before that
        are released at a later ``begin_step`` (see the module's docstring). None (the
        default) keeps every block. ``window_slack``: tokens a later ``drop_last`` may cut
        and still continue (at least ``block_size`` are kept).

        ``kv_dtype``: None (pools take the dtype of the K/V written),
        ``torch.float8_e4m3fn`` (FP8 pools with per-(layer, KV head) scales) or ``torch.int8``
        (INT8 pools with per-slot scales); ``pools`` may then be four lists: key pools, value
        pools, key scales, value scales, as ``pool_lists`` gives them. ``kv_scale`` (FP8
        only): None calibrates each layer's scales from its first write; a positive number
        fixes every scale to it, and must equal any scales ``pools`` comes with (a layer
        given with its scales keeps them: ``ValueError`` naming ``kv_scale`` otherwise)."""
        check_backend(backend)
        if kv_dtype is not None and kv_dtype not in QUANTIZED_DTYPES:
            raise ValueError(
                f"kv_dtype: expected None, torch.float8_e4m3fn or torch.int8, got {kv_dtype!r}"
            )
        if kv_scale is not None:
            if kv_dtype != FP8_DTYPE:
                raise ValueError("kv_scale: only FP8 pools (kv_dtype) take a scale")
            check_positive("kv_scale", kv_scale)
        check_given_scales(pools, kv_scale)
        self.kv_dtype = kv_dtype
        self.kv_scale = kv_scale
        if sliding_window is not None:
            sliding_window = as_index(sliding_window, "sliding_window", minimum=1)
        self.sliding_window = sliding_window
        self.blocks_dropped = 0  # released by the window, over the cache's life
        num_layers = as_index(num_layers, "num_layers", minimum=1)
        table_width = as_index(table_width, "table_width", minimum=1)
        block_size = as_index(block_size, "block_size", minimum=1)
        self.window_slack = max(as_index(window_slack, "window_slack"), block_size)
        self.window_held = False  # see hold_window
        self.num_layers = num_layers
        self.block_size = block_size
        self.table_width = table_width
        self.backend = backend
        if allocator is None:
            allocator = BlockAllocator(num_blocks)
        elif allocator.num_blocks != num_blocks:
            raise ValueError(f"allocator: has {allocator.num_blocks} blocks, the pool {num_blocks}")
        else:
            allocator.release_all()
        self.allocator = allocator
        if pools is None:
            pools = ([None] * num_layers, [None] * num_layers)
        if len(pools) not in (2, 4) or any(len(p) != num_layers for p in pools):
            raise ValueError(f"pools: expected two (or four) lists of {num_layers} entries")
        if len(pools) == 2:
            pools = (*pools, [None] * num_layers, [None] * num_layers)
        self.key_pools: list[torch.Tensor | None] = pools[0]
        self.value_pools: list[torch.Tensor | None] = pools[1]
        # FP8 pools' float32 scales [Hkv] per layer (None: no FP8 pool, or not written yet);
        # INT8 pools' per-slot float16 scales
        self.key_scales: list[torch.Tensor | None] = pools[2]
        self.value_scales: list[torch.Tensor | None] = pools[3]
        # the dtype of the rows this cache stored into each layer (None: not written yet);
        # FP8/INT8 pools keep theirs whatever the model's dtype, so a write from another
        # (model.half() under a held cache) is caught by this
        self._written_dtypes: list[torch.dtype | None] = [None] * num_layers
        self.stores_taken = 0  # writes whose rows the caller's kernel had stored (no scatter)
        self._attached = False  # whether a sequence took cached blocks from the allocator
        self.tables: list[BlockTable] = []
        self.step = None  # the current step's metadata (``step``)
        self._rows = np.zeros((0, 0), np.int32)  # see _block_table_rows
        self._plan_key: tuple = ()  # see _shared_prefix
        self._plan: SharedPrefixPlan | None = None
        self._row_sources: list[tuple[BlockTable, int] | None] = []

    # -- sequences -------------------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return len(self.tables)

    @property
    def groups(self) -> tuple[PagedKVCache, ...]:
        """The stores of this cache's layer groups: itself alone (see ``GroupedKVCache``)."""
        return (self,)

    def layer_window(self, layer_idx: int) -> int | None:
        """The window past which this cache releases layer ``layer_idx``'s blocks."""
        return self.sliding_window

    @property
    def step(self) -> StepMetadata | None:
        """The metadata ``write`` scatters this step's rows by (``begin_step``'s, or one a
        caller sets for a replayed forward), or None."""
        return self._step

    @step.setter
    def step(self, meta: StepMetadata | None) -> None:
        self._step = meta
        self._layers_written: set[int] = set()  # each layer takes one write a step

    def add_sequences(self, n: int) -> None:
        """Start ``n`` empty sequences after the existing ones."""
        n = as_index(n, "n", minimum=0)
        self.tables.extend(BlockTable(self.allocator, self.block_size) for _ in range(n))

    def seq_lens(self) -> list[int]:
        return [t.num_tokens for t in self.tables]

    def reorder(self, indices: list[int]) -> None:
        """Sequence ``i`` becomes a fork of old sequence ``indices[i]`` (beam search).

        Blocks are shared by reference count; a shared block is copied only when written.
        """
        indices = checked_indices(indices, len(self.tables))  # before any fork
        new_tables = [self.tables[i].fork() for i in indices]
        for table in self.tables:
            table.free()
        self.tables = new_tables
        self.step = None  # (its slots were the old rows')

    def keep_past_window(self, tokens: int) -> None:
        """From the next step on, keep at least ``tokens`` past the window before releasing
        blocks (raises ``window_slack``, never lowers it): a later ``drop_last`` of up to that
        many tokens can still continue. Blocks released before stay released."""
        self.window_slack = max(as_index(tokens, "tokens", minimum=0), self.window_slack)

    def hold_window(self) -> None:
        """From the next step on, release no block for the sliding window until
        ``release_past_window``: a caller that may cut back any number of tokens (a
        look-ahead it then drops) keeps every position it may return to."""
        self.window_held = True

    def release_past_window(self) -> None:
        """Release now the blocks every sequence's sliding window no longer needs (kept by
        ``hold_window``); the hold stays for later steps."""
        if self.sliding_window is not None:
            self._release_past_window(self.tables)

    def _release_past_window(self, tables: list[BlockTable]) -> None:
        # no query of the next step or later sits before num_tokens, so none sees a position
        # before num_tokens - window + 1
        for table in tables:
            first_seen = table.num_tokens - self.sliding_window + 1
            self.blocks_dropped += table.drop_before(first_seen - self.window_slack)

    def can_drop_last(self, n: int) -> bool:
        """Whether every sequence could still take new tokens after ``drop_last(n)``: under a
        sliding window, not one cut back past the positions its window kept (the test
        ``begin_step`` makes, here before anything changes)."""
        n = as_index(n, "n", minimum=0)
        if self.sliding_window is None:
            return True
        for table in self.tables:
            length = max(0, table.num_tokens - n)
            if self._sees_released(min(table.dropped, -(-length // self.block_size)), length):
                return False
        return True

    def _sees_released(self, dropped: int, num_tokens: int) -> bool:
        """Whether the next query of a sequence of ``num_tokens`` tokens whose first
        ``dropped`` blocks the window released would see one of those positions."""
        return bool(dropped) and dropped * self.block_size > num_tokens - self.sliding_window + 1

    def drop_last(self, n: int) -> None:
        """Forget the last ``n`` tokens of every sequence (assisted decoding's rejected
        candidates); a sequence with fewer keeps none. Under a sliding window, a sequence cut
        back past what its window kept (its next query would see released positions) can
        no longer take tokens: ``begin_step`` refuses it."""
        n = as_index(n, "n", minimum=0)
        for table in self.tables:
            table.truncate(max(0, table.num_tokens - n))
        self.step = None

    def truncate_rows(self, lengths: list[int]) -> None:
        """Cut sequence i back to ``lengths[i]`` tokens (a failed forward's tokens); every
        length is checked before any row changes."""
        lengths = checked_lengths(lengths, self.seq_lens())
        for table, length in zip(self.tables, lengths, strict=True):
            table.truncate(length)
        self.step = None

    def hold(self) -> list[BlockTable]:
        """A fork of every sequence's table, sharing its blocks by reference count: while
        held, nothing done to the sequences (a beam reorder, a window's release, a crop)
        frees what they held, and a write into a shared last block goes to a copy.
        ``restore`` puts them back (a failed call), ``release`` lets them go."""
        return _Hold(self, [table.fork() for table in self.tables])

    def restore(self, held: list[BlockTable]) -> None:
        """The sequences as ``hold`` took them; what they became since is freed. Either this
        or ``release`` ends a hold, once."""
        self._check_held(held)
        for table in self.tables:
            table.free()
        self.tables = list(held)
        self.step = None

    def release(self, held: list[BlockTable]) -> None:
        """Let go of what ``hold`` took (the sequences keep what they hold now)."""
        self._check_held(held)
        for table in held:
            table.free()
            table.released = True

    def _check_held(self, held: list[BlockTable]) -> None:
        """ValueError naming ``held`` when it is not a hold of this cache still open: a list
        ``hold`` did not return (restoring one would free every row: ``[]`` emptied them), a
        restored hold's tables are the live rows (releasing them would empty the cache), a
        released one's hold nothing (restoring them would empty every row)."""
        if not isinstance(held, _Hold) or held.cache is not self:
            raise ValueError(f"held: {type(held).__name__}, not what this cache's hold() returned")
        live = {id(table) for table in self.tables}
        if any(id(table) in live or table.released for table in held):
            raise ValueError(
                "held: this hold has ended (restored or released already); a hold ends once, "
                "by restore or by release"
            )

    def leave_inference_mode(self) -> None:
        """Outside ``torch.inference_mode``, the pools and scales made under it (which take no
        in-place write outside it) become copies of themselves that do; blocks, tables and
        cached prefixes stay as they are. Under inference mode nothing changes."""
        if torch.is_inference_mode_enabled():
            return
        for tensors in self.pool_lists:
            for i, t in enumerate(tensors):
                if t is not None and t.is_inference():
                    tensors[i] = t.clone()

    def reset(self) -> None:
        """Free every sequence; the pools stay allocated for reuse."""
        for table in self.tables:
            table.free()
        self.tables = []
        self.step = None

    # -- cached prefixes (see prefix.py) ------------------------------------------------------

    def attach_prefix(self, seq: int, digests: list[bytes]) -> int:
        """Give the empty sequence ``seq`` the published blocks found by ``digests`` (one per
        leading full block, in order, up to the first miss); returns the tokens they hold."""
        table = self.tables[checked_seq(seq, len(self.tables))]
        digests = checked_digests(digests)
        if table.num_blocks:  # (checked before any reference is taken)
            raise ValueError("seq: only an empty sequence takes cached blocks")
        blocks = []
        for digest in digests:
            block = self.allocator.lookup(digest)
            if block is None:
                break
            blocks.append(block)
        try:
            table.adopt(blocks)
        except BaseException:
            self.allocator.free(blocks[::-1])  # (tail first, as BlockTable.free)
            raise
        self._attached = self._attached or bool(blocks)
        return len(blocks) * self.block_size

    def publish(self, seq: int, digests: list[bytes], first: int = 0) -> None:
        """Make sequence ``seq``'s full blocks findable by ``digests`` (one per block from
        the first; blocks past the digests, or not full, stay unpublished). ``first``: the
        blocks before it are known to be published (attached by ``attach_prefix``)."""
        table = self.tables[checked_seq(seq, len(self.tables))]
        digests = checked_digests(digests)
        first = as_index(first, "first", minimum=0)
        full = table.num_tokens // self.block_size
        pairs = zip(table.block_ids[first:full], digests[first:], strict=False)
        for block, digest in pairs:
            if block != DROPPED:  # a released block was published before it was released
                self.allocator.publish(block, digest)

    def grow(self, n: int) -> None:
        """Give the pool ``n`` more blocks: every allocated pool is copied into a larger one
        (its tokens and block ids stay), so memory addresses change."""
        n = as_index(n, "n", minimum=0)
        self._swap_in(self._larger_pools(n), n)

    def _larger_pools(self, n: int) -> list:
        """Copies of the allocated pools with ``n`` more blocks (all made before any is
        swapped in by ``_swap_in``: a failed allocation changes nothing)."""
        larger = []
        if n == 0:
            return larger
        for pools in self._block_indexed():
            for layer, pool in enumerate(pools):
                if pool is not None:
                    copy = pool.new_zeros((pool.shape[0] + n, *pool.shape[1:]))
                    copy[: pool.shape[0]] = pool
                    larger.append((pools, layer, copy))
        return larger

    def _swap_in(self, larger: list, n: int) -> None:
        for pools, layer, copy in larger:
            pools[layer] = copy
        if n:
            self.allocator.grow(n)

    # -- the step boundary -------------------------------------------------------------------

    def begin_step(self, new_token_mask: torch.Tensor, device: torch.device) -> StepMetadata:
        """Grow every table once for this forward's tokens and build the step's metadata.

        ``new_token_mask`` bool [S, q]: True where column j of row i is a real token to
        store (padding is False and never stored). All tables grow or none do: on
        ``OutOfBlocks`` the tables and the pools are left as they were.
        """
        device = step_device(device)
        tables, counts_np, mask_np = self._prepare_step(new_token_mask)
        self.step = self._commit_step(tables, counts_np, mask_np, device)
        return self.step

    def _prepare_step(self, new_token_mask: torch.Tensor):
        """Check ``new_token_mask``, release what the window no longer needs and check that
        every table can grow; changes no table's tokens. Returns (tables, counts, mask) for
        ``_commit_step``."""
        if not isinstance(new_token_mask, torch.Tensor) or new_token_mask.dtype != torch.bool:
            # (a float or int mask was cast: 0.5 stored a token)
            kind = getattr(new_token_mask, "dtype", type(new_token_mask).__name__)
            raise ValueError(f"new_token_mask: expected a bool tensor [num_seqs, q], got {kind}")
        mask = new_token_mask.to("cpu")
        if mask.dim() != 2:
            raise ValueError(f"new_token_mask: expected [num_seqs, q], got {tuple(mask.shape)}")
        if mask.shape[0] == 0:
            raise ValueError("new_token_mask: an empty batch (0 rows); a step needs a sequence")
        tables = self.tables
        if not tables:  # the first step starts the sequences, kept only if it succeeds
            tables = [BlockTable(self.allocator, self.block_size) for _ in range(mask.shape[0])]
        if mask.shape[0] != len(tables):
            raise ValueError(
                f"new_token_mask: {mask.shape[0]} rows for {len(tables)} cached sequences"
            )
        mask_np = mask.numpy()
        counts_np = mask_np.sum(axis=1, dtype=np.int32)
        counts = counts_np.tolist()
        if self.sliding_window is not None:
            self._check_window_kept(tables, counts)
            if not self.window_held:  # (released even if OutOfBlocks follows: unneeded)
                self._release_past_window(tables)
        self._reserve(tables, counts)
        return tables, counts_np, mask_np

    def _commit_step(self, tables, counts_np, mask_np, device) -> StepMetadata:
        """Grow ``tables`` (checked by ``_prepare_step``) and build the step's metadata."""
        counts = counts_np.tolist()
        self.tables = tables
        slot_lists = [table.append(n) for table, n in zip(tables, counts, strict=True)]
        self._apply_pending_copies()

        # numpy, then one wrap per tensor: a decode step runs this for every forward
        total = sum(counts)
        flat_slots = np.fromiter(itertools.chain.from_iterable(slot_lists), np.int64, total)
        if total == mask_np.size:  # no padding (every decode step): no masking
            slot_mapping, token_index = flat_slots, np.arange(total)
        else:
            token_index = np.flatnonzero(mask_np)
            slot_mapping = np.full(mask_np.size, -1, np.int64)
            slot_mapping[token_index] = flat_slots
        seq_lens = np.fromiter((t.num_tokens for t in self.tables), np.int32, len(self.tables))
        cu = np.zeros(len(counts) + 1, np.int32)
        np.cumsum(counts_np, out=cu[1:])
        all_single = all(n == 1 for n in counts)
        block_tables = self._block_table_rows()
        host = StepMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            token_index=torch.from_numpy(token_index.astype(np.int64, copy=False)),
            block_tables=block_tables,
            seq_lens=torch.from_numpy(seq_lens),
            cu_seqlens_q=torch.from_numpy(cu),
            all_single=all_single,
            equal_lengths=bool(seq_lens.size) and bool(seq_lens.min() == seq_lens.max()),
            shared_prefix=self._shared_prefix(block_tables, seq_lens, device)
            if all_single
            else None,
        )
        return host.to(device) if torch.device(device).type != "cpu" else host

    def _check_window_kept(self, tables: list[BlockTable], counts: list[int]) -> None:
        """ValueError when a sequence taking new tokens lacks positions its first new query
        sees (``drop_last`` cut it back past what the sliding window kept)."""
        for i, (table, n) in enumerate(zip(tables, counts, strict=True)):
            if n and self._sees_released(table.dropped, table.num_tokens):
                raise ValueError(
                    f"new_token_mask: sequence {i} was cut back to {table.num_tokens} tokens "
                    f"after the sliding window ({self.sliding_window}) released its positions "
                    f"before {table.dropped * self.block_size}; it cannot take new tokens"
                )

    def _shared_prefix(self, block_tables: torch.Tensor, seq_lens: np.ndarray, device):
        """The decode step's ``SharedPrefixPlan``: None when no rows share blocks, under a
        sliding window (whose released entries would look alike), and where the decode
        launch would not take a plan (``takes_shared_prefix``: grids too small). Kept until a
        table is replaced or changes what it shares: fresh blocks at a table's end never do,
        and a decode step's newest token is always in a private block, so the plan holds
        from step to step."""
        pool = next((p for p in self.key_pools if p is not None), None)
        heads = pool.shape[2] if pool is not None else 1
        if (
            not self.share_prefix_reads
            or len(self.tables) < 2
            or self.sliding_window is not None
            or not takes_shared_prefix(len(self.tables), heads, None, torch.device(device))
        ):
            return None
        key = tuple((t.serial, t.sharing_version) for t in self.tables)
        if key != self._plan_key:
            self._plan = plan_shared_prefix(block_tables.numpy(), seq_lens, self.block_size)
            self._plan_key = key
        return self._plan

    def _block_table_rows(self) -> torch.Tensor:
        """Every table's block ids as int32 [S, width], zero padded.

        Kept in a host array across steps; only rows whose table changed (a new block, a
        copy-on-write swap, a new table) are rewritten, so a decode step costs little.
        """
        num_seqs = len(self.tables)
        width = max(self.table_width, max(t.num_blocks for t in self.tables))
        rows = self._rows
        if rows.shape[0] != num_seqs or rows.shape[1] < width:
            rows = self._rows = np.zeros((num_seqs, max(width, rows.shape[1])), np.int32)
            self._row_sources = [None] * num_seqs
        for i, table in enumerate(self.tables):
            source = self._row_sources[i]
            if source is None or source[0] is not table or source[1] != table.version:
                ids = table.block_ids
                rows[i, : len(ids)] = ids
                rows[i, : table.dropped] = 0  # DROPPED entries: never read, kept in range
                rows[i, len(ids) :] = 0
                self._row_sources[i] = (table, table.version)
        return torch.from_numpy(rows[:, :width].copy())

    def _reserve(self, tables: list[BlockTable], counts: list[int]) -> None:
        """Check that all tables can grow before any does (so growth is all or nothing)."""
        # n tokens take at most ceil(n / block_size) new blocks, plus one for a copy-on-write
        # swap; when that many are free the exact count is not needed (every decode step)
        if sum(-(-n // self.block_size) + 1 for n in counts if n) <= self.allocator.num_free:
            return
        needed = 0
        writers: dict[int, int] = {}  # shared last block -> tables writing into it now
        for table, n in zip(tables, counts, strict=True):
            new, shared = table._blocks_needed(n)
            needed += new
            if shared:
                writers[table.block_ids[-1]] = writers.get(table.block_ids[-1], 0) + 1
        for block, count in writers.items():
            # every writer copies the block, except the last when all of its holders write:
            # by then it holds the block alone and writes in place
            needed += count - int(count == self.allocator.refcount(block))
        if needed > self.allocator.num_free:
            # allocate() raises OutOfBlocks with the figures, and allocates nothing
            self.allocator.allocate(needed)

    def _apply_pending_copies(self) -> None:
        pairs = [pair for table in self.tables for pair in table.pending_copies]
        for table in self.tables:
            table.pending_copies = []
        if not pairs:
            return
        host = torch.tensor(pairs, dtype=torch.int64, device="cpu")  # [n, 2]: (source, destination)
        per_device: dict[torch.device, torch.Tensor] = {}
        for pool in itertools.chain(*self._block_indexed()):
            if pool is not None:
                if pool.device not in per_device:
                    per_device[pool.device] = host.to(pool.device)
                index = per_device[pool.device]
                pool[index[:, 1]] = pool[index[:, 0]]

    # -- per layer ---------------------------------------------------------------------------

    @property
    def pool_lists(self) -> tuple[list, list, list, list]:
        """(key_pools, value_pools, key_scales, value_scales): what ``pools=`` takes back."""
        return self.key_pools, self.value_pools, self.key_scales, self.value_scales

    def layer_pools(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(key pool, value pool) of layer ``layer_idx``; (None, None) before its first write."""
        index = self._layer_index(layer_idx)
        return self.key_pools[index], self.value_pools[index]

    def _block_indexed(self) -> list[list[torch.Tensor | None]]:
        """The per-layer lists of tensors indexed by block: the pools, and the INT8 pools'
        per-slot scales (what a block copy, a growth or the byte count covers)."""
        lists = [self.key_pools, self.value_pools]
        if self.kv_dtype == INT8_DTYPE:
            lists += [self.key_scales, self.value_scales]
        return lists

    def _pools(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.allocator.num_blocks, self.block_size, *like.shape[1:])
        dtype = self.kv_dtype or like.dtype
        pool = self.key_pools[layer_idx]
        kept = pool is not None and (pool.shape, pool.dtype, pool.device) == (
            shape,
            dtype,
            like.device,
        )
        if not kept:
            if pool is not None and self._holds_tokens(layer_idx):
                misfit = _misfit(layer_idx, pool, like, self.allocator.num_blocks, dtype)
                raise ValueError(f"key: {misfit}")
            if pool is not None:  # the pool's cached prefixes go with its memory
                self.allocator.clear_prefixes()
            self.key_pools[layer_idx] = torch.zeros(shape, dtype=dtype, device=like.device)
            self.value_pools[layer_idx] = torch.zeros_like(self.key_pools[layer_idx])
            self.key_scales[layer_idx] = self.value_scales[layer_idx] = None
        if dtype == INT8_DTYPE and not self._int8_scales_fit(layer_idx, shape, like.device):
            if kept:  # a pool given without fitting scales: what it holds cannot be read
                if self._holds_tokens(layer_idx):
                    raise ValueError(f"key: layer {layer_idx}'s INT8 scales do not fit its pool")
                self.allocator.clear_prefixes()
            opts = dict(dtype=INT8_SCALE_DTYPE, device=like.device)
            self.key_scales[layer_idx] = torch.zeros(int8_scale_shape(shape, INT8_K_GROUP), **opts)
            self.value_scales[layer_idx] = torch.zeros(int8_scale_shape(shape, None), **opts)
        return self.key_pools[layer_idx], self.value_pools[layer_idx]

    def _holds_tokens(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s pool holds tokens of this cache: written into, or
        reached through a cached prefix attached from it."""
        return self._written_dtypes[layer_idx] is not None or self._attached

    def _int8_scales_fit(self, layer_idx: int, shape: tuple, device: torch.device) -> bool:
        """Whether layer ``layer_idx`` holds per-slot scales for INT8 pools of ``shape``."""
        wanted = (
            (self.key_scales[layer_idx], int8_scale_shape(shape, INT8_K_GROUP)),
            (self.value_scales[layer_idx], int8_scale_shape(shape, None)),
        )
        return all(
            scales is not None
            and (tuple(scales.shape), scales.dtype, scales.device)
            == (want, INT8_SCALE_DTYPE, device)
            for scales, want in wanted
        )

    def _first_scales(self, rows: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """float32 [Hkv] scales for a new FP8 pool from the first K (or V) rows written
        [T, Hkv, D] (``real`` bool [T]: the rows stored): ``kv_scale``, or the rows' per-head
        amax times ``CALIBRATION_HEADROOM`` over 448. Computed on the device (no sync)."""
        if self.kv_scale is not None:
            return torch.full(rows.shape[1:2], float(self.kv_scale), device=rows.device)
        amax = rows.detach().abs().amax(dim=-1).float()  # [T, Hkv]
        amax = torch.where(real[:, None], amax.nan_to_num(0.0, 0.0, 0.0), 0.0).amax(dim=0)
        # a head with nothing to go by (all zero) gets scale 1 (e4m3's own range)
        return torch.where(amax > 0, amax * (CALIBRATION_HEADROOM / FP8_MAX), 1.0)

    def scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer ``layer_idx``'s (k_scale, v_scale): float32 [Hkv] (FP8), the per-slot float16
        scales (INT8), or (None, None) for pools in the compute dtype."""
        return self.key_scales[layer_idx], self.value_scales[layer_idx]

    def scales_for(self, key_pool: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """(k_scale, v_scale) of the layer whose key pool is ``key_pool`` (what ``write``
        returned); (None, None) unless the pools are FP8 or INT8."""
        if key_pool.dtype not in QUANTIZED_DTYPES:
            return None, None
        for layer, pool in enumerate(self.key_pools):
            if pool is key_pool:
                return self.scales(layer)
        raise ValueError("key_pool: not a pool of this cache")

    def store_target(
        self,
        layer_idx: int,
        rows: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_heads: int,
        dim: int,
    ) -> KVStore | None:
        """Where a kernel that makes this step's K/V rows of layer ``layer_idx`` (``rows``
        of [``kv_heads``, ``dim``] in ``dtype`` on ``device``, the padded layout) may store
        them itself: the layer's pools and the step's slots on ``device``. Then ``write(...,
        stored=)`` with this target and those very rows skips its scatter. None unless a
        step of that many rows is begun, the layer not yet written in it, and its pools exist
        already in ``dtype`` (not FP8 or INT8), on ``device``, of that row shape."""
        if self.step is None or type(layer_idx) is not int:
            return None
        if not 0 <= layer_idx < self.num_layers or layer_idx in self._layers_written:
            return None
        if self.step.slot_mapping.shape[0] != rows:
            return None
        key_pool, value_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
        shape = (self.allocator.num_blocks, self.block_size, kv_heads, dim)
        if key_pool is None or value_pool is None or self.kv_dtype not in (None, dtype):
            return None
        if any(
            (pool.shape, pool.dtype, pool.device) != (shape, dtype, torch.device(device))
            or not pool.is_contiguous()
            for pool in (key_pool, value_pool)
        ):
            return None
        if self._written_dtypes[layer_idx] not in (None, dtype):
            return None
        return KVStore(key_pool, value_pool, self.step.to(device).slot_mapping)

    def write(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        check: bool = True,
        backend: str | None = None,
        stored: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter this step's K/V [S * q, Hkv, D] (padded layout) into layer ``layer_idx``,
        through ``backend`` (default: the cache's). ``stored``: a ``store_target`` of this
        step and layer into which the caller's kernel already stored exactly ``key`` and
        ``value``; the scatter is skipped when it still names the layer's pools and the
        step's slots (else it runs as without), and ``stores_taken`` counts it.

        Returns the layer's (key_pool, value_pool).
        """
        if type(layer_idx) is not int or not 0 <= layer_idx < self.num_layers:
            layer_idx = self._layer_index(layer_idx)
        if self.step is None:
            raise RuntimeError("write() before begin_step(): the step boundary is missing")
        if layer_idx in self._layers_written:  # (a begin_step that failed left the last step)
            raise RuntimeError(
                f"write(): layer {layer_idx} already holds this step's rows; begin_step() "
                "starts the next step"
            )
        if key.dim() != 3:
            raise ValueError(f"key: expected [tokens, kv_heads, head_dim], got {tuple(key.shape)}")
        if check:  # before a pool is made or replaced, or FP8 scales calibrated from the rows
            _check_rows(key, value, self.step.slot_mapping.shape[0])
        written = self._written_dtypes[layer_idx]
        if self.kv_dtype in QUANTIZED_DTYPES and written not in (None, key.dtype):
            raise ValueError(
                f"key: layer {layer_idx} already holds this cache's K/V written from {written} "
                f"rows and cannot take {key.dtype} rows; mixing them would attend over keys of "
                "two precisions. Start a new cache after changing the model's dtype."
            )
        key_pool, value_pool = self._pools(layer_idx, key)
        step = self.step.to(key_pool.device)
        if self.kv_dtype == FP8_DTYPE and self.key_scales[layer_idx] is None:
            if self._attached:  # (calibrating now would misread what the pool holds)
                raise ValueError(
                    f"key: layer {layer_idx}'s FP8 pool came without its scales, and the "
                    "prefix attached from it was stored at scales this cache cannot know; "
                    "pass the pools with their scales (pool_lists gives all four lists)"
                )
            real = step.slot_mapping >= 0
            self.key_scales[layer_idx] = self._first_scales(key, real)
            self.value_scales[layer_idx] = self._first_scales(value, real)
        k_scale, v_scale = self.scales(layer_idx)
        done = (
            stored is not None
            and stored.key_pool is key_pool
            and stored.value_pool is value_pool
            and stored.slot_mapping is step.slot_mapping
            and k_scale is None
        )
        if done:
            self.stores_taken += 1
        else:
            slot_scatter(
                key, value, key_pool, value_pool, step.slot_mapping,
                k_scale=k_scale, v_scale=v_scale, check=check, backend=backend or self.backend,
            )  # fmt: skip
        self._written_dtypes[layer_idx] = key.dtype
        self._layers_written.add(layer_idx)
        return key_pool, value_pool

    def _layer_index(self, layer_idx: object) -> int:
        """``layer_idx`` as an int in [0, num_layers) (a numpy int too); else ValueError."""
        index = as_index(layer_idx, "layer_idx")
        if not 0 <= index < self.num_layers:
            raise ValueError(
                f"layer_idx: {layer_idx!r} outside [0, {self.num_layers}) "
                f"(this cache has {self.num_layers} layers)"
            )
        return index

    # -- figures -----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Pool figures: blocks used, tokens stored, bytes reserved, share holding no token,
        blocks the sliding window released."""
        slots_filled = filled_slots(self.tables, self.block_size)
        bytes_per_slot = sum(
            pool[0, 0].numel() * pool.element_size()
            for pool in itertools.chain(*self._block_indexed())
            if pool is not None
        )
        total_slots = self.allocator.num_blocks * self.block_size
        return {
            "num_blocks": self.allocator.num_blocks,
            "block_size": self.block_size,
            "blocks_used": self.allocator.num_used,
            "sequences": len(self.tables),
            "tokens": sum(self.seq_lens()),
            "slots_filled": slots_filled,
            "bytes_reserved": total_slots * bytes_per_slot,
            "bytes_holding_tokens": slots_filled * bytes_per_slot,
            "unused_share": 1.0 - slots_filled / total_slots,
            "blocks_dropped_by_window": self.blocks_dropped,
        }


class _Hold(list):
    """What ``PagedKVCache.hold`` took: forks of its tables, and the cache that took them."""

    def __init__(self, cache: PagedKVCache, tables: list[BlockTable]):
        super().__init__(tables)
        self.cache = cache


def _check_rows(key: torch.Tensor, value: torch.Tensor, slots: int) -> None:
    """ValueError naming ``value`` or ``key`` when a step's rows cannot be written: value not
    key's shape, dtype and device, or a row count other than the step's ``slots``."""
    if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != (
        key.shape,
        key.dtype,
        key.device,
    ):
        got = (
            (tuple(value.shape), value.dtype, value.device)
            if isinstance(value, torch.Tensor)
            else value
        )
        raise ValueError(
            f"value: must match key's shape, dtype and device "
            f"({tuple(key.shape)}, {key.dtype}, {key.device}), got {got}"
        )
    if key.dtype not in FLOAT_DTYPES:
        raise ValueError(f"key: K/V rows must be floating point, got {key.dtype}")
    if 0 in key.shape[1:]:
        raise ValueError(
            f"key: [tokens, kv_heads, head_dim] with none zero, got {tuple(key.shape)}"
        )
    if key.shape[0] != slots:
        raise ValueError(f"key: {key.shape[0]} rows for the step's {slots} slots (S * q)")


def int_list(name: str, values) -> list[int]:
    """``values`` (a sequence of ints, or a 1-d integer tensor or numpy array) as a list of
    ints."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise ValueError(f"{name}: expected a 1-d integer array, got {values!r}")
        return [int(v) for v in values.tolist()]
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.is_floating_point() or values.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-d integer tensor, got {values!r}")
        return [int(v) for v in values.tolist()]
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}: expected a sequence of ints, got {values!r}")
    return [as_index(v, name) for v in values]


def checked_indices(indices, num_rows: int) -> list[int]:
    """``indices`` (``int_list``) each in [0, num_rows), else ValueError naming ``indices``."""
    indices = int_list("indices", indices)
    for i in indices:
        if not 0 <= i < num_rows:
            raise ValueError(f"indices: {i} outside [0, {num_rows})")
    return indices


def checked_seq(seq, num_seqs: int) -> int:
    """``seq`` an int index in [0, num_seqs) (no negative ones), else ValueError naming
    ``seq``."""
    seq = as_index(seq, "seq")
    if not 0 <= seq < num_seqs:
        raise ValueError(f"seq: {seq} outside [0, {num_seqs})")
    return seq


def checked_digests(digests) -> list[bytes]:
    """``digests`` (a sequence of bytes, one per leading block) as a list, else ValueError
    naming ``digests``."""
    if isinstance(digests, (str, bytes)) or not isinstance(digests, Sequence):
        raise ValueError(f"digests: expected a list of bytes, got {digests!r}")
    digests = list(digests)
    if not all(isinstance(d, bytes) for d in digests):
        raise ValueError("digests: every entry must be bytes (block_digests gives them)")
    return digests


def checked_lengths(lengths, held: list[int]) -> list[int]:
    """``lengths`` (``int_list``), one a row, each within the row's ``held`` tokens, else
    ValueError naming ``lengths``."""
    lengths = int_list("lengths", lengths)
    if len(lengths) != len(held):
        raise ValueError(f"lengths: {len(lengths)} entries for {len(held)} rows")
    for i, (length, most) in enumerate(zip(lengths, held, strict=True)):
        if not 0 <= length <= most:
            raise ValueError(f"lengths: row {i} to {length} tokens, outside [0, {most}]")
    return lengths


def filled_slots(tables, block_size: int) -> int:
    """Slots holding a token across ``tables`` (``BlockTable``s), a block shared by several
    tables counted once at its fullest: each table's leading ``num_tokens // block_size``
    blocks are full, the next holds the remainder, any after it nothing."""
    full: set[int] = set()
    partial: dict[int, int] = {}
    for table in tables:
        ids, whole = table.block_ids, table.num_tokens // block_size
        full.update(ids[:whole])
        rest = table.num_tokens - whole * block_size
        if rest and whole < len(ids):
            partial[ids[whole]] = max(partial.get(ids[whole], 0), rest)
    full.discard(DROPPED)
    rest = sum(n for block, n in partial.items() if block not in full and block != DROPPED)
    return len(full) * block_size + rest


def step_device(device) -> torch.device:
    """``device`` as a ``torch.device`` a step's metadata can go to; ValueError naming
    ``device`` otherwise (a step checks it before any table grows)."""
    try:
        return _checked_device(device)
    except TypeError:  # (unhashable: not a device either)
        raise ValueError(f"device: {device!r} is not a device") from None


@functools.lru_cache(maxsize=64)
def _checked_device(device) -> torch.device:
    """``step_device``, remembered: it is asked at every step."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: {device!r} is not a device ({error})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device} asked for, but CUDA is not available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device: {device} asked for, but there are {torch.cuda.device_count()}")
    return device
