"""Allocator and block tables against a simple model, driven by hypothesis."""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve import BlockAllocator, BlockTable, OutOfBlocks
from nanoserve.cache import block_digests

NUM_BLOCKS = 12
BLOCK_SIZE = 4


class TablesMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(NUM_BLOCKS)
        self.tables: list[BlockTable] = []
        self.contents: list[list[int]] = []  # the model: each live table's tokens
        self.published: list[list[int]] = []  # token lists whose full blocks were published
        self.pool = [None] * (NUM_BLOCKS * BLOCK_SIZE)  # what each slot holds
        self.next_token = 0

    @rule()
    def new_table(self):
        self.tables.append(BlockTable(self.alloc, BLOCK_SIZE))
        self.contents.append([])

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.integers(0, 2 * BLOCK_SIZE + 1))
    def append(self, data, n):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        free_before, ids_before = self.alloc.num_free, self.tables[i].block_ids
        try:
            slots = self.tables[i].append(n)
        except OutOfBlocks:
            assert self.alloc.num_free == free_before
            assert self.tables[i].block_ids == ids_before
            return
        for src, dst in self.tables[i].pending_copies:
            base_src, base_dst = src * BLOCK_SIZE, dst * BLOCK_SIZE
            self.pool[base_dst : base_dst + BLOCK_SIZE] = self.pool[
                base_src : base_src + BLOCK_SIZE
            ]
        self.tables[i].pending_copies.clear()
        assert len(slots) == n == len(set(slots))
        tokens = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        for slot, token in zip(slots, tokens, strict=True):
            self.pool[slot] = token
        self.contents[i] += tokens

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        self.tables.append(self.tables[i].fork())
        self.contents.append(list(self.contents[i]))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        self.tables.pop(i).free()
        self.contents.pop(i)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def truncate(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        keep = data.draw(st.integers(0, len(self.contents[i])))
        self.tables[i].truncate(keep)
        del self.contents[i][keep:]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def publish(self, data):
        i = data.draw(st.integers(0, len(self.tables) - 1))
        table, content = self.tables[i], self.contents[i]
        digests = block_digests(content, BLOCK_SIZE)
        for block, digest in zip(table.block_ids, digests, strict=False):
            self.alloc.publish(block, digest)
        self.published.append(list(content))

    @precondition(lambda self: self.published)
    @rule(data=st.data())
    def attach(self, data):
        """A new table takes the cached blocks of a published token list, up to the first
        block no longer findable (evicted, or cut by a truncate); what it reads back must be
        those tokens (the invariants below)."""
        content = data.draw(st.sampled_from(self.published))
        blocks = []
        for digest in block_digests(content, BLOCK_SIZE):
            block = self.alloc.lookup(digest)
            if block is None:
                break
            blocks.append(block)
        table = BlockTable(self.alloc, BLOCK_SIZE)
        table.adopt(blocks)
        self.tables.append(table)
        self.contents.append(content[: len(blocks) * BLOCK_SIZE])

    @rule()
    def release_everything(self):
        """A call ends with its tables let go at once (a kept pool's next cache)."""
        self.alloc.release_all()
        self.tables.clear()
        self.contents.clear()

    @invariant()
    def counts_add_up(self):
        assert self.alloc.num_free + self.alloc.num_used == NUM_BLOCKS
        owners = Counter(b for t in self.tables for b in t.block_ids)
        for block in range(NUM_BLOCKS):
            assert self.alloc.refcount(block) == owners.get(block, 0)
        assert self.alloc.num_used == len(owners)
        assert self.alloc.num_evictable <= self.alloc.num_cached

    @invariant()
    def tables_match_the_model(self):
        for table, content in zip(self.tables, self.contents, strict=True):
            length = len(content)
            assert table.num_tokens == length
            assert len(table.block_ids) == -(-length // BLOCK_SIZE)
            assert len(set(table.block_ids)) == len(table.block_ids)

    @invariant()
    def every_table_reads_back_its_own_tokens(self):
        # copy-on-write: a write through one table never changes what another table reads
        for table, content in zip(self.tables, self.contents, strict=True):
            assert [self.pool[table.slot(p)] for p in range(len(content))] == content


TablesMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_tables = TablesMachine.TestCase
