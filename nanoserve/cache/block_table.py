"""BlockTable: one sequence's map from logical token position to physical pool slot."""

from __future__ import annotations

import itertools

import numpy as np

from nanoserve.cache.allocator import BlockAllocator, as_index

DROPPED = -1  # block_ids entry of a block released under a sliding window
_SERIALS = itertools.count()  # each table's own number (an id() can be reused)


class BlockTable:
    """Logical position ``p`` lives in block ``block_ids[p // block_size]`` at offset
    ``p % block_size``; its flat slot is ``block_id * block_size + offset``.

    One table serves every layer: a block id names the same slot in each layer's pool.
    Blocks may be shared with other tables (``fork``); a shared block is never written in
    place: ``append`` swaps it for a private copy and records the (source, destination)
    pair in ``pending_copies`` for the owner of the pools to copy (copy-on-write).

    Under a sliding window the leading blocks no query will read again are released
    (``drop_before``); their entries in ``block_ids`` become ``DROPPED`` and the positions
    they held have no slot.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int):
        block_size = as_index(block_size, "block_size", minimum=1)
        self.allocator = allocator
        self.block_size = block_size
        self._block_ids: list[int] = []
        self._num_tokens = 0
        self._dropped = 0  # leading entries of _block_ids released by drop_before (DROPPED)
        self.pending_copies: list[tuple[int, int]] = []
        self.version = 0  # bumped whenever block_ids change (lets readers cache them)
        # bumped whenever block_ids change other than by fresh blocks at the end (what this
        # table shares with others can have changed); with ``serial`` a cache key for plans
        # over the shared blocks of several tables
        self.sharing_version = 0
        self.serial = next(_SERIALS)
        self.released = False  # a hold's table let go (PagedKVCache.release): ended

    @property
    def block_ids(self) -> list[int]:
        """Block id of every logical block, ``DROPPED`` for those ``drop_before`` released."""
        return list(self._block_ids)

    @property
    def dropped(self) -> int:
        """How many leading blocks ``drop_before`` released."""
        return self._dropped

    def _held(self) -> list[int]:
        return self._block_ids[self._dropped :]

    @property
    def num_blocks(self) -> int:
        """How many blocks this table holds (``len(block_ids)`` without the copy)."""
        return len(self._block_ids)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def slot(self, pos: int) -> int:
        """Flat pool slot of logical position ``pos`` (0 <= pos < num_tokens)."""
        if not self._dropped * self.block_size <= pos < self._num_tokens:
            low = self._dropped * self.block_size
            raise ValueError(f"pos: {pos} outside [{low}, {self._num_tokens}) (the held positions)")
        return self._block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _blocks_needed(self, n: int) -> tuple[int, bool]:
        """(new blocks for n more tokens, whether the partly filled last block is shared)."""
        total = -(-(self._num_tokens + n) // self.block_size)
        new = total - len(self._block_ids)
        writes_last = n > 0 and self._num_tokens % self.block_size != 0
        shared = writes_last and self.allocator.refcount(self._block_ids[-1]) > 1
        return new, shared

    def append(self, n: int) -> list[int]:
        """Reserve slots for ``n`` new tokens and return them; all or nothing."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n: must be an int >= 0, got {n!r}")
        offset = self._num_tokens % self.block_size
        if n == 1 and offset and self.allocator.refcount(self._block_ids[-1]) == 1:
            # a decode step inside a private block: no allocation, no copy (the hot path)
            self._num_tokens += 1
            return [self._block_ids[-1] * self.block_size + offset]
        new, shared = self._blocks_needed(n)
        blocks = self.allocator.allocate(new + int(shared))  # raises before changing anything
        if new or shared:
            self.version += 1
        if shared:
            self.sharing_version += 1
            private = blocks.pop()
            old = self._block_ids[-1]
            self.pending_copies.append((old, private))
            self._block_ids[-1] = private
            self.allocator.free([old])
        self._block_ids.extend(blocks)
        start = self._num_tokens
        self._num_tokens += n
        if n <= self.block_size:
            return [self.slot(p) for p in range(start, start + n)]
        # a prefill's many tokens: the slots of whole blocks at once
        bs = self.block_size
        first = start // bs
        positions = np.arange(start, start + n)
        ids = np.asarray(self._block_ids[first : (start + n - 1) // bs + 1], np.int64)
        return (ids[positions // bs - first] * bs + positions % bs).tolist()

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens; blocks past them are released (and blocks
        ``drop_before`` released stay so, even where they now end the table)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise ValueError(f"num_tokens: must be an int, got {num_tokens!r}")
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"num_tokens: {num_tokens} outside [0, {self._num_tokens}]")
        keep = -(-num_tokens // self.block_size)
        if keep > self._dropped and num_tokens % self.block_size:
            # The new last block is partial and its tail will be written (in place, or into
            # a copy while shared): it must no longer be found by the tokens it held in full.
            last = self._block_ids[keep - 1]
            if self.allocator.is_published(last):
                self.allocator.unpublish(last)
        # (tail first: a cached block the release makes evictable goes before its head)
        self.allocator.free(self._block_ids[max(keep, self._dropped) :][::-1])
        if keep < len(self._block_ids):
            self.version += 1
        self.sharing_version += 1
        del self._block_ids[keep:]
        self._dropped = min(self._dropped, keep)
        self._num_tokens = num_tokens

    def drop_before(self, position: int) -> int:
        """Release the leading blocks all of whose positions are before ``position`` (never
        the last block); returns how many were released now."""
        end = min(max(position, 0) // self.block_size, len(self._block_ids) - 1)
        if end <= self._dropped:
            return 0
        released = self._block_ids[self._dropped : end]
        self.allocator.free(released)  # a published block stays findable: its tokens are whole
        self._block_ids[self._dropped : end] = [DROPPED] * len(released)
        self._dropped = end
        self.version += 1
        self.sharing_version += 1
        return len(released)

    def adopt(self, block_ids: list[int]) -> None:
        """Start an empty table with ``block_ids``, full blocks whose references the caller
        already took (cached prefix blocks found by ``BlockAllocator.lookup``)."""
        if self._num_tokens or self._block_ids:
            raise ValueError("block_ids: only an empty table adopts cached blocks")
        self._block_ids = list(block_ids)
        self._num_tokens = len(block_ids) * self.block_size
        self._dropped = 0
        if block_ids:
            self.version += 1
            self.sharing_version += 1

    def fork(self) -> BlockTable:
        """A second table over the same tokens, sharing every block by reference count."""
        self.allocator.incref(self._held())
        child = BlockTable(self.allocator, self.block_size)
        child._block_ids = list(self._block_ids)
        child._num_tokens = self._num_tokens
        child._dropped = self._dropped
        return child

    def free(self) -> None:
        """Release every block, the last first (a cached prefix's tail is then evicted
        before its head, which later prompts reach first); the table is empty afterwards."""
        self.allocator.free(self._held()[::-1])
        self._block_ids = []
        self._num_tokens = 0
        self._dropped = 0
        self.pending_copies = []
        self.version += 1
        self.sharing_version += 1
