"""The paged KV store: block allocator, block tables, per-layer pools. Knows nothing of HF."""

from nanoserve.cache.allocator import BlockAllocator, OutOfBlocks
from nanoserve.cache.block_table import BlockTable
from nanoserve.cache.grouped_cache import GroupedKVCache
from nanoserve.cache.paged_cache import PagedKVCache, StepMetadata
from nanoserve.cache.prefix import block_digests

__all__ = [
    "BlockAllocator",
    "BlockTable",
    "GroupedKVCache",
    "OutOfBlocks",
    "PagedKVCache",
    "StepMetadata",
    "block_digests",
]
