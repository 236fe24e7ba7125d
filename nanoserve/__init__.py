"""nanoserve: a paged KV cache with Triton kernels under stock Hugging Face models."""

from nanoserve.cache import BlockAllocator, BlockTable, OutOfBlocks, PagedKVCache

# The HF adapter imports transformers; it is loaded on first use so that the cache and the
# kernels stay importable (and quick to import) without it.
_ADAPTER_NAMES = (
    "PagedCache",
    "cache_stats",
    "decode_graph_stats",
    "patch_model",
    "release_memory",
    "unpatch_model",
)


def __getattr__(name):
    if name in _ADAPTER_NAMES:
        from nanoserve import adapters

        return getattr(adapters, name)
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")


__all__ = [
    "BlockAllocator",
    "BlockTable",
    "OutOfBlocks",
    "PagedCache",
    "PagedKVCache",
    "cache_stats",
    "decode_graph_stats",
    "patch_model",
    "release_memory",
    "unpatch_model",
]
__version__ = "0.1.0"
