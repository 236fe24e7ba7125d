"""GroupedKVCache: one ``PagedKVCache`` per layer group, for models that mix sliding and
global layers.

A layer that attends only within a window never reads the blocks before it, but a layer
that attends to the whole history needs every one. Layers are therefore split into groups
by window (a list of (layer indices, window or None)); each group has its own allocator,
block tables and pools, so a sliding group releases the blocks that fell out of its window
(``PagedKVCache``'s ``sliding_window``) while a global group keeps them all. Every group
stores the same tokens of the same rows: rows' lengths are shared, block tables differ.

Every operation on rows (a step, a beam reorder, a crop, a cached prefix) is applied to
every group; a step grows all groups or none (``OutOfBlocks`` leaves all as they were).
The step's metadata holds each group's slot mapping and block tables; each layer reads its
group's (``StepMetadata.for_layer``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoserve.cache.allocator import BlockAllocator, as_index
from nanoserve.cache.paged_cache import (
    PagedKVCache,
    StepMetadata,
    check_given_scales,
    checked_digests,
    checked_indices,
    checked_lengths,
    checked_seq,
    grouped_metadata,
    step_device,
)
from nanoserve.kernels.quant import QUANTIZED_DTYPES
from nanoserve.kernels.slot_scatter import KVStore


def check_layer_groups(
    layer_groups, num_layers: int | None = None
) -> list[tuple[list[int], int | None]]:
    """``layer_groups`` as a list of (sorted layer indices, window or None); ValueError
    naming ``layer_groups`` unless every layer in ``[0, num_layers)`` is in exactly one
    group (``num_layers``: one past the highest layer when None)."""
    try:
        groups = [
            (sorted(as_index(i, "layer_groups") for i in layers), window)
            for layers, window in layer_groups
        ]
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"layer_groups: expected (layer indices, window) pairs ({error})"
        ) from None
    if not groups or any(not layers for layers, _ in groups):
        raise ValueError("layer_groups: every group needs at least one layer")
    every = sorted(i for layers, _ in groups for i in layers)
    if num_layers is None:
        num_layers = every[-1] + 1
    if every != list(range(num_layers)):
        raise ValueError(
            f"layer_groups: every layer of [0, {num_layers}) must be in exactly one group, "
            f"got {[layers for layers, _ in groups]}"
        )
    for _, window in groups:
        if window is not None:
            as_index(window, "layer_groups (window)", minimum=1)
    return groups


class GroupedKVCache:
    """K/V of layer groups, each in its own ``PagedKVCache``; the same interface."""

    def __init__(
        self,
        layer_groups: Sequence[tuple[Sequence[int], int | None]],
        num_blocks: Sequence[int],
        block_size: int = 16,
        table_width: int = 1,
        pools: Sequence[tuple[list, list] | None] | None = None,
        backend: str = "auto",
        allocators: Sequence[BlockAllocator | None] | None = None,
        window_slack: int = 0,
        kv_dtype: torch.dtype | None = None,
        kv_scale: float | None = None,
    ):
        """``layer_groups``: (layer indices, window or None) per group, every layer in one.
        ``num_blocks``, ``pools`` and ``allocators``: one entry per group, as
        ``PagedKVCache`` takes them (``pools[g]`` indexed by the group's own layer order,
        its layers sorted). The other arguments are every group's."""
        groups = check_layer_groups(layer_groups)
        count = len(groups)
        num_blocks = _per_group("num_blocks", num_blocks, count)
        pools = _per_group("pools", pools, count)
        allocators = _per_group("allocators", allocators, count)
        # every group's arguments checked before a group is made: making one releases the
        # kept allocator it is given, which a later group's bad argument must not leave done
        num_blocks = [as_index(n, "num_blocks", minimum=1) for n in num_blocks]
        for g, (allocator, blocks) in enumerate(zip(allocators, num_blocks, strict=True)):
            if allocator is None:
                continue
            if not isinstance(allocator, BlockAllocator):
                raise ValueError(f"allocators: entry {g} is a {type(allocator).__name__}")
            if allocator.num_blocks != blocks:
                raise ValueError(
                    f"allocators: entry {g} has {allocator.num_blocks} blocks, num_blocks {blocks}"
                )
            if any(other is allocator for other in allocators[:g]):
                # each group counts its own free blocks: one allocator for two groups would
                # let a step reserve the same blocks twice
                raise ValueError(f"allocators: entry {g} is an earlier entry's allocator")
        for g, ((layers, _), group_pools) in enumerate(zip(groups, pools, strict=True)):
            if group_pools is None:
                continue
            if len(group_pools) not in (2, 4) or any(len(p) != len(layers) for p in group_pools):
                raise ValueError(
                    f"pools: entry {g} must be two (or four) lists of {len(layers)} entries "
                    "(the group's layers)"
                )
        for group_pools in pools:  # before any group's constructor frees its allocator
            check_given_scales(group_pools, kv_scale)
        self.layer_groups = groups
        self._groups = tuple(
            PagedKVCache(
                len(layers),
                blocks,
                block_size,
                table_width,
                pools=group_pools,
                backend=backend,
                allocator=allocator,
                sliding_window=window,
                window_slack=window_slack,
                kv_dtype=kv_dtype,
                kv_scale=kv_scale,
            )
            for (layers, window), blocks, group_pools, allocator in zip(
                groups, num_blocks, pools, allocators, strict=True
            )
        )
        self.num_layers = sum(len(layers) for layers, _ in groups)
        self._where = [(0, 0)] * self.num_layers  # layer -> (group, index in the group)
        for g, (layers, _) in enumerate(groups):
            for local, layer in enumerate(layers):
                self._where[layer] = (g, local)
        self._layer_group = tuple(g for g, _ in self._where)
        self.block_size = self._groups[0].block_size
        self.table_width = self._groups[0].table_width
        self.backend = backend
        self.kv_dtype = self._groups[0].kv_dtype
        self.kv_scale = self._groups[0].kv_scale
        self.sliding_window = None  # per group: see layer_window
        self._step: StepMetadata | None = None

    @property
    def groups(self) -> tuple[PagedKVCache, ...]:
        return self._groups

    def keep_past_window(self, tokens: int) -> None:
        """Every group's ``PagedKVCache.keep_past_window``."""
        for group in self._groups:
            group.keep_past_window(tokens)

    def hold_window(self) -> None:
        """Every group's ``PagedKVCache.hold_window``."""
        for group in self._groups:
            group.hold_window()

    def release_past_window(self) -> None:
        """Every group's ``PagedKVCache.release_past_window``."""
        for group in self._groups:
            group.release_past_window()

    @property
    def window_held(self) -> bool:
        """Whether the groups hold their windows' blocks (``PagedKVCache.hold_window``)."""
        return self._groups[0].window_held

    @property
    def window_slack(self) -> int:
        """Tokens every group keeps past its window (``PagedKVCache.window_slack``)."""
        return self._groups[0].window_slack

    def scales_for(self, key_pool: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """(k_scale, v_scale) of the layer whose key pool is ``key_pool``; (None, None)
        unless the pools are FP8 or INT8 (see ``PagedKVCache.scales_for``)."""
        if not isinstance(key_pool, torch.Tensor):
            raise ValueError(f"key_pool: expected a tensor, got {type(key_pool).__name__}")
        if key_pool.dtype not in QUANTIZED_DTYPES:
            return None, None
        for group in self._groups:
            if any(pool is key_pool for pool in group.key_pools):
                return group.scales_for(key_pool)
        raise ValueError("key_pool: not a pool of this cache")

    def layer_window(self, layer_idx: int) -> int | None:
        """The window past which layer ``layer_idx``'s group releases blocks (None: none)."""
        return self._groups[self._where[self._layer(layer_idx)][0]].sliding_window

    def _layer(self, layer_idx: object) -> int:
        if type(layer_idx) is not int or not 0 <= layer_idx < self.num_layers:
            layer_idx = as_index(layer_idx, "layer_idx")
            if not 0 <= layer_idx < self.num_layers:
                raise ValueError(f"layer_idx: {layer_idx} outside [0, {self.num_layers})")
        return layer_idx

    def _seq(self, seq: object) -> int:
        return checked_seq(seq, self.num_seqs)

    # What a PagedKVCache has once and a GroupedKVCache once per group: a clear error
    # rather than one group's (a group's block ids mean nothing in another's pools).
    @property
    def tables(self):
        raise _per_group_only("tables", "block tables")

    @property
    def allocator(self):
        raise _per_group_only("allocator", "allocator")

    @property
    def pool_lists(self):
        raise _per_group_only("pool_lists", "pool lists")

    @property
    def blocks_dropped(self) -> int:
        """Blocks the sliding groups released over the cache's life."""
        return sum(group.blocks_dropped for group in self._groups)

    # -- rows: the same in every group -----------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return self._groups[0].num_seqs

    def seq_lens(self) -> list[int]:
        return self._groups[0].seq_lens()

    def add_sequences(self, n: int) -> None:
        n = as_index(n, "n", minimum=0)
        for group in self._groups:
            group.add_sequences(n)

    def reorder(self, indices: list[int]) -> None:
        """Row i becomes a fork of old row ``indices[i]`` in every group."""
        indices = checked_indices(indices, self.num_seqs)  # before any group changes
        for group in self._groups:
            group.reorder(indices)
        self._step = None

    def can_drop_last(self, n: int) -> bool:
        """Whether every group could still take new tokens after ``drop_last(n)``."""
        return all(group.can_drop_last(n) for group in self._groups)

    def drop_last(self, n: int) -> None:
        n = as_index(n, "n", minimum=0)
        for group in self._groups:
            group.drop_last(n)
        self._step = None

    def truncate_rows(self, lengths: list[int]) -> None:
        """Cut row i back to ``lengths[i]`` tokens in every group."""
        lengths = checked_lengths(lengths, self.seq_lens())  # before any group changes
        for group in self._groups:
            group.truncate_rows(lengths)
        self._step = None

    def hold(self) -> list:
        """``PagedKVCache.hold`` of every group."""
        return [group.hold() for group in self._groups]

    def restore(self, held: list) -> None:
        """``PagedKVCache.restore`` of every group."""
        for group, tables in zip(self._groups, held, strict=True):
            group.restore(tables)
        self._step = None

    def release(self, held: list) -> None:
        """``PagedKVCache.release`` of every group."""
        for group, tables in zip(self._groups, held, strict=True):
            group.release(tables)

    def leave_inference_mode(self) -> None:
        """``PagedKVCache.leave_inference_mode`` of every group."""
        for group in self._groups:
            group.leave_inference_mode()

    def reset(self) -> None:
        for group in self._groups:
            group.reset()
        self._step = None

    def attach_prefix(self, seq: int, digests: list[bytes]) -> int:
        """``PagedKVCache.attach_prefix`` in every group: the leading blocks found in all of
        them (a group may have evicted some the others still hold)."""
        seq = self._seq(seq)
        digests = checked_digests(digests)
        for group in self._groups:  # checked before any reference is taken
            if group.tables[seq].num_blocks:
                raise ValueError("seq: only an empty sequence takes cached blocks")
        found = []
        for group in self._groups:
            blocks = []
            for digest in digests:
                block = group.allocator.lookup(digest)
                if block is None:
                    break
                blocks.append(block)
            found.append(blocks)
        n = min(len(blocks) for blocks in found)
        for group, blocks in zip(self._groups, found, strict=True):
            group.allocator.free(blocks[n:][::-1])  # (tail first, as BlockTable.free)
            group.tables[seq].adopt(blocks[:n])
            group._attached = group._attached or n > 0
        return n * self.block_size

    def publish(self, seq: int, digests: list[bytes], first: int = 0) -> None:
        """``PagedKVCache.publish`` in every group."""
        seq = self._seq(seq)
        digests = checked_digests(digests)
        first = as_index(first, "first", minimum=0)
        for group in self._groups:
            group.publish(seq, digests, first)

    def grow(self, n: Sequence[int]) -> None:
        """Give group g ``n[g]`` more blocks (``PagedKVCache.grow``)."""
        n = _per_group("n", n, len(self._groups))
        n = [as_index(more, "n", minimum=0) for more in n]
        # every group's larger pools allocated before any is swapped in: a failed
        # allocation leaves every group as it was
        larger = [group._larger_pools(more) for group, more in zip(self._groups, n, strict=True)]
        for group, more, pools in zip(self._groups, n, larger, strict=True):
            group._swap_in(pools, more)

    # -- the step ----------------------------------------------------------------------------

    def begin_step(self, new_token_mask: torch.Tensor, device: torch.device) -> StepMetadata:
        """``PagedKVCache.begin_step`` for every group: all grow or none does (each group's
        ``_prepare_step`` checks the mask before anything changes)."""
        device = step_device(device)
        prepared = [group._prepare_step(new_token_mask) for group in self._groups]
        metas = []
        for group, (tables, counts, mask) in zip(self._groups, prepared, strict=True):
            group.step = group._commit_step(tables, counts, mask, device)
            metas.append(group.step)
        self._step = grouped_metadata(tuple(metas), self._layer_group)
        return self._step

    @property
    def step(self) -> StepMetadata | None:
        return self._step

    @step.setter
    def step(self, meta: StepMetadata | None) -> None:
        """Set the step every group's ``write`` uses (a grouped metadata, or None)."""
        if meta is not None and not isinstance(meta, StepMetadata):
            raise ValueError(f"meta: expected a StepMetadata or None, got {type(meta).__name__}")
        if meta is not None and len(meta.group_metas) != len(self._groups):
            raise ValueError(
                f"meta: metadata of {len(meta.group_metas)} groups for {len(self._groups)}"
            )
        self._step = meta
        for g, group in enumerate(self._groups):
            group.step = None if meta is None else meta.group_metas[g]

    def store_target(
        self,
        layer_idx: int,
        rows: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_heads: int,
        dim: int,
    ) -> KVStore | None:
        """``PagedKVCache.store_target`` of layer ``layer_idx`` in its group (its slots)."""
        if type(layer_idx) is not int or not 0 <= layer_idx < len(self._where):
            return None
        group, local = self._where[layer_idx]
        return self._groups[group].store_target(local, rows, dtype, device, kv_heads, dim)

    @property
    def stores_taken(self) -> int:
        """``PagedKVCache.stores_taken`` over the groups."""
        return sum(group.stores_taken for group in self._groups)

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
        """``PagedKVCache.write`` into layer ``layer_idx``'s group; returns its pools."""
        group, local = self._where[self._layer(layer_idx)]
        return self._groups[group].write(
            local, key, value, check=check, backend=backend, stored=stored
        )

    # -- pools and figures -------------------------------------------------------------------

    def layer_pools(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``PagedKVCache.layer_pools`` of layer ``layer_idx``, from its group."""
        group, local = self._where[self._layer(layer_idx)]
        return self._groups[group].layer_pools(local)

    @property
    def key_pools(self) -> list[torch.Tensor | None]:
        """Every layer's key pool, in layer order (a new list: assign through the groups)."""
        return [self._groups[g].key_pools[i] for g, i in self._where]

    @property
    def value_pools(self) -> list[torch.Tensor | None]:
        return [self._groups[g].value_pools[i] for g, i in self._where]

    @property
    def key_scales(self) -> list[torch.Tensor | None]:
        """Every layer's FP8 (or INT8 per-slot) key scales, in layer order (a new list)."""
        return [self._groups[g].key_scales[i] for g, i in self._where]

    @property
    def value_scales(self) -> list[torch.Tensor | None]:
        return [self._groups[g].value_scales[i] for g, i in self._where]

    def scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``PagedKVCache.scales`` of layer ``layer_idx`` (in its group)."""
        group, local = self._where[self._layer(layer_idx)]
        return self._groups[group].scales(local)

    def stats(self) -> dict[str, float]:
        """``PagedKVCache.stats`` summed over the groups (``block_size``, ``sequences``
        and ``tokens`` are every group's), plus each group's figures as
        ``group{g}_<name>`` with ``group{g}_layers`` and ``group{g}_window`` (0: global)."""
        per_group = [group.stats() for group in self._groups]
        total = dict(per_group[0])
        for name in (
            "num_blocks",
            "blocks_used",
            "slots_filled",
            "bytes_reserved",
            "bytes_holding_tokens",
            "blocks_dropped_by_window",
        ):
            total[name] = sum(stats[name] for stats in per_group)
        slots = sum(stats["num_blocks"] for stats in per_group) * self.block_size
        total["unused_share"] = 1.0 - total["slots_filled"] / slots
        for g, ((layers, window), stats) in enumerate(
            zip(self.layer_groups, per_group, strict=True)
        ):
            total[f"group{g}_layers"] = len(layers)
            total[f"group{g}_window"] = window or 0
            for name, value in stats.items():
                if name not in ("block_size", "sequences", "tokens"):
                    total[f"group{g}_{name}"] = value
        total["layer_groups"] = len(self._groups)
        return total


def _per_group_only(name: str, what: str) -> AttributeError:
    return AttributeError(
        f"{name}: a GroupedKVCache has its {what} per layer group; read groups[g].{name} "
        "(rows and their tokens are the same in every group: seq_lens())"
    )


def _per_group(name: str, values, count: int) -> list:
    """``values`` (one entry per layer group, or None for None in each) as a list."""
    if values is None:
        return [None] * count
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}: expected one entry per layer group, got {values!r}")
    if len(values) != count:
        raise ValueError(f"{name}: {len(values)} entries for {count} layer groups")
    return list(values)
