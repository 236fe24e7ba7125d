"""BlockAllocator: the free list and reference counts of a pool of fixed-size KV blocks."""

from __future__ import annotations

import operator
from collections.abc import Iterable


def as_index(value: object, name: str, minimum: int | None = None) -> int:
    """``value`` as a plain int: any integral type but bool (a numpy int is fine, a bool is
    almost always a mistake), at least ``minimum``; else ``ValueError`` naming ``name``."""
    if type(value) is not int:
        if isinstance(value, bool):
            raise ValueError(f"{name}: must be an int, got the bool {value!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise ValueError(f"{name}: must be an int, got {value!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks for a request; nothing was allocated."""

    def __init__(self, needed: int, free: int, total: int):
        self.needed, self.free, self.total = needed, free, total
        super().__init__(
            f"out of KV blocks: needed {needed}, {free} free of {total}. "
            "Raise `num_blocks` (or `max_memory`) to give the pool more blocks."
        )


class BlockAllocator:
    """Hands out block ids in ``[0, num_blocks)``; a block is free when its refcount is 0.

    Recently freed blocks are reused first (a LIFO free list), which keeps the working set
    of the pool small and makes stale-data bugs show up quickly in tests.
    """

    def __init__(self, num_blocks: int):
        num_blocks = as_index(num_blocks, "num_blocks", minimum=1)
        self._num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_blocks - len(self._free)

    def grow(self, n: int) -> None:
        """Add ``n`` free blocks, ids ``[num_blocks, num_blocks + n)``, handed out after the
        blocks already free."""
        n = as_index(n, "n", minimum=0)
        old = self._num_blocks
        self._num_blocks += n
        self._refcounts.extend([0] * n)
        self._free[:0] = range(old + n - 1, old - 1, -1)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount 1 each); all or nothing, else ``OutOfBlocks``."""
        n = as_index(n, "n", minimum=0)
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free), self._num_blocks)
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            self._refcounts[block] = 1
        return blocks

    def _block_id(self, block: object, name: str) -> int:
        try:
            block_id = as_index(block, name)
        except ValueError:
            raise ValueError(f"{name}: unknown block id {block!r} (not an int)") from None
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"{name}: unknown block id {block!r}")
        return block_id

    def _live(self, block_ids: Iterable[int]) -> list[int]:
        """``block_ids`` as plain ints, each allocated; else ``ValueError``, nothing changed."""
        ids = [self._block_id(block, "block_ids") for block in block_ids]
        for block in ids:
            if self._refcounts[block] == 0:
                raise ValueError(f"block_ids: block {block} is not allocated (double free?)")
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each allocated block (a second owner shares it)."""
        block_ids = self._live(block_ids)
        for block in block_ids:
            self._refcounts[block] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block at zero returns to the free list."""
        block_ids = self._live(block_ids)
        drops: dict[int, int] = {}
        for block in block_ids:
            drops[block] = drops.get(block, 0) + 1
            if drops[block] > self._refcounts[block]:
                raise ValueError(f"block_ids: block {block} freed more often than referenced")
        for block in block_ids:
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                self._free.append(block)

    def refcount(self, block_id: int) -> int:
        """Number of owners of ``block_id`` (0 when free)."""
        return self._refcounts[self._block_id(block_id, "block_id")]
