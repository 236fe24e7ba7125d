"""BlockAllocator: the free list and reference counts of a pool of fixed-size KV blocks."""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict
from collections.abc import Iterable

_STORE_IDS = itertools.count()


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

    Cached prefixes: a full block can be ``publish``ed under the digest of its tokens (and of
    everything before them, see ``prefix.py``); ``lookup`` finds it again and takes a
    reference. A published block whose last reference is freed is not free but *evictable*:
    still findable, and handed out by ``allocate`` (which forgets its digest) only once the
    free list is empty, least recently released first. ``num_free`` counts both.
    """

    def __init__(self, num_blocks: int):
        num_blocks = as_index(num_blocks, "num_blocks", minimum=1)
        self._num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._in_use: set[int] = set()  # the blocks whose refcount is not 0
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._digest_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._published_at: dict[int, int] = {}  # block -> when it was published
        self._publications = itertools.count()
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        # no other allocator of this process has it: names the store of these cached blocks
        self.store_id = next(_STORE_IDS)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self._num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Published blocks (findable by ``lookup``), in use or evictable."""
        return len(self._digest_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def grow(self, n: int) -> None:
        """Add ``n`` free blocks, ids ``[num_blocks, num_blocks + n)``, handed out after the
        blocks already free."""
        n = as_index(n, "n", minimum=0)
        old = self._num_blocks
        self._num_blocks += n
        self._refcounts.extend([0] * n)
        self._free[:0] = range(old + n - 1, old - 1, -1)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount 1 each), evicting the oldest cached ones once the
        free list is empty; all or nothing, else ``OutOfBlocks``."""
        n = as_index(n, "n", minimum=0)
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free, self._num_blocks)
        blocks = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(blocks) < n:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            blocks.append(block)
        for block in blocks:
            self._refcounts[block] = 1
        self._in_use.update(blocks)
        return blocks

    # -- cached prefixes ---------------------------------------------------------------------

    def publish(self, block_id: int, digest: bytes) -> bool:
        """Make the allocated, full ``block_id`` findable under ``digest``; False (and no
        change) when the digest or the block is published already. ValueError naming
        ``digest`` when it is not bytes (``lookup`` takes bytes)."""
        if not isinstance(digest, bytes):
            raise ValueError(f"digest: expected bytes, got {type(digest).__name__}")
        (block,) = self._live([block_id])
        if digest in self._block_of or block in self._digest_of:
            return False
        self._block_of[digest] = block
        self._digest_of[block] = digest
        self._published_at[block] = next(self._publications)
        return True

    def lookup(self, digest: bytes) -> int | None:
        """The block published under ``digest``, with one more reference taken (an evictable
        one comes back into use); None when there is none."""
        block = self._block_of.get(digest)
        if block is None:
            return None
        if self._refcounts[block] == 0:
            del self._evictable[block]
            self._in_use.add(block)
        self._refcounts[block] += 1
        return block

    def is_published(self, block_id: int) -> bool:
        return self._block_id(block_id, "block_id") in self._digest_of

    def unpublish(self, block_id: int) -> None:
        """Forget ``block_id``'s digest (its tokens are about to change); an evictable block
        becomes free."""
        block = self._block_id(block_id, "block_id")
        self._forget(block)
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)

    def clear_prefixes(self) -> None:
        """Forget every digest; evictable blocks become free."""
        for block in list(self._digest_of):
            self.unpublish(block)

    def release_all(self) -> None:
        """Drop every reference at once (the owners of all blocks are gone): published
        blocks become evictable, as the most recently used (after those evictable already,
        whose order is kept), the others free. Among them the latest published go first: a
        prompt's tail is evicted before its head, which later prompts reach first. Costs a
        step per block in use, not per block of the pool."""
        released = sorted(self._in_use)
        published = [block for block in released if block in self._digest_of]
        published.sort(key=self._published_at.__getitem__, reverse=True)
        for block in released:
            self._refcounts[block] = 0
        for block in published:
            self._evictable[block] = None
        self._free.extend(block for block in released if block not in self._digest_of)
        self._in_use.clear()

    def _forget(self, block: int) -> None:
        digest = self._digest_of.pop(block, None)
        if digest is not None:
            del self._block_of[digest]
            del self._published_at[block]

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
        """Drop one reference from each block; a block at zero returns to the free list (a
        published one becomes evictable)."""
        block_ids = self._live(block_ids)
        drops: dict[int, int] = {}
        for block in block_ids:
            drops[block] = drops.get(block, 0) + 1
            if drops[block] > self._refcounts[block]:
                raise ValueError(f"block_ids: block {block} freed more often than referenced")
        for block in block_ids:
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                self._in_use.discard(block)
                if block in self._digest_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def refcount(self, block_id: int) -> int:
        """Number of owners of ``block_id`` (0 when free)."""
        return self._refcounts[self._block_id(block_id, "block_id")]
