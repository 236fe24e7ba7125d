"""nanoserve: a paged KV cache with Triton kernels under stock Hugging Face models."""

from nanoserve.cache import BlockAllocator, BlockTable, OutOfBlocks, PagedKVCache

__all__ = ["BlockAllocator", "BlockTable", "OutOfBlocks", "PagedKVCache"]
__version__ = "0.1.0"
